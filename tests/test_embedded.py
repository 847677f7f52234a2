"""The embedded SmolLM2-135M (LLaMA, GQA 9/3 heads): the H2O cache reproduces full attention exactly."""

import torch
from transformers import DynamicCache

from h2o_chat.cache import H2OCache
from h2o_chat.generate import generate, stream_generate
from h2o_chat.policies import make_policy


def test_greedy_generation_is_token_identical_to_dynamic_cache(embedded, prompt_ids):
    model, tok = embedded.model, embedded.tokenizer
    ids = prompt_ids("Name three colours of the rainbow and describe each in one sentence.")
    model.set_attn_implementation("sdpa")
    try:
        expected = model.generate(
            torch.tensor([ids]), max_new_tokens=48, do_sample=False, past_key_values=DynamicCache(config=model.config)
        )[0, len(ids) :]
    finally:
        model.set_attn_implementation("h2o")
    cache = H2OCache.for_model(model, make_policy("h2o", 512))
    got = [r.token for r in stream_generate(model, tok, cache, ids, max_new_tokens=48)]
    assert got == expected.tolist() and len(got) > 20
    assert cache.stats().evicted == 0


def test_small_budget_holds_the_budget_and_still_writes(embedded, prompt_ids):
    model, tok = embedded.model, embedded.tokenizer
    ids = prompt_ids("Tell me a story about a cat.")
    cache = H2OCache.for_model(model, make_policy("h2o", 48))
    text = generate(model, tok, cache, ids, max_new_tokens=60, stop_ids=set())
    stats = cache.stats()
    assert stats.kept == 48 and stats.seen == len(ids) + 59
    assert stats.evicted == len(ids) + 59 - 48
    assert len(text.split()) > 20
