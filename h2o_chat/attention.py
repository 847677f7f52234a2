"""The attention function registered with transformers as "h2o".

H2O needs, for every cached token, the softmax attention mass it receives. `attention_with_mass` computes the
attention of the new queries over two blocks -- the cached slots and the new tokens -- with one fp32 softmax,
and returns the output together with the mass per key, summed over the queries and over the query heads that
share a KV head (GQA: summing or averaging a group gives the same ranking; we sum, as the official code sums
over heads and queries). The new tokens are never concatenated onto the cache: only the small logit rows are.

Plugging in: `H2OLayer.update` stashes the new keys/values and marks itself active; the model then calls
`h2o_attention_forward`, which hands the queries to that layer. Without an H2O cache (a plain forward, or
transformers' own caches) the function falls back to ordinary causal SDPA, so a prepared model still works
everywhere. The registered mask function passes the 2D padding mask through untouched: the cache knows which
slots are valid and builds its own (small) masks, so no (seq x seq) mask is ever materialised.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from h2o_chat.cache import H2OLayer

ATTN_IMPLEMENTATION = "h2o"

_ACTIVE = threading.local()  # the H2OLayer whose update() ran last on this thread


def set_active(layer: H2OLayer | None) -> None:
    _ACTIVE.layer = layer


def get_active() -> H2OLayer | None:
    return getattr(_ACTIVE, "layer", None)


def attention_with_mass(
    query: torch.Tensor,  # (B, Hq, T, D)
    k_cache: torch.Tensor,  # (B, H, N, D)
    v_cache: torch.Tensor,  # (B, H, N, Dv)
    k_new: torch.Tensor,  # (B, H, T, D)
    v_new: torch.Tensor,  # (B, H, T, Dv)
    scaling: float,
    cache_valid: torch.Tensor | None = None,  # (B, H, N) bool; None = all valid
    new_valid: torch.Tensor | None = None,  # (B, T) bool; None = all valid
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention of T new queries over N cached keys (all in the past) and the T new keys.

    Returns (output (B, T, Hq, Dv), mass on cached keys (B, H, N) fp32, mass on new keys (B, H, T) fp32).
    Padding queries (new_valid False) add no mass; padding keys get none.
    """
    B, Hq, T, D = query.shape
    H, N = k_cache.shape[1], k_cache.shape[2]
    G = Hq // H
    # query heads h*G .. h*G+G-1 share KV head h (repeat_kv's order): rows of qg are (g, t)
    qg = (query * scaling).reshape(B, H, G * T, D)
    logits = torch.cat(
        (qg @ k_cache.transpose(-1, -2), qg @ k_new.transpose(-1, -2)), dim=-1
    ).float()  # (B, H, G*T, N+T)

    if cache_valid is not None:
        logits[..., :N].masked_fill_(~cache_valid[:, :, None, :], -torch.inf)
    if T > 1 or new_valid is not None:
        t = torch.arange(T, device=query.device)
        allowed = t[None, :] <= t[:, None]  # (T, T) causal among the new tokens
        if new_valid is not None:
            # a query always sees itself, so padding rows never turn into NaN
            allowed = (allowed & new_valid[:, None, None, :]) | torch.eye(T, dtype=torch.bool, device=t.device)
        # (.., T, T) -> (.., G*T, T): the same pattern for each query head of the group
        allowed = allowed.repeat(*([1] * (allowed.dim() - 2)), G, 1)
        logits[..., N:].masked_fill_(~allowed, -torch.inf)

    probs = logits.softmax(dim=-1)  # (B, H, G*T, N+T) fp32
    weighted = probs
    if new_valid is not None:
        weighted = probs * new_valid.repeat(1, G)[:, None, :, None]  # padding queries add no mass
    mass = weighted.sum(dim=-2)  # (B, H, N+T)

    p = probs.to(v_cache.dtype)
    out = p[..., :N] @ v_cache + p[..., N:] @ v_new  # (B, H, G*T, Dv)
    out = out.reshape(B, Hq, T, -1).transpose(1, 2)  # (B, T, Hq, Dv)
    return out, mass[..., :N], mass[..., N:]


def causal_sdpa(
    query: torch.Tensor,  # (B, Hq, T, D)
    key: torch.Tensor,  # (B, H, S, D), the last T keys are the queries' own
    value: torch.Tensor,
    padding_mask: torch.Tensor | None,  # (B, >=S) 2D, 1 = real token
    scaling: float | None,
) -> torch.Tensor:
    """Ordinary causal attention, used when no H2O cache is attached. Returns (B, T, Hq, Dv)."""
    T, S = query.shape[2], key.shape[2]
    mask = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)
    if padding_mask is not None:
        eye = torch.zeros_like(mask)
        eye[:, S - T :] = torch.eye(T, dtype=torch.bool, device=mask.device)
        mask = (mask & padding_mask[:, None, None, -S:].bool()) | eye
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2)


def h2o_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    layer = get_active()
    if layer is not None and layer.owns(key):
        set_active(None)
        return layer.attend(query, padding, scaling), None
    return causal_sdpa(query, key, value, padding, scaling), None


def passthrough_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask 'creation' for the h2o implementation: keep the 2D padding mask, build nothing."""
    return attention_mask


_registered = False


def register() -> None:
    """Register the "h2o" attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, h2o_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, passthrough_mask)
    _registered = True


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's attention through h2o-chat (needed for the H2O cache); returns the model."""
    register()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
