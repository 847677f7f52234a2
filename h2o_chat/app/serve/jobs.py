"""A request as the engine thread sees it (`Job`), and the events it sends back to the HTTP side (`Outbox`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from h2o_chat.app.serve.api import GenRequest
from h2o_chat.app.serve.rows import Reading
from h2o_chat.app.serve.sessions import Turn
from h2o_chat.engine.step.generate import TextStream

SHUTTING_DOWN = "the server is shutting down: it finishes the replies under way and takes no new ones"


@dataclass
class Job:
    req: GenRequest
    turn: Turn  # planned by the HTTP side: the conversation (taken out of the idle store) and the tokens to read
    # ("started", None) | ("text", str) | ("done", result) | ("error", ApiError), put by the engine thread into
    # `events` through `loop` (the HTTP side's), all of one turn of the loop at once (`Outbox.flush`)
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the HTTP side when the client goes away
    stream: TextStream | None = None
    first_at: float | None = None
    read_seconds: float = 0.0
    reading: Reading | None = None  # its prompt being read (its row waits, fed nothing of its own)
    text: list[str] = field(default_factory=list)  # the reply so far, as sent


class Outbox:
    """The events of this turn of the engine thread's loop, not yet handed to the HTTP side."""

    def __init__(self) -> None:
        self._events: list[tuple[Job, tuple]] = []

    def send(self, job: Job, event: tuple) -> None:
        self._events.append((job, event))

    def flush(self) -> None:
        """Hand this turn's events to the HTTP side: one wake-up of its event loop per turn, however many rows
        stepped (a wake-up per row and token took a core's slice from the engine's threads on a small machine)."""
        if not self._events:
            return
        by_loop: dict = {}
        for job, event in self._events:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._events = []
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[Job, tuple]]) -> None:
    """In the HTTP side's event loop: each event into its job's queue."""
    for job, event in batch:
        job.events.put_nowait(event)
