"""The decode engine: the one loop every generation, evaluation and benchmark in h2o-chat drives.

In the style of gpt-fast: `prefill` (chunked; snap's two passes), then `decode` steps of one token per row.
The engine says what each forward is (`cache.begin("chunk" | "step")` ... `cache.end()`), never the shape. A
decode step is static -- the cache's shapes never change, its bookkeeping stays on the device, sampling happens
on the device -- so it can run three ways (`--decode`):

- graph: the whole step (model forward, cache update, eviction, sampling) captured once as a CUDA graph and
  replayed; capturing takes a second or two (the CUDA default).
- compile: the model's forward and sampling as one program compiled by inductor, eviction eagerly after it
  (`compiled.py` says why); compiled once per machine and model, kept in a cache directory.
- eager: plain PyTorch (the CPU default, and the fallback of the other two).

Host bookkeeping (`cache.before_forward`) runs before each step, outside the captured or compiled region;
renumbering positions rewrites storage in place, so a captured step stays valid. When something changes shape
-- the cache re-allocates, rows leave the batch, the sampler's settings change -- the step is captured (or
compiled) again. `tokens()` streams sampled tokens one step behind the device on CUDA: step t+1 is queued before
token t is read back, so the GPU never waits for the host.

Ctrl-C while a prompt is read takes effect at the end of the chunk being read (`PrefillInterrupted`), so the
cache always holds whole chunks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterator

import torch

from h2o_chat.engine.policies.snap import compress_prompt
from h2o_chat.engine.step import compiled
from h2o_chat.engine.step.attention import cache_keyword
from h2o_chat.engine.step.sampling import RowSampler, Sampler
from h2o_chat.engine.storage.slots import mark_static
from h2o_chat.errors import ConfigError, SettingError

DECODE_MODES = ("auto", "eager", "graph", "compile")
DEFAULT_CHUNK = 512
_WARMUP = 2  # eager steps before a capture (lazy CUDA initialisation must not happen inside one)

# progress(done, total) after each prefill chunk: prompt columns read, of all the passes over the prompt
Progress = Callable[[int, int], None] | None


def resolve_decode(mode: str, device: torch.device) -> str:
    """auto -> graph on CUDA; on CPU compile (the step compiled ahead of time: `compiled.py`), unless no
    compiler is at hand or `H2O_CHAT_DECODE` says eager; an explicit mode must be possible on this device."""
    if mode not in DECODE_MODES:
        raise SettingError("decode", f"must be one of {', '.join(DECODE_MODES)}", mode)
    if mode == "auto":
        if device.type == "cuda":
            return "graph"
        mode = os.environ.get("H2O_CHAT_DECODE") or "compile"
        if mode not in ("eager", "compile"):
            raise ConfigError(f"H2O_CHAT_DECODE must be eager or compile, got {mode!r}")
        return "eager" if mode == "compile" and compiled.unavailable() else mode
    if mode == "graph" and device.type != "cuda":
        raise SettingError(
            "decode", "captures CUDA graphs and needs a CUDA GPU; use compile or eager here", mode, got=False
        )
    if mode == "compile" and device.type != "cpu":
        raise SettingError(
            "decode", "builds the CPU's decode step; on a GPU the step is a CUDA graph (graph)", mode, got=False
        )
    if mode == "compile" and (why := compiled.unavailable()):
        raise SettingError("decode", f"is not possible here: {why}; use eager", mode, got=False)
    return mode


class PrefillInterrupted(KeyboardInterrupt):
    """Ctrl-C while a prompt was read: the cache holds the chunks read so far (`done` of `total` columns, over
    every pass), whole."""

    def __init__(self, done: int, total: int):
        super().__init__(f"stopped reading the prompt after {done} of {total} tokens")
        self.done, self.total = done, total


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Within the block Ctrl-C only sets a flag (the returned call reads it), so a prefill can stop between
    chunks instead of inside one. Only in the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    hit = [False]

    def note(signum, frame) -> None:
        hit[0] = True
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)  # whoever handled Ctrl-C before (the chat's stop flag) hears it too

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield lambda: hit[0]
    finally:
        signal.signal(signal.SIGINT, previous)


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU): around timed work, and where a step must be finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask) of shape (B, longest), padded on the left (prompts end together)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


class Engine:
    """Prefill and decode steps over one `H2OCache` for one model.

    The engine owns the cache's host bookkeeping from now on. Keep one engine per conversation: its captured
    step survives between turns as long as the cache keeps its storage.
    """

    def __init__(self, model, cache, decode: str = "auto"):
        self.model, self.cache = model, cache
        self._cache_kw = cache_keyword(model)
        self.device = next(model.parameters()).device
        self.mode = resolve_decode(decode, self.device)
        # `auto` never waits for a compilation: until the package of a step's kind is ready the step runs eagerly
        # and `builder` (the app's: a build in another process) prepares it; an explicit `compile` builds it now
        self.waits = decode == "compile"
        self.builder: Callable[[compiled.StepKind], None] | None = None
        self.vocab = model.config.get_text_config().vocab_size
        cache.host_managed = True
        self.sampler: RowSampler | None = None  # None: greedy (argmax), e.g. for evaluation
        self.setup_seconds = 0.0  # one-time cost so far: captures
        self.captures = 0
        self.fed_last = False  # whether the last token tokens() yielded has been fed to the cache
        self._tokens: torch.Tensor | None = None  # the step's static input, (B,)
        self._key = None
        self._warmups = 0  # eager steps run since the step last changed (a capture needs two)
        self._graph = None
        self._program = None  # the compiled step (`--decode compile`), for the step's current key
        self._out = None
        self._pool = None
        self._host = None  # pinned buffers for reading tokens back without waiting for the next step
        # queue step t+1 before reading token t back (on CUDA the host then never waits for the device)
        self.lookahead = self.device.type == "cuda"
        self.on_setup: Callable[[str], None] | None = None  # told before a capture starts
        self._asked: set = set()  # step kinds the builder was asked for

    # -- description ------------------------------------------------------------------------------
    def describe(self) -> str:
        """For the panel: how decode steps run."""
        what = {"graph": ("CUDA graph", "captured"), "compile": ("compiled", "compiled")}.get(self.mode)
        if what is None:
            return "eager"
        if self.mode == "compile" and self._program is None and self._asked:
            return "eager (the compiled step is being built)"
        if self.captures:
            return f"{what[0]} ({self.captures} {what[1]}, {self.setup_seconds:.1f} s)"
        return what[0]

    # -- sampling ---------------------------------------------------------------------------------
    def set_sampler(self, sampler: Sampler | None, batch: int, **per_row) -> None:
        """Sample with these settings (None: greedy). A sampler for the same rows and settings is reused, so a
        captured step survives between chat turns."""
        if sampler is None:
            self.sampler = None
            return
        new = sampler.for_batch(batch, self.device, self.vocab, **per_row)
        old = self.sampler
        if old is not None and old.shape_key == new.shape_key:
            old.load(new)
            return
        self.sampler = new

    # -- prefill ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        progress: Progress = None,
    ) -> torch.Tensor:
        """Feed a (left-padded) prompt (B, L) in chunks, evicting between chunks (KV memory: budget + chunk);
        returns the last position's logits (B, V). The cache numbers the tokens, continuing from what it has
        seen (chat turns append). A policy that compresses prompts (snap) reads the prompt twice. Ctrl-C stops
        at the end of the chunk being read and raises `PrefillInterrupted`."""
        ids = ids.to(self.device)
        mask = torch.ones_like(ids) if mask is None else mask.to(self.device)
        if self.sampler is not None:
            self.sampler.observe(ids, mask)
        return self._read(self.cache, ids, mask, chunk_size, progress)

    @torch.inference_mode()
    def refill(
        self, row: int, ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK, progress: Progress = None, **sampling
    ) -> torch.Tensor:
        """Start a new prompt (1, L) in batch row `row` while the other rows keep theirs (continuous batching):
        the row is emptied and the prompt read into it alone, in place, so a captured step stays valid. Returns
        the row's first token (a 0-d tensor), drawn with `sampling` (temperature, penalty, top_k, min_p: the
        row's own settings); feed it in the row's place at the next step. A full cache must have room for the
        prompt (`cache.reserve`)."""
        ids = ids.to(self.device).reshape(1, -1)
        self.cache.clear_row(row)
        view = self.cache.row(row)
        logits = self._read(view, ids, torch.ones_like(ids), chunk_size, progress)[0]
        self.cache.absorb(view, row)
        if self.sampler is None:
            return logits.argmax()
        if sampling:
            self.sampler.set_row(row, **sampling)
        self.sampler.start_row(row, ids)
        return self.sampler.first_of_row(row, logits)

    @torch.inference_mode()
    def prefill_steps(
        self, ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK, progress: Progress = None
    ) -> Generator[tuple[int, int], None, torch.Tensor]:
        """`prefill` one prompt (1, L) a chunk at a time: a generator that yields (columns read, of all the
        passes) after each chunk and returns the last position's logits (1, V), so that its caller can do other
        work between chunks (the server decodes its other rows). No sampler observes the prompt."""
        ids = ids.to(self.device)
        return (yield from self._read_steps(self.cache, ids, torch.ones_like(ids), chunk_size, progress, None))

    def _read(self, cache, ids, mask, chunk_size, progress) -> torch.Tensor:
        with deferred_interrupt() as interrupted:
            steps = self._read_steps(cache, ids, mask, chunk_size, progress, interrupted)
            while True:
                try:
                    next(steps)
                except StopIteration as end:
                    return end.value

    def _read_steps(self, cache, ids, mask, chunk_size, progress, interrupted) -> Generator:
        done = [0]  # prompt columns read so far, over every pass

        def feed(target, total: int | None = None) -> Generator:
            """Read the prompt into `target`; `total`: columns read over every pass."""
            total = ids.shape[1] if total is None else total
            return self._chunks(target, ids, mask, chunk_size, progress, done, total, interrupted)

        return (yield from compress_prompt(cache, mask, feed))

    def _chunks(self, cache, ids, mask, chunk_size, progress, done, total, interrupted) -> Generator:
        B, L = ids.shape
        logits = None
        cache.host_managed = True
        # chunks end where the prompt ends: left-padded rows then meet the same chunk boundaries (counted from
        # their last token) as they would alone, so a row's eviction does not depend on its neighbours
        first = L % chunk_size or chunk_size
        spans = list(zip([0, *range(first, L, chunk_size)], range(first, L + 1, chunk_size), strict=True))
        # each row's own tokens per chunk, read once per pass (compress_prompt has just read the device): a row's
        # positions, and when they are renumbered, follow its tokens, not the batch's columns
        real = torch.stack([mask[:, s:e].sum(-1) for s, e in spans]).tolist() if spans else []
        for (s, e), counts in zip(spans, real, strict=True):
            cache.before_forward(e - s, counts)
            positions = cache.begin("chunk", mask[:, s:e], e - s)
            try:
                logits = self._forward(ids[:, s:e], positions, cache)
            except BaseException:
                cache.abort()
                raise
            cache.end()
            done[0] += e - s
            if progress is not None:
                progress(done[0], total)
            if interrupted is not None and interrupted():
                raise PrefillInterrupted(done[0], total)
            yield done[0], total
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        kw = {self._cache_kw: cache}
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **kw)
        return out.logits[:, -1]  # (B, V)

    # -- decode -----------------------------------------------------------------------------------
    def _body(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step, all on the device: the static input tokens in, logits and next tokens out."""
        cache = self.cache
        positions = cache.begin("step")
        if self._program is not None:
            logits, tokens, *cache.forward.returned = self._program(self._tokens, positions, cache, self.sampler)
        else:
            logits, tokens = self._produce(self._tokens, positions)
        cache.end()  # new tokens into their slots, eviction for every layer, rows advance
        self._tokens.copy_(tokens)
        return logits, tokens

    def _produce(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward over the read-only storage, and sampling: what `compile` makes one program of."""
        logits = self._forward(tokens[:, None], positions, self.cache)
        tokens = self.sampler(logits) if self.sampler is not None else logits.argmax(dim=-1)
        return logits, tokens

    def _compile_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A compiled step: the package for this step's kind, loaded (or built) when the step changed; while it
        is not ready and the engine does not wait, an eager step (the builder asked once per kind)."""
        if self._program is None and not self.waits and not compiled.ready(self.model, self.cache, self.sampler):
            kind = compiled.StepKind.of(self.cache, self.sampler)
            if kind not in self._asked:
                self._asked.add(kind)
                if self.builder is not None:
                    self.builder(kind)
            return self._body()
        if self._program is None:
            t = time.perf_counter()
            try:
                self._program = compiled.program(self.model, self.cache, self.sampler, self._cache_kw, self.on_setup)
            except Exception as e:  # noqa: BLE001 -- export's and inductor's failures have many types
                return self._fall_back(e, "compiling one")
            self.captures += 1
            self.setup_seconds += time.perf_counter() - t
        return self._body()

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one token per row -- `tokens` (B,), or the tokens the last step produced -- and return the next
        step's (logits (B, V), tokens (B,)) on the device. Outputs of a captured step are overwritten by the
        next step: use them before calling again."""
        cache = self.cache
        cache.before_forward(1)  # host only: context checks, renumbering, room in a full cache
        if tokens is not None:
            tokens = tokens.to(self.device)
            if self._tokens is None or self._tokens.shape != tokens.shape:
                self._tokens = tokens.clone()
                mark_static(self._tokens)
            else:
                self._tokens.copy_(tokens)
        sampler = self.sampler
        key = (cache.version, self._tokens.shape[0], sampler and sampler.serial, sampler and sampler.shape_key)
        if key != self._key:
            self._key, self._warmups, self._graph, self._out, self._program = key, 0, None, None, None
        if self.mode == "eager":
            return self._body()
        if self.mode == "compile":
            return self._compile_step()
        with torch.cuda.device(self.device):  # captured on the model's GPU's stream, not the current GPU's
            return self._graph_step()

    def _graph_step(self):
        if self._graph is not None:
            self._graph.replay()
            return self._out
        if self._warmups < _WARMUP:  # real steps, eagerly, on a side stream as CUDA graphs require
            self._warmups += 1
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                out = self._body()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            return out
        if self.on_setup is not None and not self.captures:
            self.on_setup("capturing the decode step as a CUDA graph (once)")
        t = time.perf_counter()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._out = self._body()  # recorded, not run: the replay below performs this step
        except RuntimeError as e:  # something in the model reads the device (e.g. dynamic rope scaling)
            return self._fall_back(e, "capturing one")
        self._graph = graph
        self.captures += 1
        self.setup_seconds += time.perf_counter() - t
        graph.replay()
        return self._out

    def _fall_back(self, error: Exception, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A step that cannot be captured or compiled runs eagerly from now on, and the user is told why."""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.cache.abort()  # nothing recorded ran: forget the half-done bookkeeping of that attempt
        self.cache.notices.append(f"decode steps run eagerly: {what} failed ({reason[:160]})")
        self.mode, self._graph, self._program = "eager", None, None
        sync(self.device)
        return self._body()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only batch rows `index` (finished rows leave); the next step is captured anew."""
        index = index.to(self.device)
        self.cache.select_rows(index)
        if self.sampler is not None:
            self.sampler.select_rows(index)
        if self._tokens is not None:
            self._tokens = self._tokens[index].clone()
            mark_static(self._tokens)

    # -- streams ----------------------------------------------------------------------------------
    def first_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens (B,) sampled from the prefill's logits, with the same sampler as the steps."""
        with torch.inference_mode():
            return self.sampler(logits) if self.sampler is not None else logits.argmax(dim=-1)

    def tokens(self, logits: torch.Tensor, steps: int) -> Iterator[list[int]]:
        """Sample from the prefill's logits, then decode: yields `steps` lists of B host ints (token t of every
        row). On CUDA the step that feeds token t is queued before token t is read back (`fed_last` says whether
        the last yielded token has been fed to the cache). Stop by closing the iterator or leaving the loop."""
        pending = self.first_tokens(logits)
        lookahead = self.lookahead
        for i in range(steps):
            last = i + 1 == steps
            ahead = None
            if lookahead and not last:
                read = self._read_async(pending)
                ahead = self.decode(pending if i == 0 else None)[1]  # queued: feeds token i
                self.fed_last = True
                row_tokens = read()
            else:
                row_tokens = pending.tolist()
                self.fed_last = False
            yield row_tokens
            if last:
                return
            if ahead is None:
                ahead = self.decode(pending if i == 0 else None)[1]
            pending = ahead

    def _read_async(self, t: torch.Tensor) -> Callable[[], list[int]]:
        """Copy t to pinned host memory behind the work queued so far; the returned call waits for that copy
        only, not for work queued after it."""
        if self.device.type != "cuda":  # a forced lookahead on CPU: the values are there once it is read
            t = t.clone()
            return t.tolist
        if self._host is None or self._host[0].shape != t.shape:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for _ in range(2)]
        buf = self._host[0]
        self._host.reverse()  # alternate buffers: the previous one may still be read
        buf.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()

        def read() -> list[int]:
            event.synchronize()
            return buf.tolist()

        return read
