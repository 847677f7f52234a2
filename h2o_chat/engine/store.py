"""The store of evicted tokens behind the `recall` policy, and what each step and prompt chunk brings back from it.

Every token a row that recalls evicts -- in a decode step (`evict.step`) or a prompt chunk (`evict.chunk`) -- is
appended here with its key (as stored: rotated at its true position, or at the number the cache gave it), value,
true position and the position its key is rotated at, per layer, row and KV head, in eviction order (a chunk's
losers sorted by position, so a block holds neighbours). The store lives off the accelerator (on the host; on CPU
that is the same memory): what the accelerator holds stays the budget.

A decode step (`recall`) ranks the stored tokens of each (row, KV head) by their attention logit under the step's
query (the maximum over the group's query heads), takes the `recalled` best, and attends over the held slots plus
those tokens. A prompt chunk (a user's message) recalls too, once for all its queries: twice `recalled` stored
tokens, those with the largest logit under any of its real queries, attended by every query of the chunk beside the
held slots (transient: the accelerator holds them while the chunk is read). Both are needed (measured on the
multi-turn recall evaluation's tuning texts at a 10% budget: steps alone kept 0.69 of the likelihood gain, however
many tokens they recalled, chunks alone 0.01, both 0.97, 1.00 when a chunk recalls twice as many as a step): the
answer's own queries are the ones that look for an early fact, but the keys and values of the question, read as a
chunk, must have been computed with the fact in view. Recalled tokens are attended at their true positions (once the
cache renumbers the held tokens past the trained context, at their rank among them: `renumber`) and never enter the
slots (nothing is duplicated; the held set evolves exactly as snap's); their attention mass is not accumulated.

With `block` > 1 the store ranks blocks of `block` entries instead, by Quest's page summary: the per-channel minimum
and maximum of the block's keys, from which sum_d max(q_d * min_d, q_d * max_d) bounds every logit in the block from
above. It costs 2 / block of the exact ranking, but evicted tokens leave one or a few at a time, so a block mixes
unrelated tokens and the bound is loose: measured, it keeps much less (see `Recall`).

Costs per step and layer: while the store is small, one (G x D) @ (D x stored) product per (row, head), a top-k and
the gather of the recalled tokens' values -- the first half of attention over everything evicted, without its
softmax or values; the step attends with the ranking's own logits of the tokens it recalled (their keys are never
gathered). Empty entries are not stored where a whole column would be empty (a single row's chunks), so such a store
is ranked without masks. Reading the stored keys is most of it once the store is large (they do not stay in the
processor's caches), so past `TWO_PASS_FROM` x `CANDIDATES` x the tokens recalled a step ranks in two passes: the
stored keys' coordinates in their `RANK_DIM` principal directions (per layer, row and KV head; fitted each time the
store doubles, new entries projected as they come) choose `CANDIDATES` x the tokens recalled, which are ranked
exactly. Each row follows its own schedule (its own threshold, candidates, basis and refits, from the tokens it
holds), so a row recalls what it would alone whatever its batch neighbours' budgets. It reads a quarter of each
stored key's channels plus the candidates' keys, so a step's cost grows about a third as fast with the store
(measured on the embedded model, one CPU thread, budget 512: 1.37x h2o's step at 8,192 tokens seen where exact
ranking took 1.76x; see README). On the multi-turn evaluation it kept the gain (held-out
texts, 10% budget: 0.997 with 9/30 hits, exact ranking 0.90 with 4/30). Cheaper first passes lost the fact: 8
directions (held-out, 10%: 0.79), two candidates per recalled token (tuning texts, 10%: 0.80), Quest's block bounds
in eviction order or by position; so did ranking less often than every step (every 2nd step with the next 3 tokens
of each recalled one kept its gain on the tuning texts, every 4th lost 0.3, a ranking by the previous step's queries
0.2): the step whose query turns to the fact must find it. SparQ's approximate first pass over the query's largest
channels was measured no faster on CPU (its gathers cost what they save).

On a CPU each of those operators costs microseconds whatever its size, and a step ran about 17 per layer, two of
them top-k sorts; a store of float32 (the CPU's), float16 or bfloat16 keys (a GPU model's) ranks a step in one call
per layer of `csrc/recall_step.c` instead (`native`: the same ranking in float32 arithmetic, its selections made
without sorting, each head's passes shared by the machine's threads), and falls back to the operators where it
cannot be built or the store is 8-bit or uneven (rows that recall different counts, holes). The coordinates are kept
in bfloat16 (the first pass's bytes are its cost; it only chooses candidates). The C ranking also lists, during its
first pass, the entries that score at least a threshold the same layer and head left at its last step, and takes the
candidates from that list when it holds enough (the same entries: every one above the k-th best is in it), which
spares ranking every entry again.

A chunk's ranking is a (G T x D) @ (D x stored) product, in blocks of queries: what a full cache's attention over
the same tokens costs. On CUDA the store stays on the host, so a step sends each layer's query down and the recalled
tokens up (eager steps: the store grows every step, which a captured graph cannot follow).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from h2o_chat.engine import native
from h2o_chat.engine.quant import SCALE_DTYPE, bytes_per_element, dequantize, quantize

GROW = 1024  # entries added when the store is full (then doubled)
HOST_RESERVE = 1 << 30  # host memory the store leaves free: it stops growing rather than take it
CHUNK_TIMES = 2  # a prompt chunk recalls this many times what a step recalls
RANK_DIM = 16  # principal directions of the stored keys whose coordinates a step's first ranking pass reads
CANDIDATES = 4  # a step ranks exactly this many times what it recalls: the first pass's best
TWO_PASS_FROM = 2  # ... once the store holds this many times the candidates (below, one exact pass costs less)
# the C ranking's store dtypes (`csrc/recall_step.c`'s kinds): keys and values as the model makes them
NATIVE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
LOW_DTYPE = torch.bfloat16  # the stored keys' coordinates in the basis (see `_allocate`)
BLOCK_BUFFERS = ("kmin", "kmax", "filled")  # the Quest summaries, per block of entries (the rest are per entry)
RANK_BLOCK = 1 << 19  # (queries x stored) logits ranked at once by a prompt chunk: 2 MB in fp32, reduced while
# still in the processor's cache (blocks of 64 MB, written out to memory and read back, took twice as long)


def entry_bytes(
    layers: int,
    rows: int,
    kv_heads: int,
    key_dim: int,
    value_dim: int,
    elem: int,
    block: int = 1,
    value_elem: float | None = None,
    rank_dim: int | None = None,
):
    """Host bytes one store entry takes over every layer, row and KV head: its key, the key's `rank_dim`
    principal coordinates (bf16), its value (`value_elem` bytes per value element when they are kept in 8 bits),
    position (8), the position its key is rotated at (4), empty flag (1) and recall count (4), and with blocks its
    share of the block summaries."""
    blocks = (2 * key_dim * 4 + 1) / block if block > 1 else 0
    rank_dim = rank_dim_for(key_dim, block) if rank_dim is None else rank_dim
    values = value_dim * (value_elem or elem)
    return layers * rows * kv_heads * (key_dim * elem + rank_dim * 2 + values + 8 + 4 + 1 + 4 + blocks)


def rank_dim_for(key_dim: int, block: int = 1) -> int:
    """Principal coordinates kept per stored key for the two-pass ranking (0: exact ranking only, for keys too
    small to gain from it or a store ranked in blocks)."""
    return RANK_DIM if key_dim > RANK_DIM and block == 1 else 0


class Recalled(NamedTuple):
    """What a layer's queries bring back from the store, on the queries' device: the stored tokens' values (B, H,
    R, Dv) and whether each is a token (B, H, R; None: every one is). A prompt chunk gets their keys (B, H, R, D)
    to attend with; a decode step gets their logits (B, H, G, R), unscaled, from its own ranking (the step's
    query is the one that ranked them: taking the logits from there spares gathering the keys and a product)."""

    keys: torch.Tensor | None
    values: torch.Tensor
    valid: torch.Tensor | None
    logits: torch.Tensor | None = None


def host_available() -> int:
    """Bytes the host can still give this process (psutil's available: free plus reclaimable)."""
    import psutil

    return psutil.virtual_memory().available


class Store:
    """Per layer, row and KV head: evicted keys (L, B, H, N, D), values, true positions (-1: nothing), and the
    block summaries. `recalled` (B,) tokens each row brings back per step (0: a row that does not recall)."""

    def __init__(
        self, layers: int, key: torch.Tensor, value: torch.Tensor, recalled: list[int], block: int, quant: bool = False
    ):
        B, H, _, D = key.shape
        self.block, self.device = block, torch.device("cpu")
        self.quant = quant  # values in int8 with a scale per entry (`--kv-quant 8bit`); keys stay wide for ranking
        self.shape = (layers, B, H)
        self.dtype, self.D, self.Dv = key.dtype, D, value.shape[-1]
        self.count = 0  # entries appended (the same for every row and head: see `append`)
        self.full = False  # it stopped growing: the host had no memory to spare; later evictions are not kept
        self.holes = False  # some entry before `count` holds nothing (padding, a row that does not recall)
        self.renumbers = 0  # times the entries were renumbered (`renumber`; a snapshot from before cannot return)
        self._ones = None
        # a step's ranking in one C call per layer (`native`; not 8-bit stores): None until the first step asks
        self._native: bool | None = None
        self._calls: dict[int, tuple] = {}  # per layer, what its calls pass but the step (`_native_call`)
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # the C ranking's, shared by every layer
        self.listed = 0  # (layer, row, head) rankings whose candidates the last step's threshold listed (C ranking)
        # a step's ranking in two passes (`_recall_step`): the keys' coordinates in `rank_dim` principal directions
        # choose `candidates` times what it recalls, which are ranked exactly (0: every stored key ranked exactly)
        self.rank_dim = rank_dim_for(D, block)
        self.candidates = CANDIDATES if self.rank_dim else 0
        self.basis = None  # (L, B, H, D, rank_dim): the stored keys' principal directions (`_fit`)
        # per row, so that a row ranks as it would alone whatever its batch neighbours recall (evaluations compare
        # budgets as rows of one batch): the tokens it holds (its largest layer and head) and fitted its basis on
        self.row_tokens = torch.zeros(B, dtype=torch.long)
        self.fitted = torch.zeros(B, dtype=torch.long)
        self.set_recalled(recalled)  # also which rows rank in two passes (`_set_two`)
        self._allocate(0)

    def set_recalled(self, recalled: list[int]) -> None:
        """Tokens each row brings back per step (0: a row that does not recall); a policy change keeps the store."""
        self._set_blocks(torch.tensor([r // self.block for r in recalled]))

    def _set_blocks(self, blocks_per_row: torch.Tensor) -> None:
        self.blocks_per_row = blocks_per_row  # (B,)
        self.rows_recall = blocks_per_row > 0
        self.select = int(blocks_per_row.max())  # blocks brought back per step (rows with fewer mask theirs)
        self.uniform = bool((blocks_per_row == self.select).all())  # every row recalls as many
        # a row ranks in two passes once it holds TWO_PASS_FROM x its own candidates (none: rows that do not recall)
        self.two_from = torch.where(self.rows_recall, TWO_PASS_FROM * CANDIDATES * blocks_per_row, -1)
        self._set_two()

    def _allocate(self, n: int) -> None:
        L, B, H = self.shape
        nb = n // self.block if self.block > 1 else 0  # exact ranking reads the keys themselves
        self.keys = torch.zeros(L, B, H, n, self.D, dtype=self.dtype)
        # keys in the basis (the first pass), in bfloat16 whatever the keys' dtype: the first pass reads every entry's
        # coordinates each step, and its bytes are its cost; it only chooses candidates (ranked exactly after), which
        # bf16's 8 bits of mantissa do not change (measured: the multi-turn evaluation's gain as with fp32), and a
        # bf16 widens to fp32 by a shift (the C ranking; the operators widen a layer's coordinates first)
        # (.., rank_dim, n): a step's first pass multiplies rows of entries, twice as fast as columns on a CPU
        self.low = torch.zeros(L, B, H, self.rank_dim, n, dtype=LOW_DTYPE)
        self.values = torch.zeros(L, B, H, n, self.Dv, dtype=torch.int8 if self.quant else self.dtype)
        self.vscale = torch.zeros(L, B, H, n, int(self.quant), dtype=SCALE_DTYPE)  # empty unless 8-bit
        self.pos = torch.full((L, B, H, n), -1, dtype=torch.long)
        self.rot = torch.full((L, B, H, n), -1, dtype=torch.int32)  # the position its key is rotated at (`renumber`)
        self.empty = torch.ones(L, B, H, n, dtype=torch.bool)  # pos < 0, kept beside it: a step reads it
        self.kmin = torch.zeros(L, B, H, nb, self.D)
        self.kmax = torch.zeros(L, B, H, nb, self.D)
        self.filled = torch.zeros(L, B, H, nb, dtype=torch.bool)  # a block holds at least one token
        self.marks = torch.zeros(L, B, H, n, dtype=torch.int32)  # times recalled since `take_counts`
        self._set_offsets()
        self._calls = {}

    def _set_offsets(self) -> None:
        """Each (row, head)'s first entry in a layer's buffers flattened (kept: a step would rebuild it per layer)."""
        _, B, H = self.shape
        self._offsets = torch.arange(B * H).view(B * H, 1) * self.capacity

    @property
    def capacity(self) -> int:
        return self.pos.shape[-1]

    def nbytes(self) -> int:
        """Host bytes held (keys, values, positions, marks, summaries)."""
        return sum(t.numel() * t.element_size() for t in self._buffers().values())

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer, per entry (keys .. marks) and per block (kmin, kmax, filled)."""
        names = ("keys", "low", "values", "vscale", "pos", "rot", "empty", "marks", *BLOCK_BUFFERS)
        return {name: getattr(self, name) for name in names}

    def _entries(self) -> dict[str, torch.Tensor]:
        """The per-entry buffers, each a view with the entries along dimension 3 (the coordinates' moved there
        from last), for the copies that move entries whatever the buffer."""
        return {
            name: t.movedim(-1, 3) if name == "low" else t
            for name, t in self._buffers().items()
            if name not in BLOCK_BUFFERS
        }

    def tokens(self) -> int:
        """Evicted tokens held per row and head (the first row's count; rows of one cache evict alike)."""
        return int((self.pos[0, 0, 0, : self.count] >= 0).sum()) if self.count else 0

    def _grow(self, need: int) -> bool:
        """Room for `need` entries; False (and `full`) when the host cannot give it and keep `HOST_RESERVE`
        free (the old and the new buffers are held together while the entries are copied)."""
        size = max(need, 2 * self.capacity, GROW)
        size = -(-size // self.block) * self.block
        value_elem = bytes_per_element("8bit", self.dtype, self.Dv) if self.quant else None
        entry = entry_bytes(
            *self.shape, self.D, self.Dv, self.keys.element_size(), self.block, value_elem, self.rank_dim
        )
        if size * entry + HOST_RESERVE > host_available():
            self.full = True
            return False
        old, old_blocks = self._entries(), {name: getattr(self, name) for name in BLOCK_BUFFERS}
        self._allocate(size)
        n, nb = self.count, min(old_blocks["kmin"].shape[3], self.kmin.shape[3])
        for name, new in self._entries().items():
            new[:, :, :, :n] = old[name][:, :, :, :n]
        for name, t in old_blocks.items():
            getattr(self, name)[:, :, :, :nb] = t[:, :, :, :nb]
        return True

    # -- writing ------------------------------------------------------------------------------------
    def append(
        self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, rot: torch.Tensor | None = None
    ) -> None:
        """Evicted tokens (L, B, H, n, D), (L, B, H, n, Dv), true positions (L, B, H, n) (-1: an empty slot or
        padding lost; nothing to keep) and the positions their keys were rotated at (None: the true ones, as until
        the cache renumbers). Rows that do not recall keep nothing. Columns empty in every layer, row and head (a
        prompt chunk's empty slots, sorted first) are dropped: a store without empty entries is ranked without
        masks."""
        if self.full or keys.shape[3] == 0:
            return
        pos = pos.to(self.device).masked_fill(~self.rows_recall[None, :, None, None], -1)
        rot = pos if rot is None else rot.to(self.device)
        some = (pos >= 0).flatten(0, 2).any(0)  # (n,)
        if not bool(some.all()):
            keep = some.nonzero().flatten()
            keys, values, pos, rot = (
                keys[:, :, :, keep.to(keys.device)],
                values[:, :, :, keep.to(values.device)],
                pos[..., keep],
                rot[..., keep],
            )
        n = keys.shape[3]
        if n == 0:
            return
        if self.count + n > self.capacity and not self._grow(self.count + n):
            return  # the host has no room: these and later evictions are not kept (the cache says so once)
        c0, c1 = self.count, self.count + n
        self.keys[:, :, :, c0:c1] = keys.to(self.device, self.dtype)
        if self.quant:
            self.values[:, :, :, c0:c1], self.vscale[:, :, :, c0:c1] = quantize(values.to(self.device))
        else:
            self.values[:, :, :, c0:c1] = values.to(self.device, self.dtype)
        self.pos[:, :, :, c0:c1] = pos
        self.rot[:, :, :, c0:c1] = rot
        self.empty[:, :, :, c0:c1] = empty = pos < 0
        self.holes = self.holes or bool(empty.any())
        self.row_tokens += (~empty).sum(-1).amax(dim=(0, 2))
        self.count = c1
        if self.candidates:
            self._project(c0, c1)
        self._summarise(c0 // self.block, -(-c1 // self.block))

    def _project(self, c0: int, c1: int) -> None:
        """Entries c0..c1's coordinates in the basis; a row's basis is fitted again (on every key it stored) each
        time its tokens have doubled since it was last fitted, once it ranks in two passes (`_recall_step`)."""
        if self.basis is not None:
            self.low[..., c0:c1] = self.basis.mT @ self.keys[:, :, :, c0:c1].float().mT
        due = (self.row_tokens > self.two_from) & (self.row_tokens >= 2 * self.fitted) & self.rows_recall
        if bool(due.any()):
            self._fit(due.nonzero().flatten())
        self._set_two()

    def _set_two(self) -> None:
        """Which rows rank in two passes (`_recall_step`): None for none, True for all, else a (B,) mask; kept
        rather than derived in every layer of every step."""
        two = (self.fitted > 0) & (self.row_tokens > self.two_from)
        self._two = None if not (self.candidates and bool(two.any())) else True if bool(two.all()) else two

    def _fit(self, rows: torch.Tensor) -> None:
        """Per layer, row (of `rows`) and KV head: the `rank_dim` directions along which the stored keys vary most
        (the top eigenvectors of their uncentred second moment, D x D), and every stored key's coordinates in them.
        One layer at a time (the transient is one layer's keys in fp32); it reads the row's whole store, and runs
        each time the row's tokens double: amortized, a constant cost per stored token."""
        n, (L, B, H) = self.count, self.shape
        if self.basis is None:  # rows never fitted keep zeros (their coordinates are never read)
            self.basis = torch.zeros(L, B, H, self.D, self.rank_dim)
        for i in range(L):
            keys = self.keys[i, rows, :, :n].float() * ~self.empty[i, rows, :, :n, None]  # nothing from empty ones
            vectors = torch.linalg.eigh(keys.transpose(-1, -2) @ keys).eigenvectors  # eigenvalues ascend
            basis = vectors[..., -self.rank_dim :]
            self.basis[i, rows] = basis
            self.low[i, rows, :, :, :n] = (basis.mT @ keys.mT).to(LOW_DTYPE)
        self.fitted[rows] = self.row_tokens[rows]
        self._calls = {}  # a new basis (and its first pass's thresholds are stale)

    def _summarise(self, b0: int, b1: int) -> None:
        blk = self.block
        if blk == 1:
            return
        k = self.keys[:, :, :, b0 * blk : b1 * blk].float().unflatten(3, (b1 - b0, blk))
        held = (self.pos[:, :, :, b0 * blk : b1 * blk] >= 0).unflatten(3, (b1 - b0, blk))
        filled = held.any(-1)
        empty = ~filled[..., None]
        self.kmin[:, :, :, b0:b1] = k.masked_fill(~held[..., None], torch.inf).amin(4).masked_fill(empty, 0)
        self.kmax[:, :, :, b0:b1] = k.masked_fill(~held[..., None], -torch.inf).amax(4).masked_fill(empty, 0)
        self.filled[:, :, :, b0:b1] = filled

    def truncate(self, count: int) -> None:
        """Forget what was appended after `count` entries (a snapshot restored)."""
        if count >= self.count:
            return
        self.pos[:, :, :, count : self.count] = -1
        self.empty[:, :, :, count : self.count] = True
        self.count = count
        self.row_tokens = (~self.empty[:, :, :, :count]).sum(-1).amax(dim=(0, 2))
        self._set_two()
        if self.block > 1:
            b0 = count // self.block
            self.filled[:, :, :, b0:] = False
            if count % self.block:
                self._summarise(b0, b0 + 1)

    def clear(self) -> None:
        self.basis, self._calls = None, {}
        self.fitted.zero_()
        self.truncate(0)
        self.marks.zero_()
        self.full = self.holes = False

    def clear_row(self, r: int) -> None:
        self.holes = True
        self.pos[:, r] = -1
        self.empty[:, r] = True
        self.filled[:, r] = False
        self.marks[:, r] = 0
        self.row_tokens[r] = self.fitted[r] = 0
        self._set_two()

    @torch.inference_mode()
    def put_row(self, r: int, other: Store) -> None:
        """Row r (emptied by `clear_row`) takes the one row of `other` (what a prompt read into row r alone
        evicted: continuous batching), its entries first. A batch whose rows were refilled holds entries that
        nothing uses (a finished row's, and each refilled row's gap up to the shared count): once they are half
        of the busiest row's, every row's entries move to the front (`compact`), so the store stays the size of
        what the rows hold, however many prompts pass through them."""
        n = other.count
        if self.full:
            return  # a full store keeps nothing new (the cache said so)
        if n > self.capacity and not self._grow(n):
            return
        theirs = other._entries()
        for name, t in self._entries().items():
            t[:, r, :, :n] = theirs[name][:, 0, :, :n]
        nb = -(-n // self.block) if self.block > 1 else 0
        for name in BLOCK_BUFFERS:
            getattr(self, name)[:, r, :, :nb] = getattr(other, name)[:, 0, :, :nb]
        if other.basis is not None and self.basis is None:
            self.basis = torch.zeros(*self.shape, self.D, self.rank_dim)
        if self.basis is not None:  # (a row never fitted has zeros: its coordinates are not read)
            self.basis[:, r] = 0 if other.basis is None else other.basis[:, 0]
        self.row_tokens[r], self.fitted[r] = other.row_tokens[0], other.fitted[0]
        self.count = max(self.count, n)
        self.holes = bool(self.empty[:, :, :, : self.count].any())  # (the row's entries may stop short of others')
        self.full = self.full or other.full
        self._calls = {}
        self.compact()
        self._set_two()

    @torch.inference_mode()
    def compact(self) -> None:
        """Every row's entries moved to the front, in order (their positions, rotations, marks and coordinates
        with them), when at least half of the entries up to the count hold nothing for the busiest row; the count
        becomes the busiest row's."""
        n, (_, B, _) = self.count, self.shape
        held = (~self.empty[:, :, :, :n]).any(0).any(1)  # (B, n): an entry some layer and head of the row uses
        most = int(held.sum(1).max())
        if not n or 2 * most > n:
            return
        for b in range(B):
            keep = held[b].nonzero().flatten()
            m = len(keep)
            for t in self._entries().values():
                t[:, b, :, :m] = t[:, b, :, keep]
            self.pos[:, b, :, m:n] = -1
            self.rot[:, b, :, m:n] = -1
            self.empty[:, b, :, m:n] = True
            self.marks[:, b, :, m:n] = 0
        self.count = most
        self.holes = bool(self.empty[:, :, :, :most].any())
        if self.block > 1:
            self.filled[:] = False
            self._summarise(0, -(-most // self.block))
        self._calls = {}

    @torch.inference_mode()
    def renumber(self, rows: list[int], held: torch.Tensor, rope) -> None:
        """Rows `rows` just had their held tokens numbered by their order (`cache._renumber`: 0, 1, 2, ... by true
        position, per layer and KV head; `held` (L, B, H, S) their true positions, -1 for an empty slot). Each
        stored token of those rows is numbered where it stands among them -- the count of held tokens with a
        smaller true position, so it shares the number of the held token after it -- and its key is rotated by the
        change (`rope.rotate_by`). A recalled token is then as far from the query as the held tokens between
        them, as a held one is. The coordinates of the rotated keys are fitted again (their first pass's basis)."""
        n, (L, B, _) = self.count, self.shape
        if n == 0:
            return
        selected = torch.zeros(B, dtype=torch.bool)
        selected[torch.as_tensor(rows)] = True
        selected = selected[:, None, None]  # (rows that do not recall store nothing: their positions are -1)
        big = torch.iinfo(torch.long).max
        step = max(1, (1 << 22) // max(1, B * self.shape[2] * self.D))  # entries rotated at once (a few 16 MB)
        for i in range(L):
            order = torch.where(held[i] >= 0, held[i], big).sort(-1).values.to(self.device)  # (B, H, S)
            for c0 in range(0, n, step):
                pos, rot = self.pos[i, :, :, c0 : c0 + step], self.rot[i, :, :, c0 : c0 + step]
                rank = torch.searchsorted(order, pos.contiguous()).to(rot.dtype)
                change = torch.where(selected & (pos >= 0), rank - rot, 0)
                keys = self.keys[i, :, :, c0 : c0 + step]
                keys.copy_(rope.rotate_by(keys, change))
                rot.copy_(torch.where(selected & (pos >= 0), rank, rot))
        self.renumbers += 1
        self._calls = {}  # the thresholds its first passes left are for the old keys
        fitted = ((self.fitted > 0) & selected.flatten()).nonzero().flatten()
        if len(fitted):
            self._fit(fitted)
        self._summarise(0, -(-n // self.block))

    def rows(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (in that order)."""
        index = index.to(self.device)
        for name, t in self._buffers().items():
            setattr(self, name, t.index_select(1, index))
        if self.basis is not None:
            self.basis = self.basis.index_select(1, index)
        self.row_tokens, self.fitted = self.row_tokens.index_select(0, index), self.fitted.index_select(0, index)
        self._set_blocks(self.blocks_per_row.index_select(0, index))
        self.shape = (self.shape[0], len(index), self.shape[2])
        self._set_offsets()
        self._calls = {}

    # -- reading ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def bounds(self, i: int, query: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's queries (B, Hq, T, D) -> per stored block (B, H, blocks): the largest logit of its keys
        under any of the real queries (`real` (B, T); every query when None), or an upper bound of it (Quest's
        summary, block > 1); -inf for a block holding nothing. Unscaled (the order is the same). The (queries x
        stored) logits are taken `RANK_BLOCK` at a time: a long prompt chunk never holds them all at once."""
        nb = -(-self.count // self.block)
        B, H = self.shape[1:]
        T = query.shape[2]
        q = query.to(self.device).reshape(B, H, -1, T, self.D)  # query heads grouped by their KV head
        G = q.shape[2]
        skip = None if real is None else ~real.to(self.device)[:, None, None, :, None]  # padding queries
        if self.block == 1:
            q, keys = q.to(self.dtype), self.keys[i, :, :, :nb].transpose(-1, -2)
            empty = self.empty[i, :, :, :nb]
        else:
            q, empty = q.float(), ~self.filled[i, :, :, :nb]
        step = max(1, RANK_BLOCK // max(1, B * H * G * nb))
        bound = None
        for s in range(0, T, step):
            qs = q[:, :, :, s : s + step]
            b = qs.shape[3]
            qs = qs.flatten(2, 3)
            if self.block == 1:
                part = (qs @ keys).float()
            else:
                part = qs.clamp(min=0) @ self.kmax[i, :, :, :nb].transpose(-1, -2)
                part += qs.clamp(max=0) @ self.kmin[i, :, :, :nb].transpose(-1, -2)
            part = part.view(B, H, G, b, nb)
            if skip is not None:
                part.masked_fill_(skip[:, :, :, s : s + b], -torch.inf)
            part = part.amax((2, 3))
            bound = part if bound is None else torch.maximum(bound, part)
        return bound.masked_fill(empty, -torch.inf)

    @torch.inference_mode()
    def recall(self, i: int, query: torch.Tensor, real: torch.Tensor | None = None) -> Recalled | None:
        """Layer i's queries (B, Hq, T, D) -> what they bring back (`Recalled`), on the query's device; None when
        nothing is stored yet. A decode step (T = 1) recalls what its query attends to most; a prompt chunk
        recalls once for all its real queries (`real` (B, T)): the stored tokens with the largest logit under
        any of them."""
        nb = -(-self.count // self.block)
        if nb == 0 or self.select == 0:
            return None
        if real is None and self.block == 1 and query.shape[2] == 1:
            return self._recall_step(i, query)
        bound = self.bounds(i, query, real)
        many = 1 if real is None else CHUNK_TIMES  # a chunk's queries are many and want different tokens
        k = min(self.select * many, nb)
        top = bound.topk(k, dim=-1)
        wanted = (top.values > -torch.inf) & (torch.arange(k) < many * self.blocks_per_row[:, None, None])
        blk = self.block
        tok = (top.indices[..., None] * blk + torch.arange(blk)).flatten(-2)  # (B, H, k * blk)
        valid = ~self.empty[i].gather(-1, tok) & (wanted.repeat_interleave(blk, -1) if blk > 1 else wanted)
        B, H = self.shape[1:]
        flat = self._mark(i, tok.flatten(0, 1), valid.flatten(0, 1))
        keys = self.keys[i].view(-1, self.D).index_select(0, flat).view(B, H, -1, self.D)
        values = self._values(i, flat, B, H)
        return Recalled(*(t.to(query.device) for t in (keys, values, valid)))

    def _recall_step(self, i: int, query: torch.Tensor) -> Recalled:
        """`recall` for a decode step, in as few operations as it takes (it runs in every layer of every step; on
        CPU each operation costs microseconds whatever its size): one (G x D) @ (D x stored) product per (row,
        head), its maximum over the group, a top-k, the recall marks and a gather of the values; the recalled
        tokens' logits are the ranking's own. Without holes (padding, rows that do not recall) every ranked entry
        is a token: nothing is masked and the validity is None. A large store is ranked in two passes (see the
        module's docstring): reading the stored keys is most of the cost once it is large (they do not stay in
        the processor's caches)."""
        n, (_, B, H), device = self.count, self.shape, query.device
        BH, N, D = B * H, self.capacity, self.D
        k = min(self.select, n)
        if self._native is None:
            self._native = self.dtype in NATIVE_KINDS and not self.quant and self.block == 1 and native.available()
        if query.device != self.device or query.dtype != self.dtype:
            query = query.to(self.device, self.dtype)  # (the C ranking widens it: the operators' numbers)
        if self._native and self.uniform and not self.holes and (self._two is None or self._two is True):
            return self._native_step(i, query.float(), k, device)
        q, keys, empty = query.view(BH, -1, D), self.keys[i].view(BH, N, D), self.empty[i].view(BH, N)
        if self._two is None:
            tok, logits, best = self._exact(q, keys, empty, n, k)
        elif self._two is True:
            tok, logits, best = self._two_pass(i, q, keys, empty, n, k)
        else:  # a batch whose rows rank each as it would alone (evaluations): both rankings, each row its own
            chosen = [self._exact(q, keys, empty, n, k), self._two_pass(i, q, keys, empty, n, k)]
            by_row = self._two.repeat_interleave(H)  # (BH,)
            tok, logits, best = (
                torch.where(by_row.view(-1, *[1] * (a.dim() - 1)), b, a) for a, b in zip(*chosen, strict=True)
            )
        valid = None
        if self.holes or not self.uniform:
            valid = best > -torch.inf
            if not self.uniform:  # rows that recall fewer (or none) mask the rest
                valid &= torch.arange(k) < self.blocks_per_row.repeat_interleave(H)[:, None]
        values = self._values(i, self._mark(i, tok, valid), B, H)
        logits = logits.view(B, H, -1, k)
        if logits.dtype != torch.float32:
            logits = logits.float()
        if valid is not None:
            valid = valid.view(B, H, k)
        if device != self.device:
            values, logits = values.to(device), logits.to(device)
            valid = None if valid is None else valid.to(device)
        return Recalled(None, values, valid, logits)

    def _native_step(self, i: int, query: torch.Tensor, k: int, device: torch.device) -> Recalled:
        """`_recall_step` in one call of `csrc/recall_step.c` (every row recalls as many, nothing to mask): the
        same ranking (two passes when `_two`, else exact), its selections made without sorting."""
        n, two = self.count, self._two is True
        G = query.shape[1] // self.shape[2]
        call = self._calls.get(i)
        if call is None or call[0] != (two, k, G):
            call = self._calls[i] = self._native_call(i, two, k, G)
        _, step, logits, values = call
        many = min(self.candidates * self.select, n) if two else n
        q = query.to("cpu", torch.float32).contiguous()  # a name: the pointer handed over stays valid
        self.listed += step(q, n, many, torch.get_num_threads())
        if device != self.device or values.dtype != self.dtype:  # (values come out in float32)
            values, logits = values.to(device, self.dtype), logits.to(device)
        return Recalled(None, values, None, logits)

    def _native_call(self, i: int, two: bool, k: int, G: int) -> tuple:
        """What layer i's calls pass but the step (sizes, buffers, scratch, each (row, head)'s threshold for its
        next first pass) and the outputs they write (the step's attention reads them before the next call for
        this layer: each layer's are reused); kept until the buffers change (`_allocate`, `rows`, `_fit`, `clear`)
        or the call does. The scratch is one for all layers (they rank one after the other): when it must grow,
        every layer's call is prepared again."""
        (_, B, H), N, Dv = self.shape, self.capacity, self.Dv
        BH = B * H
        logits, values = torch.empty(B, H, G, k), torch.empty(B, H, k, Dv)
        if self._scratch is None or self._scratch[0].numel() < BH * (G + 2) * N:
            self._calls = {}  # they point at the scratch replaced
            self._scratch = torch.empty(BH * (G + 2) * N), torch.empty(BH * 3 * N, dtype=torch.int32)
        scratch = self._scratch
        thresholds = torch.full((BH,), torch.nan)

        step = native.RecallStep(
            G=G, k=k, basis=self.basis[i] if two else None, low=self.low[i] if two else None, keys=self.keys[i],
            values=self.values[i], marks=self.marks[i], thresholds=thresholds, out_logits=logits, out_values=values,
            scratch=scratch,
        )  # fmt: skip
        return (two, k, G), step, logits, values

    def _exact(self, q, keys, empty, n: int, k: int):
        """Every stored key ranked by its logit: the k best entries (BH, k), their logits (BH, G, k) and each
        one's ranking value (-inf: nothing there)."""
        logits = torch.bmm(q, keys[:, :n].transpose(1, 2))  # (BH, G, n)
        return self._best(logits, None, empty[:, :n] if self.holes else None, k, not self.uniform)

    def _two_pass(self, i: int, q, keys, empty, n: int, k: int):
        """The keys' coordinates in the basis choose `candidates` x what a row recalls (its own count: a row
        ranks as it would alone), which are ranked exactly; as `_exact`."""
        BH, N, D, r = q.shape[0], keys.shape[1], self.D, self.rank_dim
        many, qf = min(self.candidates * self.select, n), q.float()
        approx = torch.bmm(torch.bmm(qf, self.basis[i].view(BH, D, r)), self.low[i].view(BH, r, N)[:, :, :n].float())
        approx = approx.amax(1)
        if self.holes:
            approx.masked_fill_(empty[:, :n], -torch.inf)
        cand = approx.topk(many, dim=-1, sorted=not self.uniform).indices  # (BH, many)
        near = keys.reshape(-1, D).index_select(0, (cand + self._offsets).view(-1)).view(BH, many, D)
        logits = torch.bmm(qf, near.float().transpose(1, 2))  # (BH, G, many)
        emptied = empty.gather(1, cand) if self.holes else None
        if not self.uniform:  # a row that recalls fewer ranks only its own number of candidates (the best first)
            own = self.candidates * self.blocks_per_row.repeat_interleave(self.shape[2])
            beyond = torch.arange(many) >= own[:, None]
            emptied = beyond if emptied is None else emptied | beyond
        return self._best(logits, cand, emptied, k, not self.uniform)

    @staticmethod
    def _best(logits, cand, emptied, k: int, ordered: bool):
        """The k entries with the largest logit under any query head of the group (BH, k) (`cand`: the ranked
        entries' indices; None: all of them in order), their logits (BH, G, k) and ranking values (BH, k);
        `ordered`: best first (rows that recall fewer than k keep their first ones)."""
        bound = logits.amax(1)
        if emptied is not None:
            bound.masked_fill_(emptied, -torch.inf)
        top = bound.topk(k, dim=-1, sorted=ordered)
        logits = logits.gather(2, top.indices[:, None, :].expand(-1, logits.shape[1], -1))
        tok = top.indices if cand is None else cand.gather(1, top.indices)
        return tok, logits, top.values

    def _mark(self, i: int, tok: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Count layer i's stored entries `tok` (B H, R) as recalled (each valid one, `take_counts`); their flat
        indices into the layer's buffers (B H R,)."""
        marks = self.marks[i].view(tok.shape[0], -1)
        if valid is None:
            if self._ones is None or self._ones.shape != tok.shape:
                self._ones = torch.ones(tok.shape, dtype=torch.int32)
            marks.scatter_add_(1, tok, self._ones)
        else:
            marks.scatter_add_(1, tok, valid.int())
        return (tok + self._offsets).view(-1)  # one index_select per buffer

    def _values(self, i: int, flat: torch.Tensor, B: int, H: int) -> torch.Tensor:
        """Layer i's stored values at flat indices (B H R,) -> (B, H, R, Dv) in the store's dtype."""
        values = self.values[i].view(-1, self.Dv).index_select(0, flat).view(B, H, -1, self.Dv)
        if self.quant:
            scale = self.vscale[i].view(-1, 1).index_select(0, flat).view(B, H, -1, 1)
            values = dequantize(values, scale, self.dtype)
        return values

    @torch.inference_mode()
    def take_counts(self) -> torch.Tensor:
        """How often each true position was recalled (by any layer, head and step) since the last call, per row:
        (B, positions) float over [0, max position recalled] (empty when nothing was); the counts are reset."""
        counts = self.marks.masked_fill(self.pos < 0, 0)
        self.marks.zero_()
        hit = counts > 0
        if not bool(hit.any()):
            return torch.zeros(self.shape[1], 0)
        out = torch.zeros(self.shape[1], int(self.pos[hit].max()) + 1)
        rows = torch.arange(self.shape[1])[None, :, None, None].expand_as(counts)
        out.index_put_((rows[hit], self.pos[hit]), counts[hit].float(), accumulate=True)
        return out
