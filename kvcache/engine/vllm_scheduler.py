"""The scheduler half of the vLLM connector: lookups, offers, planning. In the engine-core process.

- ``get_num_new_matched_tokens`` looks the prompt's full blocks up
  (``match_prefix``) on a helper thread; a lookup that is not back within
  ``match_wait_ms`` answers ``None``, vLLM's "ask again next step", so a slow
  store never stalls scheduling. A hit is offered only when loading it is
  predicted to beat recomputing it (fetch or recompute, from the load
  bandwidth and prefill rate the workers measure and send back). By default
  the load is asynchronous: the request waits in WAITING_FOR_REMOTE_KVS while
  others compute.
- Hybrid models: the same lookup reads the SWA holder records of the prompt's
  keys (``HAS_DIR``), and the hit is cut to the longest prefix after which a
  worker holds the state (``kvcache.engine.hybrid.state_hit``). Loads are then
  always asynchronous: vLLM 0.32 recovers from a failed load of a multi-group
  model only per request (``failed_recving``), which it has only for
  asynchronous loads; such a request is recomputed whole, and offered nothing
  again.
- ``update_state_after_alloc`` plans the load, ``build_connector_meta`` plans
  loads, saves and states, ``request_finished_all_groups`` forgets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from kvcache.engine.hints import hint_from_params
from kvcache.engine.hybrid import SwaLoadSpec, state_hit, window_ids
from kvcache.engine.vllm_context import ConnectorContext
from kvcache.engine.vllm_meta import (
    CachedReq,
    FetchPlanner,
    LoadMode,
    NewReq,
    PendingMatches,
    SchedulerBook,
    StepPlan,
    external_tokens,
    loadable_blocks,
)
from kvcache.keys import block_keys
from kvcache.retention.decide import Hint
from kvcache.swa_local.directory import Directory
from kvcache.swa_local.protocol import HolderRecord

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)


class SchedulerSide:
    """Everything the scheduler half does (see the module docstring)."""

    def __init__(self, ctx: ConnectorContext, *, load_failure_policy: str = "recompute") -> None:
        self.ctx = ctx
        settings = ctx.settings
        self._async_loads = settings.load_mode is LoadMode.ASYNC or ctx.hybrid is not None
        if ctx.hybrid is not None and settings.load_mode is LoadMode.SYNC:
            log.warning(
                "kvcache: load_mode 'sync' is not available for a hybrid model (vLLM recovers "
                "from a failed multi-group load only asynchronously); loading asynchronously"
            )
        self.client = ctx.make_client()
        self.directory = (
            Directory(self.client, replicas=ctx.swa_config().directory_replicas)
            if ctx.hybrid is not None
            else None
        )
        self.book = SchedulerBook(
            block_size=ctx.block_size, load=ctx.load, save=ctx.save, hybrid=ctx.hybrid
        )
        self.matches = PendingMatches(
            wait_s=settings.match_wait_ms / 1000,
            deadline_s=settings.match_deadline_ms / 1000,
            clock=time.monotonic,
        )
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-match")
        self._local_tokens: dict[str, int] = {}
        #: Requests with a LoRA adapter or a cache_salt: neither loaded nor saved.
        self._isolated_ids: set[str] = set()
        #: Per request asked about: whether its stored blocks are loaded (decided once).
        self._offers: dict[str, bool] = {}
        #: Hybrid: the holders of the state at each offered hit (filled on the lookup thread).
        self._holders: dict[str, tuple[HolderRecord, ...]] = {}
        self._holders_lock = threading.Lock()
        #: Retention hints of live requests that carry one (``kv_transfer_params["kvcache"]``).
        self._hints: dict[str, Hint] = {}
        #: Requests already asked for their hint (each is parsed once).
        self._hint_seen: set[str] = set()
        #: Hybrid: requests whose load failed; offered nothing again (they are recomputed).
        self._no_offer: set[str] = set()
        #: Bounded-replay models: requests whose offer restores the window (a state is held
        #: at the hit's end); only these report every group as loaded. Filled on the lookup
        #: thread, read by vLLM's scheduling thread.
        self._claims: set[str] = set()
        self.planner = FetchPlanner(
            margin=settings.recompute_margin,
            load_gbps=settings.load_gbps,
            prefill_tokens_per_s=settings.prefill_tokens_per_s,
        )
        if ctx.load and load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a kvcache block that cannot be loaded will fail "
                "its request; set kv_load_failure_policy='recompute' to recompute it instead",
                load_failure_policy,
            )

    # ------------------------------------------------------------------ offers

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store can supply, or None: ask again."""
        ctx = self.ctx
        prompt = request.prompt_token_ids
        req_id = request.request_id
        self._remember_hint(request)
        isolated = self._isolated(request)  # noted even when loads are off: saves skip it
        if not ctx.load or prompt is None or req_id in self._no_offer or isolated:
            return 0, False
        b = ctx.block_size
        loadable = loadable_blocks(
            prompt_tokens=len(prompt), num_tokens=request.num_tokens, block_size=b
        )
        if loadable <= num_computed_tokens // b:
            return 0, False
        tokens = prompt[: loadable * b]
        hit = self.matches.poll(
            req_id,
            lambda: self._pool.submit(self._lookup, req_id, tokens, num_computed_tokens),
        )
        self._sync_lookup_stats()
        if hit is None:
            return None, False
        # What to load is worked out from the tokens vLLM has now: a request asked again (its
        # blocks could not be allocated) may have more of its prompt in vLLM's own prefix
        # cache by then, and an offer kept from the first ask then overran the prompt (vLLM
        # asserts, and the engine died). Whether to load at all is decided once.
        ext = external_tokens(
            hit_blocks=hit, local_tokens=num_computed_tokens, loadable=loadable, block_size=b
        )
        fetch = self._offers.get(req_id)
        if fetch is None:
            fetch = bool(ext) and bool(self._fetch_or_recompute(ext, num_computed_tokens + ext))
            self._offers[req_id] = fetch
        if not fetch:
            ext = 0
        if ext:
            self._local_tokens[req_id] = num_computed_tokens
        return ext, bool(ext) and self._async_loads

    def _isolated(self, request: Any) -> bool:
        """Whether the request's KV must not be shared through the store: a LoRA adapter's
        or a ``cache_salt``'s KV differs from (or must not mix with) the base model's for the
        same tokens, and block keys name neither, so a load could hand one the other's KV
        (wrong tokens). Such requests are neither loaded nor saved."""
        req_id = request.request_id
        if req_id in self._isolated_ids:
            return True
        if getattr(request, "lora_request", None) is None and not getattr(
            request, "cache_salt", None
        ):
            return False
        self._isolated_ids.add(req_id)
        with self.ctx.lock:
            self.ctx.stats.requests_isolated += 1
        return True

    def _remember_hint(self, request: Any) -> None:
        """Parse the request's retention hint once (a bad one is logged, counted, ignored)."""
        req_id = request.request_id
        if req_id in self._hint_seen:
            return
        self._hint_seen.add(req_id)
        hint, error = hint_from_params(getattr(request, "kv_transfer_params", None), request=req_id)
        if error is not None:
            with self.ctx.lock:
                self.ctx.stats.hints_bad += 1
        if hint is not None:
            self._hints[req_id] = hint

    def _fetch_or_recompute(self, tokens: int, position: int) -> int:
        """``tokens`` when loading them is predicted to beat recomputing them, else 0."""
        ctx = self.ctx
        nbytes = tokens * ctx.geometry.bytes_per_token
        if ctx.hybrid is not None:
            nbytes += ctx.hybrid.state_bytes(position)
        fetch = self.planner.fetch(tokens, -(-nbytes // tokens))
        with ctx.lock:
            ctx.stats.fetch_decisions = self.planner.fetched
            ctx.stats.recompute_decisions = self.planner.recomputed
            if not fetch:
                ctx.stats.tokens_recompute_chosen += tokens
        return tokens if fetch else 0

    def _lookup(self, req_id: str, tokens: Sequence[int], local_tokens: int) -> int:
        """Hit blocks of ``tokens`` (runs on the lookup thread)."""
        ctx = self.ctx
        if self.directory is None:
            hit = self.client.match_prefix(ctx.namespace, tokens).hit_blocks
            with ctx.lock:
                ctx.stats.lookups += 1
            return hit
        b = ctx.block_size
        keys = block_keys(ctx.namespace, tokens)
        match, holders = self.directory.lookup_keys(keys, tokens_per_block=b)
        ns_id = ctx.state_ns_id
        usable: dict[int, tuple[HolderRecord, ...]] = {}
        for block, records in holders.items():
            good = tuple(
                r
                for r in records
                if r.key.namespace == ns_id
                and r.key.position == (block + 1) * b
                and r.key.block == keys[block]
            )
            if good:
                usable[(block + 1) * b] = good
        hybrid = ctx.hybrid
        assert hybrid is not None
        if hybrid.replay_tokens:
            return self._bounded_hit(req_id, match.hit_blocks, len(keys), local_tokens, usable)
        blocks = state_hit(
            hit_blocks=match.hit_blocks,
            loadable=len(keys),
            local_tokens=local_tokens,
            block_size=b,
            positions=usable,
        )
        if blocks:
            with self._holders_lock:
                self._holders[req_id] = usable[blocks * b]
        with ctx.lock:
            ctx.stats.lookups += 1
            if blocks:
                ctx.stats.swa_hits += 1
            ctx.stats.swa_tokens_without_state += max(0, match.hit_blocks - blocks) * b
        return blocks

    def _bounded_hit(
        self,
        req_id: str,
        hit_blocks: int,
        loadable: int,
        local_tokens: int,
        usable: dict[int, tuple[HolderRecord, ...]],
    ) -> int:
        """A bounded-replay model's hit (DeepSeek V4.1): the whole stored prefix. The window
        is claimed only when a state lies exactly at the hit's end; otherwise vLLM replays
        the hit's last ``replay_tokens`` tokens (a state short of the end is worth nothing:
        vLLM would load the stored KV to the end and replay anyway). A hit no longer than
        the replay, without the state, is not offered: vLLM would drop it."""
        ctx = self.ctx
        hybrid = ctx.hybrid
        assert hybrid is not None
        b = ctx.block_size
        blocks = min(hit_blocks, loadable)
        holders = usable.get(blocks * b, ()) if blocks * b > local_tokens else ()
        if holders:
            with self._holders_lock:
                self._holders[req_id] = holders
                self._claims.add(req_id)
        elif blocks * b <= hybrid.replay_tokens:
            blocks = 0
        with ctx.lock:
            ctx.stats.lookups += 1
            if holders:
                ctx.stats.swa_hits += 1
            elif blocks:
                ctx.stats.swa_tokens_without_state += blocks * b
        return blocks

    def _sync_lookup_stats(self) -> None:
        ctx = self.ctx
        with ctx.lock:
            ctx.stats.lookup_deferred = self.matches.deferred
            ctx.stats.lookup_errors = self.matches.errors
            ctx.stats.lookup_timeouts = self.matches.timeouts

    # ------------------------------------------------------------------ planning

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM gave the request its blocks; plan the load of ``num_external_tokens`` tokens."""
        ctx = self.ctx
        req_id = request.request_id
        self._remember_hint(request)
        self._isolated(request)
        self.matches.forget(req_id)
        self._offers.pop(req_id, None)
        local = self._local_tokens.pop(req_id, None)
        with self._holders_lock:
            holders = self._holders.pop(req_id, ())
        if num_external_tokens <= 0:
            return
        if local is None:  # vLLM asks before it allocates; anything else is a bug to surface
            raise RuntimeError(f"request {req_id}: a load was allocated that was never offered")
        # An asynchronous load is planned now, with the request's blocks: vLLM schedules
        # the request only after the load has finished.
        groups = blocks.get_block_ids() if self._async_loads else None
        block_ids = None if groups is None else list(groups[ctx.roles.main])
        swa = None
        claimed = self.claims(req_id)
        if (
            ctx.hybrid is not None
            and groups is not None
            and (claimed or not ctx.hybrid.replay_tokens)
        ):
            swa = self._swa_load(local, local + num_external_tokens, groups, holders)
        if ctx.hybrid is not None and ctx.hybrid.replay_tokens:
            with ctx.lock:
                if claimed:
                    ctx.stats.swa_state_restores += 1
                else:
                    ctx.stats.swa_bounded_replays += 1
        self.book.on_alloc(
            req_id,
            request.prompt_token_ids,
            local_tokens=local,
            external=num_external_tokens,
            block_ids=block_ids,
            swa=swa,
        )
        with ctx.lock:
            ctx.stats.requests_matched += 1
            ctx.stats.tokens_matched += num_external_tokens

    def _swa_load(
        self,
        local: int,
        position: int,
        groups: Sequence[Sequence[int]],
        holders: tuple[HolderRecord, ...],
    ) -> SwaLoadSpec:
        """Fill the sliding-window groups' window at ``position`` from the state there. A load
        that cannot be planned (no holder, or the window is not allocated as expected) is
        planned empty: the worker fails it and vLLM recomputes the request."""
        hybrid = self.ctx.hybrid
        assert hybrid is not None
        first, end = hybrid.window_blocks(position)
        ids = window_ids(
            [groups[g] for g in hybrid.state_groups], first, end, rings=len(hybrid.ring_groups)
        )
        key = holders[0].key if holders else None
        if ids is None or key is None:
            log.warning("kvcache: no state to fill the window at %d; the load will fail", position)
            ids, holders, key = (), (), None
        # Bounded-replay groups are not prefix-cached by vLLM: every window block is written.
        own = 0 if hybrid.replay_tokens else local // hybrid.swa_tokens_per_block
        return SwaLoadSpec(
            key=key,
            holders=holders,
            first_block=first,
            write_from=max(first, own),
            block_ids=ids,
        )

    def build_connector_meta(self, so: Any) -> StepPlan:
        """This step's loads, saves and states, for the worker halves."""
        main = self.ctx.roles.main
        swa_groups = self.ctx.hybrid.state_groups if self.ctx.hybrid is not None else ()
        new = [
            NewReq(
                r.req_id,
                r.prompt_token_ids,
                _group(r.block_ids, main),
                r.num_computed_tokens,
                swa_block_ids=[_group(r.block_ids, g) for g in swa_groups],
            )
            for r in so.scheduled_new_reqs
        ]
        c = so.scheduled_cached_reqs
        cached = []
        for i, req_id in enumerate(c.req_ids):
            added = c.new_block_ids[i]
            cached.append(
                CachedReq(
                    req_id,
                    req_id in c.resumed_req_ids,
                    None if added is None else _group(added, main),
                    c.num_computed_tokens[i],
                    None if added is None else [_group(added, g) for g in swa_groups],
                )
            )
        spec = {rid: len(toks) for rid, toks in so.scheduled_spec_decode_tokens.items()}
        plan = self.book.plan_step(new, cached, so.num_scheduled_tokens, spec)
        if self._isolated_ids:
            plan = self._without_isolated(plan)
        if self._hints:
            plan = self._with_hints(plan)
        self.ctx.write_stats()
        return plan

    def _without_isolated(self, plan: StepPlan) -> StepPlan:
        """The plan without saves of requests whose KV the store must not share."""
        isolated = self._isolated_ids
        saves = tuple(s for s in plan.saves if s.req_id not in isolated)
        swa_saves = tuple(s for s in plan.swa_saves if s.req_id not in isolated)
        if len(saves) == len(plan.saves) and len(swa_saves) == len(plan.swa_saves):
            return plan
        return replace(plan, saves=saves, swa_saves=swa_saves)

    def _with_hints(self, plan: StepPlan) -> StepPlan:
        """The plan with its requests' hints; saves of ``store: false`` requests left out."""
        hints = self._hints
        named = {s.req_id for s in (*plan.loads, *plan.saves)} | {s.req_id for s in plan.swa_saves}
        saves = tuple(s for s in plan.saves if s.req_id not in hints or hints[s.req_id].store)
        swa_saves = tuple(
            s for s in plan.swa_saves if s.req_id not in hints or hints[s.req_id].store
        )
        declined = len(plan.saves) - len(saves)
        if declined:
            with self.ctx.lock:
                self.ctx.stats.saves_declined += declined
        return replace(
            plan,
            saves=saves,
            swa_saves=swa_saves,
            hints={r: hints[r] for r in named if r in hints},
        )

    def update_connector_output(self, output: Any) -> None:
        """Learn rates from the workers' measurements; remember requests whose load failed."""
        failed = getattr(output, "failed_recving", None)
        if failed:
            self._no_offer.update(failed)
            for req_id in failed:
                self.book.on_load_failed(req_id)
            with self._holders_lock:
                recomputed = len(self._claims & set(failed))
            if recomputed:  # a claimed window whose load failed: vLLM recomputes it all
                with self.ctx.lock:
                    self.ctx.stats.swa_full_recomputes += recomputed
        meta = output.kv_connector_worker_meta
        loads = getattr(meta, "loads", None)
        steps = getattr(meta, "steps", None)
        if loads is None or steps is None:
            return
        for nbytes, seconds in loads:
            self.planner.record_load(nbytes, seconds)
        for tokens, seconds in steps:
            self.planner.record_step(tokens, seconds)
        with self.ctx.lock:
            self.ctx.stats.load_gbps_estimate = self.planner.load_gbps
            self.ctx.stats.prefill_tokens_per_s_estimate = self.planner.prefill_tokens_per_s

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks may be freed at once: a save's gather (and a
        state's) is ordered before any later write to them on the device, and an
        asynchronous load holds its blocks through vLLM until the worker reports it."""
        req_id = request.request_id
        self.book.on_finished(req_id)
        self._hints.pop(req_id, None)
        self._hint_seen.discard(req_id)
        self.matches.forget(req_id)
        self._local_tokens.pop(req_id, None)
        self._offers.pop(req_id, None)
        self._no_offer.discard(req_id)
        self._isolated_ids.discard(req_id)
        with self._holders_lock:
            self._holders.pop(req_id, None)
            self._claims.discard(req_id)
        return False, None

    def claims(self, req_id: str) -> bool:
        """Whether ``req_id``'s offer restores the sliding-window window (bounded replay)."""
        with self._holders_lock:
            return req_id in self._claims

    def loaded_group_ids(self, req_id: str) -> tuple[int, ...]:
        """The groups a load of ``req_id`` restores. A bounded-replay model (V4.1): every
        group when the state at the hit's end is in hand (vLLM replays nothing), else the
        full group only (vLLM replays). Other hybrid models: all of them (their loads always
        carry the state). Otherwise the one group."""
        roles = self.ctx.roles
        if roles.replay_tokens and not self.claims(req_id):
            return (roles.main,)
        return (roles.main, *roles.swa, *roles.ring)

    def shutdown(self) -> None:
        """Stop the lookup thread and close the client."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _group(block_ids: Any, index: int) -> list[int]:
    """The block ids of KV cache group ``index``."""
    return list(block_ids[index]) if block_ids else []
