"""Rows of a cache and copies of it: row views for continuous batching, selections, forks, snapshots, clears.

Nothing here lists the storage's buffers or a row's bookkeeping: `Slots` derives its copies, views and clears
from its declared fields (`slots.FIELDS`), and each row's bookkeeping is one `RowState`, copied whole. What a
snapshot carries besides them is `SNAPSHOT`.
"""

from __future__ import annotations

import copy

import torch

from h2o_chat.engine.layer import H2OLayer
from h2o_chat.engine.policies import Rules
from h2o_chat.engine.positions import Group, RowState
from h2o_chat.engine.storage.allocation import FULL_INITIAL
from h2o_chat.engine.storage.slots import order, tie
from h2o_chat.errors import CacheUsageError

SNAPSHOT = ("columns", "renumbered")  # the sequence's plain values a snapshot carries, besides rows, slots, store


def twin(cache, slots):
    """A cache like `cache` over `slots`, with its own copy of every row's bookkeeping and no forward running."""
    other = copy.copy(cache)
    other.layers = [H2OLayer(other, i) for i in range(len(cache.layers))]
    other.slots, other.forward, other.probe, other.observation = slots, None, None, None
    other.store = None  # a copy (snap's probe) keeps nothing it evicts
    other.groups = [copy.copy(g) for g in cache.groups]
    other.rows = [r.copy() for r in cache.rows]
    other.warned = set(cache.warned)
    other.is_view = False
    return other


def fork(cache):
    copied = twin(cache, None if cache.slots is None else cache.slots.copy())
    copied.notices = []
    # nor does it make a store when it allocates: a fork of an empty cache and one of a filled row (a refilled
    # batch row) must read alike, and a row's probe would otherwise recall what the other never kept
    copied.is_fork = True
    return copied


def row(cache, r: int):
    """Row r as a cache of its own that shares `cache`'s storage: a prompt read into it lands in row r while the
    other rows keep theirs (continuous batching). Notes go to `cache`. `absorb` takes its host bookkeeping back,
    and what the prompt evicted into the store when the row recalls (the view keeps its own while it reads: its
    chunks recall only what this prompt evicted)."""
    view = twin(cache, cache.slots.row(r))
    view.rules = cache.rules.of_rows(torch.tensor([r], device=cache.slots.seen.device))
    view.rows = [cache.rows[r].copy()]
    view.columns = view.rows[0].columns
    view.groups = [Group(view.rows[0].group.policy, None, view.rows[0].group.positions)]
    view.host_managed = True
    view.is_view = True
    view.store = None if cache.store is None else cache.store.view_of_row(r)
    return view


def absorb(cache, view, r: int) -> None:
    if view.slots is None or view.slots.keys.data_ptr() != cache.slots.row(r).keys.data_ptr():
        raise CacheUsageError("a row's storage was re-allocated while a prompt was read into it")
    state = view.rows[0].copy()
    state.group = cache.rows[r].group
    cache.rows[r] = state
    cache.columns = max(x.columns for x in cache.rows)
    if cache.store is not None and view.store is not None:
        cache.store.absorb(r, view.store)
    cache.renumbered |= view.renumbered
    cache.warned |= view.warned


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep only the batch rows `index`."""
    if cache.slots is None:
        return
    index = index.to(cache.slots.seen.device)
    cache.rows = [cache.rows[i].copy() for i in index.tolist()]
    cache.columns = max((x.columns for x in cache.rows), default=0)
    if cache.store is not None:
        cache.store = cache.store.select(index)
    cache.install(cache.slots.select(index))


def clear_row(cache, r: int) -> None:
    cache.slots.clear_row(r)
    if cache.store is not None:
        cache.store.clear_row(r)
    group = cache.rows[r].group
    cache.rows[r] = RowState(group, switched=cache.numbering.starts_switched(group))


def clear(cache) -> None:
    for r in range(cache.slots.batch if cache.slots is not None else 0):
        clear_row(cache, r)
    cache.columns = 0


def state_of(cache) -> dict:
    """The sequence as `restore` takes it, the cache's own rows and tensors (no copy: for a restore into other
    storage before this cache changes)."""
    return {**{name: getattr(cache, name) for name in SNAPSHOT}, "rows": cache.rows, "slots": cache.slots,
            "store": cache.store}  # fmt: skip


def snapshot(cache) -> dict:
    """The sequence, copied to the host (e.g. when the user stops the reading of a long message, the
    conversation continues from before it)."""
    state = state_of(cache)
    state["rows"] = [r.copy() for r in cache.rows]
    state["slots"] = None if cache.slots is None else cache.slots.copy("cpu")
    state["store"] = None if cache.store is None else cache.store.copy("cpu")  # bounded: a copy costs its size
    return state


def restore(cache, state: dict, device: torch.device | str | None = None) -> None:
    if cache.slots is not None:
        device = cache.slots.keys.device
    cache.forward = None
    for name in SNAPSHOT:
        setattr(cache, name, state[name])
    cache.rows = [r.copy() for r in state["rows"]]
    stored = state.get("store")
    if stored is None:
        if cache.store is not None:
            cache.store.clear()
    elif cache.store is not None and cache.store.keys.shape == stored.keys.shape:
        cache.store.load(stored)  # in place: a captured step keeps reading it
        cache.store.absorb_all(stored)
    else:
        cache.store = stored.copy(device)
        cache.version += 1
    saved = state["slots"]
    if saved is None:
        cache.slots, cache.rules = None, None
        cache.version += 1
    elif cache.slots is not None and cache.slots.keys.shape == saved.keys.shape:
        cache.slots.load(saved)
    else:
        cache.install(saved.copy(device))


def set_policy(cache, policy) -> None:
    """A new budget or policy for a cache with one group: a smaller budget keeps the new policy's best slots
    (evicted tokens do not come back), a larger one re-allocates."""
    if len(cache.groups) > 1:
        raise CacheUsageError("set_policy changes a cache with one policy for all rows")
    group = cache.groups[0]
    group.policy = policy
    s = cache.slots
    if s is None:
        return
    for r in cache.rows:
        r.group = group
    held = int(s.held().max())
    capacity = policy.capacity or max(held, cache.columns, FULL_INITIAL)
    C = s.capacity
    if held > capacity:
        rules = Rules.of([policy] * s.batch, capacity, s.pos.device)
        prio = rules.priority(s.score[..., :C], s.pos[..., :C], s.seen - 1)
        keep = order(prio, tie(s.pos[..., :C])).topk(capacity, dim=-1).indices.sort(-1).values
    else:  # the held tokens first (they fill the first slots already)
        keep = torch.arange(min(C, capacity), device=s.pos.device).expand(*s.pos.shape[:3], min(C, capacity))
    cache.install(s.moved(keep, capacity))
    cache.make_store()
    for r in cache.rows:
        if r.switched:
            r.bound = min(r.bound, capacity)
