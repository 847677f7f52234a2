"""The cache's storage and its snapshots: `Slots` holds every layer's slots, allocated once; `CacheStats` is
what the panel, batch records and benchmarks are given.

Shapes: keys/values (L, B, H, S, D); pos (L, B, H, S) long, -1 = empty or padding; score (L, B, H, S) fp32;
seen (B,) real tokens per row. S = capacity + 1: the last slot is the spare a decode step writes into.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def per_slot(index: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """A slot index (..., k) expanded over buf's trailing dims, for gather/scatter along buf's slot dim
    (the index's last dim): (B, H, k) for one layer's (B, H, S, D), (L, B, H, k) for every layer's."""
    extra = buf.shape[index.dim() :]
    return index.view(*index.shape, *([1] * len(extra))).expand(*index.shape, *extra)


@dataclass
class Slots:
    """Every layer's slot storage, allocated once. S = capacity + 1: the last slot is the spare."""

    keys: torch.Tensor  # (L, B, H, S, D)
    values: torch.Tensor  # (L, B, H, S, Dv)
    pos: torch.Tensor  # (L, B, H, S) long, -1 = empty or padding
    score: torch.Tensor  # (L, B, H, S) fp32
    seen: torch.Tensor  # (B,) real tokens per row
    evicted: torch.Tensor  # () real tokens evicted, all layers, rows and heads
    valid: torch.Tensor | None = None  # decode step: pos >= 0, (L, B, H, S)
    rank: torch.Tensor | None = None  # decode step with rolling positions: rank among held tokens

    @property
    def capacity(self) -> int:
        return self.keys.shape[3] - 1

    @property
    def spare(self) -> int:
        return self.keys.shape[3] - 1

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @classmethod
    def allocate(cls, layers: int, key: torch.Tensor, value: torch.Tensor, capacity: int) -> Slots:
        B, H, _, D = key.shape
        L, S, dev = layers, capacity + 1, key.device
        return cls(
            keys=key.new_zeros(L, B, H, S, D),
            values=value.new_zeros(L, B, H, S, value.shape[-1]),
            pos=torch.full((L, B, H, S), -1, dtype=torch.long, device=dev),
            score=torch.zeros(L, B, H, S, dtype=torch.float32, device=dev),
            seen=torch.zeros(B, dtype=torch.long, device=dev),
            evicted=torch.zeros((), dtype=torch.long, device=dev),
        )

    def moved(self, keep: torch.Tensor, capacity: int) -> Slots:
        """New storage of `capacity` (+ spare) slots holding the slots `keep` (L, B, H, k) first, in order."""
        k = keep.shape[-1]

        def move(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = t.new_full((*t.shape[:3], capacity + 1, *t.shape[4:]), fill)
            out[:, :, :, :k] = t.gather(3, per_slot(keep, t))
            return out

        return Slots(
            move(self.keys, 0), move(self.values, 0), move(self.pos, -1), move(self.score, 0), self.seen, self.evicted
        )

    def mark_static(self) -> None:
        """Fixed addresses for torch.compile: a compiled step writes into these in place."""
        for t in (self.keys, self.values, self.pos, self.score, self.seen, self.evicted):
            torch._dynamo.mark_static_address(t)

    def rows(self, index: torch.Tensor) -> Slots:
        index = index.to(self.seen.device)
        pick = [t.index_select(1, index) for t in (self.keys, self.values, self.pos, self.score)]
        return Slots(*pick, self.seen.index_select(0, index), self.evicted)


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
    positions: str = "absolute"  # how positions are given now, e.g. "auto: absolute (trained 8192)"

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kept": mean_count(self.kept), "evicted": mean_count(self.evicted)}

    @classmethod
    def combine(cls, parts: list[CacheStats]) -> CacheStats:
        """Several caches side by side (the groups of a GroupedCache) as one."""
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
        )


def mean_count(x: float) -> int | float:
    """A mean token count for JSON: an integer when it is whole, else one decimal."""
    x = round(x, 1)
    return int(x) if x == int(x) else x
