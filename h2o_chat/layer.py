"""One layer's fixed-slot H2O cache: storage allocated once, attention with mass, eviction in place.

Shapes: keys/values (B, H, cap, D); pos (absolute position of the token in each slot, -1 if empty or
padding) and score (accumulated attention mass, fp32) are (B, H, cap); seen (real tokens per row) is (B,).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_chat.attention import attention_with_mass, get_active, set_active
from h2o_chat.errors import CacheUsageError
from h2o_chat.policies import Policy
from h2o_chat.rope import Rope

if TYPE_CHECKING:
    from h2o_chat.snap import Observation, Probe

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
        self.rope: Rope | None = None  # set by the cache for rolling positions
        self.rolling = False  # keys stored un-rotated, rotated by rank at attention time
        self.probe: Probe | None = None  # snap pass 1: collects the prompt's last queries
        self.observation: Observation | None = None  # snap pass 2: scores tokens by those queries

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
        held = torch.arange(self.n, device=self.device).expand(*self.pos.shape[:2], self.n)
        self._move_slots(held, max(2 * self.capacity, needed))

    def _move_slots(self, keep: torch.Tensor, cap: int) -> None:
        """Re-allocate the slot buffers with `cap` slots, holding the slots `keep` (B, H, k) first, in order."""
        kept = keep.shape[-1]

        def moved(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = t.new_full((*t.shape[:2], cap, *t.shape[3:]), fill)
            out[:, :, :kept] = t.gather(2, _per_slot(keep, t))
            return out

        self.keys, self.values = moved(self.keys, 0), moved(self.values, 0)
        self.pos, self.score = moved(self.pos, -1), moved(self.score, 0)
        self.n = kept

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

        keys, q, k = self.keys[:, :, :n], query, k_new
        if self.rolling:
            q, keys, k = self._rotate_by_rank(query, keys, k_new, new_valid)
        out, mass_cache, mass_new = attention_with_mass(
            q, keys, self.values[:, :, :n], k, v_new, scaling, cache_valid, new_valid
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
        if self.probe is not None:  # snap pass 1: remember the prompt's last queries
            self.probe.capture(self, query, pos_new, scaling)
        pos_new = pos_new[:, None, :].expand(*k_new.shape[:2], T)  # (B, H, T)
        new = [k_new, v_new, pos_new, mass_new]
        if self.observation is not None:  # snap pass 2: score by the observation queries
            new.append(self.observation.score_new(self, k_new, pos_new))
        self._insert(new)
        return out

    def _rotate_by_rank(self, query, keys, k_new, new_valid):
        """Rolling positions: a held token's position is its rank among the held tokens (by true position);
        the new tokens come right after. Returns rotated copies (query, stored keys, new keys)."""
        n, T = keys.shape[2], k_new.shape[2]
        pos = self.pos[:, :, :n]
        order = torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max).argsort(dim=-1)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=self.device).expand_as(order))
        held = (pos >= 0).sum(-1, keepdim=True)  # (B, H, 1)
        if new_valid is None:
            step = torch.arange(T, device=self.device)
        else:
            step = (new_valid.cumsum(-1) - 1).clamp(min=0)[:, None, :]  # padding does not advance
        rank_new = held + step  # (B, H, T)
        G = query.shape[1] // k_new.shape[1]
        bound = n + T + 1
        return (
            self.rope.rotate(query, rank_new.repeat_interleave(G, dim=1), small=bound),
            self.rope.rotate(keys, rank, small=bound),
            self.rope.rotate(k_new, rank_new, small=bound),
        )

    @torch.inference_mode()
    def unrotate(self) -> None:
        """Switch from absolute to rolling positions: undo each stored key's rotation at its true position."""
        if self.is_initialized and self.n:
            n = self.n
            self.keys[:, :, :n] = self.rope.rotate(self.keys[:, :, :n], -self.pos[:, :, :n].clamp(min=0))
        self.rolling = True

    def _buffers(self) -> list[torch.Tensor]:
        """Per-slot tensors, moved together: keys, values, pos, score (and snap's observation logits)."""
        bufs = [self.keys, self.values, self.pos, self.score]
        return bufs + [self.observation.obs] if self.observation is not None else bufs

    def _priority(self, pos_new: torch.Tensor, score_new: torch.Tensor) -> torch.Tensor:
        """Keep-priority of every candidate, stored slots then new tokens: (B, H, n + T)."""
        n, newest = self.n, self.seen - 1
        if self.observation is not None:
            return self.observation.priority(self, pos_new)
        return torch.cat(
            (
                self.policy.priority(self.score[..., :n], self.pos[..., :n], newest),
                self.policy.priority(score_new, pos_new, newest),
            ),
            dim=-1,
        )

    def _insert(self, new: list[torch.Tensor]) -> None:
        T = new[0].shape[2]
        n, cap = self.n, self.capacity
        if n + T > cap and self.policy.capacity is None:
            self._grow(n + T)
            cap = self.capacity
        if n + T <= cap:  # room left: append
            for buf, values in zip(self._buffers(), new, strict=True):
                buf[:, :, n : n + T] = values
            self.n = n + T
        elif T == 1 and self.observation is None:  # decode, cache full: overwrite the lowest-priority slot
            self._overwrite_lowest(new)
        else:
            self._replace_k_lowest(new)

    def _overwrite_lowest(self, new: list[torch.Tensor]) -> None:
        victim = self.policy.victim(self.score, self.pos, self.seen - 1)[..., None]  # (B, H, 1)
        self.evicted += (self.pos.gather(-1, victim) >= 0).sum()
        for buf, values in zip(self._buffers(), new, strict=True):
            buf.scatter_(2, _per_slot(victim, buf), values)

    def _replace_k_lowest(self, new: list[torch.Tensor]) -> None:
        """A chunk of T new tokens: keep the `cap` best of the n stored + T new, writing survivors in place."""
        n, cap, T = self.n, self.capacity, new[0].shape[2]
        pos_new = new[2]
        prio = self._priority(pos_new, new[3])  # (B, H, n+T)
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
        for buf, values in zip(self._buffers(), new, strict=True):
            buf[b, h, s] = values[b, h, t]
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
        self._move_slots(keep, cap)

    # -- inspection -------------------------------------------------------------------------------
    def kept(self) -> torch.Tensor:
        """Real tokens held per (row, head), (B, H)."""
        return (self.pos[..., : self.n] >= 0).sum(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values)) if self.is_initialized else 0


def _per_slot(index: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """A slot index (B, H, k) expanded over buf's trailing dims, for gather/scatter along dim 2."""
    return index.view(*index.shape, *([1] * (buf.dim() - 3))).expand(*index.shape, *buf.shape[3:])
