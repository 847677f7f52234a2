"""The replies of the rows decoding: each token into its job's text, a finished reply into the idle store."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from h2o_chat.app.messages import PLAIN_STOP, use_chat_template
from h2o_chat.app.serve.api import GenRequest
from h2o_chat.app.serve.jobs import Job, Outbox
from h2o_chat.app.serve.rows import Lane
from h2o_chat.app.serve.sessions import SessionStore, end_turn, snapshot_bytes
from h2o_chat.engine.step.generate import TextStream, stop_token_ids


class Replies:
    """Where a reply ends (the model's stop tokens, a base model's "\\nUser:", the request's stops), each row's
    token turned into text for its job, and a finished reply's row kept in the store as an idle conversation
    (`served` counts them; `log` gets a line for each)."""

    def __init__(self, loaded, store: SessionStore, outbox: Outbox, log: Callable[[str], None] | None = None):
        self.loaded, self.store, self.outbox, self.log = loaded, store, outbox, log
        self.stop_ids = stop_token_ids(loaded.tokenizer, loaded.model)
        self.plain = use_chat_template(loaded.tokenizer)  # a base model's plain template: replies end at "\nUser:"
        self.served = 0

    def stream(self, req: GenRequest) -> TextStream:
        """A reply's tokens into text, ended by a stop or `max_tokens`."""
        stops = (*((PLAIN_STOP,) if self.plain and req.kind == "chat" else ()), *req.stop)
        return TextStream(self.loaded.tokenizer, req.max_tokens, self.stop_ids, stops)

    def take(self, lane: Lane, tokens: list[int]) -> None:
        """A step's tokens: each to the row's reply (rows still reading their prompt were fed nothing)."""
        for r, job in enumerate(lane.jobs):
            if job is not None and job.reading is None:
                self.consume(lane, r, tokens[r])

    def consume(self, lane: Lane, r: int, token: int) -> None:
        job = lane.jobs[r]
        text, reason = job.stream.add(token)
        if job.first_at is None:
            job.first_at = time.perf_counter()
        if text:
            job.text.append(text)
            self.outbox.send(job, ("text", text))
        if reason is not None:
            self._finish(lane, r, job, reason)

    def _finish(self, lane: Lane, r: int, job: Job, reason: str) -> None:
        turn, req = job.turn, job.req
        stats, state = lane.stop(r, keep=True)
        session = turn.session
        stream = job.stream
        seam = stream.seam(len(stream.tokens) - 1)  # a row's last token is never fed before its reply ends
        end_turn(session, req, turn, stream.tokens, "".join(job.text), False, self.stop_ids, seam)
        session.state, session.nbytes = state, snapshot_bytes(state)
        self.store.put(session)
        self.served += 1
        gc.collect()  # the views this reply used: memory stays flat however many replies pass
        result = self._result(job, reason, stats)
        if self.log:
            self.log(_log_line(result))
        self.outbox.send(job, ("done", result))

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


def _log_line(result: dict) -> str:
    h = result["h2o"]
    again = " (read again from the start)" if h["read_again"] else ""
    again += " (restored from disk)" if h["restored_from_disk"] else ""
    return (
        f"{h['conversation']}: read {h['read_tokens']} tokens{again}, {h['cached_tokens']} cached, "
        f"generated {result['generated_tokens']} | kept {h['kept']:g} of {h['seen']} seen | "
        f"first token {h['time_to_first_token']:.2f} s | {h['tokens_per_second']:.1f} tok/s"
    )
