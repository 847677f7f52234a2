"""The embedded SmolLM2-135M (LLaMA, GQA 9/3 heads): the H2O cache reproduces full attention exactly."""

import contextlib

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.generate import stream_generate


def full_cache_logits(model, ids: list[int], n: int, follow: list[int] | None = None) -> torch.Tensor:
    """transformers' own attention (SDPA) over a DynamicCache: the prompt read in one pass through the products
    the engine reads prompt chunks with (`model.prompt_products`: the AMX kernel where it runs), then `n` steps of
    one row through PyTorch's kernel, as the engine's decode steps are. Each step feeds the token `follow` gives
    (greedy: the argmax). Returns the (n, vocab) float logits, row i the distribution of the i-th new token."""
    products = getattr(model, "prompt_products", None) or contextlib.nullcontext
    cache, rows = DynamicCache(config=model.config), []
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            with products():
                logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
            for i in range(n):
                rows.append(logits.float())
                token = int(logits.argmax()) if follow is None else follow[i]
                logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
    finally:
        model.set_attn_implementation("h2o")
    return torch.stack(rows)


def test_greedy_generation_is_the_dynamic_caches_own_choice_at_every_step(embedded, prompt_ids):
    """Nothing evicted: at every step our greedy token is the one transformers' own attention over a DynamicCache
    chooses along the same tokens, but for near ties (AVX2's library rounds each product's x to 8 bits, so the two
    attentions' last bits can move a rounding: 0.08 apart at the 8th token here, where the best two are 0.083
    apart; a cache attending to the wrong keys is off by whole units)."""
    model, tok = embedded.model, embedded.tokenizer
    ids = prompt_ids("Name three colours of the rainbow and describe each in one sentence.")
    cache = H2OCache.for_model(model, make_policy("h2o", 512))
    got = [r.token for r in stream_generate(model, tok, cache, ids, max_new_tokens=48)]
    logits = full_cache_logits(model, ids, len(got), follow=got)
    best = logits.argmax(-1)
    chosen = logits[torch.arange(len(got)), torch.tensor(got)]
    assert len(got) > 20 and cache.stats().evicted == 0
    assert bool((chosen >= logits.max(-1).values - 0.15).all())
    assert (best == torch.tensor(got)).float().mean() >= 0.9


def test_small_budget_holds_the_budget_and_still_writes(embedded, prompt_ids):
    """Budget 48 with a 38-token prompt: identical to the full cache until the first eviction, then text the full
    model itself finds likely (a cache attending to the wrong keys writes what the model finds improbable)."""
    model, tok = embedded.model, embedded.tokenizer
    ids = prompt_ids("Tell me a story about a cat.")
    cache = H2OCache.for_model(model, make_policy("h2o", 48))
    got = [r.token for r in stream_generate(model, tok, cache, ids, max_new_tokens=60, stop_ids=set())]
    stats = cache.stats()
    assert stats.kept == 48 and stats.seen == len(ids) + 59
    assert stats.evicted == len(ids) + 59 - 48
    logits = full_cache_logits(model, ids, len(got), follow=got)  # the full cache along our tokens
    unevicted = 48 - len(ids) + 1  # tokens produced before the cache first overflowed
    # the full cache's own choice until then, but for near ties (0.034 apart at the 6th token here: how the two
    # attentions round decides those)
    chosen = logits[torch.arange(len(got)), torch.tensor(got)]
    assert bool((chosen[:unevicted] >= logits[:unevicted].max(-1).values - 0.05).all())
    nll = F.cross_entropy(logits, torch.tensor(got), reduction="none")[unevicted:]
    assert float(nll.mean()) < 3.0  # ~0.9 here; random tokens score ~14
    assert len(set(got)) > 0.3 * len(got)  # not stuck repeating a few tokens
