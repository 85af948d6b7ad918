"""Each subpackage's public names are pinned: removing or renaming one is a visible decision."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "kvcache": ["BlockKey", "DType", "KVLayout", "Namespace", "REFERENCE_LAYOUT", "block_keys"],
    "kvcache.client": ["AsyncClient", "Client", "ClientConfig", "LoadResult", "MatchResult", "StoreResult"],
    "kvcache.engine": ["PagedKVAdapter", "TransferHandle", "kv_dtype"],
    "kvcache.retention": ["DAY_S", "DEFAULT_CLASSES", "DEFAULT_CLASS_NAME", "NO_HINT", "Applied", "Hint", "RetentionPolicy", "clamp", "merged_expiry", "parse_duration"],
    "kvcache.server": ["Clock", "DaemonInfo", "DaemonThread", "DataServer", "RequestHandler", "ServerConfig", "ShardStore", "SyncMode", "load_server_config", "run_daemon"],
    "kvcache.erasure": ["Backend", "Codec", "EncodeJob", "ErasureParams", "alloc_stripes", "encode_payloads", "get_codec", "isal_available", "payload_view"],
    "kvcache.testing": ["HostCluster", "HostDaemon", "HostNet", "HostNetMode", "cleanup_stale"],
    "kvcache.sim": ["BalanceStats", "FailureModel", "Layout", "MonteCarloResult", "MoveStats", "RepairCost", "RepairTime", "StripeChain", "balance_stats", "expm", "measure_balance", "measure_join", "measure_leave", "moved_slots", "plan_loss", "repair_time", "sample_keys", "simulate_failures", "synthetic_map"],
    "kvcache.swa_local": ["DEFAULT_TTL_S", "HolderRecord", "PeerTransport", "StateKey", "StoredState", "SwaConfig", "SwaStore", "SwaTier", "TcpPeerTransport", "Wanted", "state_digest", "state_namespace_id", "window_blocks"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PUBLIC[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is listed but missing"


def test_engine_package_does_not_import_vllm() -> None:
    import sys

    importlib.import_module("kvcache.engine")
    assert "vllm" not in sys.modules
