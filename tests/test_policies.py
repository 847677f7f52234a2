"""Policies and the one selection rule are pure tensor code: test them on hand-made slot states."""

import pytest
import torch

from h2o_chat.engine.policies import H2O, Full, Recent, Rules, Sink, make_policy
from h2o_chat.engine.storage.slots import order, tie
from h2o_chat.errors import ConfigError


def state(acc, pos):
    return torch.tensor([[acc]], dtype=torch.float32), torch.tensor([[pos]])


def keys(policy, acc, pos, newest, policies=None):
    """The selection key of every slot (lower loses) for rows following `policy` (or `policies`, one a row)."""
    rules = Rules.of(policies or [policy] * newest.shape[0], pos.shape[-1], "cpu")
    return order(rules.priority(acc, pos, newest), tie(pos))


def victim(policy, acc, pos, newest, policies=None):
    """The slot a decode step overwrites, per (..., row, head)."""
    return keys(policy, acc, pos, newest, policies).argmin(-1)


def lowest(policy, acc, pos, newest, k):
    """The k slots a chunk drops, lowest first."""
    return keys(policy, acc, pos, newest).sort(-1).indices[..., :k]


def test_h2o_evicts_lowest_score_outside_recent_window():
    p = H2O(budget=4, heavy_ratio=0.5)  # 2 heavy + 2 recent
    acc, pos = state([5.0, 0.1, 3.0, 0.0], [0, 1, 2, 3])
    # newest is 3: positions 2 and 3 are recent; of 0 and 1 the lower score (pos 1) goes
    assert victim(p, acc, pos, torch.tensor([3])).item() == 1


def test_h2o_protects_recent_even_with_zero_score():
    p = H2O(budget=4, heavy_ratio=0.75)  # 3 heavy + 1 recent
    acc, pos = state([5.0, 0.1, 3.0, 0.0], [0, 1, 2, 3])
    assert victim(p, acc, pos, torch.tensor([3])).item() == 1
    assert lowest(p, acc, pos, torch.tensor([3]), 3)[0, 0].tolist() == [1, 2, 0]


def test_equal_priorities_go_oldest_first_wherever_they_sit():
    """Ties break by position, not by slot: the same tokens in another slot order give the same choice."""
    h2o = H2O(budget=4, heavy_ratio=0.5)  # newest 8: the recent window is {7, 8}
    acc, pos = state([0.5, 0.5, 0.5, 9.0], [3, 1, 2, 8])
    assert victim(h2o, acc, pos, torch.tensor([8])).item() == 1  # positions 1, 2, 3 tie: position 1 goes
    assert lowest(h2o, acc, pos, torch.tensor([8]), 2)[0, 0].tolist() == [1, 2]
    acc, pos = state([0.5, 0.5, 0.5, 9.0], [2, 3, 1, 8])
    assert victim(h2o, acc, pos, torch.tensor([8])).item() == 2


def test_h2o_sinks_are_never_evicted():
    p = H2O(budget=4, heavy_ratio=0.5, sinks=1)
    acc, pos = state([0.0, 0.5, 3.0, 0.0], [0, 1, 2, 3])
    assert victim(p, acc, pos, torch.tensor([3])).item() == 1
    assert p.split() == {"sink": 1, "heavy": 1, "recent": 2}


def test_empty_and_padding_slots_go_first():
    p = H2O(budget=4)
    acc, pos = state([0.0, 9.0, 9.0, 9.0], [5, -1, 6, 7])
    assert victim(p, acc, pos, torch.tensor([7])).item() == 1


def test_recent_and_sink_evict_oldest():
    acc, pos = state([9.0, 9.0, 0.0, 0.0], [10, 3, 7, 11])
    assert victim(Recent(budget=4), acc, pos, torch.tensor([11])).item() == 1
    acc, pos = state([0.0] * 5, [0, 1, 2, 3, 4])
    assert victim(Sink(budget=5, sinks=2), acc, pos, torch.tensor([4])).item() == 2


def test_per_row_and_head_selection_is_independent():
    p = H2O(budget=3, heavy_ratio=2 / 3)  # 2 heavy, 1 recent
    acc = torch.tensor([[[1.0, 2.0, 0.0], [3.0, 1.0, 0.0]], [[0.5, 0.1, 9.0], [0.0, 4.0, 1.0]]])
    pos = torch.tensor([[[0, 1, 2], [0, 1, 2]], [[4, 5, 6], [4, 5, 6]]])
    assert victim(p, acc, pos, torch.tensor([2, 6])).tolist() == [[0, 1], [1, 0]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="h2o", budget=0), "positive"),
        (dict(name="h2o", budget=-5), "positive"),
        (dict(name="h2o", budget=512, heavy_ratio=1.0), "heavy_ratio"),
        (dict(name="h2o", budget=8, heavy_ratio=0.5, sinks=6), "sink"),
        (dict(name="sink", budget=4), "above its 4 sink"),
        (dict(name="h20", budget=8), "did you mean 'h2o'"),
    ],
)
def test_impossible_settings_raise_a_clear_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(**kwargs)


def test_describe_states_the_split():
    assert make_policy("h2o", 512).describe() == "h2o 512 = 256 heavy + 256 recent"
    assert make_policy("sink", 512).describe() == "sink 512 = 4 sink + 508 recent"
    assert isinstance(make_policy("full", None), Full) and make_policy("full", 1).capacity is None


def test_priority_works_on_every_layer_at_once():
    """The cache evicts for all layers together: (L, B, H, N) state with one newest position per row."""
    p = H2O(budget=3, heavy_ratio=2 / 3)
    acc = torch.tensor([[[[1.0, 2.0, 0.0]], [[0.5, 0.1, 9.0]]], [[[3.0, 1.0, 0.0]], [[0.0, 4.0, 1.0]]]])
    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])[None, :, None, :].expand(2, 2, 1, 3)
    assert victim(p, acc, pos, torch.tensor([2, 6])).tolist() == [[[0], [1]], [[1], [0]]]


def test_the_recent_window_never_rounds_to_zero():
    """budget 10 at heavy_ratio 0.96 would leave no recent slot: the newest token must still be protected."""
    p = make_policy("h2o", 10, heavy_ratio=0.96)
    assert p.split() == {"sink": 0, "heavy": 9, "recent": 1} and p.describe() == "h2o 10 = 9 heavy + 1 recent"
    acc, pos = state([9.0, 9.0, 9.0, 0.0], [0, 1, 2, 3])  # the newest token has no mass yet
    assert victim(p, acc, pos, torch.tensor([3])).item() != 3
    assert make_policy("h2o", 1).split() == {"sink": 0, "heavy": 0, "recent": 1}


def test_rows_of_one_cache_follow_their_own_policies_and_budgets():
    """Evaluations compare configurations as rows of one batch: each row evicts by its own rule, and a row
    with a smaller budget never fills (nor loses) the slots beyond it."""
    h2o, recent = H2O(budget=4, heavy_ratio=0.5), Recent(budget=3)
    acc = torch.tensor([[[5.0, 0.1, 3.0, 0.0, 0.0]], [[5.0, 0.1, 3.0, 0.0, 0.0]]])
    pos = torch.tensor([[[0, 1, 2, 3, 4]], [[0, 1, 2, 3, -1]]])
    got = victim(None, acc, pos, torch.tensor([4, 3]), policies=[h2o, recent])
    assert got.tolist() == [[1], [0]]  # h2o: lowest score outside {3, 4}; recent: the oldest
    # a row of budget 3 in storage of 5: slots 3 and 4 are beyond it and are never chosen, empty or not
    pos = torch.tensor([[[0, 1, 2, 3, 4]], [[5, 6, 7, -1, -1]]])
    assert victim(None, acc, pos, torch.tensor([4, 7]), policies=[h2o, recent]).tolist() == [[1], [0]]


def test_the_sort_key_orders_like_the_priorities_then_the_positions():
    prio = torch.tensor([0.5, -torch.inf, 2.0, 0.5, torch.inf, -1e-30, 1e-30, 0.0])
    pos = torch.tensor([9, -1, 3, 4, 0, 5, 6, 7])
    ranked = order(prio, tie(pos)).argsort().tolist()
    assert ranked == [1, 5, 7, 6, 3, 0, 2, 4]  # -inf, then ascending priority, ties by position, +inf last
