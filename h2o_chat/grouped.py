"""Several cache policies side by side in one batch: rows are routed to per-group H2O layers.

Teacher-forced evaluation feeds the same tokens through many configurations (policies x budgets). Decoding
cost is dominated by reading the weights, so running the configurations as rows of one batch costs little
more than one of them. Each group is an ordinary `H2OCache` (its own policy, budget and statistics); a
`GroupedLayer` splits the batch rows among the groups' layers and concatenates their attention outputs.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_chat.attention import set_active
from h2o_chat.cache import H2OCache
from h2o_chat.layer import H2OLayer
from h2o_chat.policies import Policy
from h2o_chat.rope import Rope


class GroupedLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, subs: list[H2OLayer], rows: list[int]):
        super().__init__()
        self.subs, self.rows = subs, rows
        self.layer_idx = subs[0].layer_idx
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # the sub-layers initialise themselves
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for sub, k, v in zip(self.subs, key_states.split(self.rows), value_states.split(self.rows), strict=True):
            sub.update(k, v)
        self.is_initialized = True
        self._pending = (key_states, value_states)
        set_active(self)
        return key_states, value_states

    def owns(self, key: torch.Tensor) -> bool:
        return self._pending is not None and self._pending[0] is key

    def attend(self, query: torch.Tensor, padding_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        self._pending = None
        masks = padding_mask.split(self.rows) if padding_mask is not None else [None] * len(self.subs)
        outs = [sub.attend(q, m, scaling) for sub, q, m in zip(self.subs, query.split(self.rows), masks, strict=True)]
        return torch.cat(outs, dim=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(s.n for s in self.subs) + query_length, 0

    def get_seq_length(self) -> int:
        return self.subs[0].get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for sub in self.subs:
            sub.reset()
        self._pending = None


class GroupedCache(Cache):
    """`groups[g]` is an H2OCache over rows `rows[g]` of the batch (contiguous, in order)."""

    def __init__(
        self,
        policies: list[Policy],
        num_layers: int,
        rows: list[int] | None = None,
        positions: list[str] | None = None,
        rope: Rope | None = None,
        context: int | None = None,
    ):
        positions = positions or ["absolute"] * len(policies)
        self.groups = [H2OCache(p, num_layers, m, rope, context) for p, m in zip(policies, positions, strict=True)]
        self.rows = rows or [1] * len(policies)
        layers = [GroupedLayer([g.layers[i] for g in self.groups], self.rows) for i in range(num_layers)]
        super().__init__(layers=layers)

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        policies: list[Policy],
        rows: list[int] | None = None,
        positions: list[str] | None = None,
        context: int | None = None,
    ) -> GroupedCache:
        """`positions[g]`: absolute | rolling | auto for group g (see H2OCache.for_model)."""
        config = model.config.get_text_config()
        context = context or getattr(config, "max_position_embeddings", None)
        return cls(policies, config.num_hidden_layers, rows, positions, Rope.from_model(model), context)

    def next_positions(self, batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.cat([g.next_positions(r, device) for g, r in zip(self.groups, self.rows, strict=True)])

    def position_ids(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.cat([g.position_ids(m) for g, m in zip(self.groups, mask.split(self.rows), strict=True)])

    def stats(self):
        return [g.stats() for g in self.groups]
