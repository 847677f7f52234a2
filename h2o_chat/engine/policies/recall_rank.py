"""What a decode step and a prompt chunk bring back from recall's store (`store.Store`): the ranking of its entries.

A decode step (`step`) ranks the stored tokens of each (row, KV head) by their attention logit under the step's
query (the maximum over the group's query heads), takes the `recalled` best, and attends over the held slots
plus those tokens. A prompt chunk (a user's message) recalls too, once for all its queries (`chunk`): twice
`recalled` stored tokens, those with the largest logit under any of its real queries, attended by every query of
the chunk beside the held slots (transient: the device holds them while the chunk is read). Both are needed
(measured on the multi-turn recall evaluation's tuning texts at a 10% budget: steps alone kept 0.69 of the
likelihood gain, however many tokens they recalled, chunks alone 0.01, both 0.97, 1.00 when a chunk recalls twice
as many as a step): the answer's own queries are the ones that look for an early fact, but the keys and values of
the question, read as a chunk, must have been computed with the fact in view. Recalled tokens are attended at the
position their key is rotated at and never enter the slots (the held set evolves exactly as snap's); their
attention mass is not accumulated.

Both rank in two passes. The first reads each entry's coordinates in its head's `RANK_DIM` principal directions
(int8: a quarter of the key's bytes, or less), which choose `CANDIDATES` x the tokens recalled; their keys are
then read and ranked exactly. Cheaper first passes lost the fact (8 directions, two candidates per recalled
token: 0.79-0.80 of the gain kept on the tuning texts, against 0.97); so did ranking less often than every step
(every 4th lost 0.3): the step whose query turns to the fact must find it.

A step's ranking is pure tensor work of static shapes -- a fixed capacity, empty entries masked, a fixed number
recalled (`store.pick`'s length) -- with no host synchronisation, so it runs inside the compiled CPU step and the
captured CUDA graph. The step attends with the ranking's own logits (the recalled keys are never gathered twice)
and hands back which entries it recalled (`Recalled.index`): the step's end counts them (`Store.mark`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from h2o_chat.engine.storage.store import entries_at

CHUNK_TIMES = 2  # a prompt chunk recalls this many times what a step recalls
CANDIDATES = 4  # the exact pass ranks this many times what is recalled: the first pass's best
STORE_STEP = 64  # a decode step ranks a filling store's entries in multiples of this many (few distinct shapes)
RANK_BLOCK = 1 << 19  # (queries x entries) logits a prompt chunk ranks at once on a CPU: 2 MB in fp32
# on a GPU, 64 MB: with 2 MB a Llama-2-7B chunk of 512 ranked 4 queries at a time, 1,475 kernels per layer, and
# read a 4,096-token prompt 42x slower than h2o (H200, 2026-11-27)
RANK_BLOCK_CUDA = 1 << 24

# The native library's `recall_step` (`models.native`, a layer above: it hands itself over when imported), what
# gives it or None.
_native: Callable[[], Callable | None] | None = None


def use_native(kernel: Callable[[], Callable | None]) -> None:
    global _native
    _native = kernel


def rank_block(device: torch.device | str) -> int:
    """The (queries x entries) logits a prompt chunk ranks at once on this device."""
    return RANK_BLOCK_CUDA if torch.device(device).type == "cuda" else RANK_BLOCK


class Recalled(NamedTuple):
    """What a layer's queries bring back from the store, on the store's device: the tokens' values (B, H, R, Dv)
    and whether each is a token (B, H, R; None: the logits say it, -inf where not). A prompt chunk gets their keys
    (B, H, R, D) to attend with; a decode step gets their logits (B, H, G, R), unscaled, from its own ranking.
    `index`: the entries recalled (B, H, R)."""

    keys: torch.Tensor | None
    values: torch.Tensor
    valid: torch.Tensor | None
    logits: torch.Tensor | None = None
    index: torch.Tensor | None = None


def first_pass(q: torch.Tensor, basis: torch.Tensor, low: torch.Tensor, lscale: torch.Tensor) -> torch.Tensor:
    """Approximate logits from n entries' coordinates in a layer's basis (B, H, D, rank): q (B, H, Q, D) fp32,
    low (B, H, n, rank) int8 and its scales (B, H, n, 1) -> (B, H, Q, n)."""
    ql = q @ basis  # (B, H, Q, rank)
    # each entry's scale applied to its logit, not to its coordinates: one (B, H, n, rank) transient fewer
    return (ql @ low.float().mT) * lscale.float().mT


def read_width(store) -> int | None:
    """How many entries a decode step ranks: a store fills its entries in order (`slots.place`: an empty one first,
    the lowest), and a row has stored no more than it has evicted (`Store.evicted`, host counts), so a store still
    filling is ranked over what it can hold, in multiples of `STORE_STEP` and at least the candidates a step ranks
    (None: every entry)."""
    most = max(store.evicted, default=0)
    width = max(CANDIDATES * store.pick.shape[0], -(-most // STORE_STEP) * STORE_STEP)
    return None if width >= store.capacity else width


def step(store, i: int, query: torch.Tensor, width: int | None = None) -> Recalled:
    """Layer i's decode-step query (B, Hq, 1, D) -> the stored tokens it attends to most, in as few operations
    as it takes (it runs in every layer of every step): the first pass, its `CANDIDATES` x k best, their exact
    logits (the maximum over the group's query heads ranks them), the k best, their values. `width`: only the
    first entries are ranked (`read_width`; None: every one). On CPU the native library's `recall_step` does it
    all in one pass per row and KV head (models/native/attention.cpp), else PyTorch's operations (`ranked`)."""
    B, Hq, _, D = query.shape
    H, n = store.keys.shape[2], store.capacity if width is None else width
    q = query.reshape(B, H, Hq // H, D).float()
    per_row = None if store.uniform else store.per_row
    ranked_first = (store.low[i, :, :, :n], store.lscale[i, :, :, :n], store.pos[i, :, :, :n])
    tables = (store.basis[i], *ranked_first, store.keys[i], store.kscale[i], store.values[i], store.vscale[i])
    op = _native() if _native is not None and q.device.type == "cpu" and query.dtype == torch.float32 else None
    if op is not None:  # k (the pick's length) and the spare (the last entry) are sizes, not values
        logits, values, index = op(q, *tables, store.pick, CANDIDATES, per_row)
    else:
        logits, values, index = ranked(q, *tables, store.pick, store.capacity, per_row, query.dtype)
    return Recalled(None, values, None, logits, index)


def ranked(q, basis, low, lscale, pos, keys, kscale, values, vscale, pick, spare: int, per_row, dtype):
    """`step`'s ranking in PyTorch's operations: q (B, H, G, D) fp32, a layer's basis, the coordinates, their
    scales and positions of the n entries ranked (B, H, n, ...) and every entry's keys and values (B, H, E, ...)
    -> (logits (B, H, G, k) unscaled, values (B, H, k, Dv) in `dtype`, index (B, H, k)), best first, k the length
    of `pick` (0 .. k - 1, the store's: one tensor made once). `per_row`
    (B,): what each row recalls (None: k each); a row that recalls fewer ranks only its own number of candidates
    (the best first), and gets -inf logits and the `spare` entry past its own number."""
    B, H, G, D = q.shape
    k = pick.shape[0]
    empty = pos < 0  # (B, H, n)
    approx = first_pass(q, basis, low, lscale).amax(2).masked_fill(empty, -torch.inf)
    cand = approx.topk(CANDIDATES * k, dim=-1, sorted=True).indices  # (B, H, C)
    cand_keys = entries_at(keys, kscale, cand, torch.float32)
    skip = empty.gather(2, cand)
    if per_row is not None:
        skip = skip | (torch.arange(cand.shape[-1], device=cand.device) >= CANDIDATES * per_row[:, None, None])
    logits = (q @ cand_keys.mT).masked_fill(skip[:, :, None, :], -torch.inf)  # (B, H, G, C)
    top = logits.amax(2).topk(k, dim=-1, sorted=True).indices  # (B, H, k), best first
    index = cand.gather(2, top)
    logits = logits.gather(3, top[:, :, None, :].expand(B, H, G, k))
    if per_row is not None:  # rows that recall fewer (or none) mask the rest
        fewer = pick[None, None, :] >= per_row[:, None, None]  # (B, 1, k)
        logits = logits.masked_fill(fewer[:, :, None, :], -torch.inf)
        index = index.masked_fill(fewer, spare)  # (the spare: nothing counted)
    return logits, entries_at(values, vscale, index, dtype), index


def chunk(store, i: int, query: torch.Tensor, real: torch.Tensor | None) -> Recalled:
    """Layer i's prompt-chunk queries (B, Hq, T, D) -> the stored tokens with the largest logit under any of the
    real ones (`real` (B, T); every query when None), with their keys. The (queries x entries) logits are taken
    `rank_block(device)` at a time: a long chunk never holds them all at once. Only the first entries its rows
    can have stored are ranked (`read_width`, counted up to the end of this chunk: no fewer than it holds)."""
    B, Hq, T, D = query.shape
    H, n = store.keys.shape[2], read_width(store) or store.capacity
    G = Hq // H
    many = CHUNK_TIMES if real is not None else 1  # a chunk's queries are many and want different tokens
    k = min(many * store.k, n)
    q = query.float().reshape(B, H, G * T, D)  # query heads grouped by their KV head, then queries
    skip = None if real is None else ~real[:, None, None, :].expand(B, H, G, T).reshape(B, H, G * T, 1)
    empty = store.pos[i, :, :, :n] < 0
    block = rank_block(query.device)

    def best(logits_of, width: int) -> torch.Tensor:
        step = max(1, block // max(1, B * H * width))
        out = None
        for s in range(0, G * T, step):
            part = logits_of(q[:, :, s : s + step])
            if skip is not None:
                part = part.masked_fill(skip[:, :, s : s + step], -torch.inf)
            part = part.amax(2)
            out = part if out is None else torch.maximum(out, part)
        return out

    coordinates = (store.basis[i], store.low[i, :, :, :n], store.lscale[i, :, :, :n])
    approx = best(lambda qs: first_pass(qs, *coordinates), n).masked_fill(empty, -torch.inf)
    cand = approx.topk(min(CANDIDATES * k, n), dim=-1, sorted=True).indices
    keys = store.keys_at(i, cand, torch.float32)
    unused = empty.gather(2, cand)
    if not store.uniform:  # a row that recalls fewer ranks only its own number of candidates (the best first)
        own = CANDIDATES * many * store.per_row[:, None, None]
        unused = unused | (torch.arange(cand.shape[-1], device=cand.device) >= own)
    exact = best(lambda qs: qs @ keys.mT, cand.shape[-1]).masked_fill(unused, -torch.inf)
    top = exact.topk(k, dim=-1)
    index = cand.gather(2, top.indices)
    valid = (top.values > -torch.inf) & (torch.arange(k, device=index.device) < many * store.per_row[:, None, None])
    store.marks[i].scatter_add_(2, index, valid.to(store.marks.dtype))
    return Recalled(store.keys_at(i, index, query.dtype), store.values_at(i, index, query.dtype), valid, None, index)
