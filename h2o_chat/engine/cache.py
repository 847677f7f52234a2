"""The H2O KV cache: a transformers `Cache` whose storage is allocated once and evicts in place.

Storage (`Slots`) holds every layer stacked: keys/values (L, B, H, S, D), the absolute position of the token in
each slot (L, B, H, S; -1 if empty or padding) and its accumulated attention mass (L, B, H, S) in fp32, plus the
real tokens seen per row (B,). S is the capacity plus one spare slot. Each (layer, row, KV head) keeps its own
set of positions. A forward pass works like this:

1. The attention hook (`attention.prepare_model`) asks `h2o_layer()` for the layer, which arms it.
2. `update()` (called by the model): a decode step writes the new token into the spare slot and returns the
   layer's slot buffers, always of the same shape; a prefill chunk passes its tokens through.
3. The attention function calls the layer's `attend()`: attention with mass over the slots (and the chunk); the
   mass is added to the scores (the paper's accumulation).
4. `settle()`, when the forward has ended: a decode step evicts, per (layer, row, head), the slot the policy
   ranks lowest -- empty slots first, so a filling cache appends -- by moving the spare slot into it (one argmin
   and one scatter per buffer, for every layer at once: no Python loop, no host sync, no re-allocation).
   A prefill chunk was already placed by its layer (the best `capacity` of stored + new are kept).

Positions are tracked apart from the slot count (tokens seen != tokens stored): keys keep the rotary position
they were written with, and `get_seq_length()` reports the columns fed, so the model numbers new tokens right.
Host-side bookkeeping (`before_forward`: context checks, the switch to rolling positions, growing a full
cache) happens before a forward, outside anything a CUDA graph captures.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.cache_utils import Cache

from h2o_chat.engine.layer import H2OLayer, _ranks
from h2o_chat.engine.policies import Policy, highest
from h2o_chat.engine.rope import Rope, RopeUnsupported
from h2o_chat.engine.slots import CacheStats, Slots, per_slot
from h2o_chat.errors import CacheUsageError, ConfigError, ContextLimitError

POSITIONS = ("auto", "absolute", "rolling")
_FULL_INITIAL = 256  # a `full` cache without a reservation starts here and doubles


def _inference(method):
    """Run a method that changes the storage in inference mode (storage made in inference mode may only be
    changed there), without entering it again where it is on (inside a forward or a compiled step)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # a compiled decode step: the engine runs it in inference mode
            return method(*args, **kwargs)
        with contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode():
            return method(*args, **kwargs)

    return wrapper


def check_positions(positions: str) -> str:
    """The one check of a --positions value (the CLI runs it before loading a model)."""
    if positions not in POSITIONS:
        raise ConfigError(f"--positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    return positions


def unsupported(config) -> str | None:
    """Why the H2O cache cannot serve a model with this config, or None. Its attention must be plain causal
    attention over every past token: the cache would silently turn a sliding window into global attention."""
    text = config.get_text_config()
    types = set(getattr(text, "layer_types", None) or ())
    if types - {"full_attention"}:
        return f"its layers use {' and '.join(sorted(t.replace('_', '-') for t in types))}"
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True):
        return f"it uses sliding-window attention ({window} tokens)"
    if getattr(text, "attn_logit_softcapping", None):
        return "it soft-caps its attention logits"
    return None


def model_facts(model: torch.nn.Module, context: int | None = None) -> dict:
    """What a cache needs to know about a model: layers, rotary embedding (or why it cannot be re-applied) and
    trained context. Raises ConfigError for a model the cache cannot serve."""
    reason = unsupported(model.config)
    if reason:
        raise ConfigError(f"h2o-chat cannot serve this model: {reason}")
    config = model.config.get_text_config()
    rope, problem = None, None
    try:
        rope = Rope.from_model(model)
    except RopeUnsupported as e:
        problem = str(e)
    context = context or getattr(config, "max_position_embeddings", None)
    return {"num_layers": config.num_hidden_layers, "rope": rope, "context": context, "rope_problem": problem}


class H2OCache(Cache):
    """A transformers Cache with one `H2OLayer` per decoder layer, all following `policy`.

    Use it with a model prepared by `h2o_chat.prepare_model`, either through `model.generate(...,
    past_key_values=cache)` or h2o-chat's decode engine (`h2o_chat.engine.Engine`), which captures decode steps.
    """

    # generate() would compile its forward on CUDA for a compileable cache, with the hook's host bookkeeping inside;
    # h2o-chat's engine captures decode steps itself
    is_compileable = False

    def __init__(
        self,
        policy: Policy,
        num_layers: int,
        positions: str = "absolute",
        rope: Rope | None = None,
        context: int | None = None,
        rope_problem: str | None = None,
    ):
        super().__init__(layers=[H2OLayer(self, i) for i in range(num_layers)])
        self.policy = policy
        check_positions(positions)
        if positions == "rolling" and rope is None:
            if rope_problem:
                raise ConfigError(f"--positions rolling cannot be used with this model: {rope_problem}")
            raise ConfigError(
                "--positions rolling needs rotary position embeddings; this model has learned absolute positions "
                f"(OPT), which cannot be re-assigned: it stops at its trained context ({context} tokens)"
            )
        self.positions, self.rope, self.context, self.rope_problem = positions, rope, context, rope_problem
        self.rolling = positions == "rolling"  # keys stored un-rotated, rotated by rank at attention time
        self.slots: Slots | None = None
        self.columns = 0  # token columns fed, padding included: what the model calls "seen"
        self.host_managed = False  # True when a decode engine calls before_forward() itself
        self.version = 0  # bumps whenever storage is re-allocated or positions change (graphs re-capture)
        self.notices: list[str] = []  # things the user should be told once (the UI pops them)
        self.advance: torch.Tensor | None = None  # (B,) real tokens of the pending prefill chunk
        self._pending: str | None = None  # "step" | "chunk": a forward whose bookkeeping settle() finishes
        self._reserved = 0  # a full cache makes room for this many tokens when it allocates
        self._warned_context = False
        self._identity: tuple[torch.Tensor, torch.Tensor] | None = None

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
        return cls(policy, positions=positions, **model_facts(model, context))

    # -- the transformers Cache protocol ----------------------------------------------------------
    def h2o_layer(self, layer_idx: int, new_tokens: int) -> H2OLayer:
        """Called by the attention hook before a layer's update: arm the layer (and, at the first layer of a
        forward, finish the last one and do the host bookkeeping unless an engine does it)."""
        if layer_idx == 0:
            self.settle()
            if not self.host_managed:
                self.before_forward(new_tokens)
        layer = self.layers[layer_idx]
        layer.armed = True
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if not layer.armed:
            raise CacheUsageError(
                "the H2O cache was updated by attention that does not go through h2o-chat: "
                "call h2o_chat.prepare_model(model) before using an H2OCache"
            )
        layer.armed = False
        if self.slots is None:
            self.allocate(key_states, value_states)
        slots = self.slots
        if key_states.device != slots.keys.device:  # a layer placed elsewhere by accelerate
            key_states, value_states = key_states.to(slots.keys.device), value_states.to(slots.keys.device)
        if key_states.shape[2] > 1:  # a prefill chunk: its layer inserts it after attention
            if layer_idx == 0:
                self._pending = "chunk"
            return key_states, value_states
        # a decode step: the new token goes into the spare slot; shapes never change
        spare = slots.spare
        slots.keys[layer_idx, :, :, spare] = key_states[:, :, 0]
        slots.values[layer_idx, :, :, spare] = value_states[:, :, 0]
        if layer_idx == 0:  # once for every layer: the new token's position, which slots are valid, ranks
            slots.pos[:, :, :, spare] = slots.seen[None, :, None]
            slots.valid = slots.pos >= 0
            slots.rank = _ranks(slots.pos) if self.rolling else None
            self._pending = "step"
        return slots.keys[layer_idx], slots.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if torch.compiler.is_compiling() and self.slots is not None:
            # inside a compiled step a host counter would be baked in (and recompiled every step): give a
            # device value, as transformers' StaticCache does; h2o-chat passes position ids itself anyway
            return self.slots.seen.max()
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.policy.capacity or -1

    def reset(self) -> None:
        self.slots, self.columns, self._pending, self.advance = None, 0, None, None
        self.rolling = self.positions == "rolling"
        self.version += 1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (no assisted decoding)")

    # -- storage --------------------------------------------------------------------------------------
    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """First update: storage for every layer, shaped after the first layer's keys and values."""
        capacity = self.policy.capacity
        if capacity is None:
            capacity = max(_FULL_INITIAL, self._reserved, self.columns)
        self._install(Slots.allocate(len(self.layers), key, value, capacity))

    def _install(self, slots: Slots) -> None:
        """New storage: decode steps captured for the old one are stale (the version tells the engine)."""
        self.slots = slots
        self.version += 1
        if self.rope is not None:
            self.rope.prepare(slots.keys.shape[3] + 1, slots.keys.device)
        if not torch.compiler.is_compiling():  # fixed addresses: compiled graphs may write into them in place
            slots.mark_static()

    @_inference
    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens per row up front (only a full cache grows; a budget is fixed)."""
        if self.policy.capacity is not None:
            return
        need = self.columns + tokens
        if self.slots is None:
            self._reserved = max(self._reserved, need)
        elif need > self.slots.capacity:
            self._resize(need)

    @_inference
    def _resize(self, capacity: int) -> None:
        self.settle()
        S = self.slots.keys.shape[3]
        keep = torch.arange(S - 1, device=self.slots.pos.device).expand(*self.slots.pos.shape[:3], S - 1)
        self._install(self.slots.moved(keep, capacity))

    @_inference
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` (finished rows leave the batch)."""
        self.settle()
        if self.slots is not None:
            self._install(self.slots.rows(index))

    def abandon_step(self) -> None:
        """A decode step that was being captured did not run: drop what its Python side did."""
        if self._pending == "step":
            self._pending = None
            self.clear_spare()
        for layer in self.layers:
            layer.armed = False

    def clear_spare(self, layer_idx: int | None = None) -> None:
        """Empty the spare slot (of one layer, or all)."""
        s = self.slots
        where = slice(None) if layer_idx is None else layer_idx
        s.pos[where, :, :, s.spare] = -1
        s.score[where, :, :, s.spare] = 0

    def identity_rotation(
        self, rotation: tuple[torch.Tensor, torch.Tensor], layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos = 1, sin = 0 shaped like the model's rotation: its rotary embedding becomes the identity. Made
        once per forward, at the first layer (every layer of a forward gets the same shape)."""
        cos, sin = rotation
        if layer_idx == 0 or self._identity is None:
            self._identity = (torch.ones_like(cos), torch.zeros_like(sin))
        return self._identity

    # -- finishing a forward ------------------------------------------------------------------------
    @_inference
    def settle(self) -> None:
        """Finish the forward that ran: a decode step evicts into the spare slot's victim; rows advance."""
        pending, self._pending = self._pending, None
        if pending == "step":
            self._evict_spare()
            self.slots.seen += 1
        elif pending == "chunk":
            self.slots.seen += self.advance
            self.advance = None

    def _evict_spare(self) -> None:
        """Per (layer, row, head): the policy's lowest-priority slot (an empty one first) takes the spare slot's
        token. The spare holds the newest token, which every policy protects, so it is never its own victim."""
        s = self.slots
        victim = self.policy.victim(s.score, s.pos, s.seen)[..., None]  # (L, B, H, 1)
        s.evicted += (s.pos.gather(-1, victim) >= 0).sum()
        spare = s.spare
        for buf in (s.keys, s.values, s.pos, s.score):
            buf.scatter_(3, per_slot(victim, buf), buf[:, :, :, spare : spare + 1])
        self.clear_spare()

    # -- host bookkeeping (never inside a captured step) --------------------------------------------
    @_inference
    def before_forward(self, new_tokens: int) -> None:
        """Before a forward of `new_tokens` columns: switch `auto` to rolling, stop models that cannot go on,
        warn once, make room in a full cache; then count the columns."""
        self._check_context(new_tokens)
        if self.policy.capacity is None and self.slots is not None:
            need = self.columns + new_tokens
            if need > self.slots.capacity:
                self._resize(max(2 * self.slots.capacity, need))
        self.columns += new_tokens

    def _check_context(self, new_tokens: int) -> None:
        columns = self.columns  # tokens seen by the longest row (padding included): no device sync
        if self.rolling or self.context is None or columns + new_tokens <= self.context:
            return
        if self.rope is None and self.rope_problem is None:
            raise ContextLimitError(
                f"the model's learned positions end at {self.context} tokens (OPT): it cannot read or write past "
                "them, whatever the budget; start a new conversation (/reset) or shorten the input"
            )
        if self.positions == "auto" and self.rope is not None:
            self._switch_to_rolling()
            self.notices.append(
                f"passed the trained context ({self.context} tokens): switched to rolling positions, so the "
                "kept tokens are re-numbered by cache slot and generation can go on"
            )
        elif not self._warned_context:
            self._warned_context = True
            why = (
                f"rolling positions are not possible ({self.rope_problem})"
                if self.rope_problem
                else "--positions rolling (or auto) keeps positions within the budget"
            )
            self.notices.append(
                f"passed the trained context ({self.context} tokens) with absolute positions: quality degrades "
                f"from here; {why}"
            )

    @_inference
    def _switch_to_rolling(self) -> None:
        """Undo each stored key's rotation at its true position; from now on keys are rotated by rank."""
        self.settle()
        s = self.slots
        if s is not None:
            s.keys.copy_(self.rope.unrotate(s.keys, s.pos.clamp(min=0)))
        self.rolling = True
        self.version += 1

    def pop_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out

    # -- policy changes -------------------------------------------------------------------------------
    @_inference
    def set_policy(self, policy: Policy) -> None:
        """Change budget or policy while keeping what is cached: a smaller budget keeps the new policy's best
        slots (evicted tokens do not come back), a larger one re-allocates."""
        self.settle()
        self.policy = policy
        s = self.slots
        if s is None:
            return
        held = int((s.pos >= 0).sum(-1).max())
        capacity = policy.capacity or max(held, self.columns, _FULL_INITIAL)
        C = s.capacity
        if held > capacity:
            keep = highest(policy.priority(s.score[..., :C], s.pos[..., :C], s.seen - 1), capacity, s.pos[..., :C])
            s.evicted += (s.pos >= 0).sum() - (s.pos.gather(-1, keep) >= 0).sum()
        else:  # the held tokens first, in slot order
            order = torch.where(s.pos[..., :C] >= 0, 0, 1).argsort(dim=-1, stable=True)
            keep = order[..., : min(C, capacity)]
        self._install(s.moved(keep, capacity))

    # -- inspection -------------------------------------------------------------------------------
    def decode_positions(self) -> torch.Tensor:
        """Position ids for a decode step, (B, 1), on the device (capturable): true positions, or zeros when
        rolling (the hook makes the model's rotation the identity anyway)."""
        self.settle()
        seen = self.slots.seen
        return torch.zeros_like(seen)[:, None] if self.rolling else seen[:, None]

    def chunk_positions(self, mask: torch.Tensor) -> torch.Tensor:
        """Position ids for a prefill chunk with padding mask (B, T): true positions, or zeros when rolling."""
        self.settle()
        if self.rolling:
            return torch.zeros_like(mask, dtype=torch.long)
        start = self.slots.seen if self.slots is not None else torch.zeros(mask.shape[0], dtype=torch.long)
        return start.to(mask.device)[:, None] + (mask.long().cumsum(-1) - 1).clamp(min=0)

    def stats(self) -> CacheStats:
        self.settle()
        s = self.slots
        if s is None:
            return CacheStats(
                self.policy.name, self.policy.budget, self.policy.split(), len(self.layers),
                0, 0.0, 0, 0, 0.0, 0, 0, 0, self.positions_label(),
            )  # fmt: skip
        kept = (s.pos >= 0).sum(-1)  # (L, B, H)
        slot_bytes = (s.keys.shape[-1] + s.values.shape[-1]) * s.keys.element_size()  # K+V of one token, one slot
        heads = s.batch * s.keys.shape[2]
        return CacheStats(
            policy=self.policy.name,
            budget=self.policy.budget,
            split=self.policy.split(),
            layers=len(self.layers),
            seen=int(s.seen.max()),
            kept=float(kept.float().mean()),
            kept_min=int(kept.min()),
            kept_max=int(kept.max()),
            evicted=float(s.evicted) / (len(self.layers) * heads),
            kv_bytes=s.keys.numel() * s.keys.element_size() + s.values.numel() * s.values.element_size(),
            kv_used_bytes=int(kept.sum()) * slot_bytes,
            full_kv_bytes=self.columns * slot_bytes * kept.numel(),  # every layer, row and head
            positions=self.positions_label(),
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
        self.settle()
        if end <= start or self.slots is None:
            return 1.0
        pos = self.slots.pos[:, row]  # (L, H, S)
        inside = ((pos >= start) & (pos < end)).sum(-1).float()  # (L, H)
        return float(inside.mean()) / (end - start)

    def row_stats(self, row: int) -> dict:
        """Seen, kept and evicted tokens of one batch row (per layer and head), for batch records."""
        self.settle()
        s = self.slots
        seen = int(s.seen[row])
        kept = float((s.pos[:, row] >= 0).sum(-1).float().mean())
        return {"seen": seen, "kept": kept, "evicted": seen - kept}
