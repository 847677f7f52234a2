"""A forward through the cache (an `H2OCache`, which imports this module: its type is not named here), begun and
ended explicitly: what kind it is, and what it leaves for its end.

1. `Step.begin` / `Chunk.begin`: a decode step writes the new token's position into the spare slot; a prompt
   chunk numbers its tokens and builds its attention mask, once for every layer. Both return the model's
   position ids.
2. The model runs; each layer's attention (`H2OLayer.attend`) reads the storage and gives its new keys, values
   and the mass its slots received to the forward (a `Step` or a `Chunk`; a chunk that fits is written into its
   slots at once).
3. `Step.end` / `Chunk.end`: a step's new tokens go into the spare slot (every layer in one write) and its mass
   into the scores; then `evict.step` or `evict.chunk` places the new tokens for every layer at once; rows advance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from h2o_chat.engine.policies import evict, recall_rank
from h2o_chat.engine.storage.slots import Slots, inference
from h2o_chat.errors import CacheUsageError

WIDTH_STEP = 32  # a decode step reads its slots in multiples of this many (few distinct shapes)


def read_width(columns: int, capacity: int) -> int | None:
    """How many slots a decode step must read: every row holds its tokens in slots [0, held) (`evict.py`) and holds
    no more than the columns fed, so a cache still filling reads what it can hold, not its whole budget (None: every
    slot). Below `capacity` (the smallest budget of its rows) every row also has room for the step's token."""
    width = -(-max(columns, 1) // WIDTH_STEP) * WIDTH_STEP
    return None if width >= capacity else width


@dataclass
class Step:
    """A decode step now running: one column; each layer keeps its new key and value (B, H, 1, D), the mass its
    slots received (B, H, S: the new token's own at the spare's index) and the store entries it recalled
    (B, H, k) for `end()`, which writes every layer's at once."""

    layers: int = 0
    width: int | None = None  # the first slots, those that can hold a token, attended (None: every slot)
    store_width: int | None = None  # the first entries of recall's store ranked (None: every entry)
    valid: torch.Tensor | None = None  # (B, 1, S) slots holding a token
    new: list[tuple] = field(default_factory=list, repr=False)
    returned: list[torch.Tensor] | None = None  # `take`'s result, when a compiled step returned it
    kind: ClassVar[str] = "step"

    @classmethod
    def begin(cls, cache) -> tuple[Step, torch.Tensor]:
        """A decode step of `cache` begins: the new token's position goes into the spare slot. Returns the step
        and the model's position ids (B, 1)."""
        s = cache.slots
        if s is None:
            raise CacheUsageError("a decode step needs a prompt first: begin with a chunk")
        spare = s.capacity
        s.pos[..., spare] = s.seen[None, :, None]
        s.rot[..., spare] = s.next_rot[None, :, None]
        # a CUDA graph (or a traced step) keeps one shape: it reads every slot
        fixed = s.keys.device.type == "cuda" or torch.compiler.is_compiling()
        room = min(g.policy.capacity or spare for g in cache.groups)  # a row of a smaller budget fills first
        width = None if fixed else read_width(cache.seq.columns, min(room, spare))
        stored = None if fixed or cache.store is None else recall_rank.read_width(cache.store)
        return cls(layers=len(cache.layers), width=width, store_width=stored), s.next_rot[:, None]

    def end(self, cache) -> None:
        """The step's new tokens go into the spare slot (every layer in one write) and their mass into the scores;
        the eviction then places them; the rows advance."""
        s, rules = cache.slots, cache.rules
        keys, values, mass, *picked = self.returned if self.returned is not None else self.take()
        s.write((slice(None), slice(None), slice(None), s.capacity), keys, values)
        if self.width is not None and cache.store is None and not rules.any_decay:
            # every row still has room (`read_width`): the mass of the slots read and of the new token, which
            # takes its row's first empty slot, where `evict.step` would put it, without ranking any slot
            s.score[..., : self.width] += mass[..., :-1]
            s.score[..., s.capacity] += mass[..., -1]
            evict.append(s)
        else:
            if mass.shape[-1] != s.score.shape[-1]:  # a narrow step's: its slots', then the new token's (the spare's)
                full = mass.new_zeros(s.score.shape)
                full[..., : mass.shape[-1] - 1] = mass[..., :-1]
                full[..., s.capacity] = mass[..., -1]
                mass = full
            if picked:
                cache.store.mark(picked[0])
            if rules.any_decay:  # recall: older mass counts less (score * decay + mass, in one operation)
                torch.addcmul(mass, s.score, rules.decay, out=s.score)
            else:
                s.score += mass
            evict.step(s, rules, cache.store)
        s.seen += 1
        s.next_rot += 1

    def keep(self, key: torch.Tensor, value: torch.Tensor, mass: torch.Tensor, picked: torch.Tensor | None) -> None:
        self.new.append((key, value, mass) if picked is None else (key, value, mass, picked))

    def slots_valid(self, slots: Slots) -> torch.Tensor:
        """(B, 1, S) the slots holding a token, found once per step from the slots' positions (inside the step,
        so that a compiled step reads nothing made outside it but the storage). A compiled step keeps no state of
        its own (`compiled.py`): it finds them again in each layer, a few fused comparisons."""
        if torch.compiler.is_compiling():
            return slots.valid()[:, None, :]
        if self.valid is None:
            self.valid = slots.valid()[:, None, :]
        return self.valid

    def take(self) -> tuple[torch.Tensor, ...]:
        """Every layer's new keys and values (L, B, H, D), masses (L, B, H, S) and, with a store, the entries
        recalled (L, B, H, k), stacked."""
        parts = list(zip(*self.new, strict=True))
        self.new.clear()
        return (torch.stack(parts[0])[..., 0, :], torch.stack(parts[1])[..., 0, :], *map(torch.stack, parts[2:]))


class OwnRow(NamedTuple):
    """A row of a CPU batch's prompt chunk, attending over the columns it has alone (`own_rows`)."""

    row: int
    tokens: int  # its real tokens in the chunk (the last ones)
    stored: int  # the stored slots its tokens can be in (the first ones)
    recalls: bool  # it has evicted tokens to recall (alone, a row that has not ranks no store: no such columns)
    mass: bool  # its policy wants the attention mass in this chunk


def own_rows(cache, real: torch.Tensor, seen: torch.Tensor, attend_from: int) -> tuple[OwnRow, ...]:
    """A CPU batch's prompt chunk attends row by row, each over its own columns -- the shapes it has alone -- so a
    prompt read in a batch reads as it does alone, bit for bit. Attending as one batch did not:
    - PyTorch's CPU matrix products split their work by the batch's size: a 2-token chunk's attention output
      differed in the last bits between one row and two rows of the same prompt (layer 14 of the embedded model);
    - its fused attention sums a left-padded row's keys in other vector lanes than alone (its keys sit after the
      padding);
    - a row's output came from the blocked product (when the mass is wanted: h2o, and snap's or recall's rows not
      being compressed) or from the fused kernel (full, and snap's or recall's compressed rows) by what any row
      of the batch needed.
    A few ulps apart were enough: greedy texts parted within tens of tokens (2 of test_batch's 5 prompts under
    recall). Each row now takes its own kind of product over its own stored slots and real tokens."""
    need = [g.policy.by_score for g in cache.row_groups(real.shape[0])]
    if cache.observation is not None:  # snap's pass 2: compressed rows are scored by observation, not mass
        need = [n and not o for n, o in zip(need, cache.observation.rows.tolist(), strict=True)]
    counts, held = real.sum(-1).tolist(), seen.tolist()  # a row's tokens fill its first slots until it evicts
    recalls = cache.stored_rows or [False] * len(need)  # (`H2OCache.before_forward`, for this chunk)
    return tuple(OwnRow(b, counts[b], min(attend_from, held[b]), recalls[b], need[b]) for b in range(len(need)))


@dataclass
class Chunk:
    """A prompt chunk now running, and what it leaves for `end()`: its tokens' keys, values and mass, every
    layer's, when they must wait for the eviction (a chunk that fits is written into its slots at once)."""

    width: int  # T, the chunk's columns
    real: torch.Tensor  # (B, T) real (non-padding) tokens
    pos_new: torch.Tensor | None = None  # (B, T) true positions, -1 = padding
    rot_new: torch.Tensor | None = None  # (B, T) positions the new keys are rotated at
    attend_from: int = 0  # stored slots that can hold tokens (the chunk's keys follow them)
    fits: bool = False  # every row has room for all its tokens (no selection needed)
    track_mass: bool = True  # some row's policy needs the attention mass
    fused: bool = False  # output from the fused kernel (see attention.attention_with_mass)
    rows: tuple[OwnRow, ...] = ()  # a CPU batch's rows, each attending over its own columns (`own_rows`)
    keys: torch.Tensor | None = None  # (L, B, H, T, D), filled layer by layer
    values: torch.Tensor | None = None
    score: torch.Tensor | None = None  # (L, B, H, T) fp32 mass the new tokens received
    probe: object | None = None  # snap pass 1 (`snap.Probe`)
    observation: object | None = None  # snap pass 2 (`snap.Observation`)
    stored_valid: torch.Tensor | None = None  # (B, attend_from) stored slots holding a token
    target: torch.Tensor | None = None  # a chunk that fits: (B, T) the slots its tokens are written into
    layers: int = 0
    _mask: torch.Tensor | None = field(default=None, repr=False)
    kind: ClassVar[str] = "chunk"

    @classmethod
    @inference
    def begin(cls, cache, mask: torch.Tensor | None, T: int, batch: int | None) -> tuple[Chunk, torch.Tensor]:
        """A prompt chunk of T columns of `cache` begins (`mask` (B, T) marks real tokens, None = all): its tokens
        numbered and, when the storage holds tokens, which stored slots they see. Returns the chunk and the model's
        position ids (B, T)."""
        s = cache.slots
        if mask is None:
            B = s.batch if s is not None else batch
            if B is None:
                raise CacheUsageError("a prompt chunk needs its padding mask or its batch size")
            real = torch.ones(B, T, dtype=torch.bool, device=s.seen.device if s is not None else None)
        else:
            real = mask.bool()
        B = real.shape[0]
        zeros = torch.zeros(B, dtype=torch.long, device=real.device)
        seen, next_rot = (s.seen, s.next_rot) if s is not None else (zeros, zeros)
        steps = real.cumsum(-1) - 1
        before = cache.seq.columns - T
        capacity = s.capacity if s is not None else cache.capacity_for(0)
        limits = [g.policy.capacity or capacity for g in cache.groups]
        fwd = cls(
            T,
            real=real,
            pos_new=(seen[:, None] + steps).masked_fill(~real, -1),
            rot_new=(next_rot[:, None] + steps).masked_fill(~real, -1),
            attend_from=min(capacity, before) if s is not None else 0,
            fits=before + T <= min(limits),
            track_mass=any(g.policy.by_score for g in cache.groups)
            and (cache.observation is None or cache.observation.track_mass),
            fused=real.device.type == "cuda",
            probe=cache.probe,
            observation=cache.observation,
            layers=len(cache.layers),
        )
        if fwd.attend_from:
            fwd.stored_valid = s.valid()[:, : fwd.attend_from]
        if real.device.type == "cpu" and B > 1:
            fwd.rows = own_rows(cache, real, seen, fwd.attend_from)
        return fwd, fwd.rot_new.clamp(min=0)

    def end(self, cache) -> None:
        """Place the chunk's tokens (the eviction chooses, for every layer at once, when they did not fit) and
        advance the rows."""
        if self.score is None:  # nothing reached the attention (an empty model?)
            return
        s = cache.slots
        extra = [self.observation.new_obs] if self.observation is not None else []
        new = evict.NewTokens(self.keys, self.values, self.pos_new, self.rot_new, self.score, extra)
        priority = None
        if self.observation is not None and not self.fits:
            priority = self.observation.priority(cache, new)
        evict.chunk(s, new, cache.rules, self.fits, priority, cache.store)
        added = self.real.sum(-1)
        s.seen += added
        s.next_rot += added

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, T, n + T) additive, built once per chunk for every layer and head: a real query sees the
        stored tokens and the real chunk tokens up to itself; a padding query sees only itself."""
        if self._mask is None or self._mask.dtype != dtype:
            self._mask = self._build_mask(dtype)
        return self._mask

    def recalled_mask(self, mask: torch.Tensor, recalled: torch.Tensor) -> torch.Tensor:
        """The chunk's mask (B, 1, T, N) with R recalled tokens in front, which every real query sees where
        `recalled` (B, H, R) holds a token: (B, H, T, R + N), per KV head (what is recalled differs by head)."""
        B, H, R = recalled.shape
        seen = recalled[:, :, None, :] & self.real[:, None, :, None]  # (B, H, T, R)
        front = torch.zeros(seen.shape, dtype=mask.dtype, device=mask.device).masked_fill_(~seen, -torch.inf)
        return torch.cat((front, mask.expand(-1, H, -1, -1)), dim=-1)

    def _build_mask(self, dtype: torch.dtype) -> torch.Tensor:
        real, T = self.real, self.width
        dev = real.device
        new = torch.ones(T, T, dtype=torch.bool, device=dev).tril() & real[:, None, None, :]  # (B, 1, T, T)
        new = (new & real[:, None, :, None]) | torch.eye(T, dtype=torch.bool, device=dev)
        allowed = new
        if self.attend_from:
            allowed = torch.cat((self.stored_valid[:, None, None, :] & real[:, None, :, None], new), dim=-1)
        return torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, -torch.inf)

    def stash(self, slots: Slots, i: int, key: torch.Tensor, value: torch.Tensor, mass: torch.Tensor | None) -> None:
        """Layer i's new keys, values and mass, once its attention has run: when the chunk fits they go straight
        into their slots (appended); otherwise they wait, every layer's together, until the forward ends."""
        B, H, T, _ = key.shape
        if self.score is None:
            self.score = torch.zeros(self.layers, B, H, T, dtype=torch.float32, device=key.device)
            if self.fits:
                self.target = evict.append_slots(slots, self.real)  # (B, T), the same in every layer
            else:
                self.keys = key.new_empty(self.layers, *key.shape)
                self.values = value.new_empty(self.layers, *value.shape)
        if mass is not None:
            self.score[i] = mass
        if self.fits:
            slots.scatter(i, self.target[:, None, :, None], key, value)
            return
        self.keys[i] = key
        self.values[i] = value


Forward = Step | Chunk
