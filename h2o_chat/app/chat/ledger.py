"""Where each message of a conversation lies in the token stream, how much of it the cache still holds, and what
the recall policy brought back from it: what /evicted shows and the chat warns of."""

from __future__ import annotations

from dataclasses import dataclass, field

# the shares of a user's message held that they are told about, once each: below half the model answers from
# part of it, below a tenth it has mostly lost it (a note each time 1% went was noise, and missed these)
WARN_BELOW = (0.5, 0.1)


def warn_level(kept: float) -> float:
    """The lowest of WARN_BELOW that `kept` is under (1.0: none)."""
    return min((level for level in WARN_BELOW if kept < level), default=1.0)


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
    recalled: float = 0.0  # share of what the last turn recalled from evicted tokens that came from it (recall)


def preview(messages: list[dict], index: int, width: int = 48) -> str:
    return " ".join(messages[index]["content"].split())[:width]


@dataclass
class Ledger:
    """A conversation's spans and what the user was told of them. `spans`, `warned` and `told` carry over with
    the cache (a saved conversation keeps them); `recalled` and `recall_note` are the last turn's."""

    spans: list[Span] = field(default_factory=list)
    warned: dict[int, float] = field(default_factory=dict)  # message index -> the WARN_BELOW level last told
    told: tuple[int, ...] = ()  # the messages the last recall note named
    recalled: dict[int, float] = field(default_factory=dict)  # message index -> share of the last turn's recalls
    recall_note: str | None = None  # what the last turn recalled, when that is news (recall)

    def reports(self, cache, messages: list[dict]) -> list[EvictionReport]:
        """For each message the cache has seen: how much of it is still held."""
        return [
            EvictionReport(
                span.role,
                span.index,
                preview(messages, span.index),
                span.end - span.start,
                cache.kept_fraction(span.start, span.end),
                self.recalled.get(span.index, 0.0),
            )
            for span in self.spans
        ]

    def newly_evicted_user_messages(self, cache, messages: list[dict]) -> list[EvictionReport]:
        """The user's earlier messages that have fallen below a level of WARN_BELOW since the last check (each
        level once per message)."""
        fresh = []
        for report in self.reports(cache, messages):
            level = warn_level(report.kept)
            if report.role == "user" and level < self.warned.get(report.index, 1.0):
                self.warned[report.index] = level
                fresh.append(report)
        return fresh

    def tell_recalled(self, store, messages: list[dict]) -> None:
        """The recall policy: which earlier messages the turn brought tokens back from (`store`'s counts, taken),
        while reading the message and writing the reply (the user is told the main ones; /evicted shows every
        share)."""
        self.recalled, self.recall_note = {}, None
        if store is None:
            return
        counts = store.take_counts()
        if counts.numel() == 0 or not counts.sum():
            return
        counts, total = counts[0], float(counts[0].sum())
        for span in self.spans:
            got = float(counts[span.start : span.end].sum()) / total
            if got >= 0.005:
                self.recalled[span.index] = self.recalled.get(span.index, 0.0) + got
        top = [(i, share) for i, share in sorted(self.recalled.items(), key=lambda kv: -kv[1])[:3] if share >= 0.05]
        named = tuple(sorted(i for i, _ in top))
        if top and named != self.told:  # said when the messages it recalls from change, not every turn
            self.told = named
            parts = [f"{100 * share:.0f}% from message {i} ({preview(messages, i, 24)!r})" for i, share in top]
            self.recall_note = (
                f"this turn brought evicted tokens back: {', '.join(parts)}; /evicted shows every message"
            )
