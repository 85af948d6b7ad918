"""Bounded replay: what to recompute when a prefix's full-attention KV is loaded but its
sliding-window state is not held anywhere. Pure; the same plan serves any engine.

After a hit of ``P`` tokens the full-attention layers have their exact KV for
every token before ``P`` (from the block store); the sliding-window layers
have nothing. To continue, those layers need their KV of the last
``window - 1`` tokens. Two ways to get it:

- **Exact rebuild**: recompute tokens ``P - S·(window - 1) .. P - 1`` (``S``
  sliding-window layers): each such layer widens what the one above it
  depends on by ``window - 1`` tokens, so that many tokens back every
  sliding-window layer's window is exact (the full-attention layers use their
  stored KV and add nothing). The reference deployment: 20 layers × 128 =
  2,560 tokens.
- **Bounded replay**: recompute only the last ``replay`` tokens (default
  ``window - 1``, 128 in the reference), with the sliding-window layers'
  attention limited to those tokens (nothing before them exists in those
  layers), the full-attention layers attending to the stored KV, which the
  replay does not rewrite. The window's KV is then approximate: the replayed
  tokens' hidden states lack their own older sliding-window context. That
  cut nearly halved total prefill compute in the reference deployment.

:class:`ReplayPlan` says which tokens, and where sliding-window attention
starts; ``kvcache.swa_local.replay_torch`` executes a plan on a tiny hybrid
model and measures how far its logits land from an exact rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.errors import ArgumentError

__all__ = ["ReplayPlan", "exact_replay_tokens", "plan_replay"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayPlan:
    """Recompute tokens ``start .. hit - 1``; sliding-window layers attend only to tokens
    ``>= start``; full-attention layers keep their stored KV for every token before ``hit``.

    ``exact``: the resulting window KV is what a full prefill would give.
    """

    hit: int
    start: int
    exact: bool

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.hit:
            raise ArgumentError(f"replay start {self.start} must lie in 0..{self.hit}")

    @property
    def tokens(self) -> int:
        """Tokens recomputed."""
        return self.hit - self.start

    @property
    def swa_attend_from(self) -> int:
        """The first token sliding-window attention may see."""
        return self.start


def exact_replay_tokens(*, window: int, swa_layers: int) -> int:
    """Tokens an exact rebuild of the window recomputes (at most; fewer near the start)."""
    if window < 2 or swa_layers < 1:
        raise ArgumentError(f"need window >= 2 and swa_layers >= 1, got {window}, {swa_layers}")
    return swa_layers * (window - 1)


def plan_replay(
    hit: int,
    *,
    window: int,
    swa_layers: int,
    replay: int | None = None,
    state_held: bool = False,
    exact: bool = False,
) -> ReplayPlan:
    """The replay for a hit of ``hit`` tokens.

    ``state_held``: the state at ``hit`` was loaded, nothing is recomputed.
    ``exact``: rebuild the window exactly. Otherwise bounded replay of ``replay``
    tokens (default ``window - 1``): exact only when that reaches back far enough.
    """
    if hit < 0:
        raise ArgumentError(f"hit must be >= 0, got {hit}")
    full = exact_replay_tokens(window=window, swa_layers=swa_layers)
    if state_held:
        return ReplayPlan(hit=hit, start=hit, exact=True)
    if exact:
        return ReplayPlan(hit=hit, start=max(0, hit - full), exact=True)
    length = window - 1 if replay is None else replay
    if length < 1:
        raise ArgumentError(f"replay must be >= 1 token, got {length}")
    start = max(0, hit - length)
    return ReplayPlan(hit=hit, start=start, exact=start == 0 or length >= full)
