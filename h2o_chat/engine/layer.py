"""One layer of the H2O cache: its view of the shared slot storage, attention with mass, and prefill insertion.

Storage lives in the cache (`Slots`: every layer stacked, allocated once); a layer reads and writes its own
index of it. A decode step (one token per row) never changes a shape: `H2OCache.update` has already written the
token into the layer's spare slot, `attend` runs attention over every slot with empty ones masked and adds the
mass to the scores, and the cache evicts for all layers at once when the forward ends. A prefill chunk of T
tokens attends to the slots and the chunk, then keeps the best `capacity` of the stored + new tokens in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_chat.engine.attention import attention_over_slots, attention_with_mass
from h2o_chat.engine.policies import lowest
from h2o_chat.engine.slots import per_slot

if TYPE_CHECKING:
    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.snap import Observation, Probe


class H2OLayer(CacheLayerMixin):
    """Layer `idx` of an `H2OCache`. Shapes of its view: keys/values (B, H, S, D), pos/score (B, H, S)."""

    is_sliding = False
    is_compileable = False  # see H2OCache.is_compileable
    is_croppable = False

    def __init__(self, cache: H2OCache, idx: int):
        self.cache, self.layer_idx = cache, idx
        super().__init__()
        self.armed = False  # set by the attention hook right before the model's update() of this layer
        self.probe: Probe | None = None  # snap pass 1: collects the prompt's last queries
        self.observation: Observation | None = None  # snap pass 2: scores tokens by those queries

    # -- views of the shared storage (transformers' base class assigns keys/values/is_initialized: ignored) --
    @property
    def is_initialized(self) -> bool:
        return self.cache.slots is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        pass

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.cache.slots is None else self.cache.slots.keys[self.layer_idx]

    @keys.setter
    def keys(self, value) -> None:
        pass

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.cache.slots is None else self.cache.slots.values[self.layer_idx]

    @values.setter
    def values(self, value) -> None:
        pass

    @property
    def pos(self) -> torch.Tensor:
        """Absolute position of the token in each slot, -1 if empty or padding: (B, H, S)."""
        return self.cache.slots.pos[self.layer_idx]

    @property
    def score(self) -> torch.Tensor:
        """Accumulated attention mass per slot, fp32: (B, H, S)."""
        return self.cache.slots.score[self.layer_idx]

    @property
    def policy(self):
        return self.cache.policy

    @property
    def capacity(self) -> int:
        """Slots that hold tokens between forwards (the spare slot excluded)."""
        return self.cache.slots.capacity

    @property
    def rolling(self) -> bool:
        return self.cache.rolling

    @property
    def num_heads(self) -> int:
        return self.cache.slots.keys.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.slots.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.cache.slots.keys.device

    # -- the transformers CacheLayerMixin protocol (the cache's update() does the writing) --------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache.allocate(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        slots = self.cache.slots
        return (slots.keys.shape[3] if slots is not None else 0) + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.columns

    def get_max_length(self) -> int:
        return self.cache.policy.capacity or -1

    def reset(self) -> None:
        self.cache.reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (no assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.cache.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.cache.select_rows(torch.as_tensor(indices).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.cache.slots is not None:
            self.cache.select_rows(torch.arange(self.cache.slots.batch).repeat_interleave(repeats))

    # -- attention ----------------------------------------------------------------------------------
    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padding: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Attention for the queries of this forward; `key`/`value` are what `update()` returned. (B, T, Hq, Dv)"""
        if query.shape[2] == 1:
            return self._attend_step(query, scaling)
        return self._attend_chunk(query, key, value, padding, scaling)

    def _attend_step(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        slots, i = self.cache.slots, self.layer_idx
        keys = slots.keys[i]
        if self.cache.rolling:  # positions by rank among the held tokens; the new token (spare slot) is last
            rank, bound = slots.rank[i], slots.keys.shape[3] + 1  # (B, H, S)
            rank_q = rank[..., -1:].repeat_interleave(query.shape[1] // keys.shape[1], dim=1)  # (B, Hq, 1)
            query = self.cache.rope.rotate(query, rank_q, small=bound)
            keys = self.cache.rope.rotate(keys, rank, small=bound)
        out, mass = attention_over_slots(query, keys, slots.values[i], scaling, slots.valid[i])
        slots.score[i] += mass
        return out

    def _attend_chunk(self, query, k_new, v_new, padding, scaling) -> torch.Tensor:
        cache, slots, i = self.cache, self.cache.slots, self.layer_idx
        B, H, T = k_new.shape[:3]
        new_valid = None if padding is None else padding[:, -T:].to(device=k_new.device, dtype=torch.bool)
        keys, values, pos = slots.keys[i], slots.values[i], slots.pos[i]
        q, kc, kn = query, keys, k_new
        if cache.rolling:
            q, kc, kn = self._rotate_by_rank(query, keys, k_new, new_valid)
        out, mass_cache, mass_new = attention_with_mass(q, kc, values, kn, v_new, scaling, pos >= 0, new_valid)
        slots.score[i] += mass_cache

        # absolute positions of the new tokens, per row (B, T); padding gets -1. Rows advance when the forward ends.
        if new_valid is None:
            pos_new = slots.seen[:, None] + torch.arange(T, device=k_new.device)
            advance = torch.full_like(slots.seen, T)
        else:
            pos_new = (slots.seen[:, None] + new_valid.cumsum(-1) - 1).masked_fill(~new_valid, -1)
            advance = new_valid.sum(-1)
        if i == 0:
            cache.advance = advance
        if self.probe is not None:  # snap pass 1: remember the prompt's last queries
            self.probe.capture(self, query, pos_new, scaling)
        pos_new = pos_new[:, None, :].expand(B, H, T)
        new = [k_new, v_new, pos_new, mass_new]
        if self.observation is not None:  # snap pass 2: score by the observation queries
            new.append(self.observation.score_new(self, k_new, pos_new))
        self._insert_chunk(new, slots.seen + advance - 1)
        return out

    def _rotate_by_rank(self, query, keys, k_new, new_valid):
        """Rolling positions for a chunk: a held token's position is its rank among the held tokens (by true
        position); the new tokens come right after. Returns rotated copies (query, stored keys, new keys)."""
        S, T = keys.shape[2], k_new.shape[2]
        pos = self.cache.slots.pos[self.layer_idx]
        rank = _ranks(pos)
        held = (pos >= 0).sum(-1, keepdim=True)  # (B, H, 1)
        if new_valid is None:
            step = torch.arange(T, device=keys.device)
        else:
            step = (new_valid.cumsum(-1) - 1).clamp(min=0)[:, None, :]  # padding does not advance
        rank_new = held + step  # (B, H, T)
        G = query.shape[1] // k_new.shape[1]
        rope, bound = self.cache.rope, S + T + 1
        return (
            rope.rotate(query, rank_new.repeat_interleave(G, dim=1), small=bound),
            rope.rotate(keys, rank, small=bound),
            rope.rotate(k_new, rank_new, small=bound),
        )

    # -- prefill insertion --------------------------------------------------------------------------
    def _buffers(self) -> list[torch.Tensor]:
        """Per-slot tensors of this layer, moved together: keys, values, pos, score (and snap's observation)."""
        slots, i = self.cache.slots, self.layer_idx
        bufs = [slots.keys[i], slots.values[i], slots.pos[i], slots.score[i]]
        return bufs + [self.observation.obs] if self.observation is not None else bufs

    def _priority(self, pos_new: torch.Tensor, score_new: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """Keep-priority of every candidate, stored slots (spare excluded) then new tokens: (B, H, C + T)."""
        if self.observation is not None:
            return self.observation.priority(self, pos_new)
        slots, i, C = self.cache.slots, self.layer_idx, self.capacity
        score = torch.cat((slots.score[i][..., :C], score_new), dim=-1)
        pos = torch.cat((slots.pos[i][..., :C], pos_new), dim=-1)
        return self.cache.policy.priority(score, pos, newest)

    def _insert_chunk(self, new: list[torch.Tensor], newest: torch.Tensor) -> None:
        """Keep the `capacity` best of the stored + T new tokens, writing the surviving new ones into the freed
        slots in order (a cache still filling appends). No host sync: new tokens that lose are written into the
        spare slot, which is cleared afterwards."""
        C, T = self.capacity, new[0].shape[2]
        slots, i = self.cache.slots, self.layer_idx
        pos_new = new[2]
        prio = self._priority(pos_new, new[3], newest)  # (B, H, C + T)
        all_pos = torch.cat((slots.pos[i][..., :C], pos_new), dim=-1)
        is_out = torch.zeros_like(prio, dtype=torch.bool).scatter_(-1, lowest(prio, T, all_pos), True)
        slots.evicted += (is_out & (all_pos >= 0)).sum()

        # freed slots pair up, in order, with surviving new tokens: per (row, head) the counts are equal because
        # exactly T candidates lose
        free = is_out[..., :C]
        index = torch.arange(C, device=prio.device).expand_as(free)
        free_sorted = torch.where(free, index, C).sort(dim=-1).values  # (B, H, C) freed slots first
        keep_new = ~is_out[..., C:]  # (B, H, T)
        rank = (keep_new.cumsum(-1) - 1).clamp(min=0)
        target = torch.where(keep_new, free_sorted.gather(-1, rank), C)  # (B, H, T); losers -> the spare slot
        for buf, values in zip(self._buffers(), new, strict=True):
            buf.scatter_(2, per_slot(target, buf), values.to(buf.dtype))
        self.cache.clear_spare(i)


def _ranks(pos: torch.Tensor) -> torch.Tensor:
    """Rank of each slot's token among the held ones by true position (empty slots rank after them), same shape."""
    order = torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max).argsort(dim=-1)
    index = torch.arange(pos.shape[-1], device=pos.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, index)
