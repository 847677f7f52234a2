"""Sampling on the device: temperature, top-p and the repetition penalty, reproducible from a seed."""

from __future__ import annotations

import pytest
import torch

from h2o_chat.engine.sampling import PENALTY_WINDOW, Sampler
from h2o_chat.errors import ConfigError

P = torch.tensor([0.5, 0.3, 0.2])


def draws(sampler: Sampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    rows = sampler.rows(logits.shape[0], logits.device, logits.shape[-1])
    return torch.stack([rows(logits) for _ in range(n)])  # (n, B)


def test_samples_follow_the_distribution():
    got = draws(Sampler(temperature=1.0, seed=3), P.log()[None], 4000)[:, 0]
    freq = torch.bincount(got, minlength=3).float() / len(got)
    torch.testing.assert_close(freq, P, atol=0.03, rtol=0)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    logits = torch.randn(2, 50)
    a = draws(Sampler(temperature=1.0, seed=11), logits, 64)
    assert torch.equal(a, draws(Sampler(temperature=1.0, seed=11), logits, 64))
    assert not torch.equal(a, draws(Sampler(temperature=1.0, seed=12), logits, 64))
    assert not torch.equal(a[:, 0], a[:, 1])  # rows draw independently


def test_top_p_keeps_the_smallest_nucleus():
    logits = P.log()[None]
    assert set(draws(Sampler(temperature=1.0, top_p=0.6, seed=1), logits, 400)[:, 0].tolist()) == {0, 1}
    assert set(draws(Sampler(temperature=1.0, top_p=0.45, seed=1), logits, 100)[:, 0].tolist()) == {0}


def test_greedy_and_sampling_rows_side_by_side():
    logits = torch.tensor([[0.0, 0.1, 0.0], [0.0, 0.1, 0.0]])
    rows = Sampler(temperature=1.0, seed=5).rows(2, torch.device("cpu"), 3, temperature=[0.0, 1.0])
    got = torch.stack([rows(logits) for _ in range(200)])
    assert (got[:, 0] == 1).all() and len(set(got[:, 1].tolist())) == 3


def test_repetition_penalty_steers_away_from_recent_tokens():
    rows = Sampler(repetition_penalty=2.0).rows(1, torch.device("cpu"), 4)
    rows.observe(torch.tensor([[0, 3]]))  # the prompt's tokens count as recent
    logits = torch.tensor([[2.0, 1.5, -1.0, 1.8]])
    assert rows(logits).item() == 1  # 2.0 / 2 and 1.8 / 2 fall below 1.5
    assert rows(torch.tensor([[1.0, 1.9, 1.0, 1.0]])).item() == 2  # the sampled 1 is recent now: 0.95 < 1.0
    fresh = Sampler(repetition_penalty=2.0).rows(1, torch.device("cpu"), 4)
    fresh.observe(torch.tensor([[0, 3]]))
    assert fresh(torch.tensor([[-1.0, -1.2, -3.0, -9.0]])).item() == 1  # negative logits are multiplied: -2 < -1.2
    for _ in range(PENALTY_WINDOW):  # the window moves on: old tokens are free again
        rows(torch.tensor([[0.0, 0.0, 9.0, 0.0]]))
    assert rows(logits).item() == 0
    plain = Sampler().rows(1, torch.device("cpu"), 4)
    plain.observe(torch.tensor([[0, 3]]))
    assert plain(logits).item() == 0  # penalty 1: nothing changes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), r"--temperature must be >= 0 \(0 = greedy\), got -1$"),
        (dict(temperature=float("nan")), r"--temperature must be >= 0 \(0 = greedy\), got nan$"),
        (dict(top_p=0.0), "--top-p must be above 0 and at most 1, got 0$"),
        (dict(top_p=1.5), "--top-p must be above 0 and at most 1, got 1.5$"),
        (dict(repetition_penalty=0), r"--repetition-penalty must be above 0 \(1 = off\), got 0$"),
    ],
)
def test_bad_settings_say_which_value_is_wrong(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Sampler(**kwargs)
