"""Eviction policies: pure tensor code that ranks cached tokens; the cache evicts the lowest-ranked.

A policy sees per-slot state -- accumulated attention `acc` and absolute position `pos`, both (..., B, H, N)
(one layer, or every layer stacked in front) -- plus the newest position of each row (B,), and returns a
keep-priority of the same shape: +inf for protected slots, -inf for empty or padding ones.

The selection is written once, here: `victim` (argmin: the one slot a decode step overwrites), `lowest`
(the k slots a prefill chunk drops) and `highest` (the k slots a smaller budget keeps). The cache calls
nothing else to choose.

Budgets are in tokens per layer (per KV head and batch row: every head keeps `budget` slots).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from h2o_chat.errors import ConfigError

if TYPE_CHECKING:  # no torch at import: the command line reads DEFAULT_POLICY before deciding to load any
    import torch

INF = float("inf")
_LAST = 2**62  # above every position: "not a candidate" in the victim's tie-break

# snap reads each prompt with its last queries (keeps what the question needs), then evicts as h2o does
DEFAULT_POLICY = "snap"


@dataclass(frozen=True)
class Policy:
    """Base class. Subclasses define `rank` (higher keeps) and optionally `protected`."""

    name: ClassVar[str] = ""
    compresses_prompts: ClassVar[bool] = False
    budget: int | None = 512

    def __post_init__(self) -> None:
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget <= 0):
            raise ConfigError(f"budget must be a positive number of tokens per layer, got {self.budget!r}")

    # -- description ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """Slots allocated per layer; None means the cache grows (no eviction)."""
        return self.budget

    def split(self) -> dict[str, int]:
        """How the budget divides: e.g. {"sink": 4, "heavy": 252, "recent": 256}."""
        return {"recent": self.budget or 0}

    def describe(self) -> str:
        parts = " + ".join(f"{v} {k}" for k, v in self.split().items() if v)
        return f"{self.name} {self.budget} = {parts}"

    # -- maths ------------------------------------------------------------------------------------
    def rank(self, acc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Policy-specific keep score, (B, H, N); higher keeps."""
        raise NotImplementedError

    def protected(self, pos: torch.Tensor, newest: torch.Tensor) -> torch.Tensor | None:
        """Slots that may not be evicted (recent window, sinks), (B, H, N) bool, or None."""
        return None

    def priority(self, acc: torch.Tensor, pos: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """Keep-priority per slot: +inf protected, -inf empty or padding (pos < 0)."""
        p = self.rank(acc, pos)
        prot = self.protected(pos, newest)
        if prot is not None:
            p = p.masked_fill(prot, INF)
        return p.masked_fill(pos < 0, -INF)

    def victim(self, acc: torch.Tensor, pos: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """The one slot to overwrite per (row, head), (..., B, H): the lowest priority, the oldest of equals.
        Empty slots rank -inf and share position -1, so a filling cache takes them in slot order."""
        prio = self.priority(acc, pos, newest)
        lowest_prio = prio.amin(dim=-1, keepdim=True)
        return pos.masked_fill(prio != lowest_prio, _LAST).argmin(dim=-1)


def _by_priority(priority: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Slot indices ordered by (priority, position), ascending. Ties are broken by position, not by where a
    token happens to sit, so a batch row evicts exactly as it would alone (snap's pooled scores tie often)."""
    by_pos = pos.argsort(dim=-1, stable=True)
    return by_pos.gather(-1, priority.gather(-1, by_pos).argsort(dim=-1, stable=True))


def lowest(priority: torch.Tensor, k: int, pos: torch.Tensor) -> torch.Tensor:
    """The k lowest-priority slots along the last dim (the ones to drop), the oldest of equals first, (..., k)."""
    return _by_priority(priority, pos)[..., :k]


def highest(priority: torch.Tensor, k: int, pos: torch.Tensor) -> torch.Tensor:
    """The k highest-priority slots along the last dim (the ones to keep), in slot order, (..., k)."""
    order = _by_priority(priority, pos)
    return order[..., order.shape[-1] - k :].sort(dim=-1).values


def _newest(newest: torch.Tensor) -> torch.Tensor:
    """(B,) newest position per row -> broadcastable against (..., B, H, N)."""
    return newest[:, None, None]


def _recent_window(pos: torch.Tensor, newest: torch.Tensor, recent: int) -> torch.Tensor:
    # the `recent` newest positions of each row are protected
    return pos > _newest(newest) - recent


@dataclass(frozen=True)
class H2O(Policy):
    """The paper's Heavy-Hitter Oracle: keep the `recent` newest tokens plus the `heavy` older tokens with the
    highest accumulated attention. Optional attention sinks (the first `sinks` positions) are always kept and
    come out of the heavy share."""

    name: ClassVar[str] = "h2o"
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
            raise ConfigError("the h2o policy needs a budget (use --policy full for no eviction)")
        if self.sinks > self.heavy:
            raise ConfigError(
                f"budget {self.budget} with heavy_ratio {self.heavy_ratio} leaves {self.heavy} heavy slots, "
                f"fewer than the {self.sinks} sink tokens; raise the budget or the heavy ratio"
            )

    @property
    def heavy(self) -> int:
        # at least one recent slot: the newest token is always kept (its query is attending right now)
        return min(round(self.budget * self.heavy_ratio), self.budget - 1)

    @property
    def recent(self) -> int:
        return self.budget - self.heavy

    def split(self) -> dict[str, int]:
        return {"sink": self.sinks, "heavy": self.heavy - self.sinks, "recent": self.recent}

    def rank(self, acc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return acc

    def protected(self, pos: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        prot = _recent_window(pos, newest, self.recent)
        if self.sinks:
            prot = prot | ((pos >= 0) & (pos < self.sinks))
        return prot


@dataclass(frozen=True)
class Recent(Policy):
    """A local window: keep the `budget` newest tokens."""

    name: ClassVar[str] = "recent"

    def rank(self, acc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return pos.float()


@dataclass(frozen=True)
class Sink(Policy):
    """StreamingLLM: the first `sinks` tokens plus the newest `budget - sinks`."""

    name: ClassVar[str] = "sink"
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is None or self.budget <= self.sinks:
            raise ConfigError(f"the sink policy needs a budget above its {self.sinks} sink tokens, got {self.budget}")

    def split(self) -> dict[str, int]:
        return {"sink": self.sinks, "recent": self.budget - self.sinks}

    def rank(self, acc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return pos.float()

    def protected(self, pos: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        return (pos >= 0) & (pos < self.sinks)


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

    def rank(self, acc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # never asked to evict
        return pos.float()


@dataclass(frozen=True)
class Snap(H2O):
    """Question-aware prompts, then H2O: a prompt that overflows the budget is compressed by the attention of
    its last `window` queries (pooled over `kernel` neighbouring positions, as SnapKV does), so the tokens a
    final question needs survive; generation then evicts like h2o. See h2o_chat/snap.py."""

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
            raise ConfigError(f"the snap window must be between 1 and the budget ({self.budget}), got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"the snap pooling kernel must be a positive odd number, got {self.kernel}")

    def describe(self) -> str:
        return f"{super().describe()}; prompts kept by their last {self.window} queries"


def pool_logits(logits: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max over `kernel` neighbouring positions along the last dim, so a selected token keeps its neighbours.
    Pooling logits per query commutes with the later softmax normalisation (exp(x - lse) is monotone)."""
    import torch.nn.functional as F  # prefill only

    if kernel == 1:
        return logits
    shape = logits.shape
    flat = logits.reshape(-1, 1, shape[-1])
    return F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).reshape(shape)


def observation_mass(obs: torch.Tensor, lse: torch.Tensor, query_ok: torch.Tensor) -> torch.Tensor:
    """Softmax mass from the observation queries: obs (B, H, N, Q) pooled logits, lse (B, H, Q) the
    log-sum-exp of each query over every key seen, query_ok (B, Q) the real (non-padding) queries
    -> (B, H, N), summed over real queries (a padding query sees nothing: its lse is -inf)."""
    mass = (obs - lse[:, :, None, :]).exp()
    return mass.masked_fill(~query_ok[:, None, None, :], 0.0).sum(-1)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (H2O, Recent, Sink, Full, Snap)}


def make_policy(
    name: str = "h2o",
    budget: int | None = 512,
    *,
    heavy_ratio: float | None = None,
    sinks: int | None = None,
    window: int | None = None,
    kernel: int | None = None,
) -> Policy:
    """Build a policy by name, validating the settings; unknown names raise ConfigError with a suggestion."""
    cls = POLICIES.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, POLICIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown policy {name!r}{hint}; choose one of: {', '.join(POLICIES)}")
    if cls is Full:
        return Full()
    kwargs: dict = {"budget": budget}
    if heavy_ratio is not None and issubclass(cls, H2O):
        kwargs["heavy_ratio"] = heavy_ratio
    if sinks is not None and issubclass(cls, (H2O, Sink)):
        kwargs["sinks"] = sinks
    if cls is Snap:
        if window is None and budget:
            window = default_snap_window(budget)
        kwargs.update({k: v for k, v in (("window", window), ("kernel", kernel)) if v is not None})
    return cls(**kwargs)


def default_snap_window(budget: int) -> int:
    """The measured default (16), or a quarter of a budget too small for it."""
    return min(Snap.window, max(1, budget // 4))


def with_budget(policy: Policy, budget: int) -> Policy:
    """The same policy and settings at another budget; a snap window left at its default follows the budget."""
    settings = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init and f.name != "budget"}
    if isinstance(policy, Snap) and policy.window == default_snap_window(policy.budget):
        del settings["window"]
    return make_policy(policy.name, budget, **settings)
