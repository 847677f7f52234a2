"""--download: whether the Hugging Face Hub can be reached, asked once with a short timeout before anything
contacts it. Without network the Hub's client retried for about 27 s, printing a line per retry, before our
error; now the answer comes in a few seconds, as one line."""

from __future__ import annotations

import functools
import os
import socket
import threading
from urllib.parse import urlsplit

from h2o_chat.errors import ModelNotFoundError
from h2o_chat.models.registry import ModelSpec

TIMEOUT = 3.0  # seconds for the name lookup and the connection together


@functools.cache
def reachable(endpoint: str, timeout: float = TIMEOUT) -> str | None:
    """None when a TCP connection to the endpoint's host opens within `timeout`, else why not. The lookup runs
    in a thread of its own: a resolver without network can wait far longer than a socket's timeout."""
    parts = urlsplit(endpoint)
    host, port = parts.hostname or "huggingface.co", parts.port or (80 if parts.scheme == "http" else 443)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e.strerror or type(e).__name__)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout)
    return outcome[0] if outcome else f"no answer from {host} within {timeout:.0f} s"


def downloads(spec: ModelSpec, download: bool, status=None) -> bool:
    """Whether loading `spec` may fetch from the Hub: with --download, a Hub model whose Hub cannot be reached
    is loaded from this machine's copy when there is one (said), else one clear error."""
    if not download or spec.kind != "hub":
        return download
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    why = reachable(endpoint)
    if why is None:
        return True
    from h2o_chat.models.loading import is_present

    if is_present(spec):
        if status is not None:
            status(f"cannot reach {endpoint} ({why}): using the copy of {spec.source} on this machine")
        return False
    raise ModelNotFoundError(
        f"could not download {spec.source} from the Hugging Face Hub: cannot reach {endpoint} ({why}); check the "
        "network (or HF_ENDPOINT), or pass a local folder with -m PATH"
    )
