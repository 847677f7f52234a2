"""How a cache numbers its tokens, row by row.

Keys are stored rotated, as the model rotated them. While a row stays within the trained context its tokens get
their true positions (the paper). When the next position would pass it (`--positions auto`), or a smaller
window (`rolling`), the row's held tokens are renumbered once by their order among the held tokens (0, 1, 2,
...; StreamingLLM's positions within the cache): each key is rotated by the difference, and new tokens
continue from there. Decode steps cost the same as with absolute positions; the renumbering, a rotation of the
held keys, happens once every (window - budget) tokens. The recall policy's evicted tokens follow: each is
numbered where it stands among the held tokens and its stored key rotated (`Store.renumber`).

Each row keeps its own `RowState` (declared once: row views, row selections and snapshots copy it whole).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from h2o_chat.engine.policies import Policy
from h2o_chat.engine.rope import Rope
from h2o_chat.errors import ContextLimitError, SettingError

POSITIONS = ("auto", "absolute", "rolling")


def check_positions(positions: str) -> str:
    """The one check of a --positions value (the command line runs it before loading a model)."""
    if positions not in POSITIONS:
        raise SettingError("positions", f"must be one of {', '.join(POSITIONS)}", positions)
    return positions


@dataclass
class Group:
    """Consecutive batch rows that follow one policy and one way of numbering positions."""

    policy: Policy
    rows: int | None  # batch rows following it (None: all of them)
    positions: str


@dataclass
class RowState:
    """One batch row's host bookkeeping."""

    group: Group
    columns: int = 0  # token columns fed, padding included (rows refilled with new prompts differ)
    # counted from the row's own tokens (never its padding): an upper bound on the next position a key is rotated
    # at; the row renumbers when it would pass its window, exactly when it would alone
    bound: int = 0
    switched: bool = False  # renumbers from now on (passed its window, or rolling from the start)
    seen: int = 0  # the row's own tokens read (never its padding): a host count of what the device's `seen` holds

    def copy(self) -> RowState:
        return dataclasses.replace(self)


class Numbering:
    """The positions side of a cache: its trained context and the rotary embedding that can re-rotate keys."""

    def __init__(self, rope: Rope | None, context: int | None, rope_problem: str | None):
        self.rope, self.context, self.rope_problem = rope, context, rope_problem

    def check_mode(self, mode: str) -> None:
        check_positions(mode)
        if mode == "rolling" and self.rope is None:
            if self.rope_problem:
                raise SettingError("positions", f"cannot be used with this model: {self.rope_problem}", mode, got=False)
            raise SettingError(
                "positions",
                "needs rotary position embeddings; this model has learned absolute positions "
                f"(OPT), which cannot be re-assigned: it stops at its trained context ({self.context} tokens)",
                mode,
                got=False,
            )

    def room(self, bound: int) -> int | None:
        """Tokens a row whose positions reach `bound` can still be fed before the model's learned positions end
        (OPT's), or None: positions never stop it (rotary ones are renumbered, or kept absolute with a warning)."""
        if self.context is None or self.rope is not None or self.rope_problem is not None:
            return None
        return max(0, self.context - bound)

    def starts_switched(self, group: Group) -> bool:
        return group.positions == "rolling" and self.rope is not None

    def window(self, group: Group, limit: int, new: int) -> int | None:
        """The positions a row of `group` may reach before it renumbers, or None: it never does."""
        if group.positions == "absolute" or self.rope is None or group.policy.capacity is None:
            return None
        window = self.context if group.positions == "auto" else min(self.context, 2 * limit)
        return max(window, limit + new)

    def check(self, cache, new_tokens: int, counts: list[int]) -> None:
        """Before a forward of `new_tokens` columns (`counts`: each row's own tokens among them; empty before
        storage exists): stop a model that cannot go on, warn once, renumber the rows that would pass their
        window."""
        if self.context is None:
            return
        rows = cache.seq.rows
        ends = [r.bound + n for r, n in zip(rows, counts, strict=True)] or [cache.seq.columns + new_tokens]
        if max(ends) > self.context and (self.rope is None and self.rope_problem is None):
            raise ContextLimitError(self.context)
        if not rows or cache.slots is None:  # nothing stored yet: the first chunk starts at position 0
            if max(ends) > self.context:
                self._past_context(cache, cache.groups[0])
            return
        renumber = []
        for r, row in enumerate(rows):
            window = self.window(row.group, cache.limit(r), counts[r])
            if window is None:
                if ends[r] > self.context:
                    self._past_context(cache, row.group)
            elif ends[r] > window:
                renumber.append(r)
        if renumber:
            self.renumber(cache, renumber)
            over = max(rows[r].bound + counts[r] for r in renumber)
            if over > self.context:
                cache.warn_once(
                    "window",
                    f"the budget plus this chunk ({over} positions) is more than the trained context "
                    f"({self.context}): quality degrades; a smaller budget or smaller prompt chunks keep within it",
                )

    def _past_context(self, cache, group: Group) -> None:
        if self.rope_problem:
            why = f"renumbered positions are not possible ({self.rope_problem})"
        elif group.policy.capacity is None and group.positions != "absolute":  # auto is on: a full cache
            why = "a full cache keeps every token at its true position; a bounded policy (snap, h2o, recall) "
            why += "renumbers positions within the context"
        else:
            why = "--positions auto or rolling renumbers positions within the context"
        cache.warn_once(
            "absolute",
            f"passed the trained context ({self.context} tokens) with absolute positions: quality degrades from "
            f"here; {why}",
        )

    def renumber(self, cache, rows: list[int]) -> None:
        """Number the held tokens of `rows` 0, 1, 2, ... by true position (per layer and head) and rotate each
        key by the change; new tokens continue after them."""
        s = cache.slots
        if any(not cache.seq.rows[r].switched for r in rows):
            cache.warn_once(
                "switched",
                f"passed the trained context ({self.context} tokens): from here the kept tokens are renumbered "
                "by their order whenever positions would pass it, so generation can go on",
            )
        selected = torch.zeros(s.batch, dtype=torch.bool, device=s.pos.device)
        selected[rows] = True
        big = torch.iinfo(s.pos.dtype).max
        for i in range(s.pos.shape[0]):  # one layer at a time: the rotation's transients stay small
            pos, rot = s.pos[i], s.rot[i]
            held = pos >= 0
            order = torch.where(held, pos, big).argsort(dim=-1)
            ordinal = torch.empty_like(order).scatter_(
                -1, order, torch.arange(pos.shape[-1], device=pos.device).expand_as(order)
            )
            change = torch.where(held & selected[:, None, None], ordinal - rot, 0)
            s.write((i,), self.rope.rotate_by(s.read("keys", (i,)), change))
            rot.copy_(torch.where(selected[:, None, None], torch.where(held, ordinal, -1), rot))
        s.next_rot.copy_(torch.where(selected, s.held(), s.next_rot))
        if cache.store is not None:  # evicted tokens are numbered where they stand among the held ones
            cache.store.renumber(rows, s.pos[..., : s.capacity], self.rope)
        for r in rows:
            cache.seq.rows[r].switched = True
            cache.seq.rows[r].bound = cache.limit(r)
        cache.seq.renumbered = True

    def label(self, group: Group, switched: list[bool]) -> str:
        """How tokens are numbered now and why, for rows of `group` (`switched`: whether each renumbers now)."""
        rolling = any(switched)
        now = "renumbered by order among the held tokens" if rolling else "absolute"
        trained = f"trained context {self.context}" if self.context else "trained context unknown"
        if group.positions != "auto":
            return f"{group.positions}: {now}, {trained}" if group.positions == "rolling" else f"{now}, {trained}"
        return f"auto: {now}, {'passed the ' if rolling else ''}{trained}"
