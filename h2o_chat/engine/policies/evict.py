"""Eviction, in one place: which slots lose and how the survivors move, for every layer at once.

- `step`: a decode step wrote its token into each layer's spare slot; per (layer, row, KV head) the slot with
  the lowest keep-priority (an empty one first, so a filling cache appends) takes it. One argmin and one
  scatter per buffer; `append` when every row has room (the first empty slot, nothing ranked).
- `chunk`: a prompt chunk of T tokens was attended with the stored slots; per (layer, row, head) the T
  lowest of the C stored + T new candidates lose, and the surviving new tokens move into the freed slots, in
  order. When everything fits (a cache still filling), the new tokens are appended without any selection.
- `keep`: a change of budget keeps the best `capacity` slots (`Slots.moved`).

Ties in priority go to the oldest position, never to where a token happens to sit, so a batch row evicts
exactly as it would alone; among empty slots and padding, padding loses first and empty slots are taken in
slot order. That keeps the layout every reader relies on: a row's held tokens fill slots [0, held) in every
layer and head (`Slots.held`), so one (B, slots) validity mask serves all layers and heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from h2o_chat.engine.policies import Rules
from h2o_chat.engine.storage.quant import quantize
from h2o_chat.engine.storage.slots import Slots, pair_freed_with_survivors, per_slot, place, tie

if TYPE_CHECKING:
    from h2o_chat.engine.storage.store import Store


# the native library's `slots_place` where it loaded (models/native hands it over: this layer does not import it)
_native: Callable[[], Callable | None] | None = None


def use_native(kernel: Callable[[], Callable | None]) -> None:
    global _native
    _native = kernel


def step(slots: Slots, rules: Rules, store: Store | None = None) -> None:
    """Finish a decode step: the spare slot's token replaces each (layer, row, head)'s lowest-priority slot.
    The spare holds the newest token, which every policy protects, so it is never its own victim. A `store`
    (the recall policy's) keeps the victim."""
    if store is None:
        settle(slots, rules, _native_op(slots))
        return
    victim = _victims(slots, rules)
    keys, values = slots.gather_kv(victim)
    lost = [t.gather(3, victim)[..., None] for t in (slots.pos, slots.rot, slots.score)]
    store.append_step(keys, values, *(t[..., 0] for t in lost))
    _take_spare(slots, victim)


def settle(slots: Slots, rules: Rules, op: Callable | None = None) -> None:
    """`step` without a store: the spare's token into each (layer, row, head)'s lowest-priority slot. `op`: the
    native library's `slots_place` (one pass over every layer's slots), else PyTorch's operations (a dozen
    passes and a scatter per buffer)."""
    if op is None:
        _take_spare(slots, _victims(slots, rules))
        return
    sinks = rules.sinks if rules.any_protected_sinks else None
    limit = None if rules.uniform else rules.limit  # as `Rules.within_limits`
    op(slots.buffers(), slots.pos, slots.score, slots.seen, rules.by_score, rules.recent, sinks, limit)
    slots.clear_spare()


def _victims(slots: Slots, rules: Rules) -> torch.Tensor:
    """Each (layer, row, head)'s lowest-priority slot, by PyTorch's operations (newest: the spare's position).
    (L, B, H, 1)"""
    return place(slots, rules.priority(slots.score, slots.pos, slots.seen), tie(slots.pos))


def _native_op(slots: Slots) -> Callable | None:
    """The library's `slots_place` where it serves these slots (on CPU, eager), else None."""
    if _native is None or slots.pos.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return _native()


def _take_spare(slots: Slots, victim: torch.Tensor) -> None:
    """Every buffer's spare slot into the slots `victim` (L, B, H, 1); the spare is then emptied."""
    spare = slots.capacity  # the spare slot comes right after the capacity
    for buf in slots.buffers():
        buf.scatter_(3, per_slot(victim, buf), buf[:, :, :, spare : spare + 1])
    slots.clear_spare()


def append(slots: Slots) -> None:
    """`step` while every row has room for its new token: the spare's token takes its row's first empty slot (slot
    `held`, the same in every layer and head), which is where `step` puts it (an empty slot loses first, in slot
    order), without ranking any slot."""
    fill(slots, _native_op(slots))


def fill(slots: Slots, op: Callable | None = None) -> None:
    """`append` by `op`, the library's `slots_place` with no rule (by position, nothing kept: a row's first empty
    slot is its lowest), else by PyTorch's operations (one scatter per buffer)."""
    if op is None:
        L, B, H = slots.pos.shape[:3]
        _take_spare(slots, slots.held()[None, :, None, None].expand(L, B, H, 1))
        return
    op(slots.buffers(), slots.pos, slots.score, slots.seen, None, None, None, None)
    slots.clear_spare()


@dataclass
class NewTokens:
    """A prompt chunk's tokens for every layer, waiting to be placed: T columns per row."""

    keys: torch.Tensor | None  # (L, B, H, T, D) model dtype; None: already in the slots (appended, see `append`)
    values: torch.Tensor | None  # (L, B, H, T, Dv)
    pos: torch.Tensor  # (B, T) true positions, -1 = padding
    rot: torch.Tensor  # (B, T) positions the keys were rotated at
    score: torch.Tensor  # (L, B, H, T) fp32 mass received within the chunk (zeros when not tracked)
    extra: list[torch.Tensor] = field(default_factory=list)  # per-slot side buffers (snap's), (L, B, H, T, ...)

    def buffers(self, slots: Slots) -> list[torch.Tensor | None]:
        """In `slots.buffers()` order, every one (L, B, H, T, ...); keys and values quantized with their scales
        for 8-bit storage; a field the chunk gives nothing for, its empty value; None: already in place."""
        L, B, H, T = self.score.shape
        given = {
            "pos": self.pos[None, :, None, :].expand(L, B, H, T),
            "rot": self.rot[None, :, None, :].expand(L, B, H, T),
            "score": self.score,
            "keys": self.keys,
            "values": self.values,
            "kscale": None,
            "vscale": None,
        }
        if slots.quantized and self.keys is not None:
            (given["keys"], given["kscale"]), (given["values"], given["vscale"]) = (
                quantize(self.keys),
                quantize(self.values),
            )
        out = []
        for f, buf in zip(slots.fields, slots.slot_tensors(), strict=True):
            if f.name in given:
                out.append(given[f.name])
            else:
                out.append(buf.new_full((L, B, H, T, *buf.shape[4:]), f.empty))
        return [*out, *self.extra]


def append_slots(slots: Slots, real: torch.Tensor) -> torch.Tensor:
    """Where a chunk's tokens go when every row has room for them (B, T): after the row's held tokens, in order;
    padding goes to the spare slot (cleared when the chunk is placed)."""
    return torch.where(real, slots.held()[:, None] + real.cumsum(-1) - 1, slots.capacity)


def chunk(
    slots: Slots,
    new: NewTokens,
    rules: Rules,
    fits: bool,
    priority: torch.Tensor | None = None,
    store: Store | None = None,
) -> None:
    """Place a chunk's tokens. `fits` (host-known): every row has room for all of them, so they are appended.
    Otherwise the T lowest of stored + new lose (`priority`, (L, B, H, C + T), overrides the rules': snap); a
    `store` keeps the losers (sorted by position)."""
    L, B, H, T = new.score.shape
    if fits:
        target = append_slots(slots, new.pos >= 0)[None, :, None, :].expand(L, B, H, T)
    else:
        target = _pair_freed_with_survivors(slots, new, rules, priority, store)
    for buf, values in zip(slots.buffers(), new.buffers(slots), strict=True):
        if values is not None:
            buf.scatter_(3, per_slot(target, buf), values.to(buf.dtype))
    slots.clear_spare()


def _slots_then_chunk(held: torch.Tensor, chunk: torch.Tensor, C: int) -> torch.Tensor:
    """A per-slot buffer's first C slots (L, B, H, S) followed by the chunk's per-row values (B, T): (L, B, H, C + T),
    the candidates' order in a chunk's selection."""
    L, B, H = held.shape[:3]
    return torch.cat((held[..., :C], chunk[None, :, None, :].expand(L, B, H, chunk.shape[-1])), dim=-1)


def _keep_losers(slots: Slots, new: NewTokens, losers: torch.Tensor, pos: torch.Tensor, store: Store) -> None:
    """The chunk's losers (L, B, H, T) among stored + new candidates into the store, by position: `topk` gives
    them in an order of its own, which changes with their number (a left-padded row's chunk has more, its padding),
    and the store places new entries in the order given."""
    C = slots.capacity
    losers = losers.gather(-1, pos.gather(-1, losers).argsort(dim=-1, stable=True))
    kv = []
    for which, fresh in (("keys", new.keys), ("values", new.values)):
        both = torch.cat((slots.read(which, (slice(None), slice(None), slice(None), slice(0, C))), fresh), dim=3)
        kv.append(both.gather(3, per_slot(losers, both)))
    rot = _slots_then_chunk(slots.rot, new.rot, C).gather(-1, losers)
    score = torch.cat((slots.score[..., :C], new.score), dim=-1).gather(-1, losers)
    store.append_chunk(*kv, pos.gather(-1, losers), rot, score)


def _pair_freed_with_survivors(
    slots: Slots, new: NewTokens, rules: Rules, priority, store: Store | None = None
) -> torch.Tensor:
    """Per (layer, row, head): the T losers among C + T; the surviving new tokens go to the freed slots (losing
    new tokens go to the spare slot). -> (L, B, H, T)"""
    C, T = slots.capacity, new.score.shape[-1]
    pos = _slots_then_chunk(slots.pos, new.pos, C)
    if priority is None:
        newest = new.pos.max(-1).values.clamp(min=0).maximum(slots.seen - 1)  # (B,)
        priority = rules.priority(torch.cat((slots.score[..., :C], new.score), dim=-1), pos, newest, stored=C)
    target, losers = pair_freed_with_survivors(priority, tie(pos, new_from=C), C, T)
    if store is not None:
        _keep_losers(slots, new, losers, pos, store)
    return target
