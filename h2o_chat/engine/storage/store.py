"""The store of evicted tokens behind the `recall` policy: a table of fixed capacity, allocated once beside the
slots on the cache's own device, whose entries each step and prompt chunk rank and bring back
(`recall_rank`).

Every token a row that recalls evicts -- in a decode step or a prompt chunk -- becomes an entry: its key (as
stored: rotated at its true position, or at the number the cache gave it) and value in int8 with a scale each,
the key's coordinates in its head's principal directions (int8 with a scale: what a step's first ranking pass
reads), its true position, the position its key is rotated at, the score it had when it was evicted and how
often it has been recalled. The store is a `Table` like the slots: `capacity` entries and a spare per layer,
row and KV head. A new entry is written into the spare and then takes the place of the entry its row and head
value least (`DROP` decides by what), the way a decode step places its token among the slots (`slots.place`):
a static shape, a few operators, no host synchronisation, so it runs inside a captured or compiled step. Once
full the store drops one entry per new one and stays the size it was allocated with; a dropped entry's memory
is overwritten, so it can never be recalled again (`drops` counts them).

The principal directions (`basis`, per layer, row and head) are fitted outside any step, from the held and the
stored keys (`fit`, on the host's schedule: first from the slots before the first eviction, then each time a
row's evicted tokens have doubled, and then every half capacity), in place, so a captured step stays valid.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h2o_chat.engine.storage.quant import SCALE_DTYPE, dequantize, quantize
from h2o_chat.engine.storage.slots import (
    Field,
    Table,
    allocate_fields,
    entry_bytes,
    order,
    pair_freed_with_survivors,
    per_slot,
    place,
    tie,
)
from h2o_chat.engine.storage.upkeep import StoreUpkeep

RANK_DIM = 16  # principal directions of the stored keys whose coordinates a step's first ranking pass reads
FIT_FROM = 64  # a row's store is first refitted once it holds this many entries, then at each doubling
RULES = ("age", "first", "recalls", "score")  # the drop rules (`priority`) as the native `store_place` numbers them

# The native library's `store_place` (`models.native`, a layer above: it hands itself over when imported), what
# gives it or None.
_native: Callable[[], Callable | None] | None = None


def use_native(kernel: Callable[[], Callable | None]) -> None:
    global _native
    _native = kernel


STORE_FIELDS = (
    Field("keys", 0, torch.int8, "key"),  # as stored in the slots: rotated
    Field("kscale", 0, SCALE_DTYPE, "one"),
    Field("values", 0, torch.int8, "value"),
    Field("vscale", 0, SCALE_DTYPE, "one"),
    Field("low", 0, torch.int8, "rank"),  # the key's coordinates in its head's basis (the first pass)
    Field("lscale", 0, SCALE_DTYPE, "one"),
    Field("pos", -1, torch.int32),  # the token's true position, -1 = empty
    Field("rot", -1, torch.int32),  # the position its key is rotated at
    Field("score", 0, torch.float32),  # its accumulated attention mass when it was evicted
    Field("marks", 0, torch.int32),  # times recalled since it was stored (`take_counts` reports the new ones)
)


def entries_at(table: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A layer's int8 entries (B, H, E, D) and their scales (B, H, E, 1) at `index` (B, H, n) -> (B, H, n, D) in
    `dtype`."""
    return dequantize(table.gather(2, per_slot(index, table)), scale.gather(2, index[..., None]), dtype)


def rank_dim_for(key_dim: int) -> int:
    """Principal coordinates kept per stored key: `RANK_DIM`, or the whole key when it is no larger."""
    return min(RANK_DIM, key_dim)


def store_entry_bytes(layers: int, rows: int, kv_heads: int, key_dim: int, value_dim: int) -> int:
    """Bytes one store entry (a token) takes over every layer, row and KV head, every field counted, plus its
    share of the per-head basis is not included (`store_bytes` adds it): the one formula the fit checks, the
    panel and `--recall-memory` use."""
    widths = {"key": key_dim, "value": value_dim, "rank": rank_dim_for(key_dim)}
    return layers * rows * kv_heads * entry_bytes(STORE_FIELDS, widths, 1)


def store_bytes(layers: int, rows: int, kv_heads: int, key_dim: int, value_dim: int, capacity: int) -> int:
    """Bytes of a store of `capacity` entries (and the spare) per layer, row and KV head, as `Store.allocate`
    makes it: its entries, the basis (fp32, key_dim x rank) and the drop counters."""
    per_head = key_dim * rank_dim_for(key_dim) * 4 + 8
    return (capacity + 1) * store_entry_bytes(layers, rows, kv_heads, key_dim, value_dim) + (
        layers * rows * kv_heads * per_head
    )


def tokens_in(nbytes: int, layers: int, rows: int, kv_heads: int, key_dim: int, value_dim: int) -> int:
    """The most entries per layer, row and head whose store fits in `nbytes` (0 when not even one does)."""
    fixed = store_bytes(layers, rows, kv_heads, key_dim, value_dim, 0)
    return max(0, (nbytes - fixed) // store_entry_bytes(layers, rows, kv_heads, key_dim, value_dim))


class Store(StoreUpkeep, Table):
    """Per layer, row and KV head, `capacity` evicted tokens and a spare (`STORE_FIELDS`), the basis of their
    keys' principal directions (L, B, H, D, rank) and how many entries each head dropped (L, B, H).

    Host bookkeeping, per row: tokens each recalls per step (`recalled`, 0: a row that keeps nothing), its
    tokens seen and held capacity (what it has evicted follows from them, without reading the device) and when
    its basis was last fitted."""

    HEAD_FIELDS = ("basis", "drops")
    # per row, on the host: its held capacity, the tokens it has evicted (host counts) and how many it had when its
    # basis was last fitted (0: never); copied by row views, selections, snapshots and saved files
    HOST_FIELDS = ("held_cap", "evicted", "fitted")

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        recalled: list[int],
        host: tuple | None = None,
        capacities: list[int] | None = None,
    ):
        super().__init__(tensors, STORE_FIELDS)
        self.dtype = dtype  # the model's: what keys and values are read back in
        for name, values in zip(self.HOST_FIELDS, host or ([0] * len(recalled),) * len(self.HOST_FIELDS), strict=True):
            setattr(self, name, list(values))
        self.drop = "first"  # what a full store drops first (`policies.Recall.drop`)
        self._reported: tuple[torch.Tensor, torch.Tensor] | None = None  # (marks, pos) at the last `take_counts`
        self.set_recalled(recalled, capacities)

    def host(self, rows: list[int] | None = None) -> tuple[list[int], list[int], list[int]]:
        """The rows' host bookkeeping (all of them by default)."""
        rows = range(len(self.recalled)) if rows is None else rows
        return tuple([getattr(self, name)[r] for r in rows] for name in self.HOST_FIELDS)

    def _made(self, tensors: dict[str, torch.Tensor]) -> Store:
        made = Store(tensors, self.dtype, self.recalled, self.host(), self.capacities)
        made.drop = self.drop
        return made

    @classmethod
    def allocate(
        cls, layers: int, key: torch.Tensor, value: torch.Tensor, capacities: list[int], recalled: list[int]
    ) -> Store:
        """A store of the largest of `capacities` (each row's) entries per layer, row and KV head, shaped after
        `key`, `value` (B, H, T, D) and on their device; `recalled` per row."""
        capacity = max(capacities)
        B, H, _, D = key.shape
        r, dev = rank_dim_for(D), key.device
        widths = {"key": D, "value": value.shape[-1], "rank": r}
        tensors = allocate_fields(STORE_FIELDS, (layers, B, H, capacity + 1), widths, torch.int8, dev)
        tensors["basis"] = torch.zeros(layers, B, H, D, r, device=dev)
        tensors["drops"] = torch.zeros(layers, B, H, dtype=torch.long, device=dev)
        return cls(tensors, key.dtype, recalled, capacities=capacities)

    def set_recalled(self, recalled: list[int], capacities: list[int] | None = None) -> None:
        """Tokens each row brings back per step (0: a row that does not recall and keeps nothing) and the entries
        each may hold (`capacities`, default: all; rows of one batch with smaller stores leave the rest empty, so
        that each keeps what it would alone); a policy change keeps what is stored."""
        self.recalled = list(recalled)
        # host ints (a traced step's twin store has symbolic sizes, which must not enter these)
        self.capacities = list(capacities) if capacities is not None else [int(self.capacity)] * len(recalled)
        self.k = max(self.recalled)  # a step's recalled tokens (rows that recall fewer mask the rest)
        self.uniform = len(set(self.recalled)) == 1
        self.uniform_capacity = len(set(self.capacities)) == 1
        dev = self.keys.device
        self.per_row = torch.tensor(self.recalled, dtype=torch.long, device=dev)  # (B,)
        self.pick = torch.arange(self.k, device=dev)  # (k,): a step's recalled places (its shape is k)
        self.limit = torch.tensor(self.capacities, dtype=torch.long, device=dev)  # (B,)

    def view_of_row(self, r: int) -> Store:
        """Row r as a store of its own sharing this one's memory, with the row's host bookkeeping."""
        view = Store(self.row(r).tensors(), self.dtype, [self.recalled[r]], self.host([r]), [self.capacities[r]])
        view.drop = self.drop
        return view

    def absorb(self, r: int, view: Store) -> None:
        """Row r's host bookkeeping back from its view (`view_of_row`) after a prompt was read into it."""
        for name in self.HOST_FIELDS:
            getattr(self, name)[r] = getattr(view, name)[0]

    def absorb_all(self, other: Store) -> None:
        """Every row's host bookkeeping from `other` (a snapshot of this store, loaded in place)."""
        for name, values in zip(self.HOST_FIELDS, other.host(), strict=True):
            setattr(self, name, list(values))
        self.set_recalled(other.recalled, other.capacities)

    def select(self, index: torch.Tensor) -> Store:
        rows = index.tolist()
        kept = super().select(index)
        capacities = [self.capacities[r] for r in rows]
        out = Store(kept.tensors(), self.dtype, [self.recalled[r] for r in rows], self.host(rows), capacities)
        out.drop = self.drop
        return out

    def resized(self, capacities: list[int], recalled: list[int]) -> Store:
        """A store of the largest of `capacities` (each row's) entries holding this one's best (what it would drop
        last), best first; a row keeps its own capacity's worth, the rest is dropped."""
        n, capacity = self.capacity, max(capacities)
        prio = self.priority(self.pos[..., :n], self.score[..., :n], self.marks[..., :n])
        ranked = order(prio, tie(self.pos[..., :n].long())).topk(min(n, capacity), dim=-1)
        out = self.moved(ranked.indices, capacity)
        out.set_recalled(recalled, capacities)
        for r, c in enumerate(out.capacities):
            for f in out.fields:
                getattr(out, f.name)[:, r, :, c:capacity] = f.empty
        out.drops += (self.pos[..., :n] >= 0).sum(-1) - (out.pos[..., :capacity] >= 0).sum(-1)
        return out

    def clear_row(self, r: int) -> None:
        super().clear_row(r)
        self.basis[:, r] = 0
        self.drops[:, r] = 0
        self.evicted[r] = self.fitted[r] = 0

    def clear(self) -> None:
        for r in range(self.batch):
            self.clear_row(r)

    # -- host bookkeeping ------------------------------------------------------------------------------
    def counted(self, counts: list[int], held_cap: list[int], seen: list[int]) -> None:
        """Before a forward that reads `counts` tokens into each row, which holds at most `held_cap` and has seen
        `seen` (before them): what each row will have evicted once it has read them."""
        for r, (n, cap, s) in enumerate(zip(counts, held_cap, seen, strict=True)):
            self.held_cap[r] = cap
            if self.recalled[r]:
                self.evicted[r] = max(0, s + n - cap)

    def due(self, stored: list[bool]) -> list[int]:
        """Rows whose basis should be fitted before the next forward: rows that recall, have `stored` tokens
        before it, and were never fitted (or were renumbered), or whose evicted tokens have doubled since their
        last fit (at most every half capacity). Not a row that will only start storing in this forward: a row
        refilled in a batch was fitted to an empty store before its prompt (arbitrary directions, kept until its
        evicted tokens doubled), where the same prompt alone was fitted at its first step, and its text parted
        from the prompt's alone at the 37th step."""
        out = []
        for r, (ev, at, cap) in enumerate(zip(self.evicted, self.fitted, self.capacities, strict=True)):
            if not stored[r]:
                continue
            if self.recalled[r] and ev and (at == 0 or ev - at >= min(max(at, FIT_FROM), cap // 2)):
                out.append(r)
        return out

    # -- writing (inside a step: no host synchronisation) -------------------------------------------------
    def _entry(self, keys: torch.Tensor, values: torch.Tensor, pos, rot, score) -> list[torch.Tensor]:
        """New entries' fields in `STORE_FIELDS` order from keys and values (L, B, H, n, D) in the model's dtype,
        true positions, rotations and scores (L, B, H, n); rows that do not recall keep nothing (position -1).
        Keys and values are quantized in one pass when they have the same shape (a decode step's end runs this
        every step: on a CPU each operation costs microseconds)."""
        if keys.shape == values.shape:
            q, scale = quantize(torch.stack((keys, values)))
            (qk, qv), (sk, sv) = q, scale
        else:
            (qk, sk), (qv, sv) = quantize(keys), quantize(values)
        ql, sl = quantize(keys.float() @ self.basis)  # the coordinates in the head's basis (L, B, H, n, rank)
        pos = pos.masked_fill((self.per_row == 0)[None, :, None, None] | (pos < 0), -1).to(torch.int32)
        return [qk, sk, qv, sv, ql, sl, pos, rot.to(torch.int32), score.float(), torch.zeros_like(pos)]

    def priority(self, pos: torch.Tensor, score: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
        """Keep-priority of entries (L, B, H, n) fp32, lower dropped first (`DROP`); empty ones -inf (filled
        first); stored entries past a row's capacity +inf (never filled, never dropped: the first `capacity`
        are stored ones, the rest new). Which rule drops first is the policy's (`Recall.drop`), measured on
        `eval recall` with the store capped (docs/policies.md)."""
        if self.drop == "age":  # the oldest first
            prio = pos.float()
        elif self.drop == "first":  # the latest positions first: the store keeps the earliest (a chat's opening)
            prio = -pos.float()
        elif self.drop == "recalls":
            prio = marks.float() * 1e6 + score  # the least recalled first; among them the lowest score
        else:
            prio = score
        prio = prio.masked_fill(pos < 0, -torch.inf)
        if self.uniform_capacity:
            return prio
        entry = torch.arange(prio.shape[-1], device=prio.device)
        beyond = (entry >= self.limit[:, None, None]) & (entry < self.capacity)  # (B, 1, n)
        return prio.masked_fill(beyond, torch.inf)

    def append_step(self, keys, values, pos, rot, score) -> None:
        """A decode step's evicted tokens, one per layer, row and head ((L, B, H, 1, D) keys and values, the rest
        (L, B, H, 1)): written into the spare, each takes the place of its head's lowest entry, or is dropped
        itself when lower. On CPU the native library's `store_place` places them in one pass over every layer's
        store (models/native/attention.cpp), else PyTorch's operations."""
        self.write_spare(keys, values, pos, rot, score)
        op = None
        if _native is not None and self.pos.device.type == "cpu" and not torch.compiler.is_compiling():
            op = _native()
        self.place_spare(op)

    def write_spare(self, keys, values, pos, rot, score) -> None:
        """New entries (`append_step`'s) into the spare. It is not cleared after being placed: nothing reads it but
        the next append, which writes it first (readers stop at `capacity`)."""
        spare = self.capacity
        for buf, x in zip(self.slot_tensors(), self._entry(keys, values, pos, rot, score), strict=True):
            buf[:, :, :, spare : spare + 1] = x

    def place_spare(self, op: Callable | None = None) -> None:
        """The spare entry takes the place of its (layer, row, head)'s lowest entry (itself, when it is lowest); a
        head that loses a token counts a drop. `op`: the native library's `store_place`, else PyTorch's
        operations."""
        if op is not None:
            limit = None if self.uniform_capacity else self.limit
            op(self.slot_tensors(), self.pos, self.score, self.marks, self.drops, limit, RULES.index(self.drop))
            return
        spare = self.capacity
        prio = self.priority(self.pos, self.score, self.marks)
        victim = place(self, prio, tie(self.pos))  # (L, B, H, 1): whose memory is reused
        self.drops += (self.pos.gather(3, victim) >= 0).squeeze(-1)
        for buf in self.slot_tensors():
            buf.scatter_(3, per_slot(victim, buf), buf[:, :, :, spare : spare + 1])

    def append_chunk(self, keys, values, pos, rot, score) -> None:
        """A prompt chunk's evicted tokens (L, B, H, T, ...): the T lowest of the stored and the new lose; the new
        that survive take the places freed."""
        T = keys.shape[3]
        if T == 0:
            return
        new = self._entry(keys, values, pos, rot, score)
        n = self.capacity
        fields = {f.name: x for f, x in zip(self.fields, new, strict=True)}
        both = {
            name: torch.cat((getattr(self, name)[..., :n], fields[name]), dim=-1) for name in ("pos", "score", "marks")
        }
        prio = self.priority(both["pos"], both["score"], both["marks"])
        target, losers = pair_freed_with_survivors(prio, tie(both["pos"].long(), new_from=n), n, T)
        self.drops += (both["pos"].gather(-1, losers) >= 0).sum(-1)
        for buf, x in zip(self.slot_tensors(), new, strict=True):
            buf.scatter_(3, per_slot(target, buf), x.to(buf.dtype))
        self.clear_spare()

    def mark(self, picked: torch.Tensor) -> None:
        """Count the entries a step recalled, (L, B, H, k) indices (`take_counts`)."""
        self.marks.scatter_add_(3, picked, torch.ones_like(picked, dtype=self.marks.dtype))

    # -- reading ---------------------------------------------------------------------------------------
    def keys_at(self, i: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Layer i's keys at entries `index` (B, H, n) -> (B, H, n, D) in `dtype`."""
        return entries_at(self.keys[i], self.kscale[i], index, dtype)

    def values_at(self, i: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Layer i's values at entries `index` (B, H, n) -> (B, H, n, Dv) in `dtype`."""
        return entries_at(self.values[i], self.vscale[i], index, dtype)

    def tokens(self) -> torch.Tensor:
        """(B,) entries held per row (the mean over layers and heads)."""
        return (self.pos[..., : self.capacity] >= 0).float().sum(-1).mean(dim=(0, 2))

    def dropped(self) -> torch.Tensor:
        """(B,) entries dropped per row (the mean over layers and heads): evicted tokens that can never return."""
        return self.drops.float().mean(dim=(0, 2))
