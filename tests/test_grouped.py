"""Several policies as rows of one batch give exactly what each gives alone."""

import torch

from conftest import tiny_model
from h2o_chat.cache import H2OCache
from h2o_chat.generate import decode_one, prefill
from h2o_chat.grouped import GroupedCache
from h2o_chat.policies import make_policy


def teacher_force(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Prefill the first token, then feed the rest one by one; logits for every step (B, L, V)."""
    out = [prefill(model, cache, ids[:, :1])]
    for t in range(1, ids.shape[1]):
        out.append(decode_one(model, cache, ids[:, t]))
    return torch.stack(out, 1)


def test_grouped_rows_equal_separate_runs():
    model = tiny_model("llama", seed=7)
    policies = [make_policy("h2o", 12), make_policy("sink", 12), make_policy("recent", 8), make_policy("full")]
    ids = torch.randint(0, 256, (1, 50))
    grouped = GroupedCache.for_model(model, policies)
    together = teacher_force(model, grouped, ids.expand(len(policies), -1))
    for row, policy in enumerate(policies):
        alone = teacher_force(model, H2OCache.for_model(model, policy), ids)
        torch.testing.assert_close(together[row], alone[0], atol=1e-5, rtol=1e-5)
    stats = grouped.stats()
    assert [s.kept for s in stats] == [12, 12, 8, 50] and [s.policy for s in stats] == ["h2o", "sink", "recent", "full"]
