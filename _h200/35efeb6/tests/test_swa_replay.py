"""Bounded replay: the plan (pure, by property) and the torch reference on a tiny hybrid model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache.errors import ArgumentError
from kvcache.swa_local.replay import exact_replay_tokens, plan_replay
from kvcache.swa_local.replay_torch import TinyHybridConfig, TinyHybridModel, compare_replay


def test_reference_deployment_numbers() -> None:
    # 20 sliding-window layers of a 129-token window (128 tokens before the next one).
    assert exact_replay_tokens(window=129, swa_layers=20) == 2560
    assert plan_replay(77_000, window=129, swa_layers=20, exact=True).tokens == 2560
    bounded = plan_replay(77_000, window=129, swa_layers=20)
    assert bounded.tokens == 128 and not bounded.exact
    assert plan_replay(77_000, window=129, swa_layers=20, state_held=True).tokens == 0


@given(
    hit=st.integers(0, 10_000),
    window=st.integers(2, 512),
    layers=st.integers(1, 40),
    replay=st.integers(1, 20_000) | st.none(),
)
def test_plans_stay_inside_the_hit_and_bounded_never_costs_more(
    hit: int, window: int, layers: int, replay: int | None
) -> None:
    exact = plan_replay(hit, window=window, swa_layers=layers, exact=True)
    bounded = plan_replay(hit, window=window, swa_layers=layers, replay=replay)
    for plan in (exact, bounded):
        assert 0 <= plan.start <= plan.hit == hit
        assert plan.swa_attend_from == plan.start
    assert exact.tokens == min(hit, layers * (window - 1))
    if replay is None or replay <= layers * (window - 1):
        assert bounded.tokens <= exact.tokens
    # A bounded plan claims exactness only when it reaches as far back as an exact one.
    assert bounded.exact == (bounded.start <= exact.start)


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ArgumentError):
        plan_replay(-1, window=64, swa_layers=4)
    with pytest.raises(ArgumentError):
        plan_replay(100, window=1, swa_layers=4)
    with pytest.raises(ArgumentError):
        plan_replay(100, window=64, swa_layers=4, replay=0)


# ---------------------------------------------------------------------- the torch reference

CONFIG = TinyHybridConfig(window=16, vocab=256, seed=3)
HIT, TOTAL = 256, 288


@pytest.fixture(scope="module")
def model() -> TinyHybridModel:
    return TinyHybridModel(CONFIG)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab, (TOTAL,), generator=torch.Generator().manual_seed(9))


def test_a_held_state_and_an_exact_rebuild_reproduce_the_full_prefill(
    model: TinyHybridModel, tokens: torch.Tensor
) -> None:
    held = compare_replay(model, tokens, plan_replay(HIT, window=16, swa_layers=4, state_held=True))
    exact = compare_replay(model, tokens, plan_replay(HIT, window=16, swa_layers=4, exact=True))
    assert held.plan.tokens == 0
    assert exact.plan.tokens == 4 * 15
    for report in (held, exact):
        assert report.max_abs_logit_diff < 1e-9
        assert report.argmax_agreement == 1.0


def test_bounded_replay_recomputes_less_and_is_close_but_not_exact(
    model: TinyHybridModel, tokens: torch.Tensor
) -> None:
    bounded = compare_replay(model, tokens, plan_replay(HIT, window=16, swa_layers=4))
    nothing = compare_replay(model, tokens, plan_replay(HIT, window=16, swa_layers=4, replay=1))
    assert bounded.plan.tokens == 15 < 4 * 15
    # The window really matters: without it the continuation is far off ...
    assert nothing.max_abs_logit_diff > 1e-2
    # ... bounded replay is off too, but by less.
    assert bounded.max_abs_logit_diff > 1e-6
    assert bounded.mean_kl < nothing.mean_kl


def test_model_refuses_a_hit_without_continuation(
    model: TinyHybridModel, tokens: torch.Tensor
) -> None:
    with pytest.raises(ArgumentError):
        compare_replay(model, tokens, plan_replay(TOTAL, window=16, swa_layers=4))
