"""The H2O KV cache: a transformers `Cache` whose layers hold a fixed number of slots and evict in place.

Per layer, storage for `budget` tokens is allocated once: keys/values (B, H, budget, D), the absolute position
of the token in each slot (B, H, budget) and its accumulated attention mass (B, H, budget) in fp32. Each
(row, KV head) keeps its own set of positions. A forward pass works like this:

1. `update()` (called by the model) stashes the new keys/values; nothing is concatenated.
2. The registered attention function calls `attend()`: attention of the new queries over the stored slots and
   the new tokens, with their attention mass added to the slots' scores (the paper's accumulation).
3. The new tokens go in: appended while there is room; afterwards one decode token overwrites, per (row, head),
   the slot the policy ranks lowest (an argmin and a scatter: O(1) writes, no Python loop over heads or rows);
   a prefill chunk replaces the k lowest of "stored + new" in one vectorised pass.

Positions are tracked apart from the slot count (tokens seen != tokens stored): keys keep the rotary position
they were written with, and `get_seq_length()` reports tokens seen, so the model numbers new tokens correctly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from h2o_chat.errors import ConfigError, ContextLimitError
from h2o_chat.layer import H2OLayer
from h2o_chat.policies import Policy
from h2o_chat.rope import Rope

POSITIONS = ("auto", "absolute", "rolling")


def check_positions(positions: str) -> str:
    """The one check of a --positions value (the CLI runs it before loading a model)."""
    if positions not in POSITIONS:
        raise ConfigError(f"--positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    return positions


@dataclass(frozen=True)
class CacheStats:
    """A snapshot for the panel, batch records and benchmarks. Token counts are per row and KV head."""

    policy: str
    budget: int | None
    split: dict[str, int]
    layers: int
    seen: int  # tokens seen (the longest row)
    kept: float  # tokens held per layer and head (mean)
    kept_min: int
    kept_max: int
    evicted: float  # tokens evicted per layer, row and head (mean)
    kv_bytes: int  # bytes the key/value buffers occupy (allocated: the whole budget from the first token)
    full_kv_bytes: int  # bytes a full cache would hold for the same tokens
    positions: str = "absolute"  # how positions are given now, e.g. "auto: absolute (trained 8192)"
    kv_used_bytes: int = 0  # bytes of the tokens held: tokens held x bytes per token, over layers, rows, heads

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kept": mean_count(self.kept), "evicted": mean_count(self.evicted)}


def mean_count(x: float) -> int | float:
    """A mean token count for JSON: an integer when it is whole, else one decimal."""
    x = round(x, 1)
    return int(x) if x == int(x) else x


class H2OCache(Cache):
    """A transformers Cache with one `H2OLayer` per decoder layer, all following `policy`.

    Use it with a model prepared by `h2o_chat.prepare_model` (attention implementation "h2o"), either through
    `model.generate(..., past_key_values=cache)` or a hand-written loop (see `h2o_chat.generate`).
    """

    def __init__(
        self,
        policy: Policy,
        num_layers: int,
        positions: str = "absolute",
        rope: Rope | None = None,
        context: int | None = None,
    ):
        super().__init__(layers=[H2OLayer(policy, i) for i in range(num_layers)])
        self.policy = policy
        check_positions(positions)
        if positions == "rolling" and rope is None:
            raise ConfigError(
                "--positions rolling needs rotary position embeddings; this model has learned absolute positions "
                f"(OPT), which cannot be re-assigned: it stops at its trained context ({context} tokens)"
            )
        self.positions, self.rope, self.context = positions, rope, context
        self.notices: list[str] = []  # things the user should be told once (the UI pops them)
        self._warned_context = False
        for layer in self.layers:
            layer.rope = rope
            layer.rolling = positions == "rolling"

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        policy: Policy,
        positions: str = "absolute",
        context: int | None = None,
    ) -> H2OCache:
        """`positions`: absolute (keys keep their true positions, the paper's default), rolling (positions by
        cache slot, StreamingLLM) or auto (absolute within the trained context, rolling past it)."""
        config = model.config.get_text_config()
        context = context or getattr(config, "max_position_embeddings", None)
        return cls(policy, config.num_hidden_layers, positions, Rope.from_model(model), context)

    @property
    def rolling(self) -> bool:
        return self.layers[0].rolling

    def _check_context(self, new_tokens: int) -> None:
        """Before a forward: switch `auto` to rolling, stop models that cannot go on, or warn once."""
        columns = self.layers[0].columns  # tokens seen by the longest row (padding included): no device sync
        if self.rolling or self.context is None or columns + new_tokens <= self.context:
            return
        if self.rope is None:
            raise ContextLimitError(
                f"the model's learned positions end at {self.context} tokens (OPT): it cannot read or write past "
                "them, whatever the budget; start a new conversation (/reset) or shorten the input"
            )
        if self.positions == "auto":
            for layer in self.layers:
                layer.unrotate()
            self.notices.append(
                f"passed the trained context ({self.context} tokens): switched to rolling positions, so the "
                "kept tokens are re-numbered by cache slot and generation can go on"
            )
        elif not self._warned_context:
            self._warned_context = True
            self.notices.append(
                f"passed the trained context ({self.context} tokens) with absolute positions: quality degrades "
                "from here; --positions rolling (or auto) keeps positions within the budget"
            )

    def pop_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out

    def set_policy(self, policy: Policy) -> None:
        """Change budget or policy while keeping what is cached (a smaller budget evicts at once)."""
        self.policy = policy
        for layer in self.layers:
            layer.repolicy(policy)

    @property
    def initialized_layers(self) -> list[H2OLayer]:
        return [layer for layer in self.layers if layer.is_initialized]

    def next_positions(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """Absolute position the next real token of each row will get, (B,)."""
        layers = self.initialized_layers
        return layers[0].seen.to(device) if layers else torch.zeros(batch_size, dtype=torch.long, device=device)

    def position_ids(self, mask: torch.Tensor) -> torch.Tensor:
        """Position ids to give the model for new tokens with padding mask (B, T): their true positions, or
        zeros when rolling (the model's rotary embedding is then the identity; the cache rotates by rank)."""
        self._check_context(mask.shape[1])
        if self.rolling:
            return torch.zeros_like(mask, dtype=torch.long)
        start = self.next_positions(mask.shape[0], mask.device)
        return start[:, None] + (mask.long().cumsum(-1) - 1).clamp(min=0)

    def stats(self) -> CacheStats:
        layers = self.initialized_layers
        if not layers:
            return CacheStats(
                self.policy.name,
                self.policy.budget,
                self.policy.split(),
                len(self.layers),
                0,
                0.0,
                0,
                0,
                0.0,
                0,
                0,
                self.positions_label(),
            )
        kept = torch.stack([layer.kept() for layer in layers])  # (L, B, H)
        heads = kept[0].numel()
        per_token = sum(  # bytes of K+V for one token in every layer, row and head
            layer.num_heads
            * layer.batch_size
            * (layer.keys.shape[-1] + layer.values.shape[-1])
            * layer.keys.element_size()
            for layer in layers
        )
        return CacheStats(
            policy=self.policy.name,
            budget=self.policy.budget,
            split=self.policy.split(),
            layers=len(self.layers),
            seen=int(layers[0].seen.max()),
            kept=float(kept.float().mean()),
            kept_min=int(kept.min()),
            kept_max=int(kept.max()),
            evicted=float(sum(int(layer.evicted) for layer in layers)) / (len(layers) * heads),
            kv_bytes=sum(layer.nbytes() for layer in layers),
            full_kv_bytes=layers[0].columns * per_token,
            positions=self.positions_label(),
            kv_used_bytes=sum(  # tokens held in each layer (all rows and heads) x one token's K+V bytes
                int(held) * (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
                for held, layer in zip(kept.sum(dim=(1, 2)).tolist(), layers, strict=True)
            ),
        )

    def positions_label(self) -> str:
        """For the panel: how tokens are numbered now and why."""
        now = "rolling (by cache slot)" if self.rolling else "absolute"
        trained = f"trained context {self.context}" if self.context else "trained context unknown"
        if self.positions != "auto":
            return f"{now}, {trained}"
        return f"auto: {now}, {'passed the ' if self.rolling else ''}{trained}"

    def kept_fraction(self, start: int, end: int, row: int = 0) -> float:
        """Share of positions [start, end) still held, averaged over layers and heads (for /evicted)."""
        if end <= start or not self.initialized_layers:
            return 1.0
        fractions = []
        for layer in self.initialized_layers:
            pos = layer.pos[row]  # (H, cap)
            inside = ((pos >= start) & (pos < end)).sum(-1).float()  # (H,)
            fractions.append(inside / (end - start))
        return float(torch.stack(fractions).mean())
