"""What a cache holds, for the panel, batch records and benchmarks: `CacheStats` snapshots and per-row counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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
    kv_bytes: int  # bytes the storage occupies (allocated: the whole budget from the first token), every field
    kv_used_bytes: int  # bytes of the slots holding tokens: tokens held x bytes per slot, over layers, rows, heads
    full_kv_bytes: int  # bytes a full cache would hold for the same tokens
    positions: str = "absolute"  # how positions are given now, e.g. "auto: absolute, trained context 8192"
    store_bytes: int = 0  # the recall policy's store of evicted tokens, as allocated (on the cache's device)
    kv_quant: str = "none"  # "8bit": held keys and values in int8 with a scale per token
    store_tokens: float = 0.0  # evicted tokens the store holds per layer, row and head (mean)
    store_capacity: int = 0  # what it can hold (then it drops one for each new one)
    store_dropped: float = 0.0  # evicted tokens it dropped (mean per layer, row and head): gone for good

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            **{name: mean_count(getattr(self, name)) for name in ("kept", "evicted", "store_tokens", "store_dropped")},
        }


def mean_count(x: float) -> int | float:
    """A mean token count for JSON: an integer when it is whole, else one decimal."""
    x = round(x, 1)
    return int(x) if x == int(x) else x


def of_rows(cache, rows: slice, group=None) -> CacheStats:
    """A snapshot of the batch rows `rows` (following `group`, the first group by default)."""
    group = group or cache.groups[0]
    policy = group.policy
    label = positions_label(cache, group, rows)
    s = cache.slots
    layers = len(cache.layers)
    if s is None:
        return CacheStats(policy.name, policy.budget, policy.split(), layers, 0, 0.0, 0, 0, 0.0, 0, 0, 0, label)
    pos = s.pos[:, rows, :, : s.capacity]
    kept = (pos >= 0).sum(-1)  # (L, b, H)
    slot_bytes = s.slot_bytes()  # one slot over every field, as stored
    full_bytes = (s.keys.shape[-1] + s.values.shape[-1]) * s.dtype.itemsize  # what a full cache keeps of a token
    seen = s.seen[rows]
    share = len(seen) / s.batch
    return CacheStats(
        policy=policy.name,
        budget=policy.budget,
        split=policy.split(),
        layers=layers,
        seen=int(seen.max()),
        kept=float(kept.float().mean()),
        kept_min=int(kept.min()),
        kept_max=int(kept.max()),
        evicted=float((seen[None, :, None] - kept).float().mean()),  # every real token seen is held or gone
        kv_bytes=int(s.nbytes() * share),
        kv_used_bytes=int(kept.sum()) * slot_bytes,
        full_kv_bytes=int(seen.sum()) * full_bytes * s.keys.shape[0] * s.keys.shape[2],
        positions=label,
        kv_quant="8bit" if s.quantized else "none",
        **store_stats(cache.store, rows, share),
    )


def store_stats(store, rows: slice, share: float) -> dict:
    """The store's part of a snapshot of the rows `rows` (`share` of the batch)."""
    if store is None:
        return {}
    return {
        "store_bytes": int(store.nbytes() * share),
        "store_tokens": float(store.tokens()[rows].mean()),
        "store_capacity": store.capacity,
        "store_dropped": float(store.dropped()[rows].mean()),
    }


def of_groups(cache) -> list[CacheStats]:
    """One snapshot per policy group (rows side by side)."""
    out, start = [], 0
    for g in cache.groups:
        n = g.rows if g.rows is not None else (cache.slots.batch if cache.slots is not None else 1)
        out.append(of_rows(cache, slice(start, start + n), g))
        start += n
    return out


def positions_label(cache, group, rows: slice) -> str:
    """How the rows `rows` number their tokens now and why (each row renumbers on its own: one row that passed
    the trained context says nothing of the others)."""
    if cache.seq.rows:
        switched = [r.switched for r in cache.seq.rows[rows]]
    else:
        switched = [cache.numbering.starts_switched(g) for g in cache.groups]
    return cache.numbering.label(group, switched)


def kept_fraction(cache, start: int, end: int, row: int = 0) -> float:
    if end <= start or cache.slots is None:
        return 1.0
    pos = cache.slots.pos[:, row, :, : cache.slots.capacity]  # (L, H, S)
    inside = ((pos >= start) & (pos < end)).sum(-1).float()  # (L, H)
    return float(inside.mean()) / (end - start)


def row_stats(cache, row: int) -> dict:
    s = cache.slots
    seen = int(s.seen[row])
    kept = float((s.pos[:, row, :, : s.capacity] >= 0).sum(-1).float().mean())
    return {"seen": seen, "kept": kept, "evicted": seen - kept}
