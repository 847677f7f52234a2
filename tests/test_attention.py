"""The registered attention: outputs within tolerance of PyTorch's fused attention, and the mass it reports is the
softmax column sum, computed in query blocks, the same whichever path gives the output."""

import pytest
import torch
import torch.nn.functional as F

from h2o_chat.engine.forward import Chunk
from h2o_chat.engine.step import attention
from h2o_chat.engine.step.attention import attention_with_mass, causal_sdpa


def reference(q, k, v, scale, allowed):
    """Eager attention in float64 with a boolean (B, 1, T, S) mask: (out, probs summed per KV head)."""
    B, Hq, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = Hq // H
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    logits = (q.double() @ kr.double().transpose(-1, -2)) * scale
    probs = logits.masked_fill(~allowed, -torch.inf).softmax(-1).nan_to_num(0.0)  # a query that sees nothing
    out = (probs @ vr.double()).transpose(1, 2)
    return out, probs.view(B, H, G, T, S).sum(dim=(2, 3))


def chunk_mask(real: torch.Tensor, stored_valid: torch.Tensor | None) -> torch.Tensor:
    """The additive mask the cache builds once per chunk."""
    fwd = Chunk(real.shape[1], real=real, attend_from=0 if stored_valid is None else stored_valid.shape[1])
    fwd.stored_valid = stored_valid
    return fwd.mask(torch.float32)


@pytest.mark.parametrize("fused", [False, True], ids=["blocked-eager", "fused"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_matches_fused_attention_and_reports_mass(T, heads, fused):
    torch.manual_seed(0)
    Hq, H = heads
    B, N, D = 2, 11, 16
    q = torch.randn(B, Hq, T, D)
    k, v = torch.randn(B, H, N + T, D), torch.randn(B, H, N + T, D)
    mask = chunk_mask(torch.ones(B, T, dtype=torch.bool), torch.ones(B, N, dtype=torch.bool))
    out, mass = attention_with_mass(q, k, v, mask, D**-0.5, mass=True, fused=fused)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(T, N + T, dtype=torch.bool).tril(N), enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)
    allowed = torch.ones(T, N + T, dtype=torch.bool).tril(N)[None, None]
    _, ref_mass = reference(q, k, v, D**-0.5, allowed)
    torch.testing.assert_close(mass.double(), ref_mass, atol=1e-5, rtol=1e-5)
    # every query distributes exactly one unit of mass per query head
    assert torch.allclose(mass.sum(-1), torch.full((B, H), T * Hq / H))
    plain, none = attention_with_mass(q, k, v, mask, D**-0.5, mass=False)
    assert none is None
    torch.testing.assert_close(plain, sdpa, atol=1e-5, rtol=1e-5)


def test_padding_keys_get_no_mass_and_padding_queries_see_only_themselves():
    torch.manual_seed(1)
    B, Hq, H, T, N, D = 2, 4, 2, 5, 3, 8
    q = torch.randn(B, Hq, T, D)
    k, v = torch.randn(B, H, N + T, D), torch.randn(B, H, N + T, D)
    stored = torch.tensor([True, True, False]).expand(B, N)  # the third stored slot is empty
    real = torch.tensor([[False, False, True, True, True], [True] * 5])  # row 0 is left-padded
    for fused in (False, True):
        out, mass = attention_with_mass(q, k, v, chunk_mask(real, stored), D**-0.5, fused=fused)
        assert (mass[..., 2] == 0).all()  # the empty slot
        # row 0's padding keys get exactly their own padding query's mass (1 per query head), nothing else
        torch.testing.assert_close(mass[0, :, N : N + 2], torch.full((H, 2), Hq / H))
        key_ok = torch.cat((stored, real), -1)
        causal = torch.ones(T, N + T, dtype=torch.bool).tril(N)
        allowed = causal & key_ok[:, None, None, :] & real[:, None, :, None]
        ref_out, ref_mass = reference(q, k, v, D**-0.5, allowed)  # padding queries take no part
        torch.testing.assert_close(out[0, 2:].double(), ref_out[0, 2:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1].double(), ref_out[1], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(out).all()
        real_keys = key_ok[:, None, :].expand(B, H, N + T)
        torch.testing.assert_close(mass[real_keys].double(), ref_mass[real_keys], atol=1e-5, rtol=1e-5)


def test_mass_in_query_blocks_equals_one_block(monkeypatch):
    """The mass is summed block by block over the queries, never as one (queries x keys) fp32 tensor."""
    torch.manual_seed(3)
    B, Hq, H, T, N, D = 1, 6, 2, 40, 24, 8
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, H, N + T, D), torch.randn(B, H, N + T, D)
    mask = chunk_mask(torch.ones(B, T, dtype=torch.bool), torch.ones(B, N, dtype=torch.bool))
    whole_out, whole = attention_with_mass(q, k, v, mask, D**-0.5)
    shapes = []
    real_softmax = torch.softmax

    def spy(x, *args, **kwargs):
        shapes.append(x.shape)
        return real_softmax(x, *args, **kwargs)

    monkeypatch.setattr(attention, "MASS_BLOCK", B * Hq * (N + T) * 7)  # seven queries a block
    monkeypatch.setattr(attention.torch, "softmax", spy)
    out, blocked = attention_with_mass(q, k, v, mask, D**-0.5)
    monkeypatch.undo()
    assert len(shapes) == 6 and max(s[3] for s in shapes) == 7  # 40 queries in blocks of at most 7
    torch.testing.assert_close(blocked, whole)
    torch.testing.assert_close(out, whole_out)


@pytest.mark.parametrize("how", ["blocked", "fused-output", "no-mass"])
def test_a_chunk_in_causal_parts_reads_only_the_keys_each_part_sees(monkeypatch, how):
    """On a CPU a chunk's queries attend in parts (`CPU_PART`), each over the stored keys and the chunk's keys up
    to its last query: the output and the mass are the float64 reference's, a left-padded row's and a stored hole
    included, and no part reads a key none of its queries may see."""
    torch.manual_seed(4)
    B, Hq, H, T, N, D = 2, 6, 2, 21, 9, 8
    q = torch.randn(B, Hq, T, D)
    k, v = torch.randn(B, H, N + T, D), torch.randn(B, H, N + T, D)
    stored = torch.ones(B, N, dtype=torch.bool)
    stored[:, 4] = False  # an empty slot
    real = torch.ones(B, T, dtype=torch.bool)
    real[0, :5] = False  # row 0 is left-padded
    mask = chunk_mask(real, stored)
    widths = []
    monkeypatch.setattr(attention, "CPU_PART", 8)
    real_softmax, real_fused = torch.softmax, attention.fused_attention

    def spy_softmax(x, *args, **kwargs):
        widths.append((x.shape[-2], x.shape[-1]))
        return real_softmax(x, *args, **kwargs)

    def spy_fused(query, keys, *args):
        widths.append((query.shape[2], keys.shape[2]))
        return real_fused(query, keys, *args)

    monkeypatch.setattr(attention.torch, "softmax", spy_softmax)
    monkeypatch.setattr(attention, "fused_attention", spy_fused)
    out, mass = attention_with_mass(q, k, v, mask, D**-0.5, mass=how != "no-mass", fused=how == "fused-output")
    monkeypatch.undo()
    # 21 queries in parts of 8, 8 and 5, over the 9 stored keys and the chunk's first 8, 16 and 21
    parts = [(8, N + 8), (8, N + 16), (5, N + 21)]
    assert widths == (parts if how != "fused-output" else parts + parts)
    key_ok = torch.cat((stored, real), -1)
    causal = torch.ones(T, N + T, dtype=torch.bool).tril(N)
    allowed = causal & key_ok[:, None, None, :] & real[:, None, :, None]
    ref_out, ref_mass = reference(q, k, v, D**-0.5, allowed)
    torch.testing.assert_close(out[0, 5:].double(), ref_out[0, 5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].double(), ref_out[1], atol=1e-5, rtol=1e-5)
    if how == "no-mass":
        assert mass is None
        return
    real_keys = key_ok[:, None, :].expand(B, H, N + T)
    torch.testing.assert_close(mass[real_keys].double(), ref_mass[real_keys], atol=1e-5, rtol=1e-5)
    assert (mass[..., 4] == 0).all()


def test_fallback_is_plain_causal_sdpa():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(causal_sdpa(q, k, v, None, None), expected)


def test_the_cache_is_found_under_either_name_transformers_gives_it():
    """transformers 5.2x renamed the forward's `past_key_values` to `cache` (the old name deprecated, still taken):
    the cache must attend the same whichever name the caller used. Before the attention hook looked for `cache`,
    every H2O forward on a newer transformers silently ran as if no cache were attached (garbled text)."""
    from transformers import DynamicCache

    from conftest import tiny_model
    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.policies import make_policy

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 24))
    names = {attention.cache_keyword(model), "past_key_values"}
    assert attention.cache_keyword(model) in ("cache", "past_key_values")
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(input_ids=ids[:, :16], **{attention.cache_keyword(model): reference})
        expected = model(input_ids=ids[:, 16:], **{attention.cache_keyword(model): reference}).logits
        for name in names:
            cache = H2OCache.for_model(model, make_policy("full"))
            model(input_ids=ids[:, :16], **{name: cache})
            got = model(input_ids=ids[:, 16:], **{name: cache}).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            assert cache.stats().seen == 24
