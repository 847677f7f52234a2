"""A conversation over one H2O cache: each turn prefills only the new text, the cache carries over.

The cache has seen the conversation up to the end of the last reply. To find the new text of a turn we render
the whole conversation with the chat template, with a sentinel in place of the last reply's content: what
follows the sentinel (end-of-turn tokens, the new user message, the generation prompt) is exactly what the
cache has not seen. This works for any template without decoding tokens back to text.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.decode import DEFAULT_CHUNK, Engine, Progress
from h2o_chat.engine.generate import Response, Sampler, stop_token_ids, stream_generate
from h2o_chat.engine.policies import Policy
from h2o_chat.errors import InputError
from h2o_chat.files import read_user_text
from h2o_chat.models.loading import Loaded

SENTINEL = "\x00h2o-chat-reply\x00"

# for base models without a chat template (OPT, Pythia)
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
PLAIN_STOP = "\nUser:"


FAR_BEYOND = 8  # a prompt longer than this many budgets is mostly evicted while it is read


def budget_note(prompt_tokens: int, budget: int | None) -> str | None:
    """A note for a prompt far beyond what the budget can use well, or None."""
    if budget is None or prompt_tokens <= FAR_BEYOND * budget:
        return None
    return (
        f"the prompt is {prompt_tokens:,} tokens, {prompt_tokens // budget}x the budget of {budget}: the cache "
        f"keeps about {100 * budget / prompt_tokens:.0f}% of it; a larger budget (--budget, /budget) keeps more"
    )


ROLES = ("system", "user", "assistant")


def is_messages(value) -> bool:
    """Whether `value` is a list of {"role", "content"} messages (a saved conversation's, a batch line's)."""
    return isinstance(value, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value
    )


@dataclass(frozen=True)
class ChatSettings:
    max_new_tokens: int = 512
    sampler: Sampler = field(default_factory=Sampler)
    chunk_size: int = DEFAULT_CHUNK
    system: str | None = None
    positions: str = "auto"
    decode: str = "auto"  # how decode steps run: auto | eager | graph | compile (see h2o_chat.engine)


@dataclass
class Span:
    """Where a message lies in the token stream: absolute positions [start, end)."""

    role: str
    index: int  # into Conversation.messages
    start: int
    end: int


@dataclass
class EvictionReport:
    role: str
    index: int
    preview: str
    tokens: int
    kept: float  # share of its tokens still cached, averaged over layers and heads


class Conversation:
    """Messages, the cache that has seen them, and the bookkeeping to extend both turn by turn."""

    def __init__(self, loaded: Loaded, policy: Policy, settings: ChatSettings | None = None):
        self.loaded = loaded
        self.settings = settings or ChatSettings()
        self.tokenizer = loaded.tokenizer
        self.plain = not getattr(self.tokenizer, "chat_template", None)
        if self.plain:
            self.tokenizer.chat_template = PLAIN_TEMPLATE
        self.stop_ids = stop_token_ids(self.tokenizer, loaded.model)
        self.cache = self._new_cache(policy)
        self.messages: list[dict] = []
        if self.settings.system:
            self.messages.append({"role": "system", "content": self.settings.system})
        self._restart()

    def _new_cache(self, policy: Policy) -> H2OCache:
        cache = H2OCache.for_model(self.loaded.model, policy, self.settings.positions, self.loaded.context)
        self.engine = Engine(self.loaded.model, cache, self.settings.decode)
        return cache

    def _restart(self) -> None:
        """Forget the cache; the next turn prefills the whole conversation (in chunks, within the budget)."""
        self.cache = self._new_cache(self.cache.policy)
        self.fed = 0  # tokens the cache has seen
        self.pending = self.pending_messages = 0  # tokens (and messages) the current turn reads before its reply
        self.spans: list[Span] = []
        self._unfed: int | None = None  # last sampled token, not yet fed to the cache
        self._fed_stop: int | None = None  # a stop token the engine fed while it ran one step ahead
        self.warned: set[int] = set()

    # -- settings ---------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.cache.policy

    def set_policy(self, policy: Policy) -> None:
        """New budget or policy, keeping what the cache holds (a smaller budget evicts now)."""
        self.cache.set_policy(policy)

    def set_system(self, text: str | None) -> None:
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})
        self._restart()

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self._restart()

    # -- rendering --------------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _new_turn_ids(self, user: dict) -> list[int]:
        return self._new_turn(user)[0]

    def _new_turn(self, user: dict) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids the cache has not seen yet for a new user message, and where each message ends in them:
        [(message index, end offset)], the new message being index len(self.messages)."""
        if self.fed == 0:  # nothing cached: the whole conversation (a loaded one keeps its messages apart)
            return self._whole_conversation([*self.messages, user])
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        marked = [dict(m) for m in self.messages]
        marked[last]["content"] = SENTINEL
        text = self._render([*marked, user], True)
        ids = self._encode(text.split(SENTINEL, 1)[1])
        if self._fed_stop is not None and ids and ids[0] == self._fed_stop:
            ids = ids[1:]  # the end-of-turn token the template adds is in the cache already
        ids = ([self._unfed] if self._unfed is not None else []) + ids
        return ids, [(len(self.messages), len(ids))]

    def _whole_conversation(self, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
        """Render the conversation once, and each prefix of it, to find the token offset where every message's
        rendering ends. A message whose prefix does not render as a prefix of the whole (a template that
        folds the system prompt into the first user turn, or refuses a partial conversation) shares the span
        of the message after it."""
        text = self._render(messages, True)
        ids, starts = self._encode_with_starts(text)
        ends = []
        for k in range(1, len(messages)):
            try:
                prefix = self._render(messages[:k], False)
            except Exception:  # jinja raises whatever the template's author chose
                continue
            if prefix and text.startswith(prefix):
                end = bisect.bisect_left(starts, len(prefix)) if starts is not None else len(self._encode(prefix))
                if 0 < end < len(ids) and (not ends or end > ends[-1][1]):
                    ends.append((k - 1, end))
        ends.append((len(messages) - 1, len(ids)))
        return ids, ends

    def _encode_with_starts(self, text: str) -> tuple[list[int], list[int] | None]:
        """Token ids and each token's start offset in the text (None for tokenizers without offsets)."""
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError):  # slow tokenizers have no offsets
            return self._encode(text), None
        return enc["input_ids"], [start for start, _ in enc["offset_mapping"]]

    # -- a turn -----------------------------------------------------------------------------------
    def send(self, text: str, max_new_tokens: int | None = None, *, progress: Progress = None) -> Iterator[Response]:
        """Add a user message and stream the reply. Stopping early (closing the iterator) keeps the partial
        reply in the conversation. `progress(done, total)` is called once with (0, new tokens) before they are
        read (after a note, if the budget is far too small for them, has gone to cache.notices), then after
        each prefill chunk."""
        user = {"role": "user", "content": text}
        ids, ends = self._new_turn(user)
        self.pending, self.pending_messages = len(ids), len(ends)  # what this turn reads before its reply
        note = budget_note(len(ids), self.policy.budget)
        if note:
            self.cache.notices.append(note)
        if progress is not None:
            progress(0, len(ids))
        self.messages.append(user)
        start = begin = self.fed
        for index, end in ends:  # one span per message (a whole loaded conversation has many)
            self.spans.append(Span(self.messages[index]["role"], index, begin, start + end))
            begin = start + end
        self.fed += len(ids)
        self._unfed = self._fed_stop = None
        self.cache.reserve(len(ids) + (max_new_tokens or self.settings.max_new_tokens))  # a full cache, once
        reply, last, count = [], None, 0
        reply_index = len(self.messages)
        try:
            for r in stream_generate(
                self.loaded.model,
                self.tokenizer,
                self.cache,
                ids,
                sampler=self.settings.sampler,
                chunk_size=self.settings.chunk_size,
                max_new_tokens=max_new_tokens or self.settings.max_new_tokens,
                stop_ids=self.stop_ids,
                stop_strings=(PLAIN_STOP,) if self.plain else (),
                progress=progress,
                engine=self.engine,
            ):
                last, count = r, count + 1
                reply.append(r.text)
                yield r
        finally:
            # every sampled token but the last has been fed; the last one too when the engine ran ahead. A stop
            # token that was not fed is added by the template next turn; one that was is not added again.
            fed_reply = max(0, count - 1)
            if last is not None and last.fed:
                fed_reply += 1
                if last.token in self.stop_ids:
                    self._fed_stop = last.token
            elif last is not None and last.token not in self.stop_ids:
                self._unfed = last.token
            self.fed += fed_reply
            self.messages.append({"role": "assistant", "content": "".join(reply)})
            self.spans.append(Span("assistant", reply_index, start + len(ids), self.fed))

    # -- eviction report --------------------------------------------------------------------------
    def evictions(self) -> list[EvictionReport]:
        """For each message the cache has seen: how much of it is still held."""
        out = []
        for span in self.spans:
            content = self.messages[span.index]["content"]
            preview = " ".join(content.split())[:48]
            out.append(
                EvictionReport(
                    span.role,
                    span.index,
                    preview,
                    span.end - span.start,
                    self.cache.kept_fraction(span.start, span.end),
                )
            )
        return out

    def newly_evicted_user_messages(self) -> list[EvictionReport]:
        """The user's earlier messages that have started losing tokens since the last check (once each)."""
        fresh = []
        for report in self.evictions():
            if report.role == "user" and report.kept < 1.0 and report.index not in self.warned:
                self.warned.add(report.index)
                fresh.append(report)
        return fresh

    # -- save / load ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        data = {"format": "h2o-chat/1", "model": self.loaded.spec.name, "messages": self.messages}
        try:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as e:
            raise InputError(f"cannot write {path}: {e.strerror}") from None
        return path

    def load(self, path: str | Path) -> int:
        """Replace the conversation by a saved one; it is prefilled on the next turn. Returns message count."""
        text = read_user_text(path, "conversation file")
        try:
            data = json.loads(text)
        except ValueError as e:
            raise InputError(f"{path} is not a saved conversation (invalid JSON: {e})") from None
        messages = data.get("messages") if isinstance(data, dict) else None
        if not is_messages(messages):
            raise InputError(f"{path} is not a saved conversation (expected a list of role/content messages)")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self._restart()
        return len(self.messages)
