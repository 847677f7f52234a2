"""The server's conversations: which one a request continues, what it must read, and which idle ones are kept.

A `Session` is a conversation's cache row as its last reply left it, copied out of the engine
(`H2OCache.snapshot` of the row's view: a budget's slots, one row), with what that cache has seen: the messages
(chat) or the token ids (completions). Clients send the whole history every time:

- a chat request continues the idle session whose messages are its first messages, ending with the reply that
  session generated; it reads only what follows that reply, rendered as the chat reads a new turn
  (app/chat/conversation.py's sentinel), so the reply's tokens are never re-tokenized from its text;
- a completion request continues the idle session whose fed token ids are a prefix of its prompt's ids;
- anything else starts a new session, read from the start (`Turn.read_again` when it carried earlier replies: the
  conversation was evicted, or asked for another budget or policy).

A session belongs to the scope that made it (the API key shown, the request's `user` and `cache_salt`): only a
request of that scope may continue it, so a client never learns whether another's conversation exists (nor its
id, which is random). Idle sessions live in a `SessionStore`, least recently used first out, within a count and a
memory limit; with --session-dir the ones those limits would drop go to disk instead (app/serve/session_disk.py) and
come back on their next turn. Requests are planned (matched, tokenized, checked against --max-prompt-tokens)
outside the engine thread, so the store takes a lock; a session taken out of it belongs to that request alone.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from h2o_chat.app.chat.template import reply_end, turn_ids
from h2o_chat.app.messages import chat_ids
from h2o_chat.app.serve.api import ApiError
from h2o_chat.engine.step.sampling import PENALTY_WINDOW
from h2o_chat.engine.storage.persist import StateError
from h2o_chat.errors import InputError

# A prompt with more characters to read than this many per token allowed is refused before it is tokenized (no
# text averages near 16 characters a token: English ~4.5, code ~3.5), so a huge body costs no tokenizer time
MAX_CHARS_PER_TOKEN = 16


@dataclass
class Session:
    kind: str  # "chat" | "text"
    cache_key: tuple  # (policy name, budget): a row of another key cannot continue it
    scope: tuple = ()  # (API key, user, cache salt) of the requests that may continue it
    id: str = field(default_factory=lambda: f"conv-{secrets.token_hex(8)}")
    messages: list[dict] = field(default_factory=list)  # chat: what the cache has seen, ending with the reply
    ids: list[int] = field(default_factory=list)  # text: the token ids the cache has seen
    text: str = ""  # text: the prompt and reply those ids came from (to size a continuation before tokenizing)
    fed: int = 0  # tokens the cache has seen
    unfed: int | None = None  # the reply's last token, sampled but not fed (the next turn reads it first)
    fed_stop: int | None = None  # an end-of-turn token already fed (the template's own is then skipped)
    seam: tuple[str, str] | None = None  # chat: its reply was cut by a stop string (`TextStream.seam`)
    tail: list[int] = field(default_factory=list)  # the last tokens its cache read (the penalty's window)
    state: dict | None = None  # the row's snapshot while idle; None while the conversation holds a row
    nbytes: int = 0
    turns: int = 0
    path: Path | None = None  # idle on disk (--session-dir): its snapshot's file, read back on its next turn
    policy: object = None  # on disk: the policy its snapshot was taken with


@dataclass
class Turn:
    """What a request reads into its conversation's row before the reply."""

    session: Session
    ids: list[int]  # tokens to read now
    cached: int  # tokens the conversation had seen already (not read again)
    read_again: bool  # the request carried earlier replies that no idle session held: read from the start
    from_disk: bool = False  # the conversation was idle on disk (--session-dir) and was read back


def snapshot_bytes(state: dict) -> int:
    """What an idle conversation's snapshot holds: its slots and, under recall, its store (`Table.nbytes`)."""
    return sum(table.nbytes() for table in (state.get("slots"), state.get("store")) if table is not None)


class SessionStore:
    """Idle sessions, most recently used last; `put` evicts the least recently used beyond the limits, to `disk`
    when there is one (then the disk's own count limit drops its least recently used)."""

    def __init__(self, max_sessions: int, memory_limit: int, disk=None):
        self.max_sessions, self.memory_limit, self.disk = max_sessions, memory_limit, disk
        self._idle: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0  # sessions dropped for the limits so far
        self.disk_errors: list[str] = []  # why files could not be written or read back (the last few)

    def __len__(self) -> int:
        return len(self._idle)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._idle.values())

    @property
    def on_disk(self) -> int:
        with self._lock:
            return sum(s.path is not None for s in self._idle.values())

    def put(self, session: Session) -> None:
        """Keep an idle session (its snapshot in `state`); the least recently used in memory go beyond the limits,
        to disk when there is one. Writing holds the lock: a request never misses a session on its way there."""
        with self._lock:
            self._idle[session.id] = session
            self._idle.move_to_end(session.id)
            held = [s for s in self._idle.values() if s.state is not None]  # least recently used first
            nbytes = sum(s.nbytes for s in held)
            while held and (len(held) > self.max_sessions or nbytes > self.memory_limit):
                s = held.pop(0)
                nbytes -= s.nbytes
                self._spill(s)
            if self.disk is not None:
                files = [s for s in self._idle.values() if s.path is not None]
                for s in files[: max(0, len(files) - self.disk.max_files)]:
                    self._drop(s)

    def _spill(self, session: Session) -> None:
        if self.disk is None:
            self._drop(session)
            return
        try:
            self.disk.write(session)
        except StateError as e:
            self._note(str(e))
            self._drop(session)

    def _drop(self, session: Session) -> None:
        self._idle.pop(session.id, None)
        if self.disk is not None:
            self.disk.remove(session)
        self.evicted += 1

    def _note(self, why: str) -> None:
        self.disk_errors = [*self.disk_errors[-4:], why]

    def read_back(self, session: Session | None) -> tuple[Session | None, bool]:
        """A session taken out of the store with its snapshot (read back from disk when it was there): (the
        session, whether it came from disk); (None, False) when its file could not be read (it is dropped)."""
        if session is None or session.path is None:
            return session, False
        try:
            self.disk.read(session)
        except StateError as e:
            self._note(str(e))
            self.evicted += 1
            return None, False
        session.nbytes = snapshot_bytes(session.state)
        return session, True

    def close(self) -> None:
        """The server stops: the files it wrote go (they are its memory, not an archive)."""
        with self._lock:
            for s in self._idle.values():
                if self.disk is not None:
                    self.disk.remove(s)

    def holds(self, session: Session) -> bool:
        return session.id in self._idle

    def _take(self, longest: Session | None) -> Session | None:
        return self._idle.pop(longest.id) if longest is not None else None

    def _mine(self, kind: str, scope: tuple, cache_key: tuple) -> list[Session]:
        return [s for s in self._idle.values() if s.kind == kind and s.scope == scope and s.cache_key == cache_key]

    def take_chat(self, scope: tuple, cache_key: tuple, messages: tuple[dict, ...]) -> Session | None:
        """The idle chat session of `scope` that `messages` continue (the longest, if several), taken out."""
        with self._lock:
            best = None
            for s in self._mine("chat", scope, cache_key):
                n = len(s.messages)
                if n < len(messages) and list(messages[:n]) == s.messages:
                    best = s if best is None or n > len(best.messages) else best
            return self._take(best)

    def text_known(self, scope: tuple, cache_key: tuple, prompt: str) -> int:
        """Characters at the start of `prompt` that an idle completion session of `scope` has read already."""
        with self._lock:
            return max((len(s.text) for s in self._mine("text", scope, cache_key) if prompt.startswith(s.text)),
                       default=0)  # fmt: skip

    def take_text(self, scope: tuple, cache_key: tuple, ids: list[int]) -> Session | None:
        """The idle completion session of `scope` whose fed ids are a prefix of `ids` (the longest), taken out."""
        with self._lock:
            best = None
            for s in self._mine("text", scope, cache_key):
                n = len(s.ids)
                if 0 < n < len(ids) and ids[:n] == s.ids:
                    best = s if best is None or n > len(best.ids) else best
            return self._take(best)


def plan_turn(store: SessionStore, req, tokenizer, max_prompt_tokens: int) -> Turn:
    """The session a request continues (taken out of the store) or a new one, and the tokens it reads now; an
    ApiError (400) when those are more than `max_prompt_tokens` (then nothing is taken). Runs outside the engine
    thread: a huge prompt is refused by its characters before it is tokenized."""
    key, scope = req.cache_key, req.scope
    if req.kind == "text":
        _check_chars(len(req.prompt) - store.text_known(scope, key, req.prompt), max_prompt_tokens)
        ids = tokenizer(req.prompt)["input_ids"]
        session, from_disk = store.read_back(store.take_text(scope, key, ids))
        if session is not None:
            turn = Turn(session, ids[len(session.ids) :], session.fed, False, from_disk)
        else:
            turn = Turn(Session("text", key, scope), ids, 0, False)
        return _within(store, turn, max_prompt_tokens)
    session, from_disk = store.read_back(store.take_chat(scope, key, req.messages))
    try:
        return _plan_chat(store, req, tokenizer, max_prompt_tokens, session, from_disk)
    except InputError as e:  # the chat template refuses these messages
        if session is not None and not store.holds(session):
            store.put(session)
        raise ApiError(400, f'"messages": {e}', param="messages") from None


def _plan_chat(store: SessionStore, req, tokenizer, max_prompt_tokens: int, session, from_disk: bool) -> Turn:
    key, scope, messages = req.cache_key, req.scope, req.messages
    new = messages[len(session.messages) :] if session is not None else messages
    try:
        _check_chars(sum(len(m["content"]) for m in new), max_prompt_tokens)
    except ApiError:
        if session is not None:
            store.put(session)
        raise
    if session is not None:
        ids = continuation(tokenizer, session, new)
        if ids:
            return _within(store, Turn(session, ids, session.fed, False, from_disk), max_prompt_tokens)
        store.evicted += 1  # its cache cannot be continued with these messages (`continuation`): read them again
    ids = chat_ids(tokenizer, list(messages))
    turn = Turn(Session("chat", key, scope), ids, 0, any(m["role"] == "assistant" for m in messages))
    return _within(store, turn, max_prompt_tokens)


def _too_long(what: str, limit: int) -> ApiError:
    return ApiError(
        400, f"this request would read {what}, more than this server reads for one request (--max-prompt-tokens "
        f"{limit}); send a shorter prompt (a conversation this server kept reads only its new messages)",
        param="messages", code="context_length_exceeded",
    )  # fmt: skip


def _check_chars(chars: int, limit: int) -> None:
    if chars > MAX_CHARS_PER_TOKEN * limit:
        raise _too_long(f"{chars:,} characters (over {MAX_CHARS_PER_TOKEN} per token allowed)", limit)


def _within(store: SessionStore, turn: Turn, limit: int) -> Turn:
    if len(turn.ids) > limit:
        if turn.session.state is not None:  # a conversation that was idle stays as it was
            store.put(turn.session)
        raise _too_long(f"{len(turn.ids):,} prompt tokens", limit)
    return turn


def continuation(tokenizer, session: Session, new: tuple[dict, ...]) -> list[int] | None:
    """The ids a chat session has not seen (`template.turn_ids`, as the chat reads a new turn); None when its cache
    cannot be continued: the template does not render its reply where it was, or the cache has read text past a
    reply cut by a stop string that these messages do not hold (the client's history is the conversation)."""
    return turn_ids(tokenizer, session.messages, list(new), session.unfed, session.fed_stop, session.seam)


def end_turn(
    session: Session, req, turn: Turn, generated: list[int], text: str, fed_last: bool, stop_ids, seam=None
) -> None:
    """Record a finished reply: every generated token but the last has been fed (the last too when `fed_last`);
    `seam`: where a stop string cut it (`TextStream.seam`)."""
    session.seam = seam if req.kind == "chat" else None  # a completion continues only by its token ids
    fed, session.unfed, session.fed_stop = reply_end(generated, fed_last, stop_ids)
    read = [*turn.ids, *generated[:fed]]  # what the cache read this turn
    session.fed += len(read)
    session.tail = [*session.tail, *read][-PENALTY_WINDOW:]
    session.turns += 1
    if req.kind == "chat":
        session.messages = [*req.messages, {"role": "assistant", "content": text}]
    else:
        session.ids = [*session.ids, *read]
        session.text = req.prompt + text
