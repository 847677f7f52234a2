"""The transformers `Cache` protocol of the H2O cache: what a model's forward and `generate` call on it.

A layer's attention finds its `H2OLayer` (`h2o_layer`); its `update` hands the new keys and values to that
layer's attention, which reads the storage and keeps them for the forward's end (`forward.py`): nothing is
written here. Sequence lengths are the cache's columns (a device value inside a compiled step).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from h2o_chat.errors import CacheUsageError


class CacheProtocol(Cache):
    """The part of `H2OCache` that transformers calls (the rest is h2o-chat's own verbs)."""

    # generate() would compile its forward on CUDA for a compileable cache; h2o-chat's engine captures steps itself
    is_compileable = False

    def h2o_layer(self, layer_idx: int):
        """Called by the attention hook before the layer's update: its `H2OLayer`, if a forward has begun."""
        if self.forward is None:
            raise CacheUsageError(
                "the H2O cache was used outside a forward it began: call h2o_chat.prepare_model(model) before "
                "using an H2OCache, and run the model (or its base module), not its layers one by one"
            )
        return self.layers[layer_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The layer's attention reads the storage and keeps the new tokens; `end()` places them."""
        if self.forward is None:
            raise CacheUsageError(
                "the H2O cache was updated by attention that does not go through h2o-chat: "
                "call h2o_chat.prepare_model(model) before using an H2OCache"
            )
        if self.slots is None:
            self.allocate(key_states, value_states)
        device = self.slots.keys.device
        if key_states.device != device:  # a layer placed elsewhere by accelerate
            key_states, value_states = key_states.to(device), value_states.to(device)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if torch.compiler.is_compiling() and self.slots is not None:
            # a traced step would bake a host counter in (and retrace every step): give a device value, as
            # transformers' StaticCache does; h2o-chat passes position ids itself anyway
            return self.slots.seen.max()
        return self.seq.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return (self.policy.capacity or -1) if len(self.groups) == 1 else -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (no assisted decoding)")
