"""A conversation over one H2O cache: each turn prefills only the new text, the cache carries over.

Its parts: the chat template that finds each turn's new tokens (`template.py`), the ledger of where each message
lies and how much of it is held (`ledger.py`), and the engine that reads and replies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from h2o_chat.app.chat.ledger import EvictionReport, Ledger, Span
from h2o_chat.app.chat.slowdown import TurnPace
from h2o_chat.app.chat.template import ChatTemplate, reply_end
from h2o_chat.app.messages import PLAIN_STOP, read_conversation, write_conversation
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import Policy
from h2o_chat.engine.policies.snap import columns_read
from h2o_chat.engine.stats import CacheStats
from h2o_chat.engine.step.decode import Engine, PrefillInterrupted, Progress
from h2o_chat.engine.step.generate import Response, Sampler, stop_token_ids, stream_generate
from h2o_chat.engine.step.sampling import PENALTY_WINDOW
from h2o_chat.engine.storage.slots import slot_bytes
from h2o_chat.errors import DeviceError, InputError, out_of_memory
from h2o_chat.models.loading import Loaded
from h2o_chat.models.memory import prefill_chunk
from h2o_chat.models.prebuild import builder_for

__all__ = ["ChatSettings", "Conversation", "EvictionReport", "Span", "budget_note"]

UNDO_SNAPSHOT_BYTES = 64 * 2**20  # a cache up to this size is copied before each turn, for /undo
FAR_BEYOND = 8  # a prompt longer than this many budgets is mostly evicted while it is read


def budget_note(prompt_tokens: int, budget: int | None, how: str = "--budget") -> str | None:
    """A note for a prompt far beyond what the budget can use well, or None; `how` is the way to change the
    budget where the note is read (--budget on the command line, /budget in the chat)."""
    if budget is None or prompt_tokens <= FAR_BEYOND * budget:
        return None
    return (
        f"the prompt is {prompt_tokens:,} tokens, {prompt_tokens // budget}x the budget of {budget}: the cache "
        f"keeps about {100 * budget / prompt_tokens:.0f}% of it; a larger budget ({how}) keeps more"
    )


@dataclass(frozen=True)
class ChatSettings:
    max_new_tokens: int = 512
    sampler: Sampler = field(default_factory=Sampler)
    chunk_size: int | None = None  # None: the device's (`prefill.default_chunk`)
    system: str | None = None
    positions: str = "auto"
    kv_quant: str = "none"  # "8bit": held keys and values in int8 (`engine/storage/quant.py`)
    decode: str = "auto"  # how decode steps run: auto | eager | graph (see h2o_chat.engine)
    stop: tuple[str, ...] = ()  # stop strings (--stop): the reply ends before the first one
    chat_template: tuple[str, str] | None = None  # --chat-template: (its file, its Jinja text), not the tokenizer's
    ignore_eos: bool = False  # --ignore-eos: replies run to max_new_tokens past the end-of-sequence token


class Conversation:
    """Messages, the cache that has seen them, and the bookkeeping to extend both turn by turn."""

    def __init__(self, loaded: Loaded, policy: Policy, settings: ChatSettings | None = None):
        self.loaded = loaded
        self.settings = settings or ChatSettings()
        self.template = ChatTemplate(loaded.tokenizer, self.settings.chat_template)
        self.tokenizer = self.template.tokenizer
        self.stop_ids = stop_token_ids(self.tokenizer, loaded.model)
        self.budget_hint = "--budget"  # how the user changes the budget, for notes (the chat says /budget)
        self._on_setup: Callable[[str], None] | None = None
        self.pace = TurnPace()  # speeds without one-time setup; decode that collapses on a busy CPU is said once
        self.cache = self._new_cache(policy)
        self.messages: list[dict] = []
        if self.settings.system:
            self.messages.append({"role": "system", "content": self.settings.system})
        self._saved = list(self.messages)  # as last saved or loaded: what /load may replace without asking
        self._restart()

    def _new_cache(self, policy: Policy) -> H2OCache:
        settings = self.settings
        cache = H2OCache.for_model(
            self.loaded.model, policy, settings.positions, self.loaded.context, kv_quant=settings.kv_quant
        )
        self.engine = Engine(self.loaded.model, cache, self.settings.decode)
        self.engine.on_setup = self._on_setup
        self.engine.builder = builder_for(self.loaded, self._on_setup)
        return cache

    def _restart(self, policy: Policy | None = None, new_cache: bool = True) -> None:
        """Forget the cache; the next turn prefills the whole conversation (in chunks, within the budget).
        `new_cache` False: the cache and engine stay, for a saved state to be restored into them
        (`app/chat/resume.py`)."""
        if new_cache:
            self.cache = self._new_cache(policy or self.cache.policy)
        self.fed = 0  # tokens the cache has seen
        self.pending = self.pending_messages = 0  # tokens (and messages) the current turn reads before its reply
        self.ledger = Ledger()  # where each message lies, what the user was told of it, what recall brought back
        self._unfed: int | None = None  # last sampled token, not yet fed to the cache
        self._fed_stop: int | None = None  # a stop token the engine fed while it ran one step ahead
        self._seam: tuple[str, str] | None = None  # a reply cut by a stop string: `TextStream.seam`
        self._tail: list[int] = []  # the last tokens the cache read: the repetition penalty's window sees them
        self._undo: tuple | None = None  # how to go back to before the last turn (/undo), when it can

    # -- settings ---------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.cache.policy

    @property
    def on_setup(self) -> Callable[[str], None] | None:
        """Told before a one-time capture or compilation of the decode step, whichever engine runs the turn."""
        return self._on_setup

    @on_setup.setter
    def on_setup(self, callback: Callable[[str], None] | None) -> None:
        self._on_setup = self.engine.on_setup = callback
        self.engine.builder = builder_for(self.loaded, callback)

    def set_policy(self, policy: Policy) -> None:
        """New budget or policy, keeping what the cache holds (a smaller budget evicts now). Out of memory
        while the cache moves: the old policy stays, and the next turn re-reads the conversation."""
        old = self.cache.policy
        self._undo = None  # a snapshot from before holds the old policy's slots
        try:
            self.cache.set_policy(policy)
        except Exception as e:
            if not out_of_memory(e):
                raise
            self._restart(old)
            raise DeviceError(
                f"out of memory while the cache moved to {policy.describe()}; it keeps {old.describe()}"
            ) from None

    def set_sampling(self, **changes) -> None:
        """Change settings for the next turns (sampler, max_new_tokens, ...): /set in the chat."""
        self.settings = dataclasses.replace(self.settings, **changes)
        if "sampler" in changes:
            self.engine.set_sampler(None, 1)  # the engine reuses a sampler's device state: start a fresh one

    def set_system(self, text: str | None) -> None:
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})
        self._restart()

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self._restart()

    def undo_last_turn(self) -> tuple[str, bool]:
        """Take back the last user message and its reply: the cache goes back to before them when the last turn
        kept a snapshot (True), else it restarts and the next turn re-reads the conversation (False)."""
        undo, self._undo = self._undo, None
        last = max((i for i, m in enumerate(self.messages) if m["role"] == "user"), default=None)
        if undo is None or last is None or undo[0] != last or len(self.messages) != last + 2:
            return self.drop_last_turn(), False
        _, before, (fed, spans), carried = undo
        text = self.messages[last]["content"]
        del self.messages[last:]
        self.fed, self.ledger.spans = fed, spans
        self._unfed, self._fed_stop, self._seam, self._tail = carried
        self.ledger.recalled = {}
        self.ledger.warned.pop(last, None)
        self.cache.restore(before)
        return text, True

    def drop_last_turn(self) -> str:
        """Take back the last user message and whatever replied to it (a reply to generate again, or a turn
        that failed); the cache restarts and the next turn re-reads the conversation. Returns the message."""
        last = max((i for i, m in enumerate(self.messages) if m["role"] == "user"), default=None)
        if last is None:
            raise InputError("there is no message to answer again yet")
        text = self.messages[last]["content"]
        del self.messages[last:]
        self._restart()
        return text

    # -- rendering --------------------------------------------------------------------------------
    def _new_turn(self, user: dict) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids the cache has not seen yet for a new user message, and where each message ends in them:
        [(message index, end offset)], the new message being index len(self.messages)."""
        if self.fed == 0:  # nothing cached: the whole conversation (a loaded one keeps its messages apart)
            return self.template.whole([*self.messages, user])
        return self.template.next_turn(self.messages, user, self._unfed, self._fed_stop, self._seam)

    def reads(self, tokens: int) -> int:
        """Columns a turn of `tokens` new tokens is read for: snap reads an overflowing prompt twice (its probe
        chooses what the second read keeps)."""
        return columns_read(self.cache, tokens)

    # -- a turn -----------------------------------------------------------------------------------
    def send(
        self,
        text: str,
        max_new_tokens: int | None = None,
        *,
        progress: Progress = None,
        raw: bool = False,
        ids: list[int] | None = None,
    ) -> Iterator[Response]:
        """Add a user message and stream the reply. Stopping early (closing the iterator) keeps the partial
        reply in the conversation. `progress(done, total)` is called once with (0, total) before the new tokens
        are read (after a note, if the budget is far too small for them, has gone to cache.notices), then after
        each prefill chunk; total counts every pass over them (snap reads twice). `raw`: the text is continued
        as it is, without the chat template (a one-shot prompt). `ids`: the tokens to read, made already (the
        rest of a prompt whose start came from --prompt-cache: `app/prompt_cache.py`)."""
        user = {"role": "user", "content": text}
        if ids is not None:
            ends = [(len(self.messages), len(ids))]
        elif raw:
            ids = self.tokenizer(text)["input_ids"]
            ends = [(len(self.messages), len(ids))]
        else:
            ids, ends = self._new_turn(user)
        note = budget_note(len(ids), self.policy.budget, self.budget_hint)  # the new text's own length
        # checked before anything changes: a prompt that cannot be read leaves the conversation as it was
        chunk, smaller = prefill_chunk(self.loaded.model, self.cache, 1, len(ids), self.settings.chunk_size)
        self.pending, self.pending_messages = len(ids), len(ends)  # what this turn reads before its reply
        if note:
            self.cache.notices.append(note)
        if smaller:
            self.cache.notices.append(smaller)
        # Ctrl-C while a message is read stops after the chunk being read (a message of one chunk is read whole):
        # the turn is then taken back, before its reply has a token, and the cache restored from this copy
        before = self.cache.snapshot() if len(ids) > chunk or self._cheap_snapshot() else None
        kept = (self.fed, list(self.ledger.spans))  # what a taken-back turn restores
        if progress is not None:
            progress(0, self.reads(len(ids)))
        self.messages.append(user)
        start = begin = self.fed
        for index, end in ends:  # one span per message (a whole loaded conversation has many)
            self.ledger.spans.append(Span(self.messages[index]["role"], index, begin, start + end))
            begin = start + end
        self.fed += len(ids)
        carried = (self._unfed, self._fed_stop, self._seam, self._tail)  # what the last turn left (and restores)
        self._unfed = self._fed_stop = self._seam = None
        self.cache.reserve(len(ids) + (max_new_tokens or self.settings.max_new_tokens))  # a full cache, once
        reply, tokens, last, count, taken_back = [], [], None, 0, False
        reply_index = len(self.messages)
        self.pace.start(self.engine.setup_seconds)
        stops = (*((PLAIN_STOP,) if self.template.plain and not raw else ()), *self.settings.stop)
        try:
            for r in stream_generate(
                self.loaded.model,
                self.tokenizer,
                self.cache,
                ids,
                sampler=self._reply_sampler(),
                chunk_size=chunk,
                max_new_tokens=max_new_tokens or self.settings.max_new_tokens,
                stop_ids=set() if self.settings.ignore_eos else self.stop_ids,
                stop_strings=stops,
                progress=progress,
                engine=self.engine,
                history=self._tail,
            ):
                last, count = r, count + 1
                tokens.append(r.token)
                if note := self.pace.token(count, self.engine.setup_seconds):
                    self.cache.notices.append(note)
                reply.append(r.text)
                yield r
        except PrefillInterrupted as e:  # read in part or whole, no reply yet: it leaves no empty reply behind
            self._take_back(user, before, kept, carried, e)
            taken_back = True
            raise
        finally:
            if not taken_back:
                self._end_turn(reply, tokens, last, ids, start + len(ids), reply_index)
                self._undo = None if before is None or raw else (reply_index - 1, before, kept, carried)

    def _reply_sampler(self) -> Sampler:
        """This reply's sampler: a fresh draw each reply unless a seed was given, which repeats (the same text at the
        same place gives the same reply). A Sampler's automatic seed is drawn once, and each prompt starts the
        draw count again, so reusing one made every reply's k-th draw the same noise."""
        sampler = self.settings.sampler
        return sampler if sampler.seed is not None else sampler.reseeded()

    def _cheap_snapshot(self) -> bool:
        """Whether a copy of the cache before each turn (for /undo) is cheap: a bounded cache of a small model's
        size. A large one is not copied every turn; /undo then re-reads the conversation."""
        stats = self.cache.stats()
        return self.policy.budget is not None and stats.kv_bytes + stats.store_bytes <= UNDO_SNAPSHOT_BYTES

    def _end_turn(
        self, reply: list[str], tokens: list[int], last, ids: list[int], reply_start: int, reply_index: int
    ) -> None:
        """Record the reply (`tokens`, its last record `last`) after the turn's `ids`: what the cache read of it
        (`reply_end`), where a --stop string cut it, and the tokens the next turn's repetition window starts with."""
        fed_reply, self._unfed, self._fed_stop = reply_end(tokens, last is not None and last.fed, self.stop_ids)
        self._seam = last.seam if last is not None else None  # a --stop string cut the reply: `turn_ids`
        self._tail = [*self._tail, *ids, *tokens[:fed_reply]][-PENALTY_WINDOW:]
        self.fed += fed_reply
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        self.ledger.spans.append(Span("assistant", reply_index, reply_start, self.fed))
        self.ledger.tell_recalled(self.cache.store, self.messages)

    def _take_back(self, user: dict, before: dict | None, kept, carried, stopped: PrefillInterrupted) -> None:
        """A message whose reading was stopped leaves no trace: the cache, the tokens fed and the spans as they
        were before it (`before`, `kept`), the message gone. `stopped` says how far the reading got."""
        del self.messages[next(i for i, m in enumerate(self.messages) if m is user) :]
        self.fed, self.ledger.spans = kept
        self._unfed, self._fed_stop, self._seam, self._tail = carried
        if before is not None:
            self.cache.restore(before)
        else:
            self._restart()
        self.stopped_reading = (stopped.done, stopped.total)

    def speeds(self, record: Response) -> tuple[float, float | None, float]:
        """This turn's (prompt tok/s, decode tok/s, one-time setup seconds): see `TurnPace.speeds`."""
        return self.pace.speeds(record)

    def stats(self) -> CacheStats:
        """The cache's stats as the user is shown them (recall's store included: its bytes as allocated, its tokens
        and drops). In use: the held tokens' keys and values, counted as the full cache's figure counts a token (the
        slots' positions and scores are part of what is allocated; counted in use, they put it above the full
        cache's figure while nothing was evicted)."""
        stats, slots = self.cache.stats(), self.cache.slots
        if slots is not None:
            per_slot = slots.slot_bytes()
            keys_values = per_slot - slot_bytes(0, 0, 1)  # less the position, rotation and score of a slot
            stats = dataclasses.replace(stats, kv_used_bytes=stats.kv_used_bytes * keys_values // per_slot)
        return stats

    # -- eviction report --------------------------------------------------------------------------
    def evictions(self) -> list[EvictionReport]:
        """For each message the cache has seen: how much of it is still held."""
        return self.ledger.reports(self.cache, self.messages)

    def newly_evicted_user_messages(self) -> list[EvictionReport]:
        """The user's earlier messages that have fallen below a warning level since the last check (each once)."""
        return self.ledger.newly_evicted_user_messages(self.cache, self.messages)

    # -- save / load ------------------------------------------------------------------------------
    @property
    def unsaved(self) -> int:
        """How many messages (the system prompt aside) a /load would lose: those after what was last saved or
        loaded (0 right after a save or a load, or after an /undo back into it)."""
        same = next((i for i, (m, s) in enumerate(zip(self.messages, self._saved, strict=False)) if m != s), None)
        if same is None:
            same = min(len(self.messages), len(self._saved))
        return sum(m["role"] != "system" for m in self.messages[same:])

    def save(self, path: str | Path) -> Path:
        """Write the conversation, system prompt included, as /load reads it."""
        path = write_conversation(path, self.loaded.spec.name, self.messages)
        self._saved = list(self.messages)
        return path

    def load(self, path: str | Path) -> int:
        """Replace the conversation by a saved one (or a bare list of messages); it is prefilled on the next
        turn. Returns the message count."""
        self.messages = read_conversation(path)
        self._saved = list(self.messages)
        self._restart()
        return len(self.messages)
