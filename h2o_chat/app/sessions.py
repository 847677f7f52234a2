"""The server's conversations: which one a request continues, what it must read, and which idle ones are kept.

A `Session` is a conversation's cache row as its last reply left it, copied out of the engine
(`H2OCache.snapshot` of the row's view: a budget's slots, one row), with what that cache has seen: the messages
(chat) or the token ids (completions). Clients send the whole history every time:

- a chat request continues the idle session whose messages are its first messages, ending with the reply that
  session generated; it reads only what follows that reply, rendered as the chat reads a new turn
  (app/conversation.py's sentinel), so the reply's tokens are never re-tokenized from its text;
- a completion request continues the idle session whose fed token ids are a prefix of its prompt's ids;
- anything else starts a new session, read from the start (`Turn.read_again` when it carried earlier replies: the
  conversation was evicted, or asked for another budget or policy).

Idle sessions live in a `SessionStore`, least recently used first out, within a count and a memory limit.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from h2o_chat.app.conversation import SENTINEL
from h2o_chat.app.messages import encode, render

_ids = itertools.count(1)


@dataclass
class Session:
    kind: str  # "chat" | "text"
    cache_key: tuple  # (policy name, budget): a row of another key cannot continue it
    id: str = field(default_factory=lambda: f"conv-{next(_ids)}")
    messages: list[dict] = field(default_factory=list)  # chat: what the cache has seen, ending with the reply
    ids: list[int] = field(default_factory=list)  # text: the token ids the cache has seen
    fed: int = 0  # tokens the cache has seen
    unfed: int | None = None  # the reply's last token, sampled but not fed (the next turn reads it first)
    fed_stop: int | None = None  # an end-of-turn token already fed (the template's own is then skipped)
    state: dict | None = None  # the row's snapshot while idle; None while the conversation holds a row
    nbytes: int = 0
    turns: int = 0


@dataclass
class Turn:
    """What a request reads into its conversation's row before the reply."""

    session: Session
    ids: list[int]  # tokens to read now
    cached: int  # tokens the conversation had seen already (not read again)
    read_again: bool  # the request carried earlier replies that no idle session held: read from the start


def snapshot_bytes(state: dict) -> int:
    slots = state.get("slots")
    if slots is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*slots.slot_tensors(), slots.seen, slots.next_rot))


class SessionStore:
    """Idle sessions, most recently used last; `put` evicts the least recently used beyond the limits."""

    def __init__(self, max_sessions: int, memory_limit: int):
        self.max_sessions, self.memory_limit = max_sessions, memory_limit
        self._idle: OrderedDict[str, Session] = OrderedDict()
        self.evicted = 0  # sessions dropped for the limits so far

    def __len__(self) -> int:
        return len(self._idle)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._idle.values())

    def put(self, session: Session) -> None:
        """Keep an idle session (its snapshot in `state`); the least recently used go beyond the limits."""
        self._idle[session.id] = session
        self._idle.move_to_end(session.id)
        while self._idle and (len(self._idle) > self.max_sessions or self.nbytes > self.memory_limit):
            self._idle.popitem(last=False)
            self.evicted += 1

    def take_chat(self, cache_key: tuple, messages: tuple[dict, ...]) -> Session | None:
        """The idle chat session that `messages` continue (the longest, if several), taken out of the store."""
        best = None
        for s in self._idle.values():
            n = len(s.messages)
            if s.kind == "chat" and s.cache_key == cache_key and n < len(messages) and list(messages[:n]) == s.messages:
                best = s if best is None or n > len(best.messages) else best
        return self._idle.pop(best.id) if best is not None else None

    def take_text(self, cache_key: tuple, ids: list[int]) -> Session | None:
        """The idle completion session whose fed ids are a prefix of `ids` (the longest), taken out."""
        best = None
        for s in self._idle.values():
            n = len(s.ids)
            if s.kind == "text" and s.cache_key == cache_key and 0 < n < len(ids) and ids[:n] == s.ids:
                best = s if best is None or n > len(best.ids) else best
        return self._idle.pop(best.id) if best is not None else None

    def describe(self) -> list[dict]:
        return [{"id": s.id, "kind": s.kind, "tokens": s.fed, "turns": s.turns, "bytes": s.nbytes}
                for s in self._idle.values()]  # fmt: skip


def plan_turn(store: SessionStore, req, tokenizer) -> Turn:
    """The session a request continues (taken out of the store) or a new one, and the tokens it reads now."""
    key = req.cache_key
    if req.kind == "text":
        ids = tokenizer(req.prompt)["input_ids"]
        session = store.take_text(key, ids)
        if session is not None:
            return Turn(session, ids[len(session.ids) :], session.fed, False)
        return Turn(Session("text", key), ids, 0, False)
    messages = req.messages
    session = store.take_chat(key, messages)
    if session is not None:
        ids = continuation(tokenizer, session, messages[len(session.messages) :])
        if ids:
            return Turn(session, ids, session.fed, False)
        store.evicted += 1  # the template does not render its replies where they were: read the whole again
    ids = encode(tokenizer, render(tokenizer, list(messages)))
    return Turn(Session("chat", key), ids, 0, any(m["role"] == "assistant" for m in messages))


def continuation(tokenizer, session: Session, new: tuple[dict, ...]) -> list[int] | None:
    """The ids a chat session has not seen: the conversation rendered with a sentinel for its last reply, what
    follows the sentinel (as Conversation._new_turn); None when the template does not render that reply."""
    marked = [dict(m) for m in session.messages]
    marked[-1]["content"] = SENTINEL
    text = render(tokenizer, [*marked, *new])
    if SENTINEL not in text:
        return None
    ids = encode(tokenizer, text.split(SENTINEL, 1)[1])
    if session.fed_stop is not None and ids and ids[0] == session.fed_stop:
        ids = ids[1:]  # the end-of-turn token the template adds is in the cache already
    return ([session.unfed] if session.unfed is not None else []) + ids


def end_turn(session: Session, req, turn: Turn, generated: list[int], text: str, fed_last: bool, stop_ids) -> None:
    """Record a finished reply: every generated token but the last has been fed (the last too when `fed_last`)."""
    fed = len(turn.ids) + max(0, len(generated) - 1)
    last = generated[-1] if generated else None
    session.unfed = session.fed_stop = None
    if last is not None and fed_last:
        fed += 1
        session.fed_stop = last if last in stop_ids else None
    elif last is not None and last not in stop_ids:
        session.unfed = last
    session.fed += fed
    session.turns += 1
    if req.kind == "chat":
        session.messages = [*req.messages, {"role": "assistant", "content": text}]
    else:
        session.ids = [*session.ids, *turn.ids, *generated[: max(0, len(generated) - 1)]]
        if fed_last and generated:
            session.ids.append(generated[-1])
