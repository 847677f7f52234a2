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

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_chat.attention import attention_with_mass, get_active, set_active
from h2o_chat.errors import CacheUsageError
from h2o_chat.policies import Policy

_FULL_INITIAL_SLOTS = 256  # the `full` policy starts here and doubles


class H2OLayer(CacheLayerMixin):
    """One layer's fixed-slot cache. Shapes: keys (B, H, cap, D), pos/score (B, H, cap), seen (B,)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, policy: Policy, layer_idx: int = 0):
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        self.n = 0  # filled slots (same for every row and head)
        self.columns = 0  # token columns processed, padding included: what the model calls "seen"
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._may_hold_padding = False

    # -- storage ----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, T, D = key_states.shape
        self.batch_size, self.num_heads = B, H
        cap = self.policy.capacity or max(_FULL_INITIAL_SLOTS, T)
        self.keys = key_states.new_zeros(B, H, cap, D)
        self.values = value_states.new_zeros(B, H, cap, value_states.shape[-1])
        self.pos = torch.full((B, H, cap), -1, dtype=torch.long, device=self.device)
        self.score = torch.zeros(B, H, cap, dtype=torch.float32, device=self.device)
        self.seen = torch.zeros(B, dtype=torch.long, device=self.device)  # real tokens per row
        self.evicted = torch.zeros((), dtype=torch.long, device=self.device)  # real tokens evicted, all heads
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def _grow(self, needed: int) -> None:
        """Only for the `full` policy: double the buffers (amortised O(1) per token)."""
        cap = max(2 * self.capacity, needed)
        pad = cap - self.capacity

        def extend(t: torch.Tensor, fill: float) -> torch.Tensor:
            extra = t.new_full((*t.shape[:2], pad, *t.shape[3:]), fill)
            return torch.cat((t, extra), dim=2)

        self.keys, self.values = extend(self.keys, 0), extend(self.values, 0)
        self.pos, self.score = extend(self.pos, -1), extend(self.score, 0)

    # -- the transformers Cache protocol ----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        previous = get_active()
        unconsumed = previous is not None and previous._pending is not None
        if self._pending is not None or (unconsumed and previous.layer_idx < self.layer_idx):
            raise CacheUsageError(
                "the H2O cache was updated twice without attention running through h2o-chat: "
                "call h2o_chat.prepare_model(model) before generating with an H2OCache"
            )
        self._pending = (key_states, value_states)
        set_active(self)
        return key_states, value_states

    def owns(self, key: torch.Tensor) -> bool:
        return self._pending is not None and self._pending[0] is key

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return self.policy.capacity or -1

    def reset(self) -> None:
        if self.is_initialized:
            self.pos.fill_(-1)
            self.score.zero_()
            self.seen.zero_()
            self.evicted.zero_()
        self.n = self.columns = 0
        self._pending = None
        self._may_hold_padding = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (no assisted decoding)")

    def _select_rows(self, index: torch.Tensor) -> None:
        for name in ("keys", "values", "pos", "score", "seen"):
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.device)))
        self.batch_size = self.keys.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.as_tensor(indices, device=self.device).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    # -- attention and eviction -------------------------------------------------------------------
    def attend(self, query: torch.Tensor, padding_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention for the queries of the stashed tokens, then insert those tokens. Returns (B, T, Hq, Dv)."""
        k_new, v_new = self._pending
        self._pending = None
        T, n = k_new.shape[2], self.n

        new_valid = None
        if padding_mask is not None:
            new_valid = padding_mask[:, -T:].to(device=self.device, dtype=torch.bool)  # (B, T)
            if bool(new_valid.all()):  # one sync per prefill chunk; decode passes no mask
                new_valid = None
        cache_valid = self.pos[:, :, :n] >= 0 if self._may_hold_padding else None

        out, mass_cache, mass_new = attention_with_mass(
            query, self.keys[:, :, :n], self.values[:, :, :n], k_new, v_new, scaling, cache_valid, new_valid
        )
        self.score[:, :, :n] += mass_cache

        # absolute positions of the new tokens, per row: (B, T); padding gets -1
        if new_valid is None:
            pos_new = self.seen[:, None] + torch.arange(T, device=self.device)
            self.seen += T
        else:
            pos_new = (self.seen[:, None] + new_valid.cumsum(-1) - 1).masked_fill(~new_valid, -1)
            self.seen += new_valid.sum(-1)
            self._may_hold_padding = True
        self.columns += T
        self._insert(k_new, v_new, pos_new, mass_new)
        return out

    def _insert(self, k_new, v_new, pos_new, score_new) -> None:
        B, H, T, _ = k_new.shape
        n, cap = self.n, self.capacity
        if n + T > cap and self.policy.capacity is None:
            self._grow(n + T)
            cap = self.capacity
        pos_new = pos_new[:, None, :].expand(B, H, T)  # (B, H, T)
        if n + T <= cap:  # room left: append
            self.keys[:, :, n : n + T] = k_new
            self.values[:, :, n : n + T] = v_new
            self.pos[:, :, n : n + T] = pos_new
            self.score[:, :, n : n + T] = score_new
            self.n = n + T
        elif T == 1:  # decode, cache full: the new token overwrites the lowest-priority slot
            self._overwrite_lowest(k_new, v_new, pos_new, score_new)
        else:
            self._replace_k_lowest(k_new, v_new, pos_new, score_new)

    def _overwrite_lowest(self, k_new, v_new, pos_new, score_new) -> None:
        newest = self.seen - 1  # (B,)
        victim = self.policy.victim(self.score, self.pos, newest)[..., None]  # (B, H, 1)
        self.evicted += (self.pos.gather(-1, victim) >= 0).sum()
        idx = victim[..., None]  # (B, H, 1, 1)
        self.keys.scatter_(2, idx.expand(-1, -1, -1, self.keys.shape[-1]), k_new)
        self.values.scatter_(2, idx.expand(-1, -1, -1, self.values.shape[-1]), v_new)
        self.pos.scatter_(-1, victim, pos_new)
        self.score.scatter_(-1, victim, score_new)

    def _replace_k_lowest(self, k_new, v_new, pos_new, score_new) -> None:
        """A chunk of T > 1 tokens: keep the `cap` best of the n stored + T new, writing survivors in place."""
        n, cap, T = self.n, self.capacity, k_new.shape[2]
        newest = self.seen - 1
        # priorities of every candidate: stored slots, then the new tokens
        prio = torch.cat(
            (
                self.policy.priority(self.score[..., :n], self.pos[..., :n], newest),
                self.policy.priority(score_new, pos_new, newest),
            ),
            dim=-1,
        )  # (B, H, n+T)
        out = prio.topk(n + T - cap, dim=-1, largest=False).indices
        is_out = torch.zeros_like(prio, dtype=torch.bool).scatter_(-1, out, True)
        all_pos = torch.cat((self.pos[..., :n], pos_new), dim=-1)
        self.evicted += (is_out & (all_pos >= 0)).sum()

        # free slots (evicted stored ones + never-filled ones) pair up, in order, with surviving new tokens;
        # per (row, head) the two counts are equal because exactly `cap` candidates survive
        free = torch.ones(*prio.shape[:2], cap, dtype=torch.bool, device=self.device)
        free[..., :n] = is_out[..., :n]
        slots = torch.arange(cap, device=self.device).expand_as(free)
        free_sorted = torch.where(free, slots, cap).sort(dim=-1).values  # (B, H, cap) free slots first
        keep_new = ~is_out[..., n:]  # (B, H, T)
        rank = (keep_new.cumsum(-1) - 1).clamp(min=0)
        target = free_sorted.gather(-1, rank)  # (B, H, T) destination slot per new token
        b, h, t = keep_new.nonzero(as_tuple=True)
        s = target[b, h, t]
        self.keys[b, h, s] = k_new[b, h, t]
        self.values[b, h, s] = v_new[b, h, t]
        self.pos[b, h, s] = pos_new[b, h, t]
        self.score[b, h, s] = score_new[b, h, t]
        self.n = cap

    @torch.inference_mode()
    def repolicy(self, policy: Policy) -> None:
        """Switch policy mid-stream: keep the new budget's best slots by the new policy (one gather), or
        re-allocate larger. Evicted tokens do not come back."""
        self.policy = policy
        if not self.is_initialized:
            return
        cap = policy.capacity or max(self.n, _FULL_INITIAL_SLOTS)
        n = self.n
        if n > cap:
            keep = policy.priority(self.score[..., :n], self.pos[..., :n], self.seen - 1)
            keep = keep.topk(cap, dim=-1).indices.sort(-1).values  # (B, H, cap), slot order kept
            self.evicted += (self.pos[..., :n] >= 0).sum() - (self.pos.gather(-1, keep) >= 0).sum()
        else:
            keep = torch.arange(n, device=self.device).expand(*self.pos.shape[:2], n)
        kept = min(n, cap)

        def moved(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = t.new_full((*t.shape[:2], cap, *t.shape[3:]), fill)
            idx = keep.view(*keep.shape, *([1] * (t.dim() - 3))).expand(*keep.shape, *t.shape[3:])
            out[:, :, :kept] = t.gather(2, idx)
            return out

        self.keys, self.values = moved(self.keys, 0), moved(self.values, 0)
        self.pos, self.score = moved(self.pos, -1), moved(self.score, 0)
        self.n = kept

    # -- inspection -------------------------------------------------------------------------------
    def kept(self) -> torch.Tensor:
        """Real tokens held per (row, head), (B, H)."""
        return (self.pos[..., : self.n] >= 0).sum(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values)) if self.is_initialized else 0


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
    kv_bytes: int  # bytes the key/value buffers occupy
    full_kv_bytes: int  # bytes a full cache would hold for the same tokens

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 0.0

    def as_dict(self) -> dict:
        return {
            "policy": self.policy,
            "budget": self.budget,
            "split": dict(self.split),
            "layers": self.layers,
            "seen": self.seen,
            "kept": round(self.kept, 1),
            "kept_min": self.kept_min,
            "kept_max": self.kept_max,
            "evicted": round(self.evicted, 1),
            "kv_bytes": self.kv_bytes,
            "full_kv_bytes": self.full_kv_bytes,
        }


class H2OCache(Cache):
    """A transformers Cache with one `H2OLayer` per decoder layer, all following `policy`.

    Use it with a model prepared by `h2o_chat.prepare_model` (attention implementation "h2o"), either through
    `model.generate(..., past_key_values=cache)` or a hand-written loop (see `h2o_chat.generate`).
    """

    def __init__(self, policy: Policy, num_layers: int):
        super().__init__(layers=[H2OLayer(policy, i) for i in range(num_layers)])
        self.policy = policy

    @classmethod
    def for_model(cls, model: torch.nn.Module, policy: Policy) -> H2OCache:
        config = model.config.get_text_config()
        return cls(policy, config.num_hidden_layers)

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
        """Position ids to give the model for new tokens with padding mask (B, T): their true positions."""
        start = self.next_positions(mask.shape[0], mask.device)
        return start[:, None] + (mask.long().cumsum(-1) - 1).clamp(min=0)

    def stats(self) -> CacheStats:
        layers = self.initialized_layers
        if not layers:
            return CacheStats(
                self.policy.name, self.policy.budget, self.policy.split(), len(self.layers), 0, 0.0, 0, 0, 0.0, 0, 0
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
        )

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
