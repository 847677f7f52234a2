"""h2o-chat: long text generation in bounded memory with the H2O (Heavy-Hitter Oracle) KV cache.

Four layers, each importing only those below it: `app` (commands, chat, batch, rendering) -> `measure`
(bench, evaluation, soak) -> `models` (registry, loading, memory fit) -> `engine` (the library: caches,
policies, attention, the decode engine); `errors` and `files` serve them all. The public API below is imported
lazily so that `h2o-chat --help` starts without importing torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "H2OCache": "h2o_chat.engine.cache",
    "CacheStats": "h2o_chat.engine.slots",
    "Engine": "h2o_chat.engine.decode",
    "make_policy": "h2o_chat.engine.policies",
    "prepare_model": "h2o_chat.engine.attention",
    "Sampler": "h2o_chat.engine.sampling",
    "load": "h2o_chat.models.loading",
    "stream_generate": "h2o_chat.engine.generate",
    "generate": "h2o_chat.engine.generate",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'h2o_chat' has no attribute {name!r}")


__all__ = [*_LAZY, "__version__"]
