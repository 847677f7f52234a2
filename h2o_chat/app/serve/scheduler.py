"""The server's engine thread: requests in, text events out, every conversation a row of one engine.

One thread owns the model and the lanes (app/serve/rows.py); the HTTP side plans a request (the conversation it
continues, its tokens: app/serve/sessions.py, whose store takes a lock) and submits it, then reads its events. Each turn
of the loop:

1. take the jobs submitted since the last turn (a cancelled one is dropped; a client gone mid-reply frees its row
   here, at the next step);
2. start waiting jobs while rows are free (a lane grows in powers of two up to the server's rows, once for the jobs
   of its key waiting together: lanes.py): a row is theirs, and their conversation's new tokens are read beside it
   (`rows.Reading`); a prompt that cannot fit is a 503 for that job alone. A job that needs a fifth lane closes the
   least busy one to new rows, so it waits for that lane's replies, never for ever;
3. read prompts for one chunk's worth of tokens (a chunk of each in turn: a long prompt a chunk per turn, several
   short ones at once, and a short one behind a long one waits a chunk, not the whole: reading.py); a prompt read
   moves into its row, and its first token goes out at once;
4. decode one step of every lane with rows decoding, and hand each row's text to its job (replies.py); a finished
   reply's row is copied out as an idle conversation before the next step. A long prompt never holds the other
   rows' replies back for more than a chunk.

Every event of a turn goes to the HTTP side at its end (jobs.py's `Outbox`). Draining (SIGTERM) refuses every job
not yet decoding and stops a prompt being read at its next chunk; a dead engine thread answers everything, queued
or new, with a 500 at once.
"""

from __future__ import annotations

import collections
import gc
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future

import torch

from h2o_chat.app.serve.api import ApiError
from h2o_chat.app.serve.jobs import SHUTTING_DOWN, Job, Outbox
from h2o_chat.app.serve.lanes import Lanes, WaitForLane
from h2o_chat.app.serve.reading import Reader
from h2o_chat.app.serve.replies import Replies
from h2o_chat.app.serve.rows import Lane, LaneKey
from h2o_chat.app.serve.sessions import SessionStore
from h2o_chat.engine.step.prefill import default_chunk
from h2o_chat.errors import out_of_memory

MAX_WAITING = 256  # jobs queued beyond the rows; more are told the server is busy


class Scheduler:
    """Owns the engine thread. `submit` a job; `call` runs a function in the thread between steps. The thread's
    loop starts jobs in `lanes`, reads their prompts (`reader`) and steps the lanes for their `replies`."""

    def __init__(self, loaded, settings, rows: int, store: SessionStore, log: Callable[[str], None] | None = None):
        self.loaded, self.store = loaded, store
        self.outbox = Outbox()
        self.lanes = Lanes(loaded, settings, rows)
        self.replies = Replies(loaded, store, self.outbox, log)
        quantum = settings.chunk_size or default_chunk(next(loaded.model.parameters()).device)
        self.reader = Reader(quantum, self.outbox, self.replies, self.release, lambda: self.draining)
        self.waiting: list[Job] = []
        self.inbox: queue.Queue = queue.Queue()
        self.draining = False
        self.failed: str | None = None  # the engine thread's fatal error, if it died
        self.closed = False  # the thread has ended after a drain
        self._gate = threading.Lock()  # a job is queued, or told the engine died, never lost between the two
        self._stop = threading.Event()
        self._threads = torch.get_num_threads()  # --threads, set in the main thread: the engine thread's too
        self._thread = threading.Thread(target=self._run, name="h2o-chat-engine", daemon=True)
        self.last_stats: tuple[float, dict] | None = None  # (when, what) `stats` gave last: while a chunk is read

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job for the engine thread, or raise the ApiError that says why it cannot run (then the
        caller gives its conversation back: `release`)."""
        with self._gate:
            if self.failed:
                raise self._dead()
            if self.draining:
                raise ApiError(503, SHUTTING_DOWN)
            if self.inbox.qsize() + len(self.waiting) >= MAX_WAITING:
                raise ApiError(503, f"the server is busy: {MAX_WAITING} requests are waiting for a row; retry later")
            self.inbox.put(job)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` in the engine thread between steps (stats read the rows while nothing moves them); a
        future that fails at once when the thread is gone."""
        future: Future = Future()
        with self._gate:
            if self.failed:
                future.set_exception(self._dead())
            elif self.closed:
                future.set_exception(ApiError(503, SHUTTING_DOWN))
            else:
                self.inbox.put((fn, future))
        return future

    def release(self, job: Job) -> None:
        """A job that will not start: the idle conversation it continues goes back to the store."""
        if job.turn.session.state is not None:
            self.store.put(job.turn.session)

    def _dead(self) -> ApiError:
        return ApiError(500, f"the engine stopped: {self.failed}")

    def stop(self, timeout: float | None = None) -> None:
        """Finish the replies already decoding (the others get a 503), then end the thread."""
        self.draining = True
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    @property
    def busy(self) -> int:
        return self.lanes.busy

    @property
    def served(self) -> int:
        return self.replies.served

    # -- the loop ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        # a row's cache view (and snap's copy of it) is a reference cycle (cache <-> its layers): freed only by a
        # collection of the oldest generation, which the model's millions of objects make rare and slow. Frozen,
        # those objects are no longer scanned, and a collection after each reply costs next to nothing. Frozen
        # objects are never freed, this server's own among them (it is a cycle): unfrozen when the thread ends.
        gc.freeze()
        self.stats()  # what /v1/stats shows before the first turn ends
        with torch.inference_mode():
            try:
                while True:
                    idle = not self.busy
                    if idle and self._stop.is_set() and not self.waiting and self.inbox.empty():
                        self._end(ApiError(503, SHUTTING_DOWN))
                        return
                    self._take(block=idle and not self.waiting)
                    self._admit()
                    self.reader.read_some()
                    for lane in list(self.lanes):
                        self._drop_cancelled(lane)
                        if lane.decoding:
                            self._step(lane)
                    self.lanes.tidy(waiting=bool(self.waiting))
                    self.outbox.flush()
            except Exception as e:  # a bug: the traceback for its report, and one line to every job
                traceback.print_exc()
                self._die(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            finally:
                gc.unfreeze()

    def _die(self, why: str) -> None:
        """Every job -- decoding, waiting or still queued -- and every pending call gets the error now; under the
        gate, so whatever is submitted later is refused at once."""
        self.failed = why
        self._end(self._dead())

    def _end(self, error: ApiError) -> None:
        """The thread ends: whatever is left, and whatever comes later (under the gate), gets `error`."""
        self.reader.drop_lane()  # every lane's
        with self._gate:
            self.closed = True
            jobs = [*self.waiting, *(j for lane in self.lanes for j in lane.jobs if j is not None)]
            while True:
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, tuple):
                    item[1].set_exception(error)
                elif item is not None:
                    jobs.append(item)
            self.waiting = []
        for job in jobs:
            self.outbox.send(job, ("error", error))
        self.outbox.flush()

    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item is None:
                continue
            if isinstance(item, tuple):  # a call
                fn, future = item
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)
                continue
            self.waiting.append(item)

    def _admit(self) -> None:
        reserved = 0  # a row kept for an older job that waits for a lane to close
        wanting = collections.Counter(LaneKey.of(job.req) for job in self.waiting)  # a lane grows once for all
        for job in list(self.waiting):
            key = LaneKey.of(job.req)
            wanting[key] -= 1
            if job.cancelled or self.draining:
                self.waiting.remove(job)
                self.release(job)
                if not job.cancelled:
                    self.outbox.send(job, ("error", ApiError(503, SHUTTING_DOWN)))
                continue
            try:
                place = self.lanes.place(key, job.req.policy, self.lanes.max_rows - reserved, wanting[key] + 1)
                if place is None:
                    continue  # no row yet: it waits for one (jobs behind it with another key may go first)
                self.waiting.remove(job)
                job.stream = self.replies.stream(job.req)
                self.reader.begin(job, *place)
            except WaitForLane:
                reserved = 1
            except ApiError as e:
                if job in self.waiting:
                    self.waiting.remove(job)
                    self.release(job)
                self.outbox.send(job, ("error", e))

    def _drop_cancelled(self, lane: Lane) -> None:
        """A client gone: its row is free before the next step (a prompt being read stops where it is, and the
        conversation it continued stays as it was)."""
        for r, job in enumerate(lane.jobs):
            if job is None or not job.cancelled:
                continue
            if self.replies.log:  # --verbose: a reply that ends this way gets its line too
                where = "while its prompt was read" if job.reading is not None else (
                    f"after {len(job.stream.tokens)} generated tokens")  # fmt: skip
                self.replies.log(f"{job.turn.session.id}: the client went away {where}; its row is free")
            if job.reading is not None:
                self.reader.unread(job, lane, job.reading.cancel)
            else:
                lane.stop(r, keep=False)

    def _step(self, lane: Lane) -> None:
        try:
            tokens = lane.step()
        except Exception as e:
            if not out_of_memory(e):
                raise
            self._fail_lane(lane, ApiError(503, f"out of memory in a decode step ({str(e).splitlines()[0]})"))
            return
        for notice in lane.take_notices():  # e.g. a step that could not be captured: said, never swallowed
            print(f"h2o-chat: {notice}", file=sys.stderr, flush=True)
        self.replies.take(lane, tokens)

    def _fail_lane(self, lane: Lane, error: ApiError) -> None:
        """Every job of the lane gets `error` (a prompt being read stops) and the lane goes."""
        self.reader.drop_lane(lane)
        for job in lane.jobs:
            if job is not None:
                self.outbox.send(job, ("error", error))
        self.lanes.remove(lane)

    # -- what /v1/stats shows ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """What /v1/stats shows, read in the engine thread between two turns (kept as `last_stats`)."""
        from h2o_chat.models.memory import process_memory

        body = {
            "lanes": [lane.describe() for lane in self.lanes],
            "rows_busy": self.busy,
            "rows_max": self.lanes.max_rows,
            "waiting": len(self.waiting),
            "served": self.served,
            "prompts_read_together": self.reader.together,
            "idle_conversations": {
                "count": len(self.store),
                "bytes": self.store.nbytes,
                "max_count": self.store.max_sessions,
                "memory_limit": self.store.memory_limit,
                "evicted": self.store.evicted,
                **(self._disk_stats() if self.store.disk is not None else {}),
            },
            "memory": process_memory(self.loaded.device),
        }
        self.last_stats = (time.monotonic(), body)
        return body

    def _disk_stats(self) -> dict:
        disk = self.store.disk
        return {
            "on_disk": self.store.on_disk,
            "session_dir": str(disk.folder),
            "written_to_disk": disk.written,
            "restored_from_disk": disk.restored,
            "disk_errors": list(self.store.disk_errors),
        }
