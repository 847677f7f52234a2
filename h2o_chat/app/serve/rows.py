"""Rows of one engine for the server: a `Lane` is an engine whose batch rows are conversations decoding together.

Built only on the engine's public verbs, as batch mode is (app/batch/run.py): storage for every row is allocated
once by a one-token prefill; a conversation's new tokens are read into a one-row cache of its own (`Reading`:
from its snapshot, a chunk at a time, while the lane's other rows keep decoding), which then moves into a free
row in place (`H2OCache.row(r)` views the row, `restore` copies it in, `absorb` takes its bookkeeping back); a
step decodes every row at once, and a finished reply's row is copied out (`snapshot`) before the next step.
Rows grow and shrink in powers of two (`Engine.select_rows`; when: lanes.py), so a captured step is reused while
the load is steady.

A lane serves one cache key (policy, budget) and one sampler shape (top-p, whether candidates are cut): those
are fixed for a batch's step. Each row has its own temperature, penalty, top-k, min-p and seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.step.decode import Engine, left_pad
from h2o_chat.engine.step.sampling import Sampler, cuts
from h2o_chat.models.memory import prefill_chunk
from h2o_chat.models.prebuild import builder_for

NOTES_KEPT = 8  # a lane's last notices, in /v1/stats
CLEAR_FREE_EVERY = 256  # steps: free rows are fed filler tokens; emptying them keeps their positions small
NUCLEUS = 0.9  # the top-p a nucleus lane's sampler is built with: a row sets its own when it starts (`set_row`)


@dataclass(frozen=True)
class EngineSettings:
    """How every lane's cache and steps are set up (the command's cache and model options)."""

    positions: str = "auto"
    kv_quant: str = "none"
    decode: str = "auto"
    chunk_size: int | None = None  # None: the device's (`prefill.default_chunk`)


@dataclass(frozen=True)
class LaneKey:
    """What a request asks of a lane: its cache's policy and budget, and of its step's sampler whether top-p cuts
    and whether any rule cuts the candidates; requests that differ only in the values (top-p 0.9 or 0.95, a
    seed, a temperature) share the lane, each row drawing as it would alone."""

    policy: str
    budget: int
    nucleus: bool  # top-p < 1 cuts the candidates
    filtered: bool  # top-k or min-p cut the candidates (top-p < 1 does too)

    @classmethod
    def of(cls, req) -> LaneKey:
        return cls(req.policy.name, req.policy.budget, *cuts(req.top_p, req.top_k, req.min_p))


class ReadingStopped(Exception):
    """A prompt's reading was stopped between two chunks (the server drains); its row is free again."""


class Reading:
    """A conversation's new tokens read into a one-row cache of its own (from the conversation's snapshot), a
    chunk at a time (`advance`, `Engine.prefill_steps`), so that the lane's other rows decode between its chunks;
    `Lane.enter` then moves it into its row. The fit check comes first: a DeviceError means nothing was read.
    `stop()` is asked after each chunk: True raises ReadingStopped."""

    def __init__(
        self, lane: Lane, state: dict | None, ids: list[int], stop: Callable[[], bool], history: list[int] = ()
    ):
        loaded, settings = lane.loaded, lane.settings
        model = loaded.model
        self.lane, self.stop = lane, stop
        self.history = list(history)  # what the cache read before: the repetition penalty's window sees it
        self.cache = lane.spare  # the last reading's cache, emptied (its storage is not allocated again)
        lane.spare = None
        if self.cache is None:
            self.cache = H2OCache.for_model(
                model, lane.policy, settings.positions, loaded.context, kv_quant=settings.kv_quant
            )
        if state is not None:
            self.cache.restore(state, lane.device)
        chunk, _ = prefill_chunk(model, self.cache, 1, len(ids), settings.chunk_size)
        self.prompt = torch.tensor([ids], dtype=torch.long)
        self.total, self.read, self.seconds = len(ids), 0, 0.0
        self.logits: torch.Tensor | None = None
        self._steps = Engine(model, self.cache, "eager").prefill_steps(self.prompt, chunk)
        # a new conversation's prompt within one chunk may be read in one batch with others (`read_together`)
        self.together = state is None and len(ids) <= chunk

    @property
    def untouched(self) -> bool:
        """Nothing of it read yet (`read_together` may take it)."""
        return self.read == 0 and self.logits is None

    def read_as(self, view: H2OCache, logits: torch.Tensor, seconds: float) -> None:
        """It was read with others (`read_together`): `view` is its row of their cache, `logits` (V,) its last
        position's. Its own cache, unused, goes back to the lane."""
        self._steps.close()
        self.release()
        self.cache, self.logits, self.read, self.seconds = view, logits, self.total, seconds

    def advance(self) -> bool:
        """Read the next chunk: whether the prompt is read (then `logits` are its last position's)."""
        t = time.perf_counter()
        try:
            self.read, total = next(self._steps)
        except StopIteration as end:
            self.logits = end.value[0]  # (V,)
            return True
        finally:
            self.seconds += time.perf_counter() - t
        if self.stop():
            raise ReadingStopped(f"stopped after {self.read} of {total} tokens")
        return False

    def cancel(self) -> None:
        """Stop where it is (between two chunks); its cache goes back to the lane."""
        self._steps.close()
        self.release()

    def abandon(self) -> None:
        """It failed: its generator ends, and its cache is not reused."""
        self._steps.close()
        self.cache = None

    def release(self) -> None:
        """Its cache, emptied, for the lane's next reading (not a row of a cache read with others)."""
        if self.cache is not None and self.cache.slots is not None and not self.cache.storage.is_view:
            self.cache.clear()
            self.lane.spare = self.cache
        self.cache = None

    def state(self) -> dict:
        """What `restore` takes, without a copy to the host (the row's storage takes it in place)."""
        return self.cache.state()


def read_together(lane: Lane, readings: list[Reading]) -> bool:
    """New conversations' prompts, each within one chunk, read in one left-padded batch of their own; each
    reading then holds its row of that cache (`Reading.read_as`) and moves into the lane as one read alone does.

    The batch shares the model's products, and on a CPU a row of it reads exactly as alone (`forward.own_rows`;
    every tensor it keeps, tested; docs/serve.md has the figures). Its padding is no columns of its own: the row
    counts the columns it would have alone. Returns False, having read nothing, when their chunk would not fit
    in memory."""
    loaded, settings = lane.loaded, lane.settings
    model = loaded.model
    prompts = [r.prompt[0].tolist() for r in readings]
    ids, mask = left_pad(prompts, loaded.tokenizer.pad_token_id or 0)
    cache = H2OCache.for_model(model, lane.policy, settings.positions, loaded.context, kv_quant=settings.kv_quant)
    chunk, _ = prefill_chunk(model, cache, len(prompts), ids.shape[1], settings.chunk_size)
    if chunk < ids.shape[1]:
        return False
    t = time.perf_counter()
    logits = Engine(model, cache, "eager").prefill(ids, mask, chunk)  # no sampler: nothing observes the prompt
    seconds = time.perf_counter() - t
    for b, (reading, prompt) in enumerate(zip(readings, prompts, strict=True)):
        cache.seq.rows[b].columns -= ids.shape[1] - len(prompt)
        reading.read_as(cache.row(b), logits[b], seconds)
    return True


class Lane:
    """One engine and its rows; `jobs[r]` is the request generating in row r (None: the row is free)."""

    def __init__(self, loaded, key: LaneKey, policy, settings, rows: int = 1):
        self.loaded, self.key, self.policy, self.settings = loaded, key, policy, settings
        model = loaded.model
        self.device = next(model.parameters()).device
        self.cache = H2OCache.for_model(model, policy, settings.positions, loaded.context, kv_quant=settings.kv_quant)
        self.engine = Engine(model, self.cache, settings.decode)
        self.engine.builder = builder_for(self.loaded)
        pad = loaded.tokenizer.pad_token_id or 0
        self.engine.prefill(torch.full((rows, 1), pad, dtype=torch.long))  # storage for every row, once
        sampler, per_row = self._sampler(rows)
        self.engine.set_sampler(sampler, rows, **per_row)
        self.jobs: list = [None] * rows
        self.closing = False  # takes no new rows: a waiting job needs this lane's place
        self.tokens = torch.zeros(rows, dtype=torch.long, device=self.device)  # each row's next input token
        self.steps = 0
        self.oversized_since: int | None = None  # the step from which its busy rows fit in a quarter of it
        self.spare = None  # a reading's one-row cache, emptied for the next (`Reading.release`)
        self.notes: list[str] = []  # what its engine had to say (a step that could not be captured), newest last

    def _sampler(self, rows: int) -> tuple:
        """A sampler whose step can serve any row's settings (sampling, a penalty, the key's cut): each row's
        own values are set when it starts, and greedy rows stay exact (argmax; a penalty of 1 changes nothing)."""
        cut = self.key.filtered and not self.key.nucleus
        per_row = {
            "temperature": [1.0] * rows,
            "repetition_penalty": [1.1] * rows,
            "top_k": [0] * rows,
            "min_p": [0.5 if cut else 0.0] * rows,
        }
        return Sampler(top_p=NUCLEUS if self.key.nucleus else 1.0), per_row  # each row's top-p: `set_row`

    @property
    def size(self) -> int:
        """Rows of its batch, taken or free."""
        return len(self.jobs)

    @property
    def active(self) -> int:
        """Rows taken: decoding, or waiting for their prompt's reading."""
        return sum(j is not None for j in self.jobs)

    @property
    def decoding(self) -> int:
        return sum(j is not None and j.reading is None for j in self.jobs)

    def row_of(self, job) -> int:
        """The row `job` holds now (a resize moves the busy rows to the front)."""
        return next(r for r, j in enumerate(self.jobs) if j is job)

    def free_row(self) -> int | None:
        return next((r for r, j in enumerate(self.jobs) if j is None), None)

    def resize(self, rows: int) -> None:
        """Grow to `rows` (new rows copy row 0 and are free) or shrink to the busy rows plus free ones; the busy
        rows move to the front."""
        busy = [r for r, j in enumerate(self.jobs) if j is not None]
        if rows < len(busy):
            raise ValueError("cannot shrink below the busy rows")
        idle = [r for r, j in enumerate(self.jobs) if j is None]
        index = (busy + idle + [0] * rows)[:rows]
        self.engine.select_rows(torch.tensor(index))
        self.jobs = [self.jobs[r] if k < len(busy) else None for k, r in enumerate(index)]
        self.tokens = self.tokens[torch.tensor(index, device=self.device)].clone()
        for r in range(len(busy), rows):
            self.cache.clear_row(r)
        self.oversized_since = None

    # -- a conversation into a row and out of it ------------------------------------------------------------
    def read(
        self, state: dict | None, ids: list[int], stop: Callable[[], bool] = lambda: False, history: list[int] = ()
    ) -> Reading:
        """Start reading a conversation's new tokens (`Reading.advance` reads them), beside the rows; `history`:
        the last tokens its cache read before them."""
        return Reading(self, state, ids, stop, history)

    def enter(self, r: int, reading: Reading, req) -> int:
        """Move a finished reading into row r (free), in place: the other rows are untouched. Returns the reply's
        first token, drawn with the request's sampling settings."""
        view = self.cache.row(r)
        view.restore(reading.state())  # slots, store and bookkeeping, whole: nothing of the row before stays
        self.cache.absorb(view, r)
        prompt, logits, history = reading.prompt, reading.logits, reading.history
        reading.release()
        sampler = self.engine.sampler
        sampler.set_row(r, req.temperature, req.repetition_penalty, req.top_k, req.min_p, req.top_p)
        sampler.start_row(r, prompt, req.seed, history)  # as the conversation would alone, read whole or not
        first = sampler.first_of_row(r, logits.to(self.device))
        self.tokens[r] = first
        return int(first)

    def stop(self, r: int, keep: bool) -> tuple[dict, dict | None]:
        """Row r's reply is over: (its cache stats, its snapshot when `keep`); the row is emptied and free."""
        stats = self.cache.row_stats(r)
        state = self.cache.row(r).snapshot() if keep else None
        self.cache.clear_row(r)
        self.jobs[r] = None
        return stats, state

    def take_notices(self) -> list[str]:
        """Its engine's new notices (`/v1/stats` keeps the last few)."""
        new = self.cache.pop_notices()
        self.notes = (self.notes + new)[-NOTES_KEPT:]
        return new

    def step(self) -> list[int]:
        """One decode step of every row (free rows are fed filler tokens): each row's next token."""
        self.steps += 1
        if self.steps % CLEAR_FREE_EVERY == 0:
            for r, job in enumerate(self.jobs):
                if job is None:
                    self.cache.clear_row(r)
        self.tokens = self.engine.decode(self.tokens)[1].clone()  # a captured step's output is overwritten
        return self.tokens.tolist()

    def describe(self) -> dict:
        return {
            "policy": self.key.policy,
            "budget": self.key.budget,
            "nucleus": self.key.nucleus,
            "filtered": self.key.filtered,
            "rows": self.size,
            "decode": self.engine.describe(),
            "closing": self.closing,
            "notices": list(self.notes),
            "active": [  # no conversation ids: a client must not learn of others' conversations
                {
                    "row": r,
                    "generated": len(j.stream.tokens),
                    **(
                        {"reading": f"{j.reading.read} of {j.reading.total}"}
                        if j.reading is not None
                        else self.cache.row_stats(r)
                    ),
                }
                for r, j in enumerate(self.jobs)
                if j is not None
            ],
        }
