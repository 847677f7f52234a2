"""The engine thread's lanes (app/serve/rows.py: one engine per cache key) and where a new job's row is."""

from __future__ import annotations

from collections.abc import Iterator

from h2o_chat.app.serve.api import ApiError
from h2o_chat.app.serve.rows import Lane, LaneKey
from h2o_chat.errors import H2OChatError

MAX_LANES = 4  # engines with distinct cache keys or sampler shapes at once; more wait for one to empty


class WaitForLane(Exception):
    """Every lane is busy with other keys: the job waits for the one closed to new rows to empty."""


class Lanes:
    """The lanes, at most `MAX_LANES`, and `max_rows` busy rows over all of them: a job's row is found (`place`),
    a lane grown in powers of two or opened for it, and lanes shrink or go when their rows are free (`tidy`).
    Iterating gives the lanes, the oldest first."""

    def __init__(self, loaded, settings, max_rows: int):
        self.loaded, self.settings, self.max_rows = loaded, settings, max_rows
        self._lanes: list[Lane] = []

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._lanes)

    def __len__(self) -> int:
        return len(self._lanes)

    @property
    def busy(self) -> int:
        return sum(lane.active for lane in self._lanes)

    def remove(self, lane: Lane) -> None:
        self._lanes.remove(lane)

    def place(self, key: LaneKey, policy, rows: int) -> tuple[Lane, int] | None:
        """A free row for `key` among `rows` busy at most: in its lane, grown when full, or in a new lane. With
        every lane busy, the least busy closes to new rows (one at a time) and `WaitForLane` says so: rows
        keep coming to four lanes, so waiting for one to empty by chance could last for ever."""
        if self.busy >= rows:
            return None
        lane = next((lane for lane in self._lanes if lane.key == key and not lane.closing), None)
        if lane is None:
            if len(self._lanes) >= MAX_LANES:
                empty = next((la for la in self._lanes if not la.active), None)
                if empty is None:
                    if not any(la.closing for la in self._lanes):
                        min(self._lanes, key=lambda la: la.active).closing = True
                    raise WaitForLane
                self._lanes.remove(empty)
            self._fits(policy, 2)  # its first row, and the one-row cache its prompts are read into
            lane = Lane(self.loaded, key, policy, self.settings)
            self._lanes.append(lane)
        r = lane.free_row()
        if r is None:
            rows = min(2 * lane.size, self.max_rows)
            if rows == lane.size:
                return None
            self._fits(policy, rows - lane.size)
            lane.resize(rows)
            r = lane.free_row()
        return lane, r

    def _fits(self, policy, rows: int) -> None:
        """The fit check of every command for `rows` more rows of `policy`'s budget: a 503 when they cannot."""
        try:
            kv_quant, snap = self.settings.kv_quant, policy.compresses_prompts
            self.loaded.check_budget(policy.budget, rows=rows, flag='"budget"', kv_quant=kv_quant, snap=snap)
        except H2OChatError as e:
            raise ApiError(503, f"no memory for this conversation's cache: {e}") from None

    def tidy(self, waiting: bool) -> None:
        """Lanes without busy rows go (their storage is freed; the last, the default lane, stays while no job is
        `waiting` and shrinks to one row); a lane whose busy rows fit in a quarter of it shrinks to half."""
        for lane in list(self._lanes):
            if not lane.active and (len(self._lanes) > 1 or waiting or lane.closing):
                self._lanes.remove(lane)
            elif lane.size > 1 and lane.active <= lane.size // 4:
                lane.resize(max(1, lane.size // 2))
