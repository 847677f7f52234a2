"""When and how big a cache's storage is allocated: once, at the first token, for the largest budget (a `full`
cache from its reservation, doubling when it must grow); the recall policy's store beside it."""

from __future__ import annotations

import torch

from h2o_chat.engine.policies import Recall
from h2o_chat.engine.positions import RowState
from h2o_chat.engine.storage.slots import Slots
from h2o_chat.engine.storage.store import Store
from h2o_chat.errors import CacheUsageError

FULL_INITIAL = 256  # a `full` cache without a reservation starts with this many slots and doubles


def capacity_for(cache, tokens: int) -> int:
    """Slots per layer once `tokens` more are read: the storage's, or what it will allocate."""
    need = cache.columns + tokens
    budgets = [g.policy.capacity for g in cache.groups]
    if cache.slots is not None:
        return cache.slots.capacity if None not in budgets else max(cache.slots.capacity, need)
    capacity = max((b for b in budgets if b is not None), default=0)
    return max(capacity, FULL_INITIAL, cache.reserved, need) if None in budgets else capacity


def allocate(cache, key: torch.Tensor, value: torch.Tensor) -> None:
    """Storage for every layer, shaped after the first layer's keys and values (B, H, T, D)."""
    B = key.shape[0]
    counts = [g.rows for g in cache.groups]
    if None not in counts and sum(counts) != B:
        raise CacheUsageError(f"the cache's policies cover {sum(counts)} rows, the batch has {B}")
    counted = len(cache.rows) == B  # `before_forward` counted the first chunk's tokens already
    bounds = [r.bound for r in cache.rows] if counted else [cache.columns] * B
    seen = [r.seen for r in cache.rows] if counted else [0] * B
    cache.rows = [
        RowState(g, cache.columns, b, cache.numbering.starts_switched(g), n)
        for g, b, n in zip(cache.row_groups(B), bounds, seen, strict=True)
    ]
    cache.install(Slots.allocate(len(cache.layers), key, value, capacity_for(cache, 0), cache.kv_quant))
    make_store(cache)


def make_store(cache) -> None:
    """A store of evicted tokens when some row recalls, allocated once beside the slots, on their device; a
    policy change keeps what was evicted recallable (a store of another capacity keeps its best entries)."""
    policies = [r.group.policy for r in cache.rows]
    if cache.slots is None or cache.is_fork or not any(isinstance(p, Recall) for p in policies):
        cache.store = None
        return
    recalled = [p.recalled if isinstance(p, Recall) else 0 for p in policies]
    capacities = [p.store if isinstance(p, Recall) else 0 for p in policies]
    s, old = cache.slots, cache.store
    drop = next(p.drop for p in policies if isinstance(p, Recall))
    if old is not None and old.batch == s.batch and old.capacities == capacities:
        old.set_recalled(recalled, capacities)
        old.drop = drop
        return
    if old is not None and old.batch == s.batch:  # a new capacity: the best entries of the old store move over
        cache.store = old.resized(capacities, recalled)
    else:
        first = (0, slice(None), slice(None), slice(0, 1))  # a template: shapes, device and the model's dtype
        key, value = s.read("keys", first), s.read("values", first)
        cache.store = Store.allocate(len(cache.layers), key, value, capacities, recalled)
    cache.store.drop = drop
    cache.version += 1  # a captured or compiled step reads the old store


def reserve(cache, tokens: int) -> None:
    """Room for `tokens` more tokens per row up front (only a full cache grows; a budget is fixed)."""
    if all(g.policy.capacity is not None for g in cache.groups):
        return
    need = cache.columns + tokens
    if cache.slots is None:
        cache.reserved = max(cache.reserved, need)
    elif need > cache.slots.capacity:
        resize(cache, need)


def grow(cache, new_tokens: int) -> None:
    """Before a forward: a full cache without room for `new_tokens` more doubles (or grows to what it needs)."""
    if cache.slots is not None and any(g.policy.capacity is None for g in cache.groups):
        need = cache.columns + new_tokens
        if need > cache.slots.capacity:
            resize(cache, max(2 * cache.slots.capacity, need))


def resize(cache, capacity: int) -> None:
    if cache.is_view:
        raise CacheUsageError("a full cache's rows must be reserved before a prompt is read into one of them")
    s = cache.slots
    keep = torch.arange(s.capacity, device=s.pos.device).expand(*s.pos.shape[:3], s.capacity)
    cache.install(s.moved(keep, capacity))
