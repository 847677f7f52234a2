"""How a decode step runs once it is more than an eager call: captured as one CUDA graph (`Captured`), and/or as
the program compiled for its kind of step (`Compiled`, `compiled.py`: ahead of time on a CPU; in process on a GPU,
where the graph captures it). Each holds what it made for the step's current shape and forgets it when the step
changes (`forget`); `Engine.decode` chooses between them and runs the step eagerly (a GPU's compiled step: as the
plain graph), with a notice, when making one fails (`SetupFailed`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from h2o_chat.engine.step import compiled

WARMUP = 2  # eager steps before a capture (lazy CUDA initialisation must not happen inside one)

Body = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # one decode step: (logits, tokens) on the device


@contextlib.contextmanager
def beside_a_build(device: torch.device) -> Iterator[None]:
    """A forward on a CPU while a compiled step is being built beside it (`compiled.building`) leaves that build a
    core: each of the step's operators waits at its end for all of torch's threads, and with one of them descheduled
    by the build every operator waits for a time slice (8 rows of the embedded model on 2 cores: 1.8 s a step on 2
    threads, 98 ms on one, 64 ms with no build)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads < 2 or not compiled.building():
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SetupFailed(Exception):
    """A capture or a compilation failed: `what` was being made; the cause is the error."""

    def __init__(self, what: str, error: Exception):
        super().__init__(what)
        self.what, self.error = what, error


class Captured:
    """The step as one CUDA graph: two eager steps on a side stream first, then a capture, then replays."""

    def __init__(self):
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None  # the graph's outputs, overwritten by each replay
        self.pool = None  # one memory pool for every capture of this engine
        # the graph forgotten last, kept until the next capture ends: a pool whose graphs are all gone while
        # memory it gave out is still held (a buffer first made inside a capture) cannot be captured into again
        # (the allocator's `use_count > 0` assertion: what made every server lane's step fall back to eager)
        self.previous: torch.cuda.CUDAGraph | None = None
        self.warmups = 0

    def forget(self) -> None:
        if self.graph is not None:
            self.previous = self.graph
        self.graph, self.out, self.warmups = None, None, 0

    def step(
        self, body: Body, device: torch.device, told: Callable[[], None]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], float]:
        """Run one step on `device`; returns its outputs and the seconds a capture took (0 when none happened)."""
        if self.graph is not None:
            self.graph.replay()
            return self.out, 0.0
        if self.warmups < WARMUP:  # real steps, eagerly, on a side stream as CUDA graphs require
            self.warmups += 1
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                out = body()
            torch.cuda.current_stream(device).wait_stream(stream)
            return out, 0.0
        told()
        t = time.perf_counter()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.out = body()  # recorded, not run: the replay below performs this step
        except RuntimeError as e:  # something in the model reads the device (e.g. dynamic rope scaling)
            raise SetupFailed("capturing one", e) from e
        self.graph, self.previous = graph, None
        seconds = time.perf_counter() - t
        graph.replay()
        return self.out, seconds


class Compiled:
    """The step's package for its kind (`compiled.StepKind`), loaded when the step changed. `auto` never waits for
    a build: until the package is ready the step runs eagerly and the engine's builder (the app's: a build in
    another process) is asked once per kind; `waits` (an explicit `compile`) builds it now."""

    def __init__(self, waits: bool):
        self.waits = waits
        self.program = None  # for the step's current key
        self.asked: set = set()  # step kinds the builder was asked for
        self.news = False  # a builder was just asked for a kind: the engine says its steps run eagerly meanwhile

    def forget(self) -> None:
        self.program = None

    def load(self, model, cache, sampler, cache_keyword: str, on_setup, builder) -> float | None:
        """Have the program for this step ready: the seconds its loading (or building) took, or None when it is
        not ready and the step runs eagerly meanwhile."""
        if self.program is not None:
            return 0.0
        if compiled.in_process(cache.slots.keys.device):  # compiled at its first call (`compiled.Fused`)
            try:
                self.program = compiled.fused(model, cache, sampler, cache_keyword, on_setup)
            except Exception as e:  # noqa: BLE001 -- export's failures have many types
                raise SetupFailed("compiling one", e) from e
            return 0.0
        if not self.waits and not compiled.ready(model, cache, sampler):
            kind = compiled.StepKind.of(cache, sampler)
            if kind not in self.asked:
                self.asked.add(kind)
                if builder is not None:
                    builder(kind)
                    self.news = True
            return None
        t = time.perf_counter()
        try:
            self.program = compiled.program(model, cache, sampler, cache_keyword, on_setup)
        except Exception as e:  # noqa: BLE001 -- export's and inductor's failures have many types
            raise SetupFailed("compiling one", e) from e
        return time.perf_counter() - t
