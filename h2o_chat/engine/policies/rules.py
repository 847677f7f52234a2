"""What the cache computes with: every batch row's policy as tensors on the device (`Rules`), so rows with
different policies and budgets share one cache and one decode step; and the pooling snap's scores share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h2o_chat.engine.policies.kinds import INF, Policy

if TYPE_CHECKING:
    import torch


@dataclass
class Rules:
    """Every batch row's policy as tensors on the device (rows may differ: evaluations compare policies and
    budgets as rows of one batch). `priority` is the keep-priority of slots for all layers at once."""

    by_score: torch.Tensor  # (B,) bool: rank by accumulated attention; else by position
    recent: torch.Tensor  # (B,) long: the newest positions kept
    sinks: torch.Tensor  # (B,) long: the first positions kept
    limit: torch.Tensor  # (B,) long: slots a row may fill (its budget; the storage's capacity for full)
    decay: torch.Tensor  # (B, 1, 1) fp32: what a decode step multiplies the held scores by (1: a plain sum)
    # host facts that let the common cases skip work
    uniform: bool = True  # every row has the same rule and limit
    all_by_score: bool = True
    any_protected_sinks: bool = False
    any_decay: bool = False  # some row's scores decay: a step multiplies them first

    @classmethod
    def of(cls, policies: Sequence[Policy], capacity: int, device) -> Rules:
        """One policy per row; `capacity` is the storage's slots (full rows may fill all of them)."""
        import torch

        def column(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        limits = [p.capacity or capacity for p in policies]
        decays = [getattr(p, "decay", 1.0) for p in policies]  # recall's; the others keep a plain sum
        return cls(
            by_score=column([p.by_score for p in policies], torch.bool),
            recent=column([p.protected_recent for p in policies]),
            sinks=column([p.protected_sinks for p in policies]),
            limit=column(limits),
            decay=column(decays, torch.float32)[:, None, None],
            uniform=len(set(policies)) == 1 and len(set(limits)) == 1,
            all_by_score=all(p.by_score for p in policies),
            any_protected_sinks=any(p.protected_sinks for p in policies),
            any_decay=any(d != 1.0 for d in decays),
        )

    def of_rows(self, index: torch.Tensor) -> Rules:
        """The rules of batch rows `index` (a row's view)."""
        pick = [t.index_select(0, index) for t in (self.by_score, self.recent, self.sinks, self.limit, self.decay)]
        return Rules(*pick, self.uniform, self.all_by_score, self.any_protected_sinks, self.any_decay)

    def priority(
        self, score: torch.Tensor, pos: torch.Tensor, newest: torch.Tensor, stored: int | None = None
    ) -> torch.Tensor:
        """Keep-priority of each candidate, (..., B, H, N) from fp32 scores and positions of that shape and the
        newest position of each row (B,): +inf protected, -inf empty or padding. The first `stored` candidates
        (default: all) are storage slots: those beyond a row's limit are +inf too (never filled, never lost);
        the rest are new tokens."""
        import torch

        def row(t: torch.Tensor) -> torch.Tensor:  # (B,) -> broadcastable over (..., B, H, N)
            return t[:, None, None]

        rank = score if self.all_by_score else torch.where(row(self.by_score), score, pos.float())
        keep = pos > row(newest - self.recent)
        if self.any_protected_sinks:
            keep |= (pos >= 0) & (pos < row(self.sinks))
        return self.within_limits(rank.masked_fill(keep, INF).masked_fill(pos < 0, -INF), stored)

    def within_limits(self, prio: torch.Tensor, stored: int | None = None) -> torch.Tensor:
        """Keep-priorities (..., B, H, N) with the storage slots beyond a row's limit at +inf: never filled, so
        never lost (rows of one batch with smaller budgets leave the rest of the storage empty). Every priority
        a chunk's selection uses goes through it (the rules' and snap's observation)."""
        import torch

        if self.uniform:
            return prio
        slot = torch.arange(prio.shape[-1], device=prio.device)
        beyond = slot >= self.limit[:, None, None]
        if stored is not None:
            beyond &= slot < stored
        return prio.masked_fill(beyond, INF)


def pool_logits(logits: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max over `kernel` neighbouring positions along the last dim, so a selected token keeps its neighbours.
    Pooling logits per query commutes with the later softmax normalisation (exp(x - lse) is monotone)."""
    import torch.nn.functional as F  # prefill only

    if kernel == 1:
        return logits
    shape = logits.shape
    flat = logits.reshape(-1, 1, shape[-1])
    return F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).reshape(shape)
