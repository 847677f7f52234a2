"""The store of evicted tokens behind the `recall` policy: what it holds, and how rows, snapshots and renumbering
change it. What a step or a prompt chunk brings back from it is ranked in `recall_rank`.

Every token a row that recalls evicts -- in a decode step (`evict.step`) or a prompt chunk (`evict.chunk`) -- is
appended here with its key (as stored: rotated at its true position, or at the number the cache gave it), value,
true position and the position its key is rotated at, per layer, row and KV head, in eviction order (a chunk's
losers sorted by position). The store lives off the accelerator (on the host; on CPU that is the same memory):
what the accelerator holds stays the budget. It grows by doubling while the host can spare the memory
(`HOST_RESERVE`), then keeps nothing new (`full`: the cache says so once). Columns empty in every layer, row and
head (a single row's prompt chunks) are not stored, so such a store is ranked without masks.
"""

from __future__ import annotations

import torch

from h2o_chat.engine.quant import SCALE_DTYPE, bytes_per_element, dequantize, quantize
from h2o_chat.engine.recall_rank import LOW_DTYPE, Ranking, Recalled, rank_dim_for
from h2o_chat.errors import ConfigError

GROW = 1024  # entries added when the store is full (then doubled)
HOST_RESERVE = 1 << 30  # host memory the store leaves free: it stops growing rather than take it
# the per-entry buffers, each (L, B, H, N, ...) but `low` (L, B, H, rank_dim, N): every copy, move, row selection
# and byte count goes over these
ENTRY_BUFFERS = ("keys", "low", "values", "vscale", "pos", "rot", "empty", "marks")


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
    position (8), the position its key is rotated at (4), empty flag (1) and recall count (4). `block`: only 1
    (callers that still pass the store's)."""
    _check_block(block)
    rank_dim = rank_dim_for(key_dim) if rank_dim is None else rank_dim
    values = value_dim * (value_elem or elem)
    return layers * rows * kv_heads * (key_dim * elem + rank_dim * 2 + values + 8 + 4 + 1 + 4)


def _check_block(block: int) -> None:
    if block != 1:  # Quest's blocks of entries were measured too coarse and removed (see `policies.Recall`)
        raise ConfigError(f"the recall store ranks single tokens (block 1), got block {block}")


def host_available() -> int:
    """Bytes the host can still give this process (psutil's available: free plus reclaimable)."""
    import psutil

    return psutil.virtual_memory().available


class Store:
    """Per layer, row and KV head: evicted keys (L, B, H, N, D), their coordinates for the ranking's first pass,
    values, true positions (-1: nothing) and the positions their keys are rotated at. `recalled` (B,) tokens each
    row brings back per step (0: a row that does not recall, and keeps nothing). `block`: only 1."""

    def __init__(
        self,
        layers: int,
        key: torch.Tensor,
        value: torch.Tensor,
        recalled: list[int],
        block: int = 1,
        quant: bool = False,
    ):
        _check_block(block)
        B, H, _, D = key.shape
        self.block, self.device = block, torch.device("cpu")  # (the cache compares the block until it stops)
        self.quant = quant  # values in int8 with a scale per entry (`--kv-quant 8bit`); keys stay wide for ranking
        self.shape = (layers, B, H)
        self.dtype, self.D, self.Dv = key.dtype, D, value.shape[-1]
        self.rank_dim = rank_dim_for(D)  # the coordinates kept per key (0: exact ranking only)
        self.count = 0  # entries appended (the same for every row and head: see `append`)
        self.full = False  # it stopped growing: the host had no memory to spare; later evictions are not kept
        self.holes = False  # some entry before `count` holds nothing (padding, a row that does not recall)
        self.renumbers = 0  # times the entries were renumbered (`renumber`; a snapshot from before cannot return)
        self.version = 0  # bumped when buffers are replaced or entries move or turn: pointers into them are stale
        self.recalled = torch.tensor(recalled, dtype=torch.long)
        self.row_tokens = torch.zeros(B, dtype=torch.long)  # tokens each row holds (its largest layer and head)
        self._allocate(0)
        self.ranking = Ranking(self)

    def set_recalled(self, recalled: list[int]) -> None:
        """Tokens each row brings back per step (0: a row that does not recall); a policy change keeps the store."""
        self.recalled = torch.tensor(recalled, dtype=torch.long)
        self.ranking.schedule()

    def _allocate(self, n: int) -> None:
        L, B, H = self.shape
        self.keys = torch.zeros(L, B, H, n, self.D, dtype=self.dtype)
        # (.., rank_dim, n): a step's first pass multiplies rows of entries, twice as fast as columns on a CPU
        self.low = torch.zeros(L, B, H, self.rank_dim, n, dtype=LOW_DTYPE)
        self.values = torch.zeros(L, B, H, n, self.Dv, dtype=torch.int8 if self.quant else self.dtype)
        self.vscale = torch.zeros(L, B, H, n, int(self.quant), dtype=SCALE_DTYPE)  # empty unless 8-bit
        self.pos = torch.full((L, B, H, n), -1, dtype=torch.long)
        self.rot = torch.full((L, B, H, n), -1, dtype=torch.int32)  # the position its key is rotated at (`renumber`)
        self.empty = torch.ones(L, B, H, n, dtype=torch.bool)  # pos < 0, kept beside it: a step reads it
        self.marks = torch.zeros(L, B, H, n, dtype=torch.int32)  # times recalled since `take_counts`
        self._moved()

    def _moved(self) -> None:
        """The buffers were replaced or their entries moved or turned: each (row, head)'s first entry in a layer's
        buffers flattened (kept: a step would rebuild it per layer), and a new version."""
        _, B, H = self.shape
        self.offsets = torch.arange(B * H).view(B * H, 1) * self.capacity
        self.version += 1

    @property
    def capacity(self) -> int:
        return self.pos.shape[-1]

    def nbytes(self) -> int:
        """Host bytes held (every entry buffer, as allocated)."""
        return sum(t.numel() * t.element_size() for t in self._buffers().values())

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ENTRY_BUFFERS}

    def _entries(self) -> dict[str, torch.Tensor]:
        """Every buffer as a view with the entries along dimension 3 (the coordinates' moved there from last), for
        the copies that move entries whatever the buffer."""
        return {name: t.movedim(-1, 3) if name == "low" else t for name, t in self._buffers().items()}

    def tokens(self) -> int:
        """Evicted tokens held per row and head (the first row's count; rows of one cache evict alike)."""
        return int((self.pos[0, 0, 0, : self.count] >= 0).sum()) if self.count else 0

    def _grow(self, need: int) -> bool:
        """Room for `need` entries; False (and `full`) when the host cannot give it and keep `HOST_RESERVE`
        free (the old and the new buffers are held together while the entries are copied)."""
        size = max(need, 2 * self.capacity, GROW)
        value_elem = bytes_per_element("8bit", self.dtype, self.Dv) if self.quant else None
        entry = entry_bytes(*self.shape, self.D, self.Dv, self.keys.element_size(), 1, value_elem, self.rank_dim)
        if size * entry + HOST_RESERVE > host_available():
            self.full = True
            return False
        old, n = self._entries(), self.count
        self._allocate(size)
        for name, new in self._entries().items():
            new[:, :, :, :n] = old[name][:, :, :, :n]
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
        pos = pos.to(self.device).masked_fill(~(self.recalled > 0)[None, :, None, None], -1)
        rot = pos if rot is None else rot.to(self.device)
        some = (pos >= 0).flatten(0, 2).any(0)  # (n,)
        if not bool(some.all()):
            keep = some.nonzero().flatten()
            keys, values = keys[:, :, :, keep.to(keys.device)], values[:, :, :, keep.to(values.device)]
            pos, rot = pos[..., keep], rot[..., keep]
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
        self.ranking.appended(c0, c1)

    def truncate(self, count: int) -> None:
        """Forget what was appended after `count` entries (a snapshot restored)."""
        if count >= self.count:
            return
        self.pos[:, :, :, count : self.count] = -1
        self.empty[:, :, :, count : self.count] = True
        self.count = count
        self.row_tokens = (~self.empty[:, :, :, :count]).sum(-1).amax(dim=(0, 2))
        self.ranking.set_two()

    def clear(self) -> None:
        """Forget every entry (the buffers are kept)."""
        self.ranking.clear()
        self.truncate(0)
        self.marks.zero_()
        self.full = self.holes = False
        self._moved()

    def clear_row(self, r: int) -> None:
        """Forget row r's entries (its prompt is done; `put_row` refills it)."""
        self.holes = True
        self.pos[:, r] = -1
        self.empty[:, r] = True
        self.marks[:, r] = 0
        self.row_tokens[r] = 0
        self.ranking.clear_row(r)

    @torch.inference_mode()
    def put_row(self, r: int, other: Store) -> None:
        """Row r (emptied by `clear_row`) takes the one row of `other` (what a prompt read into row r alone
        evicted: continuous batching), its entries first; then `compact`, so the store stays the size of what the
        rows hold, however many prompts pass through them."""
        n = other.count
        if self.full:
            return  # a full store keeps nothing new (the cache said so)
        if n > self.capacity and not self._grow(n):
            return
        theirs = other._entries()
        for name, t in self._entries().items():
            t[:, r, :, :n] = theirs[name][:, 0, :, :n]
        self.row_tokens[r] = other.row_tokens[0]
        self.count = max(self.count, n)
        self.holes = bool(self.empty[:, :, :, : self.count].any())  # (the row's entries may stop short of others')
        self.full = self.full or other.full
        self.ranking.put_row(r, other.ranking)
        self._moved()
        self.compact()

    @torch.inference_mode()
    def compact(self) -> None:
        """Every row's entries moved to the front, in order, once at least half of those up to the count hold
        nothing for the busiest row (a finished row's, a refilled row's gap); the count becomes the busiest row's."""
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
        self._moved()

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
        chosen = selected[:, None, None]  # (rows that do not recall store nothing: their positions are -1)
        big = torch.iinfo(torch.long).max
        step = max(1, (1 << 22) // max(1, B * self.shape[2] * self.D))  # entries rotated at once (a few 16 MB)
        for i in range(L):
            order = torch.where(held[i] >= 0, held[i], big).sort(-1).values.to(self.device)  # (B, H, S)
            for c0 in range(0, n, step):
                pos, rot = self.pos[i, :, :, c0 : c0 + step], self.rot[i, :, :, c0 : c0 + step]
                rank = torch.searchsorted(order, pos.contiguous()).to(rot.dtype)
                change = torch.where(chosen & (pos >= 0), rank - rot, 0)
                keys = self.keys[i, :, :, c0 : c0 + step]
                keys.copy_(rope.rotate_by(keys, change))
                rot.copy_(torch.where(chosen & (pos >= 0), rank, rot))
        self.renumbers += 1
        self._moved()  # (the thresholds the C ranking's first passes left are for the old keys)
        self.ranking.renumbered(selected)

    def rows(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (in that order)."""
        index = index.to(self.device)
        for name, t in self._buffers().items():
            setattr(self, name, t.index_select(1, index))
        self.recalled, self.row_tokens = self.recalled.index_select(0, index), self.row_tokens.index_select(0, index)
        self.shape = (self.shape[0], len(index), self.shape[2])
        self._moved()
        self.ranking.rows(index)

    # -- reading ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def recall(self, i: int, query: torch.Tensor, real: torch.Tensor | None = None) -> Recalled | None:
        """Layer i's queries (B, Hq, T, D) -> what they bring back (`Recalled`), on the query's device; None when
        nothing is stored yet. A decode step (T = 1) recalls what its query attends to most; a prompt chunk
        recalls once for all its real queries (`real` (B, T)): the stored tokens with the largest logit under
        any of them (`recall_rank`)."""
        if self.count == 0 or self.ranking.select == 0:
            return None
        if real is None and query.shape[2] == 1:
            return self.ranking.step(i, query)
        return self.ranking.chunk(i, query, real)

    def values_at(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Layer i's stored values at flat indices (B H R,) -> (B, H, R, Dv) in the store's dtype."""
        _, B, H = self.shape
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
