"""h2o-chat: long text generation in bounded memory with the H2O (Heavy-Hitter Oracle) KV cache.

The public API is imported lazily so that `h2o-chat --help` starts without importing torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "H2OCache": "h2o_chat.cache",
    "CacheStats": "h2o_chat.cache",
    "Engine": "h2o_chat.engine",
    "make_policy": "h2o_chat.policies",
    "prepare_model": "h2o_chat.attention",
    "Sampler": "h2o_chat.sampling",
    "load": "h2o_chat.loading",
    "stream_generate": "h2o_chat.generate",
    "generate": "h2o_chat.generate",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'h2o_chat' has no attribute {name!r}")


__all__ = [*_LAZY, "__version__"]
