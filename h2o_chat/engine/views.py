"""A cache's copies and row views: twins, forks, one row seen as a cache of its own (continuous batching), row
selections and clears, and snapshots. `H2OCache` takes them from `CacheViews`; each copies the sequence's
bookkeeping whole (`sequence.Sequence`) and asks the storage for the buffers (`storage.Storage`), so nothing here
lists either's fields."""

from __future__ import annotations

import copy
from typing import Self

import torch

from h2o_chat.engine.layer import H2OLayer
from h2o_chat.engine.positions import Group, Numbering, RowState
from h2o_chat.engine.sequence import SNAPSHOT, Sequence
from h2o_chat.engine.storage.slots import inference
from h2o_chat.engine.storage.storage import Storage
from h2o_chat.errors import CacheUsageError


class CacheViews:
    """The copies and row views of an `H2OCache` (which declares these attributes)."""

    storage: Storage
    seq: Sequence
    numbering: Numbering
    groups: list[Group]
    layers: list
    slots: object
    store: object

    def twin(self, slots) -> Self:
        """A cache like this one over `slots`, with its own copy of every row's bookkeeping, no store and no
        forward running (a fork, a row's view, a compiled step's trace)."""
        other = copy.copy(self)
        other.layers = [H2OLayer(other, i) for i in range(len(self.layers))]
        other.storage = self.storage.copy(slots)
        other.forward, other.probe, other.observation = None, None, None
        other.groups = [copy.copy(g) for g in self.groups]
        other.seq = self.seq.copy()
        return other

    @inference
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` (finished rows leave the batch)."""
        if self.slots is None:
            return
        index = index.to(self.slots.seen.device)
        self.seq.select(index.tolist())
        self.storage.select(index, self.seq.rows)

    @inference
    def fork(self) -> Self:
        """An independent copy (snap's probe reads a prompt into one and throws it away). It keeps nothing it
        evicts, nor makes a store when it allocates: a fork of an empty cache and one of a filled row (a refilled
        batch row) must read alike, and a row's probe would otherwise recall what the other never kept."""
        copied = self.twin(None if self.slots is None else self.slots.copy())
        copied.storage.is_fork = True
        copied.notices = []
        return copied

    def row(self, r: int) -> Self:
        """Row r as a cache of its own that shares this cache's storage: a prompt read into it lands in row r while
        the other rows keep theirs (continuous batching). Notes go to this cache. `absorb` takes its host
        bookkeeping back, and what the prompt evicted into the store when the row recalls (the view keeps its own
        while it reads: its chunks recall only what this prompt evicted)."""
        view = self.twin(None)
        view.storage = self.storage.row(r)
        view.seq = self.seq.of_row(r)
        view.groups = [Group(view.seq.rows[0].group.policy, None, view.seq.rows[0].group.positions)]
        view.host_managed = True
        return view

    def absorb(self, view: Self, r: int) -> None:
        """Row r's host bookkeeping back from its view, after a prompt was read into it."""
        if view.slots is None or view.slots.keys.data_ptr() != self.slots.row(r).keys.data_ptr():
            raise CacheUsageError("a row's storage was re-allocated while a prompt was read into it")
        self.seq.take_row(r, view.seq)
        if self.store is not None and view.store is not None:
            self.store.absorb(r, view.store)

    @inference
    def clear_row(self, r: int) -> None:
        """Empty row r for a new prompt; the other rows are untouched."""
        self.storage.clear_row(r)
        group = self.seq.rows[r].group
        self.seq.rows[r] = RowState(group, switched=self.numbering.starts_switched(group))

    @inference
    def clear(self) -> None:
        """Empty every row in place, storage kept (a captured step stays valid): the next prompt is read from
        position 0, as into a new cache (a conversation re-reads its transcript)."""
        for r in range(self.slots.batch if self.slots is not None else 0):
            self.clear_row(r)
        self.seq.columns = 0

    def state(self) -> dict:
        """The sequence as `restore` takes it, this cache's own rows and tensors (no copy: for a restore into other
        storage before this cache changes)."""
        return {**{name: getattr(self.seq, name) for name in SNAPSHOT}, "rows": self.seq.rows, "slots": self.slots,
                "store": self.store}  # fmt: skip

    @inference
    def snapshot(self) -> dict:
        """What the cache holds now, copied to the host: `restore` brings it back (e.g. when the user stops the
        reading of a long message, the conversation continues from before it)."""
        state = self.state()
        state["rows"] = [r.copy() for r in self.seq.rows]
        state["slots"] = None if self.slots is None else self.slots.copy("cpu")
        state["store"] = None if self.store is None else self.store.copy("cpu")  # bounded: a copy costs its size
        return state

    @inference
    def restore(self, state: dict, device: torch.device | str | None = None) -> None:
        """Back to a snapshot; storage of the same shape is overwritten in place (captured steps stay valid).
        A cache without storage yet takes a copy on `device` (default: where the snapshot is)."""
        self.forward = None
        for name in SNAPSHOT:
            setattr(self.seq, name, state[name])
        self.seq.rows = [r.copy() for r in state["rows"]]
        self.storage.restore(state["slots"], state.get("store"), device, self.seq.rows)
