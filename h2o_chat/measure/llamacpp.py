"""llama.cpp as an anchor row of `bench` (decode and `--prefill`): the same GGUF file, the same token ids and
threads, timed in the same interleaved rounds as h2o-chat's rows, through `llama-cpp-python` (an optional
extra that builds llama.cpp from source once).

llama.cpp keeps a full cache: its decode cost grows with the tokens seen, where a bounded cache's stays flat.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

CONFIG = "llama.cpp"
# a native build dies with SIGILL on machines whose hypervisor reports AMX that a process may not use
INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF '
    "-DGGML_AMX_BF16=OFF\" pip install 'h2o-chat[llamacpp]'"
)


class Unavailable(Exception):
    """Why the llama.cpp row cannot run here (one line)."""


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def check(gguf: Path | None) -> None:
    """Raise `Unavailable` unless llama.cpp can run this model."""
    if gguf is None:
        raise Unavailable("the llama.cpp row needs a GGUF model (the embedded one, or -m FILE.gguf)")
    if not installed():
        raise Unavailable(f"the llama.cpp row needs llama-cpp-python (builds llama.cpp once, minutes): {INSTALL}")


class LlamaCpp:
    """One llama.cpp context over `gguf`: feed token ids, read the greedy next token."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, batch: int = 512):
        check(gguf)
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=batch,
            n_ubatch=batch,
            verbose=False,
        )
        self.vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()  # the next eval overwrites the cache from position 0

    def eval(self, ids: list[int]) -> int:
        """Feed `ids` after what was fed; the greedy next token."""
        self.llm.eval(ids)
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))  # the last token's
        return int(logits.argmax())

    def kv_bytes(self) -> int:
        """What its cache allocated: n_ctx tokens of float16 keys and values in every layer."""
        meta = self.llm.metadata
        arch = meta.get("general.architecture", "llama")
        layers = int(meta[f"{arch}.block_count"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta[f"{arch}.embedding_length"]) // heads
        return 2 * layers * kv_heads * head_dim * 2 * self.llm.n_ctx()
