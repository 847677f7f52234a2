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

import dataclasses
from dataclasses import dataclass, field

import torch

from h2o_chat.engine.quant import SCALE_DTYPE, dequantize, quantize


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


@dataclass
class Slots:
    """Every layer's slot storage, allocated once. S = capacity + 1: the last slot is the spare.

    With 8-bit storage (`quant.py`) keys and values are int8 and `kscale`/`vscale` (L, B, H, S, 1) hold each
    token's scale; `dtype` is the model's, what `read` gives back."""

    keys: torch.Tensor  # (L, B, H, S, D)
    values: torch.Tensor  # (L, B, H, S, Dv)
    pos: torch.Tensor  # (L, B, H, S) long, -1 = empty
    rot: torch.Tensor  # (L, B, H, S) long: the position each key was rotated at
    score: torch.Tensor  # (L, B, H, S) fp32
    seen: torch.Tensor  # (B,) real tokens per row
    next_rot: torch.Tensor  # (B,) the position the next token's key is rotated at
    kscale: torch.Tensor | None = None  # (L, B, H, S, 1) float16: 8-bit storage only
    vscale: torch.Tensor | None = None
    dtype: torch.dtype | None = None  # the model's: keys and values as attention reads them
    extra: list[torch.Tensor] = field(default_factory=list)  # side buffers moved with the slots (snap's)

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = self.keys.dtype

    @property
    def capacity(self) -> int:
        """Slots that hold tokens between forwards; also the index of the spare slot, which comes after them."""
        return self.keys.shape[3] - 1

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def quantized(self) -> bool:
        return self.kscale is not None

    @classmethod
    def allocate(cls, layers: int, key: torch.Tensor, value: torch.Tensor, capacity: int, quant: str = "none"):
        B, H, _, D = key.shape
        L, S, dev = layers, capacity + 1, key.device
        scales = {}
        if quant == "8bit":
            scales = {
                "kscale": torch.zeros(L, B, H, S, 1, dtype=SCALE_DTYPE, device=dev),
                "vscale": torch.zeros(L, B, H, S, 1, dtype=SCALE_DTYPE, device=dev),
            }
        stored = torch.int8 if scales else key.dtype
        return cls(
            keys=torch.zeros(L, B, H, S, D, dtype=stored, device=dev),
            values=torch.zeros(L, B, H, S, value.shape[-1], dtype=stored, device=dev),
            pos=torch.full((L, B, H, S), -1, dtype=torch.long, device=dev),
            rot=torch.full((L, B, H, S), -1, dtype=torch.long, device=dev),
            score=torch.zeros(L, B, H, S, dtype=torch.float32, device=dev),
            seen=torch.zeros(B, dtype=torch.long, device=dev),
            next_rot=torch.zeros(B, dtype=torch.long, device=dev),
            dtype=key.dtype,
            **scales,
        )

    def slot_tensors(self) -> list[torch.Tensor]:
        """The per-slot tensors (L, B, H, S, ...) of the storage itself (not the side buffers)."""
        scales = [self.kscale, self.vscale] if self.quantized else []
        return [self.keys, self.values, self.pos, self.rot, self.score, *scales]

    def buffers(self) -> list[torch.Tensor]:
        """The per-slot tensors that move together when a token changes slot."""
        return [*self.slot_tensors(), *self.extra]

    def _with(self, tensors: list[torch.Tensor], seen: torch.Tensor, next_rot: torch.Tensor) -> Slots:
        """Storage like this one made of `tensors` (in `slot_tensors` order)."""
        keys, values, pos, rot, score, *scales = tensors
        kscale, vscale = scales if scales else (None, None)
        return Slots(keys, values, pos, rot, score, seen, next_rot, kscale, vscale, self.dtype)

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

    def valid(self) -> torch.Tensor:
        """(B, S) bool: slots holding a token, the same in every layer and head (see the module's layout)."""
        return self.pos[0, :, 0] >= 0

    def held(self) -> torch.Tensor:
        """(B,) tokens held per row (per layer and head)."""
        return self.valid()[:, : self.capacity].sum(-1)

    def clear_spare(self) -> None:
        self.pos[..., self.capacity] = -1
        self.score[..., self.capacity] = 0

    def moved(self, keep: torch.Tensor, capacity: int) -> Slots:
        """New storage of `capacity` (+ spare) slots holding the slots `keep` (L, B, H, k) first, in order."""
        k = keep.shape[-1]

        def move(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = t.new_full((*t.shape[:3], capacity + 1, *t.shape[4:]), fill)
            out[:, :, :, :k] = t.gather(3, per_slot(keep, t))
            return out

        fills = {id(self.pos): -1, id(self.rot): -1}
        moved = [move(t, fills.get(id(t), 0)) for t in self.slot_tensors()]
        return self._with(moved, self.seen, self.next_rot)

    def mark_static(self) -> None:
        """Fixed addresses for a captured step, which writes into these in place."""
        mark_static(*self.slot_tensors(), self.seen, self.next_rot)

    def rows(self, index: torch.Tensor) -> Slots:
        index = index.to(self.seen.device)
        pick = [t.index_select(1, index) for t in self.slot_tensors()]
        return self._with(pick, self.seen.index_select(0, index), self.next_rot.index_select(0, index))

    def row(self, r: int) -> Slots:
        """Row r as storage of its own that shares this storage's memory (writes land in row r)."""
        return self._with(
            [t[:, r : r + 1] for t in self.slot_tensors()], self.seen[r : r + 1], self.next_rot[r : r + 1]
        )

    def clear_row(self, r: int) -> None:
        """Empty row r (a new prompt takes it)."""
        self.pos[:, r] = -1
        self.rot[:, r] = -1
        self.score[:, r] = 0
        self.seen[r] = 0
        self.next_rot[r] = 0

    def copy(self, device: torch.device | str | None = None) -> Slots:
        """An independent copy (on `device`, e.g. the host, or where it is)."""

        def dup(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, copy=True) if device else t.clone()

        return self._with([dup(t) for t in self.slot_tensors()], dup(self.seen), dup(self.next_rot))

    def load(self, other: Slots) -> None:
        """Overwrite this storage in place (same shapes) with `other`'s contents: addresses stay, so a captured
        decode step stays valid."""
        for mine, theirs in zip(self.slot_tensors(), other.slot_tensors(), strict=True):
            mine.copy_(theirs)
        self.seen.copy_(other.seen)
        self.next_rot.copy_(other.next_rot)

    def token_bytes(self) -> int:
        """Stored bytes of one token's key and value in one slot (one layer, row and KV head), scales included."""
        per = (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        return per + (2 * self.kscale.element_size() if self.quantized else 0)


@dataclass(frozen=True)
class CacheStats:
    """A snapshot for the panel, batch records and benchmarks. Token counts are per row and KV head."""

    policy: str
    budget: int | None
    split: dict[str, int]
    layers: int
    seen: int  # tokens seen (the longest row)
    kept: float  # tokens held per layer and head (mean)
    kept_min: int
    kept_max: int
    evicted: float  # tokens evicted per layer, row and head (mean)
    kv_bytes: int  # bytes the key/value buffers occupy (allocated: the whole budget from the first token)
    kv_used_bytes: int  # bytes of the tokens held: tokens held x bytes per token, over layers, rows, heads
    full_kv_bytes: int  # bytes a full cache would hold for the same tokens
    positions: str = "absolute"  # how positions are given now, e.g. "auto: absolute, trained context 8192"
    store_bytes: int = 0  # the recall policy's store of evicted tokens (off the accelerator: host memory)
    kv_quant: str = "none"  # "8bit": held keys and values in int8 with a scale per token

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kept": mean_count(self.kept), "evicted": mean_count(self.evicted)}

    @classmethod
    def combine(cls, parts: list[CacheStats]) -> CacheStats:
        """Several snapshots side by side (the policy groups of one cache) as one."""
        first = parts[0]
        return cls(
            policy=" | ".join(dict.fromkeys(p.policy for p in parts)),
            budget=max((p.budget or 0 for p in parts), default=0) or None,
            split=first.split,
            layers=first.layers,
            seen=max(p.seen for p in parts),
            kept=sum(p.kept for p in parts) / len(parts),
            kept_min=min(p.kept_min for p in parts),
            kept_max=max(p.kept_max for p in parts),
            evicted=sum(p.evicted for p in parts) / len(parts),
            kv_bytes=sum(p.kv_bytes for p in parts),
            kv_used_bytes=sum(p.kv_used_bytes for p in parts),
            full_kv_bytes=sum(p.full_kv_bytes for p in parts),
            positions=first.positions,
            store_bytes=sum(p.store_bytes for p in parts),
            kv_quant=first.kv_quant,
        )


def mean_count(x: float) -> int | float:
    """A mean token count for JSON: an integer when it is whole, else one decimal."""
    x = round(x, 1)
    return int(x) if x == int(x) else x
