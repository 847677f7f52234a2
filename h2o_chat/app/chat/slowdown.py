"""A decode pace that collapses while the machine is busy: said once, with what may help.

When another process takes a core, torch's threads wait for one another at every operation: on a 2-core machine
decode fell from ~45 to ~1 tok/s with no hint why, where one thread holds up. `SlowdownWatch` times decode steps
in windows and speaks when a window runs far below the fastest one so far while the load average is above the
threads torch uses.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

WINDOW = 16  # decode steps per measurement of the pace (a single step is noise)
SLOWER = 4.0  # a window this many times below the best one is a collapse, not noise
clock = time.perf_counter  # looked up at each step (a test drives its own)


def load_average() -> float | None:
    """The machine's load over the last minute, or None where it cannot be read (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class SlowdownWatch:
    """Told after each decode step; returns a note the first time a window of WINDOW steps runs SLOWER times below
    the fastest window so far while the load is above torch's threads, and None otherwise. `note` keeps what was
    said, for a summary."""

    def __init__(
        self, threads: Callable[[], int] | None = None, load: Callable[[], float | None] | None = None
    ) -> None:
        self.threads, self.load = threads, load  # None: torch's threads and the load average, asked when needed
        self.best = 0.0  # the fastest pace so far, tokens/s
        self.note: str | None = None  # what was said, once
        self.summary: str | None = None  # the same, short, for a run's summary line
        self.start()

    def start(self) -> None:
        """A new reply: the time between replies is no decode, so its steps start a new window."""
        self.window: tuple[int, float, float] | None = None  # (steps, when it began, setup seconds then)

    def step(self, setup_seconds: float = 0.0) -> str | None:
        """After a decode step; `setup_seconds`: the engine's one-time setup so far (a window that paid a capture or
        a compilation measures that, not the pace)."""
        now = clock()
        if self.window is None or self.window[2] != setup_seconds:
            self.window = (0, now, setup_seconds)
            return None
        steps, began, _ = self.window
        steps += 1
        if steps < WINDOW:
            self.window = (steps, began, setup_seconds)
            return None
        self.window = (0, now, setup_seconds)
        pace = steps / max(now - began, 1e-9)
        self.best = max(self.best, pace)
        if self.note is not None or pace * SLOWER > self.best:
            return None
        threads = (self.threads or torch_threads)()
        load = (self.load or load_average)()
        if load is not None and load <= threads:
            return None  # the machine is not busier than our threads: something else slowed it
        slowed = f"decode slowed to {pace:.1f} tok/s from {self.best:.1f} earlier"
        remedy = "" if threads == 1 else ": try --threads 1"
        self.summary = f"decode slowed {self.best / pace:.0f}x on a busy CPU{remedy}"
        if load is None:
            self.note = f"{slowed}; if another process is taking a core, --threads 1 may help"
        elif threads > 1:
            self.note = (
                f"{slowed}, with the machine's load ({load:.1f}) above the {threads} threads torch uses: another "
                "process is taking a core and torch's threads wait for it at every step; --threads 1 may help"
            )
        else:
            self.note = f"{slowed}, with the machine's load ({load:.1f}) above its one thread: another process is busy"
        return self.note


class TurnPace:
    """A turn's speeds without its one-time setup (a capture or compilation of the decode step is paid once and
    reported on its own, not folded into the speeds), and the watch for a pace that collapses."""

    def __init__(self):
        self.watch = SlowdownWatch()
        self.setup = [0.0, 0.0, 0.0]  # the engine's setup seconds at the turn's start, its first token, its end

    def start(self, setup_seconds: float) -> None:
        self.setup = [setup_seconds] * 3
        self.watch.start()

    def token(self, count: int, setup_seconds: float) -> str | None:
        """After the turn's `count`-th token: a note when the pace collapsed (once), else None."""
        if count == 1:
            self.setup[1] = setup_seconds  # what the prompt's reading paid
        self.setup[2] = setup_seconds
        return self.watch.step(setup_seconds)

    def speeds(self, record) -> tuple[float, float | None, float]:
        """This turn's (prompt tok/s, decode tok/s, one-time setup seconds) for its last `Response`. Decode is None
        until a decode step has run: the first token comes from the prompt's reading (a 1-token reply read 0.0
        tok/s)."""
        at_start, at_first, now = self.setup
        prompt = record.prompt_seconds - (at_first - at_start)
        decode = record.generation_seconds - (now - at_first)
        steps = record.generation_tokens - 1
        return (
            record.prompt_tokens / prompt if prompt > 0 else 0.0,
            steps / decode if steps and decode > 0 else None,
            now - at_start,
        )
