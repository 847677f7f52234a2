"""Several cache policies side by side in one batch: rows are routed to per-group H2O caches.

Teacher-forced evaluation feeds the same tokens through many configurations (policies x budgets). Decoding
cost is dominated by reading the weights, so running the configurations as rows of one batch costs little
more than one of them. Each group is an ordinary `H2OCache` (its own policy, budget, positions and statistics);
a `GroupedLayer` splits the batch rows among the groups' layers and concatenates their attention outputs.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_chat.engine.cache import H2OCache, model_facts
from h2o_chat.engine.policies import Policy
from h2o_chat.engine.rope import Rope
from h2o_chat.engine.slots import CacheStats


class GroupedLayer(CacheLayerMixin):
    """Layer `idx` of every group: attention for each group's rows with that group's layer."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: GroupedCache, idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, idx

    def lazy_initialization(self, key_states, value_states) -> None:  # the groups allocate their own storage
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def attend(self, query, key, value, padding, scaling) -> torch.Tensor:
        rows = self.cache.rows
        subs = [g.layers[self.layer_idx] for g in self.cache.groups]
        keys = key.split(rows) if query.shape[2] > 1 else [None] * len(subs)
        vals = value.split(rows) if query.shape[2] > 1 else [None] * len(subs)
        masks = padding.split(rows) if padding is not None else [None] * len(subs)
        outs = [
            sub.attend(q, k, v, m, scaling)
            for sub, q, k, v, m in zip(subs, query.split(rows), keys, vals, masks, strict=True)
        ]
        return torch.cat(outs, dim=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(g.get_mask_sizes(query_length)[0] for g in self.cache.groups), 0

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class GroupedCache(Cache):
    """`groups[g]` is an H2OCache over rows `rows[g]` of the batch (contiguous, in order)."""

    is_compileable = False

    def __init__(
        self,
        policies: list[Policy],
        num_layers: int,
        rows: list[int] | None = None,
        positions: list[str] | None = None,
        rope: Rope | None = None,
        context: int | None = None,
        rope_problem: str | None = None,
    ):
        positions = positions or ["absolute"] * len(policies)
        self.groups = [
            H2OCache(p, num_layers, m, rope, context, rope_problem) for p, m in zip(policies, positions, strict=True)
        ]
        self.rows = rows or [1] * len(policies)
        self._rolling_rows = None
        super().__init__(layers=[GroupedLayer(self, i) for i in range(num_layers)])

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
        return cls(policies, rows=rows, positions=positions, **model_facts(model, context))

    # -- what the hook, the model and the engine call -----------------------------------------------
    def h2o_layer(self, layer_idx: int, new_tokens: int) -> GroupedLayer:
        for g in self.groups:
            g.h2o_layer(layer_idx, new_tokens)
        return self.layers[layer_idx]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        for g, k, v in zip(self.groups, key_states.split(self.rows), value_states.split(self.rows), strict=True):
            g.update(k, v, layer_idx)
        return key_states, value_states  # each group's layer attends over its own slots

    @property
    def rolling(self) -> bool:
        return any(g.rolling for g in self.groups)

    def identity_rotation(
        self, rotation: tuple[torch.Tensor, torch.Tensor], layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The identity for the rows of rolling groups, the model's rotation for the others."""
        cos, sin = rotation
        key = (tuple(g.rolling for g in self.groups), cos.device, cos.dim())
        if self._rolling_rows is None or self._rolling_rows[0] != key:  # built once, not in a captured step
            flags = [g.rolling for g, n in zip(self.groups, self.rows, strict=True) for _ in range(n)]
            rows = torch.tensor(flags, device=cos.device).view(-1, *([1] * (cos.dim() - 1)))
            self._rolling_rows = (key, rows)
        rolling = self._rolling_rows[1]
        if cos.shape[0] != rolling.shape[0]:  # a rotation shared by all rows
            cos, sin = cos.expand(rolling.shape[0], *cos.shape[1:]), sin.expand(rolling.shape[0], *sin.shape[1:])
        return torch.where(rolling, 1.0, cos).to(cos.dtype), torch.where(rolling, 0.0, sin).to(sin.dtype)

    @property
    def host_managed(self) -> bool:
        return self.groups[0].host_managed

    @host_managed.setter
    def host_managed(self, value: bool) -> None:
        for g in self.groups:
            g.host_managed = value

    @property
    def version(self) -> tuple[int, ...]:
        return tuple(g.version for g in self.groups)

    @property
    def notices(self) -> list[str]:
        """Where a note for the user about the whole batch goes (pop_notices collects every group's)."""
        return self.groups[0].notices

    def settle(self) -> None:
        for g in self.groups:
            g.settle()

    def before_forward(self, new_tokens: int) -> None:
        for g in self.groups:
            g.before_forward(new_tokens)

    def reserve(self, tokens: int) -> None:
        for g in self.groups:
            g.reserve(tokens)

    def select_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError("rows of a grouped cache cannot leave the batch")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(g.columns for g in self.groups)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self) -> None:
        for g in self.groups:
            g.reset()

    def pop_notices(self) -> list[str]:
        return [n for g in self.groups for n in g.pop_notices()]

    def decode_positions(self) -> torch.Tensor:
        return torch.cat([g.decode_positions() for g in self.groups])

    def chunk_positions(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.cat([g.chunk_positions(m) for g, m in zip(self.groups, mask.split(self.rows), strict=True)])

    def stats(self) -> CacheStats:
        """All groups as one snapshot (memory summed); `group_stats()` has one per group."""
        return CacheStats.combine(self.group_stats())

    def group_stats(self) -> list[CacheStats]:
        return [g.stats() for g in self.groups]
