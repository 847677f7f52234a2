"""The engine thread's lanes (app/serve/rows.py: one engine per cache key) and where a new job's row is."""

from __future__ import annotations

from collections.abc import Iterator

from h2o_chat.app.serve.api import ApiError
from h2o_chat.app.serve.rows import Lane, LaneKey
from h2o_chat.errors import H2OChatError

MAX_LANES = 4  # engines with distinct cache keys or sampler shapes at once; more wait for one to empty
# steps a busy lane decodes with its busy rows in a quarter of it before it shrinks to half. A resize copies every
# row's cache: the embedded model at budget 512 (2-core Xeon, 2026-11-27) took ~70 ms from 8 rows to 4 and ~30 from
# 4 to 2, where a step of 4 rows saves ~15 ms over one of 8 and one of 2 ~6.5 over 4 (19 / 12 against 34 / 19 ms).
# So a lane shrinks once the steps it would have saved would have paid for the copy (rent or buy): replies that
# end together (a burst) leave without a copy each, and a long one left alone soon gets its smaller steps.
SHRINK_AFTER = 5


def covering(rows: int) -> int:
    """The power of two at least `rows` (lanes hold 1, 2, 4, 8, ... rows)."""
    return 1 << max(0, rows - 1).bit_length()


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

    def place(self, key: LaneKey, policy, rows: int, want: int = 1) -> tuple[Lane, int] | None:
        """A free row for `key` among `rows` busy at most: in its lane, grown when full, or in a new lane. With
        every lane busy, the least busy closes to new rows (one at a time) and `WaitForLane` says so: rows
        keep coming to four lanes, so waiting for one to empty by chance could last for ever. `want`: the jobs
        of this key waiting now, this one included: a lane grows (or opens) once to hold them all where it
        can (as many of them as `rows` lets be busy), not a doubling (a copy of every row) per job."""
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
            # its rows, and the one-row cache its prompts are read into
            size = self._grown(policy, 0, min(want, rows - self.busy), extra=1)
            lane = Lane(self.loaded, key, policy, self.settings, rows=size)
            self._lanes.append(lane)
        r = lane.free_row()
        if r is None:
            if lane.size >= self.max_rows:
                return None
            lane.resize(self._grown(policy, lane.size, lane.active + min(want, rows - self.busy)))
            r = lane.free_row()
        return lane, r

    def _grown(self, policy, have: int, need: int, extra: int = 0) -> int:
        """The rows a lane of `have` rows (0: a new lane) grows to for `need` busy rows: the power of two that
        holds them (at most `max_rows`), or the largest half of it that memory allows (`extra` rows counted
        besides); at least one row more than `have` (twice as many), or a 503 when even that cannot fit."""
        least = min(max(1, 2 * have), self.max_rows)
        size = max(min(covering(need), self.max_rows), least)
        while size > least:
            try:
                self._fits(policy, size - have + extra)
                return size
            except ApiError:
                size //= 2
        self._fits(policy, least - have + extra)
        return least

    def _fits(self, policy, rows: int) -> None:
        """The fit check of every command for `rows` more rows of `policy`'s budget: a 503 when they cannot."""
        try:
            kv_quant, snap = self.settings.kv_quant, policy.compresses_prompts
            self.loaded.check_budget(policy.budget, rows=rows, flag='"budget"', kv_quant=kv_quant, snap=snap)
        except H2OChatError as e:
            raise ApiError(503, f"no memory for this conversation's cache: {e}") from None

    def tidy(self, waiting: bool) -> None:
        """Lanes without busy rows go (their storage is freed; the last, the default lane, stays while no job is
        `waiting` and shrinks to one row at once); a lane whose busy rows fit in a quarter of it shrinks to half
        once it has decoded `SHRINK_AFTER` steps so."""
        for lane in list(self._lanes):
            if not lane.active and (len(self._lanes) > 1 or waiting or lane.closing):
                self._lanes.remove(lane)
            elif not lane.active and lane.size > 1:
                lane.resize(1)
            elif lane.size > 1 and lane.active <= lane.size // 4:
                lane.oversized_since = lane.steps if lane.oversized_since is None else lane.oversized_since
                if lane.steps - lane.oversized_since >= SHRINK_AFTER:
                    lane.resize(lane.size // 2)
            else:
                lane.oversized_since = None
