"""One sequence's bookkeeping beside its storage, declared once: each batch row's `RowState`, the token columns
fed, whether some row's keys are rotated at other than their true positions, and the notices given once.

A new cache starts with an empty `Sequence` and `reset` starts another; twins and row views copy it; a snapshot
carries its `SNAPSHOT` values and copies of its rows (`H2OCache.state`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from h2o_chat.engine.positions import RowState

SNAPSHOT = ("columns", "renumbered")  # the plain values a snapshot carries, besides the rows, slots and store


@dataclass
class Sequence:
    columns: int = 0  # token columns fed, padding included: what the model calls "seen"
    rows: list[RowState] = field(default_factory=list)  # per batch row, set when storage is allocated
    renumbered: bool = False  # some row's keys are rotated at other than their true positions
    warned: set[str] = field(default_factory=set)  # notices given once per sequence

    def copy(self) -> Sequence:
        """Its own rows and notices; every other field as it is (a field added above is carried)."""
        return dataclasses.replace(self, rows=[r.copy() for r in self.rows], warned=set(self.warned))

    def of_row(self, r: int) -> Sequence:
        """Row r's alone (a row's view of the cache)."""
        row = self.rows[r]
        return dataclasses.replace(self, columns=row.columns, rows=[row.copy()], warned=set(self.warned))

    def take_row(self, r: int, view: Sequence) -> None:
        """Row r's bookkeeping back from its view (`of_row`), its group kept."""
        state = view.rows[0].copy()
        state.group = self.rows[r].group
        self.rows[r] = state
        self.columns = max(x.columns for x in self.rows)
        self.renumbered |= view.renumbered
        self.warned |= view.warned

    def select(self, index: list[int]) -> None:
        """Keep only the batch rows `index`."""
        self.rows = [self.rows[i].copy() for i in index]
        self.columns = max((x.columns for x in self.rows), default=0)

    def count(self, new_tokens: int, counts: list[int]) -> None:
        """A forward of `new_tokens` columns, of which each row's own tokens are `counts`."""
        self.columns += new_tokens
        for row, n in zip(self.rows, counts, strict=True):
            row.bound += n
            row.seen += n
            row.columns += new_tokens
