"""The server's engine thread: requests in, text events out, every conversation a row of one engine.

One thread owns the model, the lanes (app/rows.py) and the idle conversations (app/sessions.py); the HTTP side
only submits jobs and reads their events, so nothing here needs a lock but the queue. Each turn of the loop:

1. take the jobs submitted since the last turn (a cancelled one is dropped; a client gone mid-reply frees its row
   here, at the next step);
2. start waiting jobs while rows are free (a lane grows in powers of two up to the server's rows): find the
   conversation they continue, bring it into a row and read only its new tokens; a prompt that cannot fit is a
   503 for that job alone;
3. decode one step of every lane with busy rows, and hand each row's text to its job; a finished reply's row is
   copied out as an idle conversation before the next step.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from h2o_chat.app.messages import PLAIN_STOP, use_chat_template
from h2o_chat.app.rows import Lane, LaneKey, TextStream
from h2o_chat.app.serve_api import ApiError, GenRequest
from h2o_chat.app.sessions import SessionStore, Turn, end_turn, plan_turn, snapshot_bytes
from h2o_chat.engine.generate import stop_token_ids
from h2o_chat.errors import H2OChatError, out_of_memory

MAX_LANES = 4  # engines with distinct cache keys or sampler shapes at once; more wait for one to empty
MAX_WAITING = 256  # jobs queued beyond the rows; more are told the server is busy


@dataclass
class Job:
    req: GenRequest
    # ("started", None) | ("text", str) | ("done", result) | ("error", ApiError), from the engine thread
    emit: Callable[[tuple], None]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the HTTP side when the client goes away
    turn: Turn | None = None
    stream: TextStream | None = None
    first_at: float | None = None
    read_seconds: float = 0.0
    text: list[str] = field(default_factory=list)  # the reply so far, as sent


class Scheduler:
    """Owns the engine thread. `submit` a job; `call` runs a function in the thread between steps."""

    def __init__(self, loaded, settings, rows: int, store: SessionStore, log: Callable[[str], None] | None = None):
        self.loaded, self.settings, self.max_rows, self.store, self.log = loaded, settings, rows, store, log
        self.stop_ids = stop_token_ids(loaded.tokenizer, loaded.model)
        self.plain = use_chat_template(loaded.tokenizer)  # a base model's plain template: replies end at "\nUser:"
        self.lanes: list[Lane] = []
        self.waiting: list[Job] = []
        self.inbox: queue.Queue = queue.Queue()
        self.draining = False
        self.served = 0
        self.failed: str | None = None  # the engine thread's fatal error, if it died
        self._stop = threading.Event()
        self._threads = torch.get_num_threads()  # --threads, set in the main thread: the engine thread's too
        self._thread = threading.Thread(target=self._run, name="h2o-chat-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down: it finishes the replies under way and takes no new ones")
        if self.failed:
            raise ApiError(500, f"the engine stopped: {self.failed}", "server_error")
        if self.inbox.qsize() + len(self.waiting) >= MAX_WAITING:
            raise ApiError(503, f"the server is busy: {MAX_WAITING} requests are waiting for a row; retry later")
        self.inbox.put(job)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` in the engine thread between steps (stats read the rows while nothing moves them)."""
        future: Future = Future()
        self.inbox.put((fn, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Finish the replies under way and the waiting ones, then end the thread."""
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
                        return
                    self._take(block=idle and not self.waiting)
                    self._admit()
                    for lane in list(self.lanes):
                        if lane.active:
                            self._step(lane)
                    self._tidy()
            except Exception as e:  # a bug: every job is told, one line each, and new ones are refused
                self.failed = f"{type(e).__name__}: {e}"
                for job in self._all_jobs():
                    job.emit(("error", ApiError(500, f"the engine stopped: {self.failed}", "server_error")))
                raise

    def _all_jobs(self) -> list[Job]:
        return [*self.waiting, *(j for lane in self.lanes for j in lane.jobs if j is not None)]

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
        for job in list(self.waiting):
            if job.cancelled:
                self.waiting.remove(job)
                continue
            try:
                place = self._place(LaneKey.of(job.req), job.req.policy)
                if place is None:
                    continue  # no row yet: it waits for one (jobs behind it with another key may go first)
                self.waiting.remove(job)
                self._start(job, *place)
            except ApiError as e:
                if job in self.waiting:
                    self.waiting.remove(job)
                job.emit(("error", e))

    def _place(self, key: LaneKey, policy) -> tuple[Lane, int] | None:
        """A free row for `key`: in its lane, grown when full, or in a new lane."""
        if self.busy >= self.max_rows:
            return None
        lane = next((lane for lane in self.lanes if lane.key == key), None)
        if lane is None:
            if len(self.lanes) >= MAX_LANES:
                empty = next((la for la in self.lanes if not la.active), None)
                if empty is None:
                    return None
                self.lanes.remove(empty)
            self._fits(policy, 1)
            lane = Lane(self.loaded, key, policy, self.settings)
            self.lanes.append(lane)
        r = lane.free_row()
        if r is None:
            rows = min(2 * lane.rows, self.max_rows)
            if rows == lane.rows:
                return None
            self._fits(policy, rows - lane.rows)
            lane.resize(rows)
            r = lane.free_row()
        return lane, r

    def _fits(self, policy, rows: int) -> None:
        """The fit check of every command for `rows` more rows of `policy`'s budget: a 503 when they cannot."""
        try:
            self.loaded.check_budget(policy.budget, rows=rows, flag='"budget"', kv_quant=self.settings.kv_quant)
        except H2OChatError as e:
            raise ApiError(503, f"no memory for this conversation's cache: {e}") from None

    def _start(self, job: Job, lane: Lane, r: int) -> None:
        req = job.req
        job.turn = turn = plan_turn(self.store, req, self.loaded.tokenizer)
        stops = (*((PLAIN_STOP,) if self.plain and req.kind == "chat" else ()), *req.stop)
        job.stream = TextStream(self.loaded.tokenizer, req.max_tokens, self.stop_ids, stops)
        lane.jobs[r] = job
        try:
            first, job.read_seconds = lane.start(r, turn.session.state, turn.ids, req)
        except Exception as e:
            lane.jobs[r] = None
            if turn.session.state is not None:  # a conversation that was idle stays as it was
                self.store.put(turn.session)
            if isinstance(e, H2OChatError):
                raise ApiError(503, f"this prompt cannot be read here: {e}") from None
            if out_of_memory(e):
                raise ApiError(503, f"out of memory while reading this prompt ({str(e).splitlines()[0]})") from None
            raise
        turn.session.state, turn.session.nbytes = None, 0  # the conversation is in the row now
        job.emit(("started", None))
        self._consume(lane, r, first)

    def _step(self, lane: Lane) -> None:
        for r, job in enumerate(lane.jobs):  # a client gone: its row is free before this step
            if job is not None and job.cancelled:
                lane.stop(r, keep=False)
        if not lane.active:
            return
        try:
            tokens = lane.step()
        except Exception as e:
            if not out_of_memory(e):
                raise
            self._fail_lane(lane, ApiError(503, f"out of memory in a decode step ({str(e).splitlines()[0]})"))
            return
        for r, job in enumerate(lane.jobs):
            if job is not None:
                self._consume(lane, r, tokens[r])

    def _consume(self, lane: Lane, r: int, token: int) -> None:
        job = lane.jobs[r]
        text, reason = job.stream.add(token)
        if job.first_at is None:
            job.first_at = time.perf_counter()
        if text:
            job.text.append(text)
            job.emit(("text", text))
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
        job.emit(("done", result))

    def _result(self, job: Job, reason: str, stats: dict) -> dict:
        turn, now = job.turn, time.perf_counter()
        ttft = job.first_at - job.submitted
        decode = now - job.first_at
        n = len(job.stream.tokens)
        kept_in = turn.session.id in {s["id"] for s in self.store.describe()}
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
                "time_to_first_token": round(ttft, 4),
                "tokens_per_second": round((n - 1) / decode, 2) if n > 1 and decode > 0 else 0.0,
            },
        }

    def _fail_lane(self, lane: Lane, error: ApiError) -> None:
        for job in lane.jobs:
            if job is not None:
                job.emit(("error", error))
        self.lanes.remove(lane)

    def _tidy(self) -> None:
        """Lanes without busy rows go (their storage is freed; the default lane shrinks to one row); a lane
        whose busy rows fit in a quarter of it shrinks to half."""
        for lane in list(self.lanes):
            if not lane.active and (len(self.lanes) > 1 or self.waiting):
                self.lanes.remove(lane)
            elif lane.rows > 1 and lane.active <= lane.rows // 4:
                lane.resize(max(1, lane.rows // 2))

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
            },
            "memory": process_memory(self.loaded.device),
        }


def _log_line(result: dict) -> str:
    h = result["h2o"]
    again = " (read again from the start)" if h["read_again"] else ""
    return (
        f"{h['conversation']}: read {h['read_tokens']} tokens{again}, {h['cached_tokens']} cached, "
        f"generated {result['generated_tokens']} | kept {h['kept']:g} of {h['seen']} seen | "
        f"first token {h['time_to_first_token']:.2f} s | {h['tokens_per_second']:.1f} tok/s"
    )
