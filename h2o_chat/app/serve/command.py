"""`h2o-chat serve`: an OpenAI-compatible server whose every conversation holds a bounded cache.

Options in, calls out: the work is in `server.py` (HTTP), `scheduler.py` (the engine thread: with `jobs.py`,
`lanes.py`, `reading.py` and `replies.py`), `rows.py` and `sessions.py`. No torch, uvicorn or starlette import at
module level (start-up stays fast for --help).
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Annotated

import typer

from h2o_chat.app.options import (
    CacheOptions,
    ModelOptions,
    PolicyKnobs,
    SamplingOptions,
    check_positive,
    grouped,
    refuse_unused,
    store_of,
)
from h2o_chat.app.reporting import reported, status
from h2o_chat.errors import H2OChatError

# --max-prompt-tokens' default: the embedded model's trained context; ~30 s of reading on a 2-core CPU (~300 tok/s),
# read a chunk at a time between the other rows' steps: how long such a request waits for its first token
MAX_PROMPT_TOKENS = 8192

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the weights load: an address that cannot be served is one line at once,
    not uvicorn's log line (and its own exit status) after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        raise H2OChatError(
            f"--host {host}: not an address this machine can listen on ({getattr(e, 'strerror', e)})"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = {
            errno.EADDRINUSE: f"port {port} is in use by another program (--port N, or --port 0 for any free one)",
            errno.EADDRNOTAVAIL: f"{host} is not an address of this machine",
            errno.EACCES: f"port {port} needs privileges (ports below 1024): choose one above",
        }.get(e.errno, e.strerror or str(e))
        raise H2OChatError(f"cannot serve on {host}:{port}: {why}") from None
    return sock


@grouped
def serve_command(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback only by default; 0.0.0.0: every one).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port, printed).")] = 8000,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            envvar="H2O_CHAT_API_KEY",
            help="Every request must send 'Authorization: Bearer KEY' (else 401); give it again for more keys, "
            "each reusing only its own conversations. Also from $H2O_CHAT_API_KEY (keys split by spaces).",
            show_default=False,
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Conversations generating together, as rows of one engine.")] = 16,
    max_sessions: Annotated[
        int, typer.Option(help="Idle conversations whose cache is kept (least recently used go first).")
    ] = 64,
    memory_limit: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="The most memory idle conversations' caches take, e.g. 2GB (default: a quarter of the memory "
            "available at start).",
            show_default=False,
        ),
    ] = None,
    session_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Idle conversations beyond --max-sessions or --memory-limit are kept in DIR (their cache, as "
            "files) and restored on their next turn, instead of being dropped; removed when the server stops.",
        ),
    ] = None,
    max_budget: Annotated[int, typer.Option(help='The largest budget a request may ask for (its own "budget").')] = (
        4096
    ),
    max_prompt_tokens: Annotated[
        int,
        typer.Option(
            help="The most prompt tokens one request may read (what its conversation's cache has not seen); more "
            "is a 400. A prompt is read a chunk at a time between the other replies' steps."
        ),
    ] = MAX_PROMPT_TOKENS,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="A line per request: conversation, tokens read and generated, kept / seen, speed."
        ),
    ] = False,
    models: ModelOptions = ModelOptions(),
    cache: CacheOptions = CacheOptions(),
    knobs: PolicyKnobs = PolicyKnobs(),
    sampling: SamplingOptions = SamplingOptions(),
) -> None:
    """Serve the model over HTTP with the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models)."""
    with reported():
        for group in (models, cache, sampling):
            group.check()
        for name, value in (("--batch-size", batch_size), ("--max-sessions", max_sessions)):
            check_positive(name, value)
        check_positive("--max-budget", max_budget)
        check_positive("--max-prompt-tokens", max_prompt_tokens)
        if not 0 <= port <= 65535:
            raise H2OChatError(f"--port must be between 0 and 65535, got {port}")
        from h2o_chat.app.budget import parse_size
        from h2o_chat.app.serve.api import SERVED_POLICIES, Limits

        if cache.policy not in SERVED_POLICIES:
            raise H2OChatError(
                f"--policy {cache.policy} is not served: choose one of {', '.join(SERVED_POLICIES)} (bounded "
                "caches, whose rows are saved and restored whole between turns)"
            )
        refuse_unused(ctx, cache.policy)
        budget = cache.tokens(models, rows=batch_size)  # a memory (every row's together, as batch) or a share
        store = cache.store_tokens(models, budget, rows=batch_size)
        policy = cache.build(knobs, budget, store)  # fails before the weights load
        if budget > max_budget:
            raise H2OChatError(f"--budget {budget} is above --max-budget {max_budget}")
        limit = parse_size("--memory-limit", memory_limit) if memory_limit else None
        if session_dir is not None:  # one line now, before the weights load
            from h2o_chat.app.serve.session_disk import session_folder

            session_folder(session_dir)
        keys = tuple(api_key or ())
        if any(not k.strip() for k in keys):
            raise H2OChatError("--api-key is empty")
        sock = listen(host, port)  # before the weights load: an address it cannot serve is said at once
        with sock:
            if host not in LOOPBACK and not keys:
                status(f"listening on {host} without --api-key: anyone who can reach this port can use the model")
            loaded = models.load(
                kv_tokens=policy.budget, kv_rows=batch_size, kv_quant=cache.kv_quant, store_tokens=store_of(policy)
            )
            if limit is None:
                from h2o_chat.models.memory import available_memory

                limit = available_memory() // 4
            from h2o_chat.app.serve.rows import EngineSettings
            from h2o_chat.app.serve.server import ServeOptions, Server

            options = ServeOptions(
                host=host,
                port=port,
                api_keys=keys,
                rows=batch_size,
                max_sessions=max_sessions,
                memory_limit=limit,
                session_dir=session_dir,
                limits=Limits(
                    policy=policy.name,
                    budget=policy.budget,
                    max_budget=max_budget,
                    max_tokens=sampling.max_new_tokens,
                    max_prompt_tokens=max_prompt_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    min_p=sampling.min_p,
                    repetition_penalty=sampling.repetition_penalty,
                    seed=sampling.given_seed,
                    knobs=tuple(knobs.kwargs().items()),
                    store=store,
                ),
                engine=EngineSettings(cache.positions, cache.kv_quant, models.decode, cache.chunk_size),
                verbose=verbose,
            )
            server = Server(loaded, options, log=status)

            def ready(bound: int) -> None:
                shown = f"[{host}]" if ":" in host else host
                status(
                    f"serving {loaded.spec.name} ({policy.describe()}) at http://{shown}:{bound}/v1 "
                    f"with up to {batch_size} conversations at once; Ctrl-C stops"
                )

            try:
                server.run(on_ready=ready, sockets=[sock])
            except OSError as e:
                raise H2OChatError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
            status("stopped")
