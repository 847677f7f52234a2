"""Several policies as rows of one cache (evaluations compare them side by side) give exactly what each
gives alone."""

import torch

from conftest import tiny_model
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.decode import Engine


def teacher_force(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Prefill the first token, then feed the rest one by one; logits for every step (B, L, V)."""
    engine = Engine(model, cache, "eager")
    out = [engine.prefill(ids[:, :1])]
    for t in range(1, ids.shape[1]):
        out.append(engine.decode(ids[:, t])[0].clone())
    return torch.stack(out, 1)


def test_rows_with_their_own_policies_equal_separate_runs():
    model = tiny_model("llama", seed=7)
    policies = [make_policy("h2o", 12), make_policy("sink", 12), make_policy("recent", 8), make_policy("full")]
    ids = torch.randint(0, 256, (1, 50))
    together_cache = H2OCache.for_model(model, policies, rows=[1] * len(policies))
    together = teacher_force(model, together_cache, ids.expand(len(policies), -1))
    for row, policy in enumerate(policies):
        alone = teacher_force(model, H2OCache.for_model(model, policy), ids)
        # rows of one batch and a batch of one go through different matmul shapes: compare at the dtype's
        # precision (a few ulps of the logits' scale), not at one machine's observed error
        scale = alone.abs().max()
        tol = 64 * torch.finfo(alone.dtype).eps * float(scale)
        torch.testing.assert_close(together[row], alone[0], atol=tol, rtol=0)
    stats = together_cache.group_stats()
    assert [s.kept for s in stats] == [12, 12, 8, 50] and [s.policy for s in stats] == ["h2o", "sink", "recent", "full"]
    whole = together_cache.stats()  # the whole cache: memory adds up
    assert whole.kv_bytes == sum(s.kv_bytes for s in stats) and whole.seen == 50
