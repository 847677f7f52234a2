"""The cache's storage and its snapshots: `Slots` holds every layer's slots, allocated once; `CacheStats` is
what the panel, batch records and benchmarks are given.

Shapes: keys/values (L, B, H, S, D); pos (L, B, H, S) long, the token's true position, -1 = empty; rot (L, B, H, S)
long, the position its key was rotated at (equal to pos until positions are renumbered, see `cache.py`); score
(L, B, H, S) fp32; seen (B,) real tokens per row (a row's evictions are seen - held);
next_rot (B,) the position the next token is rotated at.
S = capacity + 1: the last slot is the spare a decode step writes into (and where a chunk's losers go).

Layout: a row's held tokens fill slots [0, held) in every layer and head (`evict` keeps it so), so whether a
slot holds a token depends on the row only: `valid()` is one (B, S) mask for every layer and head.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from h2o_chat.engine.storage.quant import SCALE_DTYPE, dequantize, quantize


def inference(method):
    """Run a method that changes the storage in inference mode (storage made in inference mode may only be
    changed there), without entering it again where it is on."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # a traced step: its caller runs it in inference mode
            return method(*args, **kwargs)
        with contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode():
            return method(*args, **kwargs)

    return wrapper


def mark_static(*tensors: torch.Tensor) -> None:
    """Tensors a captured step reads and writes in place: they keep their address from step to step."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def per_slot(index: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """A slot index (..., k) expanded over buf's trailing dims, for gather/scatter along buf's slot dim
    (the index's last dim): (B, H, k) for one layer's (B, H, S, D), (L, B, H, k) for every layer's."""
    extra = buf.shape[index.dim() :]
    return index.view(*index.shape, *([1] * len(extra))).expand(*index.shape, *extra)


# Placement, shared by every table (the slots and recall's store): which entry a new one takes.


def order(priority: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """One int64 sort key per candidate: fp32 priority first, then `tie` (0 <= tie < 2**32). Lower loses."""
    bits = priority.contiguous().view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # IEEE floats as integers that sort like the floats
    return (bits.long() << 32) | tie


def tie(pos: torch.Tensor, new_from: int | None = None) -> torch.Tensor:
    """Held tokens tie-break by position (oldest loses first); empty slots by slot index, after padding (0)."""
    slot = torch.arange(pos.shape[-1], device=pos.device, dtype=pos.dtype)
    empty = slot + 1 if new_from is None else torch.where(slot >= new_from, 0, slot + 1)
    return torch.where(pos >= 0, pos, empty)


def place(table, priority: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """Where a table's spare entry goes: per (layer, row, head) the entry with the lowest keep-priority (empty
    ones first, so a filling table appends; ties to `ties`, the oldest position). (L, B, H, 1)

    The same entry as `order(priority, ties).argmin(-1)`, in three passes over fp32 and the ties' own width (it
    runs over every layer after each decode step): the lowest priority, then the lowest tie among the entries
    that have it."""
    low = priority.amin(dim=-1, keepdim=True)
    return torch.where(priority == low, ties, torch.iinfo(ties.dtype).max).argmin(dim=-1, keepdim=True)


def pair_freed_with_survivors(priority: torch.Tensor, ties: torch.Tensor, C: int, T: int):
    """Per (layer, row, head) of a table of C entries given T new candidates (priorities (L, B, H, C + T), the
    stored first): the T lowest lose; the j-th surviving new candidate goes to the j-th freed entry (counts are
    equal: exactly T lose), a losing one to the spare (C). -> (target (L, B, H, T), the losers (L, B, H, T))"""
    losers = order(priority, ties).topk(T, dim=-1, largest=False, sorted=False).indices
    lost = torch.zeros(priority.shape, dtype=torch.bool, device=priority.device).scatter_(-1, losers, True)
    freed, survives = lost[..., :C], ~lost[..., C:]
    # freed entry indices in order, written at their ordinal (non-freed ones at a dump column T)
    ordinal = torch.where(freed, freed.cumsum(-1) - 1, T)
    slot = torch.arange(C, device=priority.device).expand_as(freed)
    shape = (*priority.shape[:-1], T + 1)
    freed_in_order = torch.full(shape, C, device=priority.device, dtype=torch.long).scatter_(-1, ordinal, slot)
    rank = (survives.cumsum(-1) - 1).clamp(min=0)
    return torch.where(survives, freed_in_order.gather(-1, rank), C), losers


@dataclass(frozen=True)
class Field:
    """One per-slot buffer of the storage, (L, B, H, S, ...): everything that copies, moves, clears or counts the
    storage derives from `FIELDS`, so a buffer added there is carried everywhere."""

    name: str
    empty: int | float  # an empty slot's value (and a new token's, unless the forward gives one)
    dtype: torch.dtype | None  # None: the stored keys'/values' (the model's dtype, or int8 with 8-bit storage)
    width: str = ""  # trailing dim: "key" / "value" (head dims), "one" (a scale), "" (none)
    quantized_only: bool = False  # only with 8-bit storage (`quant.py`)


FIELDS = (
    Field("keys", 0, None, "key"),  # rotated as the model rotated them
    Field("values", 0, None, "value"),
    Field("pos", -1, torch.long),  # the token's true position, -1 = empty
    Field("rot", -1, torch.long),  # the position its key was rotated at
    Field("score", 0, torch.float32),  # accumulated attention mass
    Field("kscale", 0, SCALE_DTYPE, "one", quantized_only=True),  # per-token scales of 8-bit keys and values
    Field("vscale", 0, SCALE_DTYPE, "one", quantized_only=True),
)
ROW_FIELDS = ("seen", "next_rot")  # per row (B,) long: real tokens seen; the position the next key is rotated at


def fields(quantized: bool) -> tuple[Field, ...]:
    return tuple(f for f in FIELDS if quantized or not f.quantized_only)


def slot_bytes(key_dim: int, value_dim: int, elem: int, quant: str = "none") -> int:
    """Bytes of one slot (one layer, row and KV head) over every field: the one formula for the storage's size,
    used by the cache, the memory checks, the panel and `bench`. `elem`: bytes per element of the model's dtype."""
    return entry_bytes(fields(quant == "8bit"), {"key": key_dim, "value": value_dim}, 1 if quant == "8bit" else elem)


def entry_bytes(declared: tuple[Field, ...], widths: dict[str, int], stored: int) -> int:
    """Bytes of one entry of a `Table` over its declared fields: `widths` gives the named trailing dims (a field
    of width "one" has one element, "" none), `stored` the bytes of a field whose dtype is the stored keys'."""
    widths = {"one": 1, "": 1, **widths}
    return sum(widths[f.width] * (stored if f.dtype is None else f.dtype.itemsize) for f in declared)


def storage_bytes(
    layers: int, rows: int, kv_heads: int, capacity: int, key_dim: int, value_dim: int, elem: int, quant: str = "none"
) -> int:
    """Bytes of the storage `Slots.allocate` makes: `capacity` slots and the spare per layer, row and KV head,
    and the row fields."""
    per_slot = slot_bytes(key_dim, value_dim, elem, quant)
    return layers * rows * kv_heads * (capacity + 1) * per_slot + rows * len(ROW_FIELDS) * 8


def allocate_fields(
    declared: tuple[Field, ...], shape: tuple[int, int, int, int], widths: dict[str, int], stored, device
) -> dict[str, torch.Tensor]:
    """One tensor per declared field, (L, B, H, S, width...) filled with its empty value."""
    dims = {"one": (1,), "": (), **{k: (v,) for k, v in widths.items()}}
    return {
        f.name: torch.full((*shape, *dims[f.width]), f.empty, dtype=f.dtype or stored, device=device) for f in declared
    }


class Table:
    """Buffers of every layer, row and KV head declared once: per entry (L, B, H, S, ...) by `fields` (S =
    capacity + 1: the last entry is the spare that a new token is written into before it takes its place), per
    row (B,) by `ROW_FIELDS`, per head (L, B, H, ...) by `HEAD_FIELDS`. Allocation, row selection, row views,
    copies, in-place loads, clears and the byte count all derive from the declarations, so a buffer added to
    them is carried everywhere. `Slots` (the held tokens) and `store.Store` (recall's evicted tokens) are
    tables."""

    ROW_FIELDS: tuple[str, ...] = ()
    HEAD_FIELDS: tuple[str, ...] = ()

    def __init__(self, tensors: dict[str, torch.Tensor], declared: tuple[Field, ...]):
        self.fields = declared
        names = [f.name for f in declared] + list(self.ROW_FIELDS) + list(self.HEAD_FIELDS)
        if sorted(tensors) != sorted(names):
            raise ValueError(f"{type(self).__name__} needs {names}, got {list(tensors)}")
        for name in names:
            setattr(self, name, tensors[name])

    def _made(self, tensors: dict[str, torch.Tensor]) -> Table:
        """A table like this one (same kind and settings) over `tensors`."""
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        """Entries that hold tokens between forwards; also the index of the spare entry, which comes after them."""
        return getattr(self, self.fields[0].name).shape[3] - 1

    @property
    def batch(self) -> int:
        return getattr(self, self.fields[0].name).shape[1]

    def slot_tensors(self) -> list[torch.Tensor]:
        """The per-entry tensors (L, B, H, S, ...), in declaration order."""
        return [getattr(self, f.name) for f in self.fields]

    def row_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.ROW_FIELDS]

    def head_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.HEAD_FIELDS]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every declared tensor by name."""
        names = [f.name for f in self.fields] + list(self.ROW_FIELDS) + list(self.HEAD_FIELDS)
        return {name: getattr(self, name) for name in names}

    def buffers(self) -> list[torch.Tensor]:
        """The per-entry tensors that move together when a token changes entry."""
        return self.slot_tensors()

    def _map(self, per_entry, per_row, per_head=None) -> Table:
        """A new table: every per-entry tensor through `per_entry(field, t)`, every row tensor through
        `per_row(t)`, every head tensor through `per_head(t)` (default: `per_entry(None, t)`, for functions of
        the leading (L, B, H) dims)."""
        per_head = per_head or (lambda t: per_entry(None, t))
        tensors = {f.name: per_entry(f, getattr(self, f.name)) for f in self.fields}
        tensors.update({name: per_row(getattr(self, name)) for name in self.ROW_FIELDS})
        tensors.update({name: per_head(getattr(self, name)) for name in self.HEAD_FIELDS})
        return self._made(tensors)

    def with_tensors(self, replaced: dict[str, torch.Tensor]) -> Table:
        """The same table with some declared tensors replaced (a traced step reads its inputs through it)."""
        return self._made({**self.tensors(), **replaced})

    def select(self, index: torch.Tensor) -> Table:
        """A new table of the rows `index` (a batch's finished rows leave)."""
        index = index.to(getattr(self, self.fields[0].name).device)
        return self._map(lambda f, t: t.index_select(1, index), lambda t: t.index_select(0, index))

    def row(self, r: int) -> Table:
        """Row r as a table of its own that shares this table's memory (writes land in row r)."""
        return self._map(lambda f, t: t[:, r : r + 1], lambda t: t[r : r + 1])

    def copy(self, device: torch.device | str | None = None) -> Table:
        """An independent copy (on `device`, e.g. the host, or where it is)."""

        def dup(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, copy=True) if device else t.clone()

        return self._map(lambda f, t: dup(t), dup, dup)

    def load(self, other: Table) -> None:
        """Overwrite this table in place (same shapes) with `other`'s contents: addresses stay, so a captured
        decode step stays valid."""
        for mine, theirs in zip(self.tensors().values(), other.tensors().values(), strict=True):
            mine.copy_(theirs)

    def load_row(self, r: int, other: Table, o: int = 0) -> None:
        """Row r takes row `o` of `other` (same shapes but the batch), in place."""
        for mine, theirs in zip(
            self.slot_tensors() + self.head_tensors(), other.slot_tensors() + other.head_tensors(), strict=True
        ):
            mine[:, r].copy_(theirs[:, o])
        for mine, theirs in zip(self.row_tensors(), other.row_tensors(), strict=True):
            mine[r].copy_(theirs[o])

    def moved(self, keep: torch.Tensor, capacity: int) -> Table:
        """A new table of `capacity` (+ spare) entries holding the entries `keep` (L, B, H, k) first, in order."""
        k = keep.shape[-1]

        def move(f: Field, t: torch.Tensor) -> torch.Tensor:
            out = t.new_full((*t.shape[:3], capacity + 1, *t.shape[4:]), f.empty)
            out[:, :, :, :k] = t.gather(3, per_slot(keep, t))
            return out

        return self._map(move, lambda t: t, lambda t: t)

    def clear_spare(self) -> None:
        for f in self.fields:
            getattr(self, f.name)[:, :, :, self.capacity] = f.empty

    def clear_row(self, r: int) -> None:
        """Empty row r (a new prompt takes it)."""
        for f in self.fields:
            getattr(self, f.name)[:, r] = f.empty
        for t in self.row_tensors():
            t[r] = 0

    def mark_static(self) -> None:
        """Fixed addresses for a captured step, which reads these in place."""
        mark_static(*self.tensors().values())

    def nbytes(self) -> int:
        """Bytes the table occupies (every declared tensor, as allocated)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class Slots(Table):
    """Every layer's slot storage, allocated once: one attribute per field of `FIELDS` (L, B, H, S, ...) and per
    row field (B,). S = capacity + 1: the last slot is the spare. `dtype` is the model's, what `read` gives."""

    ROW_FIELDS = ROW_FIELDS

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        quantized = "kscale" in tensors
        super().__init__(tensors, fields(quantized))
        self.quantized = quantized
        self.dtype = dtype
        self.extra: list[torch.Tensor] = []  # side buffers moved with the slots (snap's observation logits)

    def _made(self, tensors: dict[str, torch.Tensor]) -> Slots:
        return Slots(tensors, self.dtype)

    @classmethod
    def allocate(cls, layers: int, key: torch.Tensor, value: torch.Tensor, capacity: int, quant: str = "none"):
        B, H, _, D = key.shape
        dev = key.device
        stored = torch.int8 if quant == "8bit" else key.dtype
        widths = {"key": D, "value": value.shape[-1]}
        tensors = allocate_fields(fields(quant == "8bit"), (layers, B, H, capacity + 1), widths, stored, dev)
        tensors.update({name: torch.zeros(B, dtype=torch.long, device=dev) for name in ROW_FIELDS})
        return cls(tensors, key.dtype)

    def buffers(self) -> list[torch.Tensor]:
        """The per-slot tensors that move together when a token changes slot."""
        return [*self.slot_tensors(), *self.extra]

    # -- keys and values as the model's dtype ------------------------------------------------------------
    def read(self, which: str, index: tuple = ()) -> torch.Tensor:
        """Keys or values ("keys" | "values") at `index` (over L, B, H, S), in the model's dtype."""
        t = getattr(self, which)[index]
        if not self.quantized:
            return t
        return dequantize(t, getattr(self, which[0] + "scale")[index], self.dtype)

    def write(self, index: tuple, key: torch.Tensor, value: torch.Tensor | None = None) -> None:
        """Store keys and values (model dtype, shaped as the index selects; no value: keys only) at `index`
        (over L, B, H, S)."""
        if not self.quantized:
            self.keys[index] = key
            if value is not None:
                self.values[index] = value
            return
        if value is None:
            self.keys[index], self.kscale[index] = quantize(key)
            return
        if key.shape == value.shape:  # both in one pass: a decode step writes one token per layer
            q, scale = quantize(torch.stack((key, value)))
            (qk, qv), (sk, sv) = q, scale
        else:
            (qk, sk), (qv, sv) = quantize(key), quantize(value)
        self.keys[index], self.kscale[index], self.values[index], self.vscale[index] = qk, sk, qv, sv

    def scatter(self, layer: int, where: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Layer `layer`'s keys and values (B, H, T, D) into the slots `where` (B, 1 or H, T, 1)."""
        pairs = [(self.keys, key), (self.values, value)]
        if self.quantized:
            (qk, sk), (qv, sv) = quantize(key), quantize(value)
            pairs = [(self.keys, qk), (self.values, qv), (self.kscale, sk), (self.vscale, sv)]
        for buf, x in pairs:
            buf[layer].scatter_(2, where.expand(x.shape), x)

    def gather_kv(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slots `index` (L, B, H, k), in the model's dtype: (L, B, H, k, D) each."""
        out = []
        for which in ("keys", "values"):
            buf = getattr(self, which)
            t = buf.gather(3, per_slot(index, buf))
            if self.quantized:
                scale = getattr(self, which[0] + "scale")
                t = dequantize(t, scale.gather(3, per_slot(index, scale)), self.dtype)
            out.append(t)
        return out[0], out[1]

    # -- which slots hold tokens --------------------------------------------------------------------------
    def valid(self) -> torch.Tensor:
        """(B, S) bool: slots holding a token, the same in every layer and head (see the module's layout)."""
        return self.pos[0, :, 0] >= 0

    def held(self) -> torch.Tensor:
        """(B,) tokens held per row (per layer and head)."""
        return self.valid()[:, : self.capacity].sum(-1)

    def slot_bytes(self) -> int:
        """Bytes of one slot (one layer, row and KV head) over every field: `slot_bytes` of this storage."""
        elem = self.dtype.itemsize
        quant = "8bit" if self.quantized else "none"
        return slot_bytes(self.keys.shape[-1], self.values.shape[-1], elem, quant)
