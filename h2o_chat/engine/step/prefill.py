"""Reading a prompt: in chunks that end where the prompt ends, evicting between them (KV memory: budget + chunk),
snap's two passes through `compress_prompt`, Ctrl-C taking effect between chunks (`PrefillInterrupted`), and a
generator form that lets its caller work between chunks (the server decodes its other rows). `Engine` takes
these verbs from `PromptReading`."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Generator, Iterator

import torch

from h2o_chat.engine.policies.snap import compress_prompt
from h2o_chat.engine.step.runners import beside_a_build
from h2o_chat.engine.step.sampling import RowSampler

DEFAULT_CHUNK = 512  # prompt tokens per chunk on a CPU (256 and 1,024 read slower: docs/design.md)
# on a GPU: a 7B model read a 4,096-token prompt 1.2-1.4x faster (full, snap) than in 512s, h2o within 15% either way
GPU_CHUNK = 1024


def default_chunk(device: torch.device) -> int:
    """Prompt tokens per chunk when none is asked for: a GPU's kernels and launches pay off over longer chunks
    (docs/results/gpu.md), at the cost of a larger transient (KV memory: budget + chunk)."""
    return GPU_CHUNK if device.type == "cuda" else DEFAULT_CHUNK


# progress(done, total) after each prefill chunk: prompt columns read, of all the passes over the prompt
Progress = Callable[[int, int], None] | None


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


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask) of shape (B, longest), padded on the left (prompts end together)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


class PromptReading:
    """The prompt-reading verbs of an `Engine` (which declares these attributes)."""

    model: torch.nn.Module
    cache: object
    device: torch.device
    sampler: RowSampler | None
    _cache_kw: str

    # -- prefill ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        chunk_size: int | None = None,
        progress: Progress = None,
        history: list[int] | None = None,
    ) -> torch.Tensor:
        """Feed a (left-padded) prompt (B, L) in chunks, evicting between chunks (KV memory: budget + chunk);
        returns the last position's logits (B, V). The cache numbers the tokens, continuing from what it has
        seen (chat turns append). A policy that compresses prompts (snap) reads the prompt twice. Ctrl-C stops
        at the end of the chunk being read and raises `PrefillInterrupted`. `history`: the tokens the cache
        read before, for the sampler's repetition window (`RowSampler.observe`)."""
        ids = ids.to(self.device)
        mask = torch.ones_like(ids) if mask is None else mask.to(self.device)
        if self.sampler is not None:
            self.sampler.observe(ids, mask, history)
        return self._read(self.cache, ids, mask, chunk_size, progress)

    @torch.inference_mode()
    def refill(
        self,
        row: int,
        ids: torch.Tensor,
        chunk_size: int | None = None,
        progress: Progress = None,
        seed: int | None = None,
        **sampling,
    ) -> torch.Tensor:
        """Start a new prompt (1, L) in batch row `row` while the other rows keep theirs (continuous batching):
        the row is emptied and the prompt read into it alone, in place, so a captured step stays valid. Returns
        the row's first token (a 0-d tensor), drawn with `sampling` (temperature, penalty, top_k, min_p, top_p:
        the row's own settings) and its own `seed` (None: the sampler's next); feed it in the row's place at the
        next step. A full cache must have room for the prompt (`cache.reserve`)."""
        ids = ids.to(self.device).reshape(1, -1)
        self.cache.clear_row(row)
        view = self.cache.row(row)
        logits = self._read(view, ids, torch.ones_like(ids), chunk_size, progress)[0]
        self.cache.absorb(view, row)
        if self.sampler is None:
            return logits.argmax()
        if sampling:
            self.sampler.set_row(row, **sampling)
        self.sampler.start_row(row, ids, seed)
        return self.sampler.first_of_row(row, logits)

    @torch.inference_mode()
    def prefill_steps(
        self, ids: torch.Tensor, chunk_size: int | None = None, progress: Progress = None
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
        chunk_size = chunk_size or default_chunk(self.device)  # None: this device's
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
        # a model may multiply a prompt chunk its own way (a 4-bit CPU model: through the AMX kernel); a decode step
        # (`_forward` too) never does
        products = getattr(self.model, "prompt_products", None) or contextlib.nullcontext
        for (s, e), counts in zip(spans, real, strict=True):
            cache.before_forward(e - s, counts)
            positions = cache.begin("chunk", mask[:, s:e], e - s)
            try:
                with beside_a_build(self.device), products():
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
