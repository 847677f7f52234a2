"""The server's side of the OpenAI API: request bodies checked into a `GenRequest`, and the replies' shapes.

A body is read as JSON and checked by pydantic models with unknown fields forbidden and types strict (`"5"` is
not a number), so a mistake is one clear 400 naming the field, never a silent default. Fields the OpenAI API has
and this server cannot honour (`n` > 1, penalties, log-probabilities) are refused with the reason when set to
anything but their neutral value. Ours: `budget` and `policy` (the conversation's cache, within the server's
limits), `repetition_penalty`, `top_k` and `min_p`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h2o_chat.errors import ConfigError, SettingError

SERVED_POLICIES = ("snap", "h2o", "recall", "sink", "recent")  # bounded: a row's snapshot carries all their state
MAX_TOKENS = 1 << 20  # a reply's ceiling: the cache is bounded, only time grows with it
MAX_TOP_K = 512  # the sampler ranks at most this many candidates per step (engine/step/sampling.py's NUCLEUS_CAP)
# The engine thread checks every stop string against a reply's text at every token, and a streamed reply holds
# back text that could begin one (up to the longest's length): a few short ones serve every chat template.
MAX_STOPS = 16
MAX_STOP_CHARS = 64
MAX_DEPTH = 32  # JSON nesting; a valid body nests 5 deep (messages, a message, its parts, a part)
MAX_PROMPT_TOKENS = 8192  # --max-prompt-tokens' default: serve.command.MAX_PROMPT_TOKENS says why (the CLI must not
# import this module at start: pydantic would slow --help; a test checks the two agree)


class ApiError(Exception):
    """An error a client gets as an HTTP status and OpenAI's error object, one clear message."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,  # None: OpenAI's type for the status
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
        codes = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 503: "unavailable"}
        self.code = code or codes.get(status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None
    # what OpenAI's clients send back with an assistant reply (`message.model_dump()`): taken when empty
    refusal: str | None = None
    tool_calls: list | None = None
    function_call: dict | None = None
    audio: dict | None = None
    annotations: list | None = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None  # null: false, as OpenAI takes it
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None  # with cache_salt: conversations are reused only within one (key, user, salt)
    cache_salt: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | int | None = None
    # ours
    budget: int | None = None
    policy: str | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)


class CompletionBody(_Body):
    prompt: str | list[str]


@dataclass(frozen=True)
class Limits:
    """What the server allows and what a request gets when it says nothing."""

    policy: str = "snap"
    budget: int = 512
    max_budget: int = 4096
    max_tokens: int = 512
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # tokens one request may read (what its conversation's cache lacks)
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.1
    seed: int | None = None
    knobs: tuple = ()  # the policy settings every request's policy is built with, as (name, value) pairs
    store: int | None = None  # recall's store in tokens (--recall-memory); None: the policy's default for the budget


@dataclass(frozen=True)
class GenRequest:
    """One checked request: what to read and how to generate."""

    kind: str  # "chat" | "text"
    messages: tuple[dict, ...] | None
    prompt: str | None
    policy: object  # engine.policies.Policy
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    scope: tuple = ()  # (API key, user, cache salt): a conversation continues only within its own scope

    @property
    def cache_key(self) -> tuple:
        """Conversations with equal keys have caches of one shape and rule: one can continue the other's."""
        return (self.policy.name, self.policy.budget)


def parse_json(raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except RecursionError:  # a body nested thousands deep: the parser gives up before any limit of ours
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ApiError(
            400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _depth(obj) > MAX_DEPTH:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    return obj


def _depth(obj) -> int:
    """How deep lists and objects nest (a loop, not recursion: the check itself must not overflow)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


_BRANCHES = ("str", "list[str]", "list[TextPart]")  # how pydantic names the branches of a union in a location
# a field of objects -> (their model, what one is called)
_NESTED = {"messages": (Message, "a message"), "content": (TextPart, "a content part"),
           "stream_options": (StreamOptions, '"stream_options"')}  # fmt: skip


def _pydantic_problem(error: ValidationError, model: type[BaseModel]) -> ApiError:
    """The most telling problem pydantic found, as one line naming the field: the deepest, so that of a union's
    branches the one the input's kind took speaks (a part of a message's list, not "should be a valid string")."""
    first = max(error.errors(), key=lambda e: len(e["loc"]))
    loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and p in _BRANCHES)]
    field = ".".join(loc) or "body"
    if first["type"] == "extra_forbidden":
        parent = next((p for p in reversed(loc[:-1]) if not p.isdigit()), None)
        nested, noun = _NESTED.get(parent, (model, "this endpoint"))
        return ApiError(400, f'unknown field "{field}"; {noun} takes: {", ".join(nested.model_fields)}', param=field)
    if first["type"] == "missing":
        return ApiError(400, f'"{field}" is required', param=field)
    if loc[-1:] == ["type"] and "content" in loc and first["type"] == "literal_error":
        return ApiError(400, f'"{".".join(loc[:-1])}": only text parts are supported (type "text"), got a part of '
                        f"type {json.dumps(first.get('input'))[:40]}", param=field)  # fmt: skip
    got = json.dumps(first.get("input"))[:60]
    return ApiError(400, f'"{field}": {first["msg"][0].lower()}{first["msg"][1:]}, got {got}', param=field)


def parse_request(obj: dict, kind: str, limits: Limits, key: str = "") -> GenRequest:
    """A chat (`kind` "chat") or completion ("text") body -> GenRequest, or ApiError(400) saying what is wrong.
    `key`: which API key the request showed (its conversations are its own)."""
    model = ChatBody if kind == "chat" else CompletionBody
    try:
        body = model.model_validate(obj)
    except ValidationError as e:
        raise _pydantic_problem(e, model) from None
    _refuse_unsupported(body)
    if kind == "chat":
        messages = tuple(m.as_dict() for m in body.messages)
        prompt = None
        max_tokens = body.max_completion_tokens or body.max_tokens
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, f'"prompt" must be one string (this server completes one prompt per request), '
                           f"got a list of {len(prompts)}", param="prompt")  # fmt: skip
        messages, prompt, max_tokens = None, prompts[0], body.max_tokens
        if not prompt:
            raise ApiError(400, '"prompt" is empty', param="prompt")
    stop = _stops(body.stop)
    pick = lambda name: getattr(limits, name) if getattr(body, name) is None else getattr(body, name)  # noqa: E731
    sampling = {k: pick(k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    _check_sampling(sampling)
    if sampling["temperature"] == 0:  # greedy: its filters change nothing, so it shares the defaults' lane
        sampling.update(top_p=limits.top_p, top_k=limits.top_k, min_p=limits.min_p)
    return GenRequest(
        kind=kind,
        messages=messages,
        prompt=prompt,
        policy=build_policy(body.policy, body.budget, limits),
        max_tokens=max_tokens or limits.max_tokens,
        **sampling,
        seed=body.seed if body.seed is not None else limits.seed,
        stop=stop,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        scope=(key, body.user or "", body.cache_salt or ""),
    )


def _stops(given: str | list[str] | None) -> tuple[str, ...]:
    stop = (given,) if isinstance(given, str) else tuple(given or ())
    if not all(stop):
        raise ApiError(400, '"stop" strings must not be empty', param="stop")
    if len(stop) > MAX_STOPS:
        raise ApiError(400, f'"stop" takes at most {MAX_STOPS} strings, got {len(stop)}', param="stop")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise ApiError(
            400, f'"stop" strings must be at most {MAX_STOP_CHARS} characters, got one of {len(longest)}', param="stop"
        )
    return stop


def _refuse_unsupported(body: _Body) -> None:
    if body.n not in (None, 1):
        raise ApiError(400, f'"n" must be 1: this server generates one choice per request, got {body.n}', param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(
                400, f'"{name}" is not supported; "repetition_penalty" (1 = off) makes recent tokens less likely',
                param=name,
            )  # fmt: skip
    if body.logprobs not in (None, False, 0):
        raise ApiError(400, '"logprobs" is not supported by this server', param="logprobs")
    for number, m in enumerate(getattr(body, "messages", ())):
        for name in ("refusal", "tool_calls", "function_call", "audio", "annotations"):
            if getattr(m, name):  # null or empty is what a client sends back with a plain reply
                what = "a refusal" if name == "refusal" else f'"{name}"'
                raise ApiError(400, f'"messages.{number}.{name}": {what} is not supported by this server (text '
                               "messages only)", param=f"messages.{number}.{name}")  # fmt: skip
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, '"stream_options" needs "stream": true', param="stream_options")


def _check_sampling(values: dict) -> None:
    from h2o_chat.engine.step.sampling import Sampler

    try:
        Sampler(values["temperature"], values["top_p"], None, values["repetition_penalty"],
                top_k=values["top_k"], min_p=values["min_p"])  # fmt: skip
    except SettingError as e:  # said with the request's field names, which are the library's keywords
        raise ApiError(400, e.worded(f'"{e.name}"'), param=e.name) from None
    if values["top_k"] > MAX_TOP_K:
        raise ApiError(400, f'"top_k" must be at most {MAX_TOP_K}, got {values["top_k"]}', param="top_k")


def build_policy(name: str | None, budget: int | None, limits: Limits):
    """The request's cache policy: the server's unless it asks for another name or budget within the limits."""
    from h2o_chat.engine.policies import make_policy

    name = limits.policy if name is None else name
    if name not in SERVED_POLICIES:
        why = "is not served (its cache grows without bound)" if name == "full" else "unknown"
        raise ApiError(400, f'"policy" {name!r} {why}; choose one of: {", ".join(SERVED_POLICIES)}', param="policy")
    budget = limits.budget if budget is None else budget
    if budget < 1:
        raise ApiError(400, f'"budget" must be a positive number of tokens, got {budget}', param="budget")
    if budget > limits.max_budget:
        raise ApiError(
            400, f'"budget" {budget} is above this server\'s limit of {limits.max_budget} tokens (--max-budget)',
            param="budget",
        )  # fmt: skip
    try:
        store = {"store": limits.store} if name == "recall" and limits.store is not None else {}
        return make_policy(name, budget, **dict(limits.knobs), **store)
    except ConfigError as e:
        raise ApiError(400, f'"budget"/"policy": {e}', param="budget") from None


# -- replies -------------------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(result: dict) -> dict:
    prompt = result["cached_tokens"] + result["read_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": result["generated_tokens"],
        "total_tokens": prompt + result["generated_tokens"],
        "prompt_tokens_details": {"cached_tokens": result["cached_tokens"]},
    }


def reply(req: GenRequest, rid: str, model: str, text: str, result: dict) -> dict:
    """The whole reply of a request that did not stream."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": result["finish"]}
    else:
        choice = {"index": 0, "text": text, "finish_reason": result["finish"], "logprobs": None}
    return {
        "id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": int(time.time()), "model": model, "choices": [choice], "usage": usage(result),
        "h2o": result["h2o"],
    }  # fmt: skip


def chunk(req: GenRequest, rid: str, model: str, text: str | None, finish: str | None = None, **extra) -> dict:
    """One server-sent event of a streamed reply (text None: the opening chunk with the role, or the usage)."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
        choices = [{"index": 0, "delta": {} if finish else delta, "finish_reason": finish}]
        kind = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
        kind = "text_completion"
    if extra.get("usage") is not None and finish is None:
        choices = []  # OpenAI's usage chunk carries no choice
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}
