"""The engine: the library a transformers user imports. Bounded KV caches, eviction policies, attention with
mass, question-aware prompt compression, rotary re-numbering, device sampling and the decode engine that
captures a static decode step.

It imports no Typer, rich, prompt-toolkit, and reads no file of the user's; below it lie only `errors` and
`files`. The names here are imported lazily (the command line reads `policies` without importing torch).
"""

from __future__ import annotations

_LAZY = {
    "H2OCache": "h2o_chat.engine.cache",
    "CacheStats": "h2o_chat.engine.stats",
    "Engine": "h2o_chat.engine.step.decode",
    "make_policy": "h2o_chat.engine.policies",
    "prepare_model": "h2o_chat.engine.step.attention",
    "Sampler": "h2o_chat.engine.step.sampling",
    "stream_generate": "h2o_chat.engine.step.generate",
    "generate": "h2o_chat.engine.step.generate",
}


def lazy_attribute(table: dict[str, str], name: str, package: str):
    """`name` from the module `table` says it lives in, imported on first use."""
    if name in table:
        import importlib

        return getattr(importlib.import_module(table[name]), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def __getattr__(name: str):
    return lazy_attribute(_LAZY, name, __name__)


__all__ = list(_LAZY)
