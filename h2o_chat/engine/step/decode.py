"""The decode engine: the one loop every generation, evaluation and benchmark in h2o-chat drives.

In the style of gpt-fast: `prefill` (chunked; snap's two passes), then `decode` steps of one token per row.
The engine says what each forward is (`cache.begin("chunk" | "step")` ... `cache.end()`), never the shape. A
decode step is static -- the cache's shapes never change, its bookkeeping stays on the device, sampling happens
on the device -- so it can run three ways (`--decode`):

- graph: the whole step (model forward, cache update, eviction, sampling) captured once as a CUDA graph and
  replayed; capturing takes a second or two (the CUDA default).
- compile: the model's forward and sampling as one program compiled by inductor, eviction eagerly after it
  (`compiled.py` says why). On a CPU compiled once per machine and model, kept in a cache directory; on a GPU
  compiled in process (Triton kernels) at the first step and captured, with the eviction, as one CUDA graph.

(`runners.py` holds the capture and the compiled program for the step's current shape.)
- eager: plain PyTorch (the CPU default, and the fallback of the other two).

Host bookkeeping (`cache.before_forward`) runs before each step, outside the captured or compiled region;
renumbering positions rewrites storage in place, so a captured step stays valid. When something changes shape
-- the cache re-allocates, rows leave the batch, the sampler's settings change -- the step is captured (or
compiled) again. `tokens()` streams sampled tokens one step behind the device on CUDA: step t+1 is queued before
token t is read back, so the GPU never waits for the host.

Ctrl-C while a prompt is read takes effect at the end of the chunk being read (`PrefillInterrupted`), so the
cache always holds whole chunks. Reading prompts is `prefill.py`'s; how a captured or compiled step is made,
`runners.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from h2o_chat.engine.step import compiled
from h2o_chat.engine.step.attention import cache_keyword
from h2o_chat.engine.step.prefill import (
    DEFAULT_CHUNK,
    PrefillInterrupted,
    Progress,
    PromptReading,
    deferred_interrupt,
    left_pad,
)
from h2o_chat.engine.step.runners import Captured, Compiled, SetupFailed, beside_a_build
from h2o_chat.engine.step.sampling import RowSampler, Sampler, draw
from h2o_chat.engine.storage.slots import mark_static
from h2o_chat.errors import ConfigError, SettingError

__all__ = ["DECODE_MODES", "DEFAULT_CHUNK", "Engine", "PrefillInterrupted", "Progress", "deferred_interrupt",
           "left_pad", "resolve_decode", "sync"]  # fmt: skip

DECODE_MODES = ("auto", "eager", "graph", "compile")


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
    if mode == "compile" and device.type not in ("cpu", "cuda"):
        raise SettingError("decode", f"compiles for a CPU or a CUDA GPU, not {device.type}", mode, got=False)
    if mode == "compile" and (why := compiled.unavailable()):
        raise SettingError("decode", f"is not possible here: {why}; use eager", mode, got=False)
    return mode


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU): around timed work, and where a step must be finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# the eager and the compiled step round differently (inductor fuses and reorders the arithmetic)
EAGER_WHILE_BUILDING = (
    "decode steps run eagerly until this kind of compiled step is built (in the background, once); later runs use "
    "it, and greedy or seeded text can then part from this run's at a near tie (--decode compile waits for the "
    "build, --decode eager never uses one)"
)


class Engine(PromptReading):
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
        self._compiled = Compiled(waits=decode == "compile")
        self._captured = Captured()
        self.builder: Callable[[compiled.StepKind], None] | None = None
        self.vocab = model.config.get_text_config().vocab_size
        cache.host_managed = True
        self.sampler: RowSampler | None = None  # None: greedy (argmax), e.g. for evaluation
        self.setup_seconds = 0.0  # one-time cost so far: captures
        self.captures = 0
        self.fed_last = False  # whether the last token tokens() yielded has been fed to the cache
        self._tokens: torch.Tensor | None = None  # the step's static input, (B,)
        self._key = None  # what the step's capture or program was made for
        self._host = None  # pinned buffers for reading tokens back without waiting for the next step
        # queue step t+1 before reading token t back (on CUDA the host then never waits for the device)
        self.lookahead = self.device.type == "cuda"
        self.on_setup: Callable[[str], None] | None = None  # told before a capture starts

    # -- description ------------------------------------------------------------------------------
    @property
    def stepping(self) -> str:
        """How its steps run now: its mode, or eager while its compiled step is not ready (being built elsewhere,
        or, with no `builder`, by nobody). What a measurement's figures are labelled with."""
        if self.mode == "compile" and self._compiled.program is None and self._compiled.asked:
            return "eager"
        return self.mode

    def describe(self) -> str:
        """For the panel: how decode steps run."""
        what = {"graph": ("CUDA graph", "captured"), "compile": ("compiled", "compiled")}.get(self.mode)
        if self.fused:
            what = ("compiled CUDA graph", "captured")
        if what is None:
            return "eager"
        if self.stepping == "eager":
            return f"eager (the compiled step is {'being built' if self.builder else 'not built'})"
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

    # -- decode -----------------------------------------------------------------------------------
    def _body(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step, all on the device: the static input tokens in, logits and next tokens out."""
        cache = self.cache
        positions = cache.begin("step")
        program = self._compiled.program
        if program is not None:
            logits, tokens, *cache.forward.returned = program(self._tokens, positions, cache, self.sampler)
        else:
            logits, tokens = self._produce(self._tokens, positions)
        cache.end()  # new tokens into their slots, eviction for every layer, rows advance
        self._tokens.copy_(tokens)
        return logits, tokens

    def _produce(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward over the read-only storage, and sampling: what `compile` makes one program of."""
        logits = self._forward(tokens[:, None], positions, self.cache)
        return logits, draw(self.sampler, logits)

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
            self._key = key
            self._captured.forget()
            self._compiled.forget()
        try:
            if self.fused:
                return self._fused_step()
            if self.mode == "compile":
                seconds = self._compiled.load(
                    self.model, cache, sampler, self._cache_kw, self.on_setup, self.builder
                )  # None: not ready, an eager step meanwhile
                self._count_setup(seconds)
                if self._compiled.news:  # once per kind: why this run's text can differ from later runs'
                    self._compiled.news = False
                    cache.notices.append(EAGER_WHILE_BUILDING)
            elif self.mode == "graph":
                with torch.cuda.device(self.device):  # captured on the model's GPU's stream, not the current GPU's
                    out, seconds = self._captured.step(self._body, self.device, self._capturing)
                    self._count_setup(seconds)
                    return out
        except SetupFailed as e:
            return self._fall_back(e.error, e.what)
        with beside_a_build(self.device):
            out = self._body()
        if self._compiled.program is not None:
            self._count_setup(self._compiled.program.take_seconds())  # a program compiled in process at this call
        return out

    @property
    def fused(self) -> bool:
        """Whether steps run compiled inside a CUDA graph (`--decode compile` on a GPU)."""
        return self.mode == "compile" and self.device.type == "cuda"

    def _fused_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """On a GPU: the compiled forward (made at its first call) and the eviction after it, as one CUDA graph."""
        with torch.cuda.device(self.device):
            self._compiled.load(self.model, self.cache, self.sampler, self._cache_kw, self.on_setup, None)
            program = self._compiled.program
            try:
                out, seconds = self._captured.step(self._body, self.device, self._capturing)
            except SetupFailed:
                raise
            except Exception as e:  # noqa: BLE001 -- inductor's and Triton's failures have many types
                compiled.fused_failed(self.model, self.cache, self.sampler, e)
                raise SetupFailed("compiling one", e) from e
            self.setup_seconds += program.take_seconds()  # compiled at a warm-up step; counted with its capture
            self._count_setup(seconds)
            return out

    def _capturing(self) -> None:
        if self.on_setup is not None and not self.captures:
            self.on_setup("capturing the decode step as a CUDA graph (once)")

    def _count_setup(self, seconds: float | None) -> None:
        """A capture or a program's loading that happened (seconds > 0) is one-time setup, reported apart."""
        if seconds:
            self.captures += 1
            self.setup_seconds += seconds

    def _fall_back(self, error: Exception, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A step that cannot be captured or compiled runs eagerly from now on (a GPU's compiled step: as the plain
        captured step), and the user is told why."""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.cache.abort()  # nothing recorded ran: forget the half-done bookkeeping of that attempt
        # a GPU's compiled step falls back to the plain captured step, anything else to eager steps
        self.mode = "graph" if self.fused else "eager"
        how = "as a CUDA graph without inductor's kernels" if self.mode == "graph" else "eagerly"
        self.cache.notices.append(f"decode steps run {how}: {what} failed ({reason[:160]})")
        self._captured.forget()
        self._compiled.forget()
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
            return draw(self.sampler, logits)

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
