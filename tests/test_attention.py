"""The registered attention: outputs equal SDPA's, and the mass it reports is the softmax column sum."""

import pytest
import torch
import torch.nn.functional as F

from h2o_chat.engine.attention import attention_with_mass, causal_sdpa


def reference(q, k, v, scale, key_ok=None):
    """Eager causal attention over keys = cache + new (the last T are new): (out, probs per KV head)."""
    B, Hq, T, D = q.shape
    H, S = k.shape[1], k.shape[2]
    G = Hq // H
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    logits = (q @ kr.transpose(-1, -2)).double() * scale
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    if key_ok is not None:
        mask = mask & key_ok[:, None, None, :]
    logits = logits.masked_fill(~mask, -torch.inf)
    probs = logits.softmax(-1)
    out = (probs.to(q.dtype) @ vr).transpose(1, 2)
    return out, probs.view(B, H, G, T, S).sum(dim=(2, 3))


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_matches_sdpa_and_reports_mass(T, heads):
    torch.manual_seed(0)
    Hq, H = heads
    B, N, D = 2, 11, 16
    q = torch.randn(B, Hq, T, D)
    k, v = torch.randn(B, H, N + T, D), torch.randn(B, H, N + T, D)
    out, mass_c, mass_n = attention_with_mass(q, k[:, :, :N], v[:, :, :N], k[:, :, N:], v[:, :, N:], D**-0.5)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(T, N + T, dtype=torch.bool).tril(N), enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)
    ref_out, ref_mass = reference(q, k, v, D**-0.5)
    torch.testing.assert_close(torch.cat((mass_c, mass_n), -1).double(), ref_mass, atol=1e-5, rtol=1e-5)
    # every query distributes exactly one unit of mass per query head
    assert torch.allclose(torch.cat((mass_c, mass_n), -1).sum(-1), torch.full((B, H), T * Hq / H))


def test_padding_keys_get_no_mass_and_padding_queries_give_none():
    torch.manual_seed(1)
    B, Hq, H, T, N, D = 2, 4, 2, 5, 3, 8
    q = torch.randn(B, Hq, T, D)
    k, v = torch.randn(B, H, N + T, D), torch.randn(B, H, N + T, D)
    cache_valid = torch.tensor([True, False, True]).expand(B, H, N)
    new_valid = torch.tensor([[False, False, True, True, True], [True] * 5])
    out, mass_c, mass_n = attention_with_mass(
        q, k[:, :, :N], v[:, :, :N], k[:, :, N:], v[:, :, N:], D**-0.5, cache_valid, new_valid
    )
    assert (mass_c[..., 1] == 0).all()
    assert (mass_n[0, :, :2] == 0).all()  # padding keys of row 0
    key_ok = torch.cat((cache_valid[:, 0], new_valid), -1)
    ref_out, _ = reference(q, k, v, D**-0.5, key_ok)
    # real queries match the reference exactly; row 0's padding queries are simply excluded
    torch.testing.assert_close(out[0, 2:], ref_out[0, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], ref_out[1], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    # mass: the reference's probabilities restricted to real queries
    G = Hq // H
    logits = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)).double() * D**-0.5
    mask = torch.ones(T, N + T, dtype=torch.bool).tril(N) & key_ok[:, None, None, :]
    probs = logits.masked_fill(~mask, -torch.inf).softmax(-1).nan_to_num(0.0) * new_valid[:, None, :, None]
    expected = probs.view(B, H, G, T, N + T).sum(dim=(2, 3))
    torch.testing.assert_close(torch.cat((mass_c, mass_n), -1).double(), expected, atol=1e-5, rtol=1e-5)


def test_fallback_is_plain_causal_sdpa():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(causal_sdpa(q, k, v, None, None), expected)
