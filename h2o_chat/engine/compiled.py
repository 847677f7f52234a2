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

Compiling the embedded model's step takes minutes on a 2-core CPU the first time (C++ code generation for 30
layers); inductor keeps what it generated in a cache directory (`cache_dir()`), so a later start on the same
machine loads it instead, after tracing the model again (seconds). That first cost is why `auto` stays eager on
CPU: a chat started once for a few replies would wait longer than it saves; a long generation gains. The engine
announces a compilation, counts its cost apart from the steps' and falls back to eager steps, saying why, when
one fails. The recall policy's step calls its native ranking and grows its store every step: it runs eagerly.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

# Neither frozen weights nor the C++ wrapper: both measured no faster per step here, and the first compilation
# took ~330 s with the wrapper against ~95 without; a warm start ~29 s with frozen weights against ~16 without
# (2-core Xeon, shared: docs/experiments.md)
INDUCTOR_OPTIONS: dict = {}


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


def compile_step(body: Callable) -> Callable:
    """`body(tokens, positions) -> outputs`, compiled for the CPU: one graph, static shapes (`INDUCTOR_OPTIONS`)."""
    from torch._inductor.runtime import cache_dir_utils

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, cache_dir_utils.default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())  # torch's default is in /tmp
    return torch.compile(body, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS or None)
