"""`h2o-chat serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the engine thread.

The HTTP side checks requests (app/serve/api.py), plans them in a thread of its own (app/serve/sessions.py: the
conversation they continue, their tokens, --max-prompt-tokens; so a huge prompt never reaches the engine thread),
submits them to the engine thread (app/serve/scheduler.py) and turns its events into replies: one JSON object, or
server-sent events as tokens come. A request that cannot start (no memory for its prompt, the server draining)
gets its status before a streamed reply begins. A client that goes away marks its job cancelled; the engine thread
frees its row before the next step. SIGINT / SIGTERM stop taking requests and reading prompts, let the replies
already decoding finish, then stop the engine thread. Every error, a bug's too, is OpenAI's JSON error object.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from h2o_chat.app.serve.api import (
    ApiError,
    GenRequest,
    Limits,
    chunk,
    new_id,
    parse_json,
    parse_request,
    reply,
    usage,
)
from h2o_chat.app.serve.jobs import SHUTTING_DOWN, Job
from h2o_chat.app.serve.rows import EngineSettings
from h2o_chat.app.serve.scheduler import Scheduler
from h2o_chat.app.serve.session_disk import SessionDisk, session_folder
from h2o_chat.app.serve.sessions import SessionStore, plan_turn

MAX_BODY = 8 * 2**20  # bytes of one request body; a larger one is a 413 (a prompt of ~2M tokens fits)
DRAIN_SECONDS = 60  # on SIGINT/SIGTERM, how long replies under way may take before they are cut
STATS_WAIT = 1.0  # seconds /v1/stats waits for the engine thread's next turn before it shows the last figures
POLL = 0.5  # seconds between checks that a client still waits for a reply that is not streamed


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # each key's clients reuse only their own conversations
    rows: int = 16  # conversations decoding together, over all lanes
    max_sessions: int = 64
    memory_limit: int = 2**30  # bytes of idle conversations' caches
    session_dir: Path | None = None  # where idle conversations beyond the limits go (else they are dropped)
    limits: Limits = field(default_factory=Limits)
    engine: EngineSettings = field(default_factory=EngineSettings)
    max_body: int = MAX_BODY
    verbose: bool = False


class Server:
    """The app, its engine thread and uvicorn. `run()` blocks in the main thread (signals drain it);
    `start()` serves from a thread and returns the port (tests, the load script)."""

    def __init__(self, loaded, options: ServeOptions, log: Callable[[str], None] | None = None):
        self.loaded, self.options, self.log = loaded, options, log
        self.model_name = loaded.spec.name
        disk = None
        if options.session_dir is not None:
            disk = SessionDisk(session_folder(options.session_dir), loaded, options.engine)
        self.store = SessionStore(options.max_sessions, options.memory_limit, disk)
        self.scheduler = Scheduler(loaded, options.engine, options.rows, self.store, log if options.verbose else None)
        self.app = _app(self)
        config = uvicorn.Config(
            self.app, host=options.host, port=options.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=DRAIN_SECONDS, lifespan="off",
        )  # fmt: skip
        self.uvicorn = _Uvicorn(config, self)
        self._thread: threading.Thread | None = None
        # one thread tokenizes (the tokenizer is not shared between threads; one core at most goes to it)
        self.planner = ThreadPoolExecutor(1, thread_name_prefix="h2o-chat-plan")

    @property
    def port(self) -> int:
        return self.uvicorn.servers[0].sockets[0].getsockname()[1]

    def run(self, on_ready: Callable[[int], None] | None = None, sockets: list | None = None) -> None:
        """Serve until a signal drains it: on `sockets` (bound by the caller), else on the options' address."""
        self.scheduler.start()
        self.uvicorn.on_ready = on_ready
        try:
            self.uvicorn.run(sockets=sockets)
        finally:
            self.scheduler.stop()
            self.store.close()
            self.planner.shutdown(wait=False, cancel_futures=True)
        if not self.uvicorn.started:
            raise OSError(f"cannot listen on {self.options.host}:{self.options.port}")

    def start(self, timeout: float = 30.0) -> int:
        self._thread = threading.Thread(target=self.run, name="h2o-chat-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.port

    def stop(self) -> None:
        self.scheduler.draining = True
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(DRAIN_SECONDS + 10)


class _Uvicorn(uvicorn.Server):
    """uvicorn, telling the engine thread to take no new requests once a signal says stop."""

    def __init__(self, config: uvicorn.Config, owner: Server):
        super().__init__(config)
        self.owner, self.on_ready = owner, None

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit and self.owner.log:
            # the rows decoding: a prompt being read stops at its next chunk (a 503), as a waiting request does
            busy = sum(lane.decoding for lane in list(self.owner.scheduler.lanes))
            self.owner.log(f"stopping: finishing {busy} repl{'y' if busy == 1 else 'ies'} under way "
                           "(Ctrl-C again stops at once)")  # fmt: skip
        self.owner.scheduler.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM drain the server; unlike uvicorn's own, the signal is not raised again once it has
        stopped, so the command ends with its own line and status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready(self.owner.port)


# -- the app ---------------------------------------------------------------------------------------------
def _app(server: Server) -> Starlette:
    opts = server.options

    async def health(request: Request) -> Response:
        ok = server.scheduler.failed is None
        body = {"status": "ok" if ok else "failed", "model": server.model_name, "draining": server.scheduler.draining}
        return JSONResponse(body, status_code=200 if ok else 503)

    def card() -> dict:
        return {"id": server.model_name, "object": "model", "created": int(time.time()), "owned_by": "h2o-chat"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != server.model_name:
            message = f"the model {name!r} is not served here; this server serves {server.model_name!r}"
            raise ApiError(404, message, param="model", code="model_not_found")
        return JSONResponse(card())

    async def stats(request: Request) -> Response:
        """The engine thread's figures at its next turn; while it reads a prompt's chunk (seconds on a CPU), the
        last ones it gave, saying how old they are."""
        scheduler = server.scheduler
        answer = asyncio.wrap_future(scheduler.call(scheduler.stats))
        try:
            return JSONResponse(await asyncio.wait_for(asyncio.shield(answer), STATS_WAIT))
        except TimeoutError:
            if scheduler.last_stats is None:
                return JSONResponse(await answer)
            when, body = scheduler.last_stats
            return JSONResponse({**body, "stale_seconds": round(time.monotonic() - when, 2)})

    async def chat(request: Request) -> Response:
        return await _generate(server, request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(server, request, "text")

    async def problem(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ApiError):
            return JSONResponse(exc.body(), status_code=exc.status)
        status = getattr(exc, "status_code", 500)
        words = {404: f"no such endpoint: {request.method} {request.url.path}", 405: "method not allowed here"}
        message = words.get(status, getattr(exc, "detail", "internal error"))
        return JSONResponse(ApiError(status, message).body(), status_code=status)

    async def bug(request: Request, exc: Exception) -> Response:  # what no handler expected: still JSON, one line
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        error = ApiError(500, f"internal error (a bug): {type(exc).__name__}: {why}"[:300])
        return JSONResponse(error.body(), status_code=500)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/stats", stats, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    handlers = {ApiError: problem, HTTPException: problem, Exception: bug}
    return _Guard(Starlette(routes=routes, exception_handlers=handlers), opts.api_keys)


class _Guard:
    """ASGI middleware: with API keys, every request must carry one (`Authorization: Bearer KEY`), else 401; the
    key it carried (a digest of it) scopes the conversations it may continue."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app, self.keys = app, [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.keys:
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = (given[7:].strip() if given.lower().startswith("bearer ") else "").encode()
            if not any([hmac.compare_digest(token, key) for key in self.keys]):  # every key compared: no timing
                why = "a wrong API key" if token else "no API key (send Authorization: Bearer KEY)"
                error = ApiError(401, f"this server needs its API key: the request has {why}", "authentication_error")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["key"] = hashlib.sha256(token).hexdigest()[:16]
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes `limit` bytes (read on a little, so the client hears the answer)."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes", param=None)
    if declared.isdigit() and int(declared) > 4 * limit:
        raise too_big
    parts, size = [], 0
    with contextlib.suppress(ClientDisconnect):
        async for part in request.stream():
            size += len(part)
            if size <= limit:
                parts.append(part)
            elif size > 4 * limit:
                break
    if size > limit:
        raise too_big
    return b"".join(parts)


async def _generate(server: Server, request: Request, kind: str) -> Response:
    body = parse_json(await _read_body(request, server.options.max_body))
    limits = server.options.limits
    req = parse_request(body, kind, limits, key=getattr(request.state, "key", ""))
    if server.scheduler.draining:  # not even tokenized: the drain reads no new prompt
        raise ApiError(503, SHUTTING_DOWN)
    loop = asyncio.get_running_loop()
    # matched, tokenized and checked against --max-prompt-tokens here, never in the engine thread
    tokenizer = server.loaded.tokenizer
    turn = await loop.run_in_executor(server.planner, plan_turn, server.store, req, tokenizer, limits.max_prompt_tokens)
    events: asyncio.Queue = asyncio.Queue()
    job = Job(req, turn, events, loop)
    try:
        server.scheduler.submit(job)
    except ApiError:
        server.scheduler.release(job)
        raise
    rid, model = new_id(kind), server.model_name  # whatever "model" the request named: one model is served
    try:
        first = await _next(events, request, job)
    except _Gone:
        return Response(status_code=499)  # nobody reads it: the client closed the connection
    except BaseException:
        job.cancelled = True
        raise
    if first[0] == "error":
        raise first[1]
    if req.stream:
        return StreamingResponse(_stream(events, job, req, rid, model), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip
    try:
        text = []
        while True:
            event = await _next(events, request, job)
            if event[0] == "text":
                text.append(event[1])
            elif event[0] == "error":
                raise event[1]
            else:
                return JSONResponse(reply(req, rid, model, "".join(text), event[1]))
    except _Gone:
        return Response(status_code=499)
    finally:
        job.cancelled = True  # a no-op once the reply is done; frees the row when the client went away


class _Gone(Exception):
    pass


async def _next(events: asyncio.Queue, request: Request, job: Job) -> tuple:
    """The job's next event; while none comes, check every POLL seconds that the client still waits."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancelled = True
                raise _Gone() from None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(events: asyncio.Queue, job: Job, req: GenRequest, rid: str, model: str) -> AsyncIterator[str]:
    """Server-sent events: the role, each piece of text, the finish with our stats, the usage when asked."""
    try:
        yield _sse(chunk(req, rid, model, None))
        later = None
        while True:
            kind, value = later or await events.get()
            later = None
            if kind == "text":
                while not events.empty():  # text that came together goes out as one chunk: one write, not several
                    kind_next, more = events.get_nowait()
                    if kind_next != "text":
                        later = (kind_next, more)
                        break
                    value += more
                yield _sse(chunk(req, rid, model, value))
            elif kind == "error":
                yield _sse(value.body())
                return
            else:
                yield _sse(chunk(req, rid, model, None, value["finish"], h2o=value["h2o"]))
                if req.include_usage:
                    yield _sse(chunk(req, rid, model, None, usage=usage(value)))
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancelled = True  # the client went away mid-stream: its row is freed at the next step
