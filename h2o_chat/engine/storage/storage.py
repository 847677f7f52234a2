"""A cache's storage as one object: the slots every layer keeps (and the rules sized for them), recall's store of
evicted tokens beside them, and the version that says when a captured step is stale.

It is allocated once, at the first token, for the largest budget (a `full` cache from its reservation, doubling
when it must grow). Everything that replaces or reshapes a buffer happens here and bumps `version`; what rows hold
and how they are numbered is the cache's bookkeeping (`RowState`), which each verb is given.
"""

from __future__ import annotations

import copy

import torch

from h2o_chat.engine.policies import Recall, Rules
from h2o_chat.engine.positions import RowState
from h2o_chat.engine.storage.slots import Slots, order, tie
from h2o_chat.engine.storage.store import Store
from h2o_chat.errors import CacheUsageError

FULL_INITIAL = 256  # a `full` cache without a reservation starts with this many slots and doubles


class Storage:
    """Slots, rules and store of one cache (or of one row of another cache's: a view, which never re-allocates;
    or a throw-away fork, which keeps nothing it evicts)."""

    def __init__(self, num_layers: int, kv_quant: str):
        self.num_layers, self.kv_quant = num_layers, kv_quant
        self.is_view = False  # a row's view of another cache's storage (`row`): never re-allocates
        self.is_fork = False  # a throw-away copy (snap's probe, `H2OCache.fork`): keeps nothing it evicts
        self.slots: Slots | None = None
        self.rules: Rules | None = None
        self.store: Store | None = None  # evicted tokens of rows that recall (`store.py`)
        self.version = 0  # bumps whenever a buffer is replaced (captured and compiled steps are then stale)
        self.reserved = 0  # a full cache makes room for this many tokens when it allocates

    def drop(self) -> None:
        """No storage (a new sequence): the next token allocates again; a reservation stays."""
        self.slots = self.rules = self.store = None
        self.version += 1

    def nbytes(self) -> int:
        return 0 if self.slots is None else self.slots.nbytes()

    # -- allocation ---------------------------------------------------------------------------------
    def capacity_for(self, need: int, budgets: list[int | None]) -> int:
        """Slots per layer once the rows hold `need` columns: the storage's, or what it will allocate. `budgets`:
        each group's capacity (None: a full cache)."""
        if self.slots is not None:
            return self.slots.capacity if None not in budgets else max(self.slots.capacity, need)
        capacity = max((b for b in budgets if b is not None), default=0)
        return max(capacity, FULL_INITIAL, self.reserved, need) if None in budgets else capacity

    def allocate(self, key: torch.Tensor, value: torch.Tensor, capacity: int, rows: list[RowState]) -> None:
        """Slots for every layer, shaped after the first layer's keys and values (B, H, T, D); the store beside them
        when some row recalls."""
        self.install(Slots.allocate(self.num_layers, key, value, capacity, self.kv_quant), rows)
        self.make_store(rows)

    def install(self, slots: Slots, rows: list[RowState]) -> None:
        """New slots (and the rules sized for them): captured decode steps are stale (the version says so)."""
        self.slots = slots
        self.rules = Rules.of([r.group.policy for r in rows], slots.capacity, slots.keys.device)
        self.version += 1
        slots.mark_static()

    def make_store(self, rows: list[RowState]) -> None:
        """A store of evicted tokens when some row recalls, allocated once beside the slots, on their device; a
        policy change keeps what was evicted recallable (a store of another capacity keeps its best entries)."""
        policies = [r.group.policy for r in rows]
        if self.slots is None or self.is_fork or not any(isinstance(p, Recall) for p in policies):
            self.store = None
            return
        recalled = [p.recalled if isinstance(p, Recall) else 0 for p in policies]
        capacities = [p.store if isinstance(p, Recall) else 0 for p in policies]
        s, old = self.slots, self.store
        drop = next(p.drop for p in policies if isinstance(p, Recall))
        if old is not None and old.batch == s.batch and old.capacities == capacities:
            old.set_recalled(recalled, capacities)
            old.drop = drop
            return
        if old is not None and old.batch == s.batch:  # a new capacity: the best entries of the old store move over
            self.store = old.resized(capacities, recalled)
        else:
            first = (0, slice(None), slice(None), slice(0, 1))  # a template: shapes, device and the model's dtype
            key, value = s.read("keys", first), s.read("values", first)
            self.store = Store.allocate(self.num_layers, key, value, capacities, recalled)
        self.store.drop = drop
        self.version += 1  # a captured or compiled step reads the old store

    def reserve(self, need: int, rows: list[RowState]) -> None:
        """Room for `need` columns per row up front (a full cache: callers check that one is)."""
        if self.slots is None:
            self.reserved = max(self.reserved, need)
        elif need > self.slots.capacity:
            self.resize(need, rows)

    def grow(self, need: int, rows: list[RowState]) -> None:
        """Before a forward of a full cache: without room for `need` columns it doubles (or grows to `need`)."""
        if self.slots is not None and need > self.slots.capacity:
            self.resize(max(2 * self.slots.capacity, need), rows)

    def resize(self, capacity: int, rows: list[RowState]) -> None:
        if self.is_view:
            raise CacheUsageError("a full cache's rows must be reserved before a prompt is read into one of them")
        s = self.slots
        keep = torch.arange(s.capacity, device=s.pos.device).expand(*s.pos.shape[:3], s.capacity)
        self.install(s.moved(keep, capacity), rows)

    def change_policy(self, policy, held_columns: int, rows: list[RowState]) -> int:
        """Every row under one new `policy`: a smaller budget keeps its best slots, a larger one re-allocates.
        Returns the new capacity."""
        s = self.slots
        held = int(s.held().max())
        capacity = policy.capacity or max(held, held_columns, FULL_INITIAL)
        C = s.capacity
        if held > capacity:
            rules = Rules.of([policy] * s.batch, capacity, s.pos.device)
            prio = rules.priority(s.score[..., :C], s.pos[..., :C], s.seen - 1)
            keep = order(prio, tie(s.pos[..., :C])).topk(capacity, dim=-1).indices.sort(-1).values
        else:  # the held tokens first (they fill the first slots already)
            keep = torch.arange(min(C, capacity), device=s.pos.device).expand(*s.pos.shape[:3], min(C, capacity))
        self.install(s.moved(keep, capacity), rows)
        self.make_store(rows)
        return capacity

    # -- rows, copies, snapshots ------------------------------------------------------------------------
    def copy(self, slots: Slots | None) -> Storage:
        """Storage like this one over `slots`, with no store (a copy keeps nothing it evicts)."""
        other = copy.copy(self)
        other.slots, other.store, other.is_view = slots, None, False
        return other

    def row(self, r: int) -> Storage:
        """Row r's view: its slots, rules and store entries shared with this storage."""
        view = self.copy(self.slots.row(r))
        view.is_view = True
        view.rules = self.rules.of_rows(torch.tensor([r], device=self.slots.seen.device))
        view.store = None if self.store is None else self.store.view_of_row(r)
        return view

    def select(self, index: torch.Tensor, rows: list[RowState]) -> None:
        """Keep only the batch rows `index` (on the slots' device)."""
        if self.store is not None:
            self.store = self.store.select(index)
        self.install(self.slots.select(index), rows)

    def clear_row(self, r: int) -> None:
        self.slots.clear_row(r)
        if self.store is not None:
            self.store.clear_row(r)

    def restore(self, slots: Slots | None, store: Store | None, device, rows: list[RowState]) -> None:
        """Back to saved `slots` and `store`: buffers of the same shape are overwritten in place (captured steps
        stay valid); others are copies on `device` (or on the storage's own)."""
        if self.slots is not None:
            device = self.slots.keys.device
        if store is None:
            if self.store is not None:
                self.store.clear()
        elif self.store is not None and self.store.keys.shape == store.keys.shape:
            self.store.load(store)  # in place: a captured step keeps reading it
            self.store.absorb_all(store)
        else:
            self.store = store.copy(device)
            self.version += 1
        if slots is None:
            self.slots, self.rules = None, None
            self.version += 1
        elif self.slots is not None and self.slots.keys.shape == slots.keys.shape:
            self.slots.load(slots)
        else:
            self.install(slots.copy(device), rows)
