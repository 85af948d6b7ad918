"""LIST (a tenant's stored shards, paged) and scrub (re-verify, delete bad shards) in a store,
and through a real daemon."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvcache.credentials import Credentials
from kvcache.server.config import ServerConfig
from kvcache.server.daemon import DaemonThread
from kvcache.server.scrub import Scrubber, verify_records
from kvcache.server.store import ShardStore
from kvcache.wire import LIST_MAX_PAGE, Op, Status, make_items
from tests.server_fixtures import FakeClock, block_records, http, put_items

TENANT_A = b"tenant-a"
TENANT_B = b"tenant-b"


def make_store(path: Path, clock: FakeClock | None = None) -> ShardStore:
    return ShardStore(path, capacity_bytes=64 << 20, clock=clock or FakeClock())


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return sorted(rng.bytes(16) for _ in range(n))


def test_list_pages_a_tenants_shards_in_key_order(tmp_path: Path) -> None:
    with make_store(tmp_path) as store:
        mine = keys(20)
        for key in mine:
            assert (store.put(TENANT_A, *put_items(block_records(key)))["status"] == 0).all()
        for key in keys(5, seed=1):
            assert (store.put(TENANT_B, *put_items(block_records(key)))["status"] == 0).all()
        seen: list[tuple[bytes, int]] = []
        start, index, inclusive = bytes(16), 0, True
        pages = 0
        while pages < 100:
            page = store.list_shards(TENANT_A, start, index, inclusive=inclusive, limit=7)
            pages += 1
            seen += [(bytes(r["key"]), int(r["index"])) for r in page]
            if len(page) < 7:
                break
            start, index, inclusive = bytes(page[-1]["key"]), int(page[-1]["index"]), False
        assert seen == [(k, i) for k in mine for i in range(12)]
        page = store.list_shards(TENANT_A, bytes(16), 0, inclusive=True, limit=12)
        record = block_records(mine[0])[3][2]
        assert int(page[3]["length"]) == len(record)
        assert int(page[3]["payload_len"]) > 0
        assert bytes(page[3]["traffic_class"]) == b"chat"
        assert int(page[3]["expiry_ms"]) > store.now_ms()


def test_list_skips_expired_shards(tmp_path: Path) -> None:
    clock = FakeClock()
    with make_store(tmp_path, clock) as store:
        key = keys(1)[0]
        store.put(TENANT_A, *put_items(block_records(key)))
        assert len(store.list_shards(TENANT_A, bytes(16), 0, inclusive=True, limit=100)) == 12
        clock.step(30 * 24 * 3600)
        assert len(store.list_shards(TENANT_A, bytes(16), 0, inclusive=True, limit=100)) == 0


def test_scrub_finds_and_deletes_a_damaged_record(tmp_path: Path) -> None:
    with make_store(tmp_path) as store:
        blocks = keys(4)
        for key in blocks:
            store.put(TENANT_A, *put_items(block_records(key)))
        found = store.records_after(b"", max_bytes=1 << 30)
        assert len(found) == 48
        assert verify_records(found) == []
        skey, record = found[5]
        damaged = bytearray(record)
        damaged[-10] ^= 0x01
        assert verify_records([(skey, bytes(damaged))]) == [(skey, bytes(damaged))]
        # A record that is no longer what was read is never deleted.
        assert store.discard([(skey, bytes(damaged))]) == 0
        assert store.discard([(skey, record)]) == 1
        assert store.recount()["shards"] == 47 == store.usage()["shards"]


def test_scrubber_passes_are_rate_limited(tmp_path: Path) -> None:
    now = [0.0]
    with make_store(tmp_path) as store:
        for key in keys(10):
            store.put(TENANT_A, *put_items(block_records(key)))
        total = sum(len(r) for _k, r in store.records_after(b"", max_bytes=1 << 30))
        rate = total // 4  # one pass takes about 4 s of the fake clock
        scrub = Scrubber(store, rate_bytes=rate, interval_s=100.0, clock=lambda: now[0])
        assert scrub.step() is False and scrub.passes == 0  # not due yet
        scrub.start_now()
        steps = 0
        while scrub.running and steps < 1000:
            now[0] += 0.05
            scrub.step()
            steps += 1
        assert scrub.passes == 1 and scrub.shards_checked == 120 and scrub.shards_bad == 0
        assert 3.0 <= now[0] <= 6.0, now[0]


def test_daemon_list_is_tenant_scoped_and_scrub_counts_in_metrics(tmp_path: Path) -> None:
    creds = Credentials.generate(("alpha", "beta"))
    config = ServerConfig(
        data_dir=tmp_path / "data",
        listen="tcp://127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        capacity_bytes=64 << 20,
        scrub_rate_bytes=64 << 20,
    )
    from kvcache.server.probe import Probe

    with DaemonThread(config, credentials=creds) as info:
        secret = {t.name: t.secret for t in creds.tenants}
        with Probe(info.data_endpoint, tenant="alpha", secret=secret["alpha"]) as alpha:
            for key in keys(3):
                assert (alpha.put(block_records(key)) == Status.OK).all()
            listed = alpha.list()
            assert len(listed) == 36
            with pytest.raises(Exception, match="limit"):
                alpha.list(limit=LIST_MAX_PAGE + 1)
            bad = make_items(Op.LIST, 2, reply=False)
            assert alpha.request(Op.LIST, bad).header.status == Status.BAD_REQUEST
        with Probe(info.data_endpoint, tenant="beta", secret=secret["beta"]) as beta:
            assert len(beta.list()) == 0
        token = creds.admin_token
        status, body = http("POST", f"{info.admin_url}/scrub", {}, token=token)
        assert status == 200, body
        status, body = http("POST", f"{info.admin_url}/scrub", {})
        assert status == 401
        # The pass runs between requests; the loop's maintenance is driven by its poll.
        from tests.server_fixtures import wait_until

        def passes() -> int:
            _status, raw = http("GET", f"{info.admin_url}/metrics")
            match = re.search(rb"kvcache_server_scrub_passes_total (\d+)", raw)
            return int(match.group(1)) if match else 0

        wait_until(lambda: passes() >= 1, timeout_s=20, what="a scrub pass")
        _status, raw = http("GET", f"{info.admin_url}/metrics")
        assert b"kvcache_server_scrub_shards_checked_total 36" in raw
        assert b"kvcache_server_scrub_shards_bad_total 0" in raw
