"""The CPU's decode step as one compiled program (`--decode compile`, or `H2O_CHAT_DECODE=compile`).

What is compiled: the model's forward over the cache's storage, which a decode step only reads (each layer
attends to the new token in the spare slot's place, `attention_over_slots(new=...)`), the stacking of every
layer's new key, value and mass, and sampling. Inductor generates C++ kernels for it, fusing the small
operators around the weight-only int4/int8 products, shapes static.

What is not: writing the new tokens into the storage and eviction (`cache.end()`: about twenty operators over
every layer's stacked slots). A write into the stacked storage inside the program is functionalized into a copy
of the whole buffer -- per layer when the layers write views of it (the reason an earlier compiled step measured
233 ms against 84 eager), once per buffer when the step writes all layers at once (15.5 ms against 2.1 for the
same step with eviction left out, in a 30-layer reproduction): so the program returns what the step produced
and eviction runs eagerly after it, on the stacked storage, in place.

Compiling the embedded model's step takes ~45 s on a 2-core CPU the first time (C++ code generation for 30
layers); inductor keeps what it generated in a cache directory (`cache_dir()`), so a later start on the same
machine loads it instead, after tracing the model again (~10 s). That cost is why `auto` compiles only for a long
generation (`decode.decode_for`): a chat's short replies would wait longer than they save. The engine announces a
compilation, counts its cost apart from the steps' and falls back to eager steps, saying why, when one fails.
The recall policy's step calls its native ranking and grows its store every step: it runs eagerly.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

# Neither frozen weights nor the C++ wrapper: both measured no faster per step here, and the first compilation
# took ~330 s with the wrapper against ~95 without; a warm start ~29 s with frozen weights against ~16 without
# (2-core Xeon, shared: docs/experiments.md). Without the size and stride check of every buffer the program's
# Python makes per step (~20 per layer): 13.2 against 14.4 ms a step (docs/results/cpu.md).
INDUCTOR_OPTIONS: dict = {"size_asserts": False}


def cache_dir() -> Path:
    """Where inductor keeps compiled programs between runs (unless TORCHINDUCTOR_CACHE_DIR says otherwise)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "h2o-chat" / "inductor"


def unavailable() -> str | None:
    """Why a compiled CPU step cannot be built here, or None."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) for inductor's CPU code"
    return None


class Program:
    """`body(tokens, positions) -> outputs` compiled for the CPU (one graph, static shapes), then replayed.

    Called through `torch.compile`, each call first checks dynamo's guards: some 10,000 here (every weight's
    type, shape and strides, the modules' attributes), 0.5-1 ms a step, 5% of it. A decode step is built to read
    only tensors that stay where they are between steps -- the discipline a CUDA graph needs -- so once two calls
    through dynamo have given the compiled graph the same inputs (the same memory, shapes and strides, while the
    first call's tensors are held) and the body's result was exactly the graph's outputs (no Python state of its
    own to restore after it: `Forward.slots_valid`), later calls run the graph on those inputs directly, as a
    CUDA graph is replayed. What would change the step (the cache's storage, the batch, the sampler) changes the
    engine's key, and a new key builds a new `Program`. A body that does not qualify keeps dynamo's checks
    (`replaying` stays False).
    """

    def __init__(self, body: Callable):
        from torch._inductor.runtime import cache_dir_utils

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, cache_dir_utils.default_cache_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())  # torch's default is in /tmp
        self._graph: Callable | None = None  # inductor's compiled graph
        self._calls: list[tuple[tuple, object]] = []  # (inputs, outputs) of the graph's calls through dynamo
        self._inputs: tuple | None = None  # once replaying: the inputs every call reads
        self.replaying = False
        self._guarded = torch.compile(body, backend=self._compile, fullgraph=True, dynamic=False)

    def _compile(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graph = compile_fx(gm, example_inputs, config_patches=INDUCTOR_OPTIONS or None)
        self._graph = graph

        def recorded(*args):
            out = graph(*args)
            if self._inputs is None and len(self._calls) < 2:  # until replaying is decided
                self._calls.append((args, out))
            return out

        return recorded

    def __call__(self, *args):
        if self.replaying:
            return self._graph(*self._inputs)
        out = self._guarded(*args)
        if len(self._calls) == 2 and self._inputs is None:
            (first, _), (second, raw) = self._calls
            self.replaying = _same_places(first, second) and _exactly(out, raw)
            self._inputs = first if self.replaying else ()
            self._calls = []
        return out


def _place(x):
    if isinstance(x, torch.Tensor):
        return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
    return (type(x), x)


def _same_places(first: tuple, second: tuple) -> bool:
    return len(first) == len(second) and all(_place(a) == _place(b) for a, b in zip(first, second, strict=True))


def _exactly(result, graph_outputs) -> bool:
    """The body returned the graph's outputs themselves, all of them, in order."""
    result, graph_outputs = list(result), list(graph_outputs)
    return len(result) == len(graph_outputs) and all(a is b for a, b in zip(result, graph_outputs, strict=True))


def compile_step(body: Callable) -> Program:
    """The decode step's body compiled (`Program`)."""
    return Program(body)
