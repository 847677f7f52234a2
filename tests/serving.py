"""Helpers for the server's tests: a server on a free loopback port, the `openai` client and raw HTTP calls."""

from __future__ import annotations

import contextlib
import http.client
import json

from h2o_chat.app.serve.server import ServeOptions, Server


@contextlib.contextmanager
def serving(loaded, ends: bool = True, **options):
    """A running server; `ends=False`: replies end only at their length (a tiny random model says its end of
    text at random, and some tests need replies that run on)."""
    server = Server(loaded, ServeOptions(port=0, **options))
    if not ends:
        server.scheduler.replies.stop_ids = set()
    port = server.start()
    try:
        yield server, port
    finally:
        server.stop()


def client(port: int, key: str = "none", timeout: float = 120):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=timeout)


def request(port: int, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60):
    """(status, the body read as JSON, else as text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    status, raw = response.status, response.read()
    conn.close()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def post(port: int, path: str, body, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    return request(port, "POST", path, body, headers, timeout)


def get(port: int, path: str, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    return request(port, "GET", path, None, headers, timeout)


def load_tiny(folder):
    """A tiny random LLaMA with a word-level tokenizer (w4 ... w255), saved and loaded as a model folder is."""
    from conftest import tiny_model, tiny_tokenizer
    from h2o_chat.models.loading import load
    from h2o_chat.models.registry import load_registry

    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return load(load_registry().resolve(str(folder)), device="cpu")
