"""The embedded SmolLM2-135M (LLaMA, GQA 9/3 heads): the H2O cache reproduces full attention exactly."""

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from conftest import cached
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.generate import stream_generate


def test_greedy_generation_is_token_identical_to_dynamic_cache(embedded, prompt_ids):
    model, tok = embedded.model, embedded.tokenizer
    ids = prompt_ids("Name three colours of the rainbow and describe each in one sentence.")
    model.set_attn_implementation("sdpa")
    try:
        expected = model.generate(
            torch.tensor([ids]), max_new_tokens=48, do_sample=False, **cached(model, DynamicCache(config=model.config))
        )[0, len(ids) :]
    finally:
        model.set_attn_implementation("h2o")
    cache = H2OCache.for_model(model, make_policy("h2o", 512))
    got = [r.token for r in stream_generate(model, tok, cache, ids, max_new_tokens=48)]
    assert got == expected.tolist() and len(got) > 20
    assert cache.stats().evicted == 0


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
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            full = model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False)[0, len(ids) :].tolist()
            sequence = torch.tensor([ids + got])
            logits = model(sequence).logits[0, len(ids) - 1 : -1].float()
    finally:
        model.set_attn_implementation("h2o")
    unevicted = 48 - len(ids) + 1  # tokens produced before the cache first overflowed
    assert got[:unevicted] == full[:unevicted]
    nll = F.cross_entropy(logits, sequence[0, len(ids) :], reduction="none")[unevicted:]
    assert float(nll.mean()) < 3.0  # ~0.9 here; random tokens score ~14
    assert len(set(got)) > 0.3 * len(got)  # not stuck repeating a few tokens
