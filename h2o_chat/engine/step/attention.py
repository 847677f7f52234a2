"""The attention function registered with transformers as "h2o", and how a model's attention finds its cache.

H2O needs, for every cached token, the softmax attention mass it receives (summed over the queries and over
the query heads that share a KV head; per batch row, where the official code sums over the batch too).

- `attention_over_slots`: a decode step. The new token already sits in its layer's spare slot, so attention
  runs over the slots, empty ones masked: all of them on CUDA (static shapes: the step can be captured as a
  graph), on a CPU the first ones its rows can hold. One fp32 softmax gives the output and the mass. On a CPU
  where our native library is used, one call of its `decode_attention` does it all, each row and KV head reading
  its slots once (float32 or 8-bit), instead of seven operations over every row with a barrier after each.
- `attention_with_mass`: a prompt chunk of T queries over the filled slots and the chunk's own keys (causal
  among them, padding masked by one additive mask built once per chunk). The output comes from PyTorch's
  fused `scaled_dot_product_attention` when the mass is not needed, and on CUDA (where the fused kernel is much
  faster than a second matrix product); the mass is then recomputed in query blocks, never as one fp32
  (queries x keys) tensor. On CPU the blocked eager product that yields the mass also gives the output, which
  measured faster than the fused kernel plus the mass. Both compute the mass the same way (logits in the
  model's dtype, softmax in fp32): the same tokens are kept whichever path runs. The chunk's own keys come last
  and are causal, so a block of queries reads only the keys up to its last query's own; on a CPU the blocks are
  parts of `CPU_PART` queries, whose (queries x keys) blocks stay in the processor's caches.

Routing, without any side channel: `prepare_model` registers a forward pre-hook on every attention module,
which hands the cache's layer to the attention function as the keyword `h2o_layer` (transformers forwards the
module's keyword arguments to its attention function), and hooks on the model's base module that begin and
end a forward for callers that do not drive the cache themselves (`model.generate`). The hook refuses a model
whose attention is not "h2o", and the cache refuses an update outside a forward it began.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from h2o_chat.errors import CacheUsageError

if TYPE_CHECKING:
    from h2o_chat.engine.forward import OwnRow
    from h2o_chat.engine.storage.store import Recalled

ATTN_IMPLEMENTATION = "h2o"
MASS_BLOCK = 1 << 24  # fp32 probabilities per block of queries (64 MB): the prefill's largest transient
# a CPU attends a chunk's queries in parts of this many: a part's keys end at its last query's own (the chunk's
# later keys are masked for all of it), and its (queries x keys) block stays in the processor's caches. 512
# queries over 512 slots: the mass 2.2x faster, the fused kernel 1.0-1.35x (docs/experiments.md, "A chunk's
# attention in causal parts")
CPU_PART = 128

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
    valid: torch.Tensor,  # (B, 1, S) bool: slots holding a token (the same for every head)
    recalled: Recalled | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over the slots. Returns (output (B, 1, Hq, Dv), mass (B, H, S) fp32).

    `new`: the step's own key and value (B, H, 1, D), attended in the place of the last slot (the spare, which
    they are written into when the step ends): the storage is only read here, so a compiled step has no write
    into it (see `decode.py`). `width` (with `new`): only the first `width` slots are read, and the mass is
    (B, H, width + 1), the new token's last. A row holds its tokens in slots [0, held) (`evict.py`), so any
    width of at least every row's held count gives the same output: a cache still filling reads what it holds,
    not its whole budget.

    `recalled`: evicted tokens attended too (the recall policy: `store.Recalled`, their logits as the store's
    ranking computed them, or their keys), in the same softmax; they get no mass. Their logits join the slots' (not
    their keys: a copy of every slot per layer and step is what concatenating keys would cost).

    `scales`: 8-bit storage (`quant.py`): keys and values are int8 and these (B, H, S, 1) their per-token
    scales, applied to the logits and to the probabilities (the stored tokens are never rebuilt)."""
    B, Hq, T, D = query.shape
    H, S = keys.shape[1], keys.shape[2]
    qg = (query * scaling).reshape(B, H, (Hq // H) * T, D)  # query heads of a group share their KV head
    if new is not None:  # the slots before the spare (or the first `width`), then the new token in the spare's place
        S = S - 1 if width is None else width
        keys, values, valid = keys[:, :, :S], values[:, :, :S], valid[..., :S]
        scales = None if scales is None else (scales[0][:, :, :S], scales[1][:, :, :S])
    kernel = _native_attention(qg, keys, values, recalled, new)
    if kernel is not None:  # one pass per row and KV head over its slots (models/native/attention.cpp)
        more = () if recalled is None else (recalled.logits * scaling, recalled.values)
        out, mass = kernel(qg, keys, values, valid, *(scales or (None, None)), *new, *more)
        return out.reshape(B, Hq, T, -1).transpose(1, 2), mass
    logits = (qg @ keys.to(qg.dtype).transpose(-1, -2)).float()  # (B, H, G, S)
    if scales is not None:
        logits *= scales[0].transpose(-1, -2)
    logits.masked_fill_(~valid[:, :, None, :], -torch.inf)
    if new is not None:
        logits = torch.cat((logits, (qg @ new[0].transpose(-1, -2)).float()), dim=-1)  # (B, H, G, S + 1)
    if recalled is not None:
        if recalled.logits is not None:  # the store's ranking computed them (a decode step)
            more = recalled.logits * scaling
        else:
            more = qg @ recalled.keys.transpose(-1, -2)
            if more.dtype != logits.dtype:
                more = more.float()
        if recalled.valid is not None:  # None: every recalled entry is a token
            more.masked_fill_(~recalled.valid[:, :, None, :], -torch.inf)
        logits = torch.cat((logits, more), dim=-1)
    probs = logits.softmax(dim=-1)
    held = probs[..., :S]
    if scales is None:
        out = held.to(values.dtype) @ values  # (B, H, G, Dv)
    else:
        out = (held * scales[1].transpose(-1, -2)).to(query.dtype) @ values.to(query.dtype)
    if new is not None:
        own = probs[..., S : S + 1]  # (B, H, G, 1)
        out = out + own.to(out.dtype) * new[1]
        held, S = probs[..., : S + 1], S + 1
    if recalled is not None:
        rest = probs[..., S:]
        out += (rest if rest.dtype == out.dtype else rest.to(out.dtype)) @ recalled.values
    return out.reshape(B, Hq, T, -1).transpose(1, 2), held.sum(dim=-2)


def _native_attention(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, recalled, new):
    """The library's decode attention where it serves this step (on CPU, float32 queries over float32 or 8-bit
    slots, and the tokens a decode step recalled, by their logits), else None: PyTorch's operations below."""
    if qg.device.type != "cpu" or new is None or qg.dtype != torch.float32:
        return None
    if recalled is not None and not (
        recalled.logits is not None and recalled.valid is None and recalled.values.dtype == torch.float32
    ):
        return None
    if keys.dtype not in (torch.float32, torch.int8) or new[0].dtype != torch.float32 or new[1].dtype != torch.float32:
        return None
    if qg.shape[-1] % 8 or values.shape[-1] % 8 or _native is None:
        return None
    return _native[0]()


# The native library's decode attention (`models.native`, a layer above: it hands itself over when imported, as
# every CPU model's loading does): what gives the kernel or None, and what names what a step calls of the library.
_native: tuple[Callable[[], Callable | None], Callable[[], str]] | None = None


def use_native(kernel: Callable[[], Callable | None], products: Callable[[], str]) -> None:
    global _native
    _native = (kernel, products)


def native_products() -> str | None:
    """What a compiled step on CPU calls of the native library (its 4-bit products' kernel, its attention), for its
    package's key: a process never loads a step calling kernels it does not use. None: the library is not in use."""
    if _native is None:
        return None
    kernel, products = _native
    return products() + (" and its attention" if kernel() is not None else "")


def fused_attention(
    query: torch.Tensor,  # (B, Hq, T, D)
    keys: torch.Tensor,  # (B, H, N, D)
    values: torch.Tensor,  # (B, H, N, Dv)
    mask: torch.Tensor | None,  # (B, 1 | H | Hq, T, N) additive, or None
    scaling: float,
) -> torch.Tensor:
    """PyTorch's fused attention (flash / memory-efficient kernels), grouped query heads included. (B, T, Hq, Dv)"""
    G = query.shape[1] // keys.shape[1]
    if G > 1 and mask is not None and mask.shape[1] not in (1, query.shape[1]):
        mask = mask.repeat_interleave(G, 1)  # a mask per KV head (recalled tokens) -> per query head
    if G > 1 and query.device.type == "cuda" and mask is not None:
        # with a mask CUDA runs the memory-efficient kernel, which wants as many KV heads as query heads
        keys, values, G = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1), 1
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=G > 1)
    return out.transpose(1, 2)


def attention_with_mass(
    query: torch.Tensor,  # (B, Hq, T, D)
    keys: torch.Tensor,  # (B, H, N, D): the stored slots attended, then the chunk's T keys
    values: torch.Tensor,  # (B, H, N, Dv)
    mask: torch.Tensor,  # (B, 1 or H, T, N) additive, query dtype: 0 where a query may look, -inf elsewhere
    scaling: float,
    mass: bool = True,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of a chunk's queries. Returns (output (B, T, Hq, Dv), mass per key (B, H, N) fp32 or None).

    `mass`: also sum each key's softmax probability over the queries (padding queries see only themselves, so
    they give mass to no real key). `fused`: take the output from the fused kernel even when the mass is
    computed (faster on CUDA); otherwise the blocked product that gives the mass gives the output too.

    The last T keys are the chunk's, causal (every caller's mask): queries s..e-1 attend only the first
    N - T + e keys, the rest being masked for all of them. Blocks of queries (parts of `CPU_PART` on a CPU)
    therefore read only those."""
    B, Hq, T, D = query.shape
    H, N = keys.shape[1], keys.shape[2]
    part = CPU_PART if query.device.type == "cpu" else T
    if not mass:
        return _fused_in_parts(query, keys, values, mask, scaling, part), None
    G = Hq // H
    q = (query * scaling).view(B, H, G, T, D)  # query heads h*G .. h*G+G-1 share KV head h (repeat_kv's order)
    kt = keys.transpose(-1, -2)
    total = torch.zeros(B, H, N, dtype=torch.float32, device=query.device)
    block = max(1, min(T, part, MASS_BLOCK // max(1, B * Hq * N)))
    outs = []
    for s, e, n in _causal_blocks(T, N, block):
        b = e - s
        qb = q if b == T else q[:, :, :, s:e]
        logits = (qb.reshape(B, H, G * b, D) @ kt[..., :n]).view(B, H, G, b, n)
        logits += mask[:, :, None, s:e, :n]  # in place: one (queries x keys) block less to allocate
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (B, H, G, b, n)
        del logits
        total[..., :n] += probs.sum(dim=(2, 3))
        if not fused:
            outs.append((probs.to(values.dtype).view(B, H, G * b, n) @ values[:, :, :n]).view(B, H, G, b, -1))
    if fused:
        return _fused_in_parts(query, keys, values, mask, scaling, part), total
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.reshape(B, Hq, T, -1).transpose(1, 2), total


def _causal_blocks(T: int, N: int, size: int) -> list[tuple[int, int, int]]:
    """A chunk's T queries in blocks of `size`: (first, end, keys), the keys being the first N - T + end of the N
    (the chunk's own T come last, causal: the later ones are masked for every query of the block)."""
    return [(s, min(s + size, T), N - T + min(s + size, T)) for s in range(0, T, size)]


def _fused_in_parts(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float, part: int
) -> torch.Tensor:
    """`fused_attention` of a chunk's queries `part` at a time, each part over the keys it can see (the chunk's
    are last and causal: `attention_with_mass`). (B, T, Hq, Dv)"""
    T, N = query.shape[2], keys.shape[2]
    if part >= T:
        return fused_attention(query, keys, values, mask, scaling)
    outs = []
    for s, e, n in _causal_blocks(T, N, part):
        outs.append(fused_attention(query[:, :, s:e], keys[:, :, :n], values[:, :, :n], mask[..., s:e, :n], scaling))
    return torch.cat(outs, dim=1)


def attention_by_row(
    query: torch.Tensor,  # (B, Hq, T, D)
    keys: torch.Tensor,  # (B, H, R + S + T, D): R recalled tokens, S stored slots, then the chunk's T keys
    values: torch.Tensor,
    mask: torch.Tensor,  # (B, 1 or H, T, R + S + T) additive
    scaling: float,
    recalled: int,  # R
    rows: tuple[OwnRow, ...],  # every row of the batch (`forward.own_rows`)
    mass: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A CPU batch's prompt chunk, attended row by row as `attention_with_mass` attends it alone: each row's last
    t queries over its recalled tokens (if it has any to recall), its first s slots and its last t chunk keys --
    its padding and the slots it cannot have filled are no columns at all -- with the blocked product where the
    row wants the mass, the fused kernel otherwise. Padding queries get zeros; a row's mass goes to its own
    columns (zeros elsewhere, and in rows that do not want it). Returns (output (B, T, Hq, Dv), mass (B, H, N)
    fp32 or None when `mass` is False)."""
    B, Hq, T, _ = query.shape
    N, dev = keys.shape[2], keys.device
    out = query.new_zeros(B, T, Hq, values.shape[-1])
    total = torch.zeros(B, keys.shape[1], N, dtype=torch.float32, device=dev) if mass else None
    for row in rows:
        b, t = row.row, row.tokens
        if t == 0:  # none of its tokens in this chunk: alone it has no such chunk
            continue
        first = 0 if row.recalls else recalled
        if first == 0 and row.stored == N - T - recalled and t == T:  # every column its own
            cols, k, v, m = None, keys[b : b + 1], values[b : b + 1], mask[b : b + 1]
        else:
            cols = torch.cat((torch.arange(first, recalled + row.stored), torch.arange(N - t, N))).to(dev)
            k, v = keys[b : b + 1].index_select(2, cols), values[b : b + 1].index_select(2, cols)
            m = mask[b : b + 1, :, T - t :].index_select(-1, cols)
        got, got_mass = attention_with_mass(query[b : b + 1, :, T - t :], k, v, m, scaling, row.mass)
        out[b, T - t :] = got[0]
        if mass and got_mass is not None:
            if cols is None:
                total[b] = got_mass[0]
            else:
                total[b].index_copy_(-1, cols, got_mass[0])
    return out, total


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
    if h2o_layer is None:  # no H2O cache in this forward: plain causal attention
        padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        return causal_sdpa(query, key, value, padding, scaling), None
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise CacheUsageError(f"this model uses {what}, which the H2O cache does not support")
    return h2o_layer.attend(query, key, value, scaling), None


def passthrough_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Mask 'creation' for the h2o implementation: keep the 2D padding mask, build nothing (the cache builds
    one mask per chunk itself)."""
    return attention_mask


# what a model's forward and its attention modules call the cache: transformers 5.2x renamed `past_key_values` to
# `cache` (the old name still accepted, deprecated); GPT-NeoX's attention says `layer_past`
CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


def _h2o_cache(kwargs: dict):
    for name in CACHE_KWARGS:
        cache = kwargs.get(name)
        if getattr(cache, "h2o_layer", None) is not None:
            return cache
    return None


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its cache by: `cache` in newer transformers, else
    `past_key_values` (passing the old name to a newer one works but warns)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _route(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of an attention module: hand the H2O cache's layer to the attention function."""
    cache = _h2o_cache(kwargs)
    if cache is None:
        return None
    if module.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise CacheUsageError(
            f"an H2O cache was passed to a model whose attention is {module.config._attn_implementation!r}: "
            "call h2o_chat.prepare_model(model) and keep its attention implementation 'h2o'"
        )
    kwargs["h2o_layer"] = cache.h2o_layer(module.layer_idx)
    return args, kwargs


def _begin(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Pre-hook of the model's base module, for callers that do not drive the cache (`model.generate`): begin a
    forward -- a decode step when one token per row follows what the cache holds, else a prompt chunk -- and
    number the new tokens as the cache does (true positions, or renumbered ones past the trained context)."""
    cache = _h2o_cache(kwargs)
    if cache is None or cache.host_managed:
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    if ids is None:
        ids = kwargs["inputs_embeds"]
    T = ids.shape[1]
    mask = kwargs.get("attention_mask")
    mask = mask[:, -T:] if mask is not None and mask.dim() == 2 else None
    padded = mask is not None and not bool(mask.all())
    kind = "step" if T == 1 and cache.slots is not None and not padded else "chunk"
    mask = mask.to(ids.device) if mask is not None else None
    kwargs["position_ids"] = cache.begin(kind, mask if kind == "chunk" else None, T, batch=ids.shape[0])
    return args, kwargs


def _end(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    cache = _h2o_cache(kwargs)
    if cache is not None and not cache.host_managed:
        cache.end()


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


def decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module that runs the decoder layers (LlamaModel, OPTDecoder, GPTNeoXModel): a forward through the
    model passes through it once, with the cache among its arguments."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return m
    return model.base_model


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
        base = decoder_stack(model)
        base.register_forward_pre_hook(_begin, with_kwargs=True)
        base.register_forward_hook(_end, with_kwargs=True)
        model._h2o_routed = True
    return model
