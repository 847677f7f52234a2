"""The server's engine thread: requests in, text events out, every conversation a row of one engine.

One thread owns the model and the lanes (app/serve/rows.py); the HTTP side plans a request (the conversation it
continues, its tokens: app/serve/sessions.py, whose store takes a lock) and submits it, then reads its events. Each turn
of the loop:

1. take the jobs submitted since the last turn (a cancelled one is dropped; a client gone mid-reply frees its row
   here, at the next step);
2. start waiting jobs while rows are free (a lane grows in powers of two up to the server's rows): a row is
   theirs, and their conversation's new tokens are read beside it (`rows.Reading`); a prompt that cannot fit is a
   503 for that job alone. A job that needs a fifth lane closes the least busy one to new rows, so it waits for
   that lane's replies, never for ever;
3. read prompts for one chunk's worth of tokens (the oldest first: a long prompt a chunk per turn, several short
   ones at once); a prompt read moves into its row, and its first token goes out at once;
4. decode one step of every lane with rows decoding, and hand each row's text to its job; a finished reply's row
   is copied out as an idle conversation before the next step. A long prompt never holds the other rows' replies
   back for more than a chunk.

Draining (SIGTERM) refuses every job not yet decoding and stops a prompt being read at its next chunk; a dead
engine thread answers everything, queued or new, with a 500 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from h2o_chat.app.messages import PLAIN_STOP, use_chat_template
from h2o_chat.app.serve.api import ApiError, GenRequest
from h2o_chat.app.serve.rows import Lane, LaneKey, Reading, ReadingStopped
from h2o_chat.app.serve.sessions import SessionStore, Turn, end_turn, snapshot_bytes
from h2o_chat.engine.step.generate import TextStream, stop_token_ids
from h2o_chat.errors import H2OChatError, out_of_memory

MAX_LANES = 4  # engines with distinct cache keys or sampler shapes at once; more wait for one to empty
MAX_WAITING = 256  # jobs queued beyond the rows; more are told the server is busy


SHUTTING_DOWN = "the server is shutting down: it finishes the replies under way and takes no new ones"


class _WaitForLane(Exception):
    """Every lane is busy with other keys: the job waits for the one closed to new rows to empty."""


@dataclass
class Job:
    req: GenRequest
    turn: Turn  # planned by the HTTP side: the conversation (taken out of the idle store) and the tokens to read
    # ("started", None) | ("text", str) | ("done", result) | ("error", ApiError), put by the engine thread into
    # `events` through `loop` (the HTTP side's), all of one turn of the loop at once (`Scheduler._flush`)
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the HTTP side when the client goes away
    stream: TextStream | None = None
    first_at: float | None = None
    read_seconds: float = 0.0
    reading: Reading | None = None  # its prompt being read (its row waits, fed nothing of its own)
    text: list[str] = field(default_factory=list)  # the reply so far, as sent


class Scheduler:
    """Owns the engine thread. `submit` a job; `call` runs a function in the thread between steps."""

    def __init__(self, loaded, settings, rows: int, store: SessionStore, log: Callable[[str], None] | None = None):
        self.loaded, self.settings, self.max_rows, self.store, self.log = loaded, settings, rows, store, log
        self.stop_ids = stop_token_ids(loaded.tokenizer, loaded.model)
        self.plain = use_chat_template(loaded.tokenizer)  # a base model's plain template: replies end at "\nUser:"
        self.lanes: list[Lane] = []
        self.waiting: list[Job] = []
        # prompts being read, the oldest first (their rows are looked up when used: a resize moves rows)
        self.readings: list[tuple[Job, Lane]] = []
        self.inbox: queue.Queue = queue.Queue()
        self.draining = False
        self.served = 0
        self.failed: str | None = None  # the engine thread's fatal error, if it died
        self._outbox: list[tuple[Job, tuple]] = []  # events of this turn of the loop, not yet handed over
        self.closed = False  # the thread has ended after a drain
        self._gate = threading.Lock()  # a job is queued, or told the engine died, never lost between the two
        self._stop = threading.Event()
        self._threads = torch.get_num_threads()  # --threads, set in the main thread: the engine thread's too
        self._thread = threading.Thread(target=self._run, name="h2o-chat-engine", daemon=True)

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
        return ApiError(500, f"the engine stopped: {self.failed}", "server_error")

    def stop(self, timeout: float | None = None) -> None:
        """Finish the replies already decoding (the others get a 503), then end the thread."""
        self.draining = True
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    @property
    def busy(self) -> int:
        return sum(lane.active for lane in self.lanes)

    # -- the loop ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        # a row's cache view (and snap's copy of it) is a reference cycle (cache <-> its layers): freed only by a
        # collection of the oldest generation, which the model's millions of objects make rare and slow. Frozen,
        # those objects are no longer scanned, and a collection after each reply costs next to nothing.
        gc.freeze()
        with torch.inference_mode():
            try:
                while True:
                    idle = not self.busy
                    if idle and self._stop.is_set() and not self.waiting and self.inbox.empty():
                        self._end(ApiError(503, SHUTTING_DOWN))
                        return
                    self._take(block=idle and not self.waiting)
                    self._admit()
                    self._read_some()
                    for lane in list(self.lanes):
                        self._drop_cancelled(lane)
                        if lane.decoding:
                            self._step(lane)
                    self._tidy()
                    self._flush()
            except Exception as e:  # a bug: the traceback for its report, and one line to every job
                traceback.print_exc()
                self._die(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")

    def _die(self, why: str) -> None:
        """Every job -- decoding, waiting or still queued -- and every pending call gets the error now; under the
        gate, so whatever is submitted later is refused at once."""
        self.failed = why
        self._end(self._dead())

    def _end(self, error: ApiError) -> None:
        """The thread ends: whatever is left, and whatever comes later (under the gate), gets `error`."""
        for job, _ in self.readings:
            job.reading.cancel()
        self.readings = []
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
            self._send(job, ("error", error))
        self._flush()

    def _send(self, job: Job, event: tuple) -> None:
        self._outbox.append((job, event))

    def _flush(self) -> None:
        """Hand this turn's events to the HTTP side: one wake-up of its event loop per turn, however many rows
        stepped (a wake-up per row and token took a core's slice from the engine's threads on a small machine)."""
        if not self._outbox:
            return
        by_loop: dict = {}
        for job, event in self._outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._outbox = []
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_deliver, batch)

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
        for job in list(self.waiting):
            if job.cancelled or self.draining:
                self.waiting.remove(job)
                self.release(job)
                if not job.cancelled:
                    self._send(job, ("error", ApiError(503, SHUTTING_DOWN)))
                continue
            try:
                place = self._place(LaneKey.of(job.req), job.req.policy, self.max_rows - reserved)
                if place is None:
                    continue  # no row yet: it waits for one (jobs behind it with another key may go first)
                self.waiting.remove(job)
                self._start(job, *place)
            except _WaitForLane:
                reserved = 1
            except ApiError as e:
                if job in self.waiting:
                    self.waiting.remove(job)
                    self.release(job)
                self._send(job, ("error", e))

    def _place(self, key: LaneKey, policy, rows: int) -> tuple[Lane, int] | None:
        """A free row for `key` among `rows` busy at most: in its lane, grown when full, or in a new lane. With
        every lane busy, the least busy closes to new rows (one at a time) and `_WaitForLane` says so: rows
        keep coming to four lanes, so waiting for one to empty by chance could last for ever."""
        if self.busy >= rows:
            return None
        lane = next((lane for lane in self.lanes if lane.key == key and not lane.closing), None)
        if lane is None:
            if len(self.lanes) >= MAX_LANES:
                empty = next((la for la in self.lanes if not la.active), None)
                if empty is None:
                    if not any(la.closing for la in self.lanes):
                        min(self.lanes, key=lambda la: la.active).closing = True
                    raise _WaitForLane
                self.lanes.remove(empty)
            self._fits(policy, 2)  # its first row, and the one-row cache its prompts are read into
            lane = Lane(self.loaded, key, policy, self.settings)
            self.lanes.append(lane)
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

    def _start(self, job: Job, lane: Lane, r: int) -> None:
        """Row r is the job's; its prompt's reading begins (`_read_some` reads it)."""
        req, turn = job.req, job.turn
        stops = (*((PLAIN_STOP,) if self.plain and req.kind == "chat" else ()), *req.stop)
        job.stream = TextStream(self.loaded.tokenizer, req.max_tokens, self.stop_ids, stops)
        try:
            job.reading = lane.read(turn.session.state, turn.ids, self._reading_stops)
        except Exception as e:
            self.release(job)
            raise self._reading_error(e) from None
        lane.jobs[r] = job
        self.readings.append((job, lane))

    def _reading_error(self, e: Exception) -> Exception:
        """What a job whose prompt could not be read is told (the conversation it continues stays as it was)."""
        if isinstance(e, ReadingStopped):
            return ApiError(503, SHUTTING_DOWN)
        if isinstance(e, H2OChatError):
            return ApiError(503, f"this prompt cannot be read here: {e}")
        if out_of_memory(e):
            return ApiError(503, f"out of memory while reading this prompt ({str(e).splitlines()[0]})")
        return e

    def _read_some(self) -> None:
        """Read prompts, the oldest first, until a chunk's worth of tokens (`--chunk-size`) is read this turn or
        none is left; each prompt read moves into its row and its first token goes out at once."""
        quantum = self.settings.chunk_size
        while self.readings and quantum > 0:
            job, lane = self.readings[0]
            reading = job.reading
            before = reading.read
            try:
                done = reading.advance()
            except Exception as e:
                self._unread(job, lane, reading.abandon)
                error = self._reading_error(e)
                if not isinstance(error, ApiError):
                    raise error from e
                self._send(job, ("error", error))
                continue
            quantum -= max(1, reading.read - before)
            if done:
                self.readings.pop(0)
                self._enter(job, lane)
                self._flush()  # its first token, before the next prompt is read

    def _unread(self, job: Job, lane: Lane, end: Callable[[], None]) -> None:
        """A prompt that will not be read to its end: its reading ends (`end`), its row is free, and the
        conversation it continues stays as it was."""
        end()
        self.readings = [x for x in self.readings if x[0] is not job]
        lane.jobs[lane.row_of(job)], job.reading = None, None
        self.release(job)

    def _enter(self, job: Job, lane: Lane) -> None:
        reading, turn, r = job.reading, job.turn, lane.row_of(job)
        first = lane.enter(r, reading, job.req)
        job.reading, job.read_seconds = None, reading.seconds
        turn.session.state, turn.session.nbytes = None, 0  # the conversation is in the row now
        self._send(job, ("started", None))
        self._consume(lane, r, first)

    def _reading_stops(self) -> bool:
        """Checked after each chunk of a prompt: a drain stops the reading at once, not at the prompt's end."""
        return self.draining

    def _drop_cancelled(self, lane: Lane) -> None:
        """A client gone: its row is free before the next step (a prompt being read stops where it is, and the
        conversation it continued stays as it was)."""
        for r, job in enumerate(lane.jobs):
            if job is None or not job.cancelled:
                continue
            if job.reading is not None:
                self._unread(job, lane, job.reading.cancel)
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
        for r, job in enumerate(lane.jobs):
            if job is not None and job.reading is None:
                self._consume(lane, r, tokens[r])

    def _consume(self, lane: Lane, r: int, token: int) -> None:
        job = lane.jobs[r]
        text, reason = job.stream.add(token)
        if job.first_at is None:
            job.first_at = time.perf_counter()
        if text:
            job.text.append(text)
            self._send(job, ("text", text))
        if reason is not None:
            self._finish(lane, r, job, reason)

    def _finish(self, lane: Lane, r: int, job: Job, reason: str) -> None:
        turn, req = job.turn, job.req
        stats, state = lane.stop(r, keep=True)
        session = turn.session
        end_turn(session, req, turn, job.stream.tokens, "".join(job.text), False, self.stop_ids)
        session.state, session.nbytes = state, snapshot_bytes(state)
        self.store.put(session)
        self.served += 1
        gc.collect()  # the views this reply used: memory stays flat however many replies pass
        result = self._result(job, reason, stats)
        if self.log:
            self.log(_log_line(result))
        self._send(job, ("done", result))

    def _result(self, job: Job, reason: str, stats: dict) -> dict:
        turn, now = job.turn, time.perf_counter()
        ttft = job.first_at - job.submitted
        decode = now - job.first_at
        n = len(job.stream.tokens)
        kept_in = self.store.holds(turn.session)
        return {
            "finish": "length" if reason == "length" else "stop",
            "read_tokens": len(turn.ids),
            "cached_tokens": turn.cached,
            "generated_tokens": n,
            "h2o": {
                "conversation": turn.session.id,
                "read_again": turn.read_again,
                "read_tokens": len(turn.ids),
                "cached_tokens": turn.cached,
                "policy": job.req.policy.name,
                "budget": job.req.policy.budget,
                "seen": stats["seen"],
                "kept": round(stats["kept"], 1),
                "evicted": round(stats["evicted"], 1),
                "kept_idle": kept_in,
                "restored_from_disk": turn.from_disk,
                "time_to_first_token": round(ttft, 4),
                "tokens_per_second": round((n - 1) / decode, 2) if n > 1 and decode > 0 else 0.0,
            },
        }

    def _fail_lane(self, lane: Lane, error: ApiError) -> None:
        for job in lane.jobs:
            if job is not None:
                if job.reading is not None:
                    job.reading.cancel()
                self._send(job, ("error", error))
        self.readings = [x for x in self.readings if x[1] is not lane]
        self.lanes.remove(lane)

    def _tidy(self) -> None:
        """Lanes without busy rows go (their storage is freed; the default lane shrinks to one row); a lane
        whose busy rows fit in a quarter of it shrinks to half."""
        for lane in list(self.lanes):
            if not lane.active and (len(self.lanes) > 1 or self.waiting or lane.closing):
                self.lanes.remove(lane)
            elif lane.size > 1 and lane.active <= lane.size // 4:
                lane.resize(max(1, lane.size // 2))

    # -- what /v1/stats shows ----------------------------------------------------------------------------
    def stats(self) -> dict:
        from h2o_chat.models.memory import process_memory

        return {
            "lanes": [lane.describe() for lane in self.lanes],
            "rows_busy": self.busy,
            "rows_max": self.max_rows,
            "waiting": len(self.waiting),
            "served": self.served,
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

    def _disk_stats(self) -> dict:
        disk = self.store.disk
        return {
            "on_disk": self.store.on_disk,
            "session_dir": str(disk.folder),
            "written_to_disk": disk.written,
            "restored_from_disk": disk.restored,
            "disk_errors": list(self.store.disk_errors),
        }


def _deliver(batch: list[tuple[Job, tuple]]) -> None:
    """In the HTTP side's event loop: each event into its job's queue."""
    for job, event in batch:
        job.events.put_nowait(event)


def _log_line(result: dict) -> str:
    h = result["h2o"]
    again = " (read again from the start)" if h["read_again"] else ""
    again += " (restored from disk)" if h["restored_from_disk"] else ""
    return (
        f"{h['conversation']}: read {h['read_tokens']} tokens{again}, {h['cached_tokens']} cached, "
        f"generated {result['generated_tokens']} | kept {h['kept']:g} of {h['seen']} seen | "
        f"first token {h['time_to_first_token']:.2f} s | {h['tokens_per_second']:.1f} tok/s"
    )
