"""Eviction policies as the user chooses them: frozen, validated `Policy` dataclasses, one per kind (what the cache
computes with is `rules.Rules`).

A policy ranks cached tokens by a keep-priority: the accumulated attention mass (h2o, snap) or the position
(recent, sink, full); the `recent` newest positions and the first `sinks` positions are protected (+inf); empty
slots and padding rank -inf. Which slots lose is decided in one place, `h2o_chat.engine.policies.evict`.

Budgets are in tokens per layer (per KV head and batch row: every head keeps `budget` slots).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from h2o_chat.errors import ConfigError

if TYPE_CHECKING:  # no torch at import: the command line reads DEFAULT_POLICY before deciding to load any
    pass

INF = float("inf")

# snap reads each prompt with its last queries (keeps what the question needs), then evicts as h2o does
DEFAULT_POLICY = "snap"
# recall's store holds this many times the budget by default (`--recall-memory` sets it), and at least
# `STORE_MIN_TIMES` times what a step recalls (the first ranking pass chooses 4 candidates per recalled token)
STORE_TIMES = 8
STORE_MIN_TIMES = 4
# what a full store drops first (lower loses): "first" (the default), the latest position, so that it keeps the
# earliest evicted positions (a conversation's opening); "recalls", the least recalled, then the lowest score;
# "score", the attention mass the token had received when it was evicted; "age", the oldest position. Measured
# with the store capped at a quarter of what conversations evict: docs/policies.md
DROP_RULES = ("score", "age", "recalls", "first")


@dataclass(frozen=True)
class Policy:
    """Base class: a budget and what it protects. Subclasses set `by_score` and the protected counts."""

    name: ClassVar[str] = ""
    compresses_prompts: ClassVar[bool] = False
    by_score: ClassVar[bool] = False  # keep by accumulated attention (h2o, snap) rather than by position
    brings_back: ClassVar[bool] = False  # evicted tokens can return for a later message (recall)
    budget: int | None = 512

    def __post_init__(self) -> None:
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget <= 0):
            raise ConfigError(f"budget must be a positive number of tokens per layer, got {self.budget!r}")

    @property
    def capacity(self) -> int | None:
        """Slots allocated per layer; None means the cache grows (no eviction)."""
        return self.budget

    @property
    def protected_recent(self) -> int:
        """The newest positions that are never evicted."""
        return 0

    @property
    def protected_sinks(self) -> int:
        """The first positions that are never evicted."""
        return 0

    def split(self) -> dict[str, int]:
        """How the budget divides: e.g. {"sink": 4, "heavy": 252, "recent": 256}."""
        return {"recent": self.budget or 0}

    def describe(self) -> str:
        parts = " + ".join(f"{v} {k}" for k, v in self.split().items() if v)
        return f"{self.name} {self.budget} = {parts}"


@dataclass(frozen=True)
class H2O(Policy):
    """The paper's Heavy-Hitter Oracle: keep the `recent` newest tokens plus the `heavy` older tokens with the
    highest accumulated attention. Optional attention sinks (the first `sinks` positions) are always kept and
    come out of the heavy share."""

    name: ClassVar[str] = "h2o"
    by_score: ClassVar[bool] = True
    heavy_ratio: float = 0.5
    sinks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.heavy_ratio < 1.0:
            raise ConfigError(
                f"heavy_ratio must be in [0, 1) so that the newest token is always kept, got {self.heavy_ratio}"
            )
        if self.sinks < 0:
            raise ConfigError(f"sinks must be >= 0, got {self.sinks}")
        if self.budget is None:
            raise ConfigError("the h2o policy needs a budget (the full policy keeps every token)")
        if self.sinks > self.older:
            raise ConfigError(
                f"budget {self.budget} with heavy_ratio {self.heavy_ratio} leaves {self.older} slots for older "
                f"tokens, fewer than the {self.sinks} sink tokens; raise the budget or the heavy ratio"
            )

    @property
    def older(self) -> int:
        """Slots for tokens outside the recent window: sinks plus heavy hitters. At least one slot is recent:
        the newest token is always kept (its query is attending right now)."""
        return min(round(self.budget * self.heavy_ratio), self.budget - 1)

    @property
    def recent(self) -> int:
        return self.budget - self.older

    @property
    def protected_recent(self) -> int:
        return self.recent

    @property
    def protected_sinks(self) -> int:
        return self.sinks

    def split(self) -> dict[str, int]:
        return {"sink": self.sinks, "heavy": self.older - self.sinks, "recent": self.recent}


@dataclass(frozen=True)
class Recent(Policy):
    """A local window: keep the `budget` newest tokens."""

    name: ClassVar[str] = "recent"


@dataclass(frozen=True)
class Sink(Policy):
    """StreamingLLM: the first `sinks` tokens plus the newest `budget - sinks`."""

    name: ClassVar[str] = "sink"
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is None or self.budget <= self.sinks:
            raise ConfigError(f"the sink policy needs a budget above its {self.sinks} sink tokens, got {self.budget}")

    @property
    def protected_sinks(self) -> int:
        return self.sinks

    def split(self) -> dict[str, int]:
        return {"sink": self.sinks, "recent": self.budget - self.sinks}


@dataclass(frozen=True)
class Full(Policy):
    """No eviction: the cache grows with the sequence (the baseline)."""

    name: ClassVar[str] = "full"
    budget: int | None = field(default=None)

    def split(self) -> dict[str, int]:
        return {}

    def describe(self) -> str:
        return "full (no eviction)"

    @property
    def capacity(self) -> int | None:
        return None


@dataclass(frozen=True)
class Snap(H2O):
    """Question-aware prompts, then H2O: a prompt that overflows the budget is compressed by the attention of
    its last `window` queries (pooled over `kernel` neighbouring positions, as SnapKV does), so the tokens a
    final question needs survive; generation then evicts like h2o. See h2o_chat/engine/policies/snap.py."""

    name: ClassVar[str] = "snap"
    window: int = 16  # defaults from the needle runs (see the README); make_policy caps it at budget // 4
    kernel: int = 11
    compresses_prompts: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget < 2:  # said first: the window is not what the user got wrong
            raise ConfigError(
                f"snap needs a budget of at least 2 (a slot for its query window and one more), got {self.budget}"
            )
        if not 1 <= self.window < self.budget:
            raise ConfigError(
                f"the snap window must be at least 1 and below the budget ({self.budget}), got {self.window}"
            )
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"the snap pooling kernel must be a positive odd number, got {self.kernel}")

    def describe(self) -> str:
        return f"{super().describe()}; prompts kept by their last {self.window} queries"


@dataclass(frozen=True)
class Recall(Snap):
    """snap, plus a store of every evicted token (keys, values, positions; renumbered with the held tokens past the
    trained context) off the accelerator, from which each decode step's own query, and each prompt chunk's queries
    together, bring back the `recalled` tokens they attend to most (ranked by their logit). The budget
    is the same memory: `budget - recalled` slots are held as snap holds them, `recalled` are filled per step (twice
    as many, transiently, while a prompt chunk is read). A fact stated early in a chat is often not attended by the
    question that asks for it (the embedded model attends to it only while writing the answer), so no choice made
    before the answer can keep it at a small budget; a choice made per step can, once the question's own keys were
    read with the fact recalled. See engine/storage/store.py and engine/policies/recall_rank.py."""

    name: ClassVar[str] = "recall"
    brings_back: ClassVar[bool] = True
    recalled: int = -1  # -1: a quarter of the budget
    store: int = -1  # evicted tokens kept per layer, row and KV head; -1: `STORE_TIMES` x the budget
    drop: str = "first"  # what a full store drops first (`DROP_RULES`): measured, docs/policies.md
    # each decode step multiplies the held slots' accumulated scores by `decay` before adding its mass, so old
    # mass counts less than recent (the plain sum favours old tokens). 0.99 from the tuning text (alice.txt, 2,048
    # tokens, 10% budget: perplexity 1.016x the full cache's with the plain sum, 1.012x with 0.99 or 0.95)
    decay: float = 0.99
    # (each evicted key is ranked by its own logit: Quest's blocks were measured too coarse here -- the multi-turn
    # recall evaluation on the tuning texts, 10% budget: likelihood gain kept 0.04 with blocks of 16, 0.47 with 4,
    # 0.97 with 1 -- evicted tokens leave one or a few at a time, so a block mixes unrelated ones)

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ConfigError(f"the recall score decay must be in (0, 1], got {self.decay}")
        if isinstance(self.budget, int) and self.recalled == -1:
            object.__setattr__(self, "recalled", max(1, self.budget // 4))
        if isinstance(self.budget, int) and self.store == -1:
            object.__setattr__(self, "store", STORE_TIMES * self.budget)
        if isinstance(self.budget, int) and not 0 < self.recalled <= self.budget - 2:
            raise ConfigError(
                f"recall needs a budget of at least {self.recalled + 2} tokens (it recalls {self.recalled} per step "
                f"and holds at least 2), got {self.budget}"
            )
        if self.drop not in DROP_RULES:
            raise ConfigError(f"recall's store drops by one of {', '.join(DROP_RULES)}, got {self.drop!r}")
        if not isinstance(self.store, int) or self.store < STORE_MIN_TIMES * self.recalled:
            raise ConfigError(
                f"recall's store must hold at least {STORE_MIN_TIMES * self.recalled:,} evicted tokens "
                f"({STORE_MIN_TIMES} times the {self.recalled} it recalls per step, which it ranks among), "
                f"got {self.store:,}"
            )
        super().__post_init__()
        if self.window >= self.capacity:
            raise ConfigError(
                f"the snap window ({self.window}) must be smaller than the {self.capacity} slots recall holds "
                f"(budget {self.budget} - {self.recalled} recalled)"
            )

    @property
    def capacity(self) -> int | None:
        return self.budget - self.recalled

    @property
    def older(self) -> int:
        held = self.budget - self.recalled
        return min(round(held * self.heavy_ratio), held - 1)

    @property
    def recent(self) -> int:
        return self.budget - self.recalled - self.older

    def split(self) -> dict[str, int]:
        return {**super().split(), "recalled": self.recalled}

    def describe(self) -> str:
        decay = f"; held scores decay x{self.decay:g} per step" if self.decay != 1 else ""
        recalled = f"{self.recalled} recalled per step and per prompt chunk from {self.store:,} evicted tokens kept"
        return f"{super().describe()}; {recalled}{decay}"


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (H2O, Recent, Sink, Full, Snap, Recall)}


def make_policy(
    name: str = "h2o",
    budget: int | None = 512,
    *,
    heavy_ratio: float | None = None,
    sinks: int | None = None,
    window: int | None = None,
    kernel: int | None = None,
    recalled: int | None = None,
    decay: float | None = None,
    store: int | None = None,
    drop: str | None = None,
) -> Policy:
    """Build a policy by name, validating the settings; unknown names raise ConfigError with a suggestion."""
    cls = POLICIES.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, POLICIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown policy {name!r}{hint}; choose one of: {', '.join(POLICIES)}")
    if cls is Full:
        return Full()
    if issubclass(cls, Snap) and window is None and budget:
        window = default_snap_window(budget)
    given = {
        "budget": budget, "heavy_ratio": heavy_ratio, "sinks": sinks, "window": window, "kernel": kernel,
        "recalled": recalled, "decay": decay, "store": store, "drop": drop,
    }  # fmt: skip
    return cls(**{k: v for k, v in given.items() if k == "budget" or (v is not None and uses(name, k))})


def uses(name: str, setting: str) -> bool:
    """Whether policy `name` reads `setting` (a keyword of make_policy, or the cache's positions); the others
    ignore it."""
    cls = POLICIES[name]
    if setting in ("budget", "positions"):  # every token held: each at its rank is each at its true position
        return cls is not Full
    return issubclass(cls, SETTING_OF[setting])


# which policies read each setting beyond the budget (and their subclasses: snap is h2o's, recall snap's)
SETTING_OF: dict[str, type[Policy] | tuple[type[Policy], ...]] = {
    "heavy_ratio": H2O, "sinks": (H2O, Sink), "window": Snap, "kernel": Snap,
    "recalled": Recall, "decay": Recall, "store": Recall, "drop": Recall,
}  # fmt: skip


def default_snap_window(budget: int) -> int:
    """The measured default (16), or a quarter of a budget too small for it."""
    return min(Snap.window, max(1, budget // 4))


def with_budget(policy: Policy, budget: int) -> Policy:
    """The same policy and settings at another budget; a snap window left at its default follows the budget."""
    settings = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init and f.name != "budget"}
    if isinstance(policy, Snap) and policy.window == default_snap_window(policy.budget):
        del settings["window"]
    if isinstance(policy, Recall) and policy.recalled == Recall(policy.budget).recalled:
        del settings["recalled"]
    if isinstance(policy, Recall) and policy.store == Recall(policy.budget).store:
        del settings["store"]
    return make_policy(policy.name, budget, **settings)
