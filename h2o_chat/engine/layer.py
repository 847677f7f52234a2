"""One layer of the H2O cache: transformers' per-layer protocol over the shared slot storage, and attention.

Storage lives in the cache (`Slots`: every layer stacked, allocated once); a layer reads its own index of it.
What a forward is -- a decode step or a prompt chunk -- is said by whoever started it (the decode engine, or
the hooks `prepare_model` puts on the model for `model.generate`), never inferred here from a shape:

- a decode step: attention runs over every slot with empty ones masked (fixed shapes), the new token in the
  spare slot's place; the storage is only read, and the new key, value and mass are kept for `end()`, which
  writes them for every layer at once (so a compiled step writes nothing inside its program).
- a prompt chunk: attention over the filled slots and the chunk (PyTorch's fused kernel for the output where
  that is faster, see `attention.attention_with_mass`); the stored slots' mass is added to their scores and the
  chunk's tokens wait in the cache until the forward ends, when `evict.chunk` places every layer's at once.

With the recall policy both also attend to the evicted tokens their queries want back (`engine/storage/store.py`),
placed after the slots in a step and before them in a chunk; those get no mass.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_chat.engine.policies import recall_rank
from h2o_chat.engine.step.attention import attention_by_row, attention_over_slots, attention_with_mass


class H2OLayer(CacheLayerMixin):
    """Layer `idx` of an `H2OCache`. Shapes of its view: keys/values (B, H, S, D), pos/score (B, H, S)."""

    is_sliding = False
    is_compileable = False  # see H2OCache.is_compileable
    is_croppable = False

    def __init__(self, cache, idx: int):
        # `cache`: the H2OCache this layer belongs to (it imports this module, not the other way round). The
        # base class's __init__ is not called: keys, values and is_initialized are read-only views of the cache's
        # storage here, and assigning them (transformers' offloading does) fails loudly instead of being ignored
        self.cache, self.layer_idx = cache, idx

    @property
    def is_initialized(self) -> bool:
        return self.cache.slots is not None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.cache.slots is None else self.cache.slots.read("keys", (self.layer_idx,))

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.cache.slots is None else self.cache.slots.read("values", (self.layer_idx,))

    @property
    def pos(self) -> torch.Tensor:
        """True position of the token in each slot, -1 if empty: (B, H, S)."""
        return self.cache.slots.pos[self.layer_idx]

    @property
    def score(self) -> torch.Tensor:
        """Accumulated attention mass per slot, fp32: (B, H, S)."""
        return self.cache.slots.score[self.layer_idx]

    # -- the transformers CacheLayerMixin protocol (the cache's update() does the writing) --------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache.allocate(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        slots = self.cache.slots
        return (slots.keys.shape[3] if slots is not None else 0) + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seq.columns

    def get_max_length(self) -> int:
        return self.cache.get_max_length()

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
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention for this forward's queries; `key`/`value` are what `update()` returned. (B, T, Hq, Dv)"""
        cache, i = self.cache, self.layer_idx
        slots, fwd = cache.slots, cache.forward
        if fwd.kind == "step":
            # the recall policy: the tokens this query wants back from the evicted ones
            got = recall_rank.step(cache.store, i, query, fwd.store_width) if cache.store is not None else None
            scales = (slots.kscale[i], slots.vscale[i]) if slots.quantized else None
            kv = slots.keys[i], slots.values[i]
            valid, new = fwd.slots_valid(slots), (key, value)
            out, mass = attention_over_slots(query, *kv, scaling, valid, got, scales, new=new, width=fwd.width)
            # written, the mass added and the recalled entries counted, for every layer at once when the step ends
            fwd.keep(key, value, mass, None if got is None else got.index)
            return out
        n = fwd.attend_from  # stored slots that can hold tokens; the chunk comes after them
        stored = (i, slice(None), slice(None), slice(0, n))
        keys = torch.cat((slots.read("keys", stored), key), dim=2) if n else key
        values = torch.cat((slots.read("values", stored), value), dim=2) if n else value
        mask = fwd.mask(query.dtype)
        got = None
        if cache.store is not None and cache.stored_before:  # (host counts: nothing stored yet, no ranking)
            got = recall_rank.chunk(cache.store, i, query, fwd.real)
        r = 0 if got is None else got.keys.shape[2]
        if got is not None:  # the recall policy: evicted tokens the chunk's queries want, before the slots
            keys, values = torch.cat((got.keys, keys), dim=2), torch.cat((got.values, values), dim=2)
            mask = fwd.recalled_mask(mask, got.valid)
        if fwd.rows:  # a CPU batch: each row over its own columns, as alone (`forward.own_rows`)
            out, mass = attention_by_row(query, keys, values, mask, scaling, r, fwd.rows, fwd.track_mass)
        else:
            out, mass = attention_with_mass(query, keys, values, mask, scaling, fwd.track_mass, fwd.fused)
        if mass is not None and n:
            slots.score[i, :, :, :n] += mass[..., r : r + n]
        fwd.stash(slots, i, key, value, None if mass is None else mass[..., r + n :])
        if fwd.probe is not None:  # snap pass 1: remember the prompt's last queries
            fwd.probe.capture(i, query * scaling, fwd.rot_new, fwd.pos_new)
        if fwd.observation is not None:  # snap pass 2: score the chunk by the observation queries
            fwd.observation.score_chunk(i, key, fwd)
        return out
