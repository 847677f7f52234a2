"""The attention function registered with transformers as "h2o", and how a model's attention finds its cache.

H2O needs, for every cached token, the softmax attention mass it receives. Two kernels compute attention with
that mass in one fp32 softmax:

- `attention_over_slots`: a decode step. The new token already sits in its layer's spare slot, so attention
  runs over all slots of fixed shape, empty ones masked (static shapes: the step can be captured as a graph).
- `attention_with_mass`: a prefill chunk of T tokens, over the stored slots and the chunk (causal among the new
  tokens, padding masked), without concatenating the chunk onto the cache.

Mass is summed over the queries and over the query heads that share a KV head (GQA: summing or averaging a
group gives the same ranking; we sum, as the official code sums over heads and queries).

Routing, without any side channel: `prepare_model` registers a forward pre-hook on every attention module.
When the module is called with an H2O cache (`past_key_values` or `layer_past`), the hook asks the cache for
that layer and passes it to the attention function as the keyword `h2o_layer` (transformers forwards the
module's keyword arguments to its attention function). The hook refuses a model whose attention is not "h2o",
and the cache refuses an update that did not come through the hook, so a bypass fails at once. In rolling
mode the hook also hands the module an identity rotation (the cache rotates by rank itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h2o_chat.errors import CacheUsageError

ATTN_IMPLEMENTATION = "h2o"

# keyword arguments some models pass to their attention function, which h2o-chat's attention does not honour
_UNSUPPORTED = {
    "sliding_window": "sliding-window attention",
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks in the softmax",
}


def attention_over_slots(
    query: torch.Tensor,  # (B, Hq, 1, D)
    keys: torch.Tensor,  # (B, H, S, D): every slot, the new token's included
    values: torch.Tensor,  # (B, H, S, Dv)
    scaling: float,
    valid: torch.Tensor,  # (B, H, S) bool: slots holding a token
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over all slots (static shapes). Returns (output (B, 1, Hq, Dv), mass (B, H, S) fp32)."""
    B, Hq, T, D = query.shape
    H = keys.shape[1]
    qg = (query * scaling).reshape(B, H, (Hq // H) * T, D)  # query heads of a group share their KV head
    logits = (qg @ keys.transpose(-1, -2)).float()  # (B, H, G, S)
    probs = logits.masked_fill(~valid[:, :, None, :], -torch.inf).softmax(dim=-1)
    out = probs.to(values.dtype) @ values  # (B, H, G, Dv)
    return out.reshape(B, Hq, T, -1).transpose(1, 2), probs.sum(dim=-2)


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
    h2o_layer=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    if h2o_layer is None:  # no H2O cache in this forward: plain causal attention
        return causal_sdpa(query, key, value, padding, scaling), None
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise CacheUsageError(f"this model uses {what}, which the H2O cache does not support")
    return h2o_layer.attend(query, key, value, padding, scaling), None


def passthrough_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask 'creation' for the h2o implementation: keep the 2D padding mask, build nothing."""
    return attention_mask


def _route(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of an attention module: hand the H2O cache's layer to the attention function."""
    cache = kwargs.get("past_key_values", kwargs.get("layer_past"))
    h2o_layer = getattr(cache, "h2o_layer", None)
    if h2o_layer is None:
        return None
    if module.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise CacheUsageError(
            f"an H2O cache was passed to a model whose attention is {module.config._attn_implementation!r}: "
            "call h2o_chat.prepare_model(model) and keep its attention implementation 'h2o'"
        )
    hidden = args[0] if args else kwargs["hidden_states"]
    kwargs["h2o_layer"] = h2o_layer(module.layer_idx, hidden.shape[1])
    rotation = kwargs.get("position_embeddings")
    if rotation is not None and cache.rolling:  # raw queries and keys: the cache rotates them by rank
        kwargs["position_embeddings"] = cache.identity_rotation(rotation, module.layer_idx)
    return args, kwargs


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


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules: they carry a layer index and call the registered attention function."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")
    ]


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's attention through h2o-chat (needed for the H2O cache); returns the model."""
    register()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if not getattr(model, "_h2o_routed", False):
        modules = attention_modules(model)
        if not modules:
            raise CacheUsageError(f"found no attention modules with a layer index in {type(model).__name__}")
        for m in modules:
            m.register_forward_pre_hook(_route, with_kwargs=True)
        model._h2o_routed = True
    return model
