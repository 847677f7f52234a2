"""h2o-chat: long text generation in bounded memory with the H2O (Heavy-Hitter Oracle) KV cache.

Four layers, each importing only those below it: `app` (commands, chat, batch, rendering) -> `measure`
(bench, evaluation, soak) -> `models` (registry, loading, memory fit) -> `engine` (the library: caches,
policies, attention, the decode engine); `errors` and `files` serve them all. The public API below is imported
lazily so that `h2o-chat --help` starts without importing torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from h2o_chat.engine import _LAZY as _ENGINE
from h2o_chat.engine import lazy_attribute

_LAZY = {**_ENGINE, "load": "h2o_chat.models.loading"}


def __getattr__(name: str):
    return lazy_attribute(_LAZY, name, __name__)


__all__ = [*_LAZY, "__version__"]
