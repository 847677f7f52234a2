"""The H2O KV cache: a transformers `Cache` whose storage is allocated once and evicts in place.

Storage (`Slots`) holds every layer stacked: keys/values (L, B, H, S, D), each slot's true position and the
position its key was rotated at, and its accumulated attention mass in fp32; S is the capacity plus one spare
slot. Each (layer, row, KV head) keeps its own set of tokens; each row may follow its own policy (`Rules`).

A forward is begun and ended explicitly -- by the decode engine, or for `model.generate` by hooks on the
model's base module -- and says what it is:

1. `before_forward(T, real)` (host only, never inside a captured step): context checks, renumbering positions,
   room in a full cache; `real` says how many of the T columns are each row's own tokens (left padding is not).
2. `begin(kind, mask)`: a decode step writes the new token's position into the spare slot; a prompt chunk
   numbers its tokens and builds its attention mask, once for every layer. Returns the model's position ids.
3. The model runs; each layer's attention (`H2OLayer.attend`) adds the mass it gives to the scores.
4. `end()`: `evict.step` or `evict.chunk` places the new tokens for every layer at once; rows advance.

Positions. Keys are stored rotated, as the model rotated them. While a row stays within the trained context its
tokens get their true positions (the paper). When the next position would pass it (`--positions auto`), or a
smaller window (`rolling`), the row's held tokens are renumbered once by their order among the held tokens
(0, 1, 2, ...; StreamingLLM's positions within the cache): each key is rotated by the difference, and new
tokens continue from there. Decode steps cost the same as with absolute positions; the renumbering, a rotation
of the held keys, happens once every (window - budget) tokens. The recall policy's evicted tokens follow: each is
numbered where it stands among the held tokens and its stored key rotated (`Store.renumber`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from h2o_chat.engine import evict
from h2o_chat.engine.layer import H2OLayer
from h2o_chat.engine.policies import Policy, Recall, Rules
from h2o_chat.engine.quant import check_mode
from h2o_chat.engine.rope import Rope, RopeUnsupported
from h2o_chat.engine.slots import CacheStats, Slots
from h2o_chat.engine.store import Store
from h2o_chat.errors import CacheUsageError, ConfigError, ContextLimitError

POSITIONS = ("auto", "absolute", "rolling")
_FULL_INITIAL = 256  # a `full` cache without a reservation starts here and doubles


def _inference(method):
    """Run a method that changes the storage in inference mode (storage made in inference mode may only be
    changed there), without entering it again where it is on."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # a traced step: its caller runs it in inference mode
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


@dataclass
class Forward:
    """The forward now running: what kind it is and, for a prompt chunk, what it leaves for `end()`."""

    kind: str  # "step" | "chunk"
    columns: int  # T
    valid: torch.Tensor | None = None  # step: (B, 1, S) slots holding a token
    real: torch.Tensor | None = None  # chunk: (B, T) real (non-padding) tokens
    pos_new: torch.Tensor | None = None  # chunk: (B, T) true positions, -1 = padding
    rot_new: torch.Tensor | None = None  # chunk: (B, T) positions the new keys are rotated at
    attend_from: int = 0  # chunk: stored slots that can hold tokens (the chunk's keys follow them)
    fits: bool = False  # chunk: every row has room for all its tokens (no selection needed)
    track_mass: bool = True  # chunk: some row's policy needs the attention mass
    fused: bool = False  # chunk: output from the fused kernel (see attention.attention_with_mass)
    keys: torch.Tensor | None = None  # chunk: (L, B, H, T, D), filled layer by layer
    values: torch.Tensor | None = None
    score: torch.Tensor | None = None  # chunk: (L, B, H, T) fp32 mass the new tokens received
    probe: object | None = None  # snap pass 1 (`snap.Probe`)
    observation: object | None = None  # snap pass 2 (`snap.Observation`)
    stored_valid: torch.Tensor | None = None  # chunk: (B, attend_from) stored slots holding a token
    target: torch.Tensor | None = None  # chunk that fits: (B, T) the slots its tokens are written into
    layers: int = 0
    skipped: torch.Tensor | None = None  # chunk: (B,) tokens counted as read before it (see H2OCache.skip)
    _mask: torch.Tensor | None = field(default=None, repr=False)

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
        real, T = self.real, self.columns
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


@dataclass
class _Group:
    policy: Policy
    rows: int | None  # batch rows following it (None: all of them)
    positions: str


class H2OCache(Cache):
    """A transformers Cache with one `H2OLayer` per decoder layer. One policy for every row, or several side by
    side (`policies` with `rows` each: evaluations compare configurations as rows of one batch).

    Use it with a model prepared by `h2o_chat.prepare_model`, either through `model.generate(...,
    past_key_values=cache)` or h2o-chat's decode engine (`h2o_chat.engine.Engine`), which captures decode steps.
    """

    # generate() would compile its forward on CUDA for a compileable cache; h2o-chat's engine captures steps itself
    is_compileable = False

    def __init__(
        self,
        policy: Policy | list[Policy],
        num_layers: int,
        positions: str | list[str] = "absolute",
        rope: Rope | None = None,
        context: int | None = None,
        rope_problem: str | None = None,
        rows: list[int] | None = None,
        kv_quant: str = "none",
    ):
        super().__init__(layers=[H2OLayer(self, i) for i in range(num_layers)])
        self.kv_quant = check_mode(kv_quant)  # how the held keys and values are stored (`quant.py`)
        policies = [policy] if isinstance(policy, Policy) else list(policy)
        modes = [positions] * len(policies) if isinstance(positions, str) else list(positions)
        if rows is None and len(policies) > 1:
            rows = [1] * len(policies)
        for mode in modes:
            check_positions(mode)
            if mode == "rolling" and rope is None:
                if rope_problem:
                    raise ConfigError(f"--positions rolling cannot be used with this model: {rope_problem}")
                raise ConfigError(
                    "--positions rolling needs rotary position embeddings; this model has learned absolute "
                    f"positions (OPT), which cannot be re-assigned: it stops at its trained context ({context} tokens)"
                )
        rows = rows or [None]
        self.groups = [_Group(p, n, m) for p, n, m in zip(policies, rows, modes, strict=True)]
        self.rope, self.context, self.rope_problem = rope, context, rope_problem
        self.host_managed = False  # True when a decode engine begins and ends forwards itself
        self.version = 0  # bumps whenever storage is re-allocated (captured steps are then stale)
        self.notices: list[str] = []  # things the user should be told once (the UI pops them)
        self._reserved = 0  # a full cache makes room for this many tokens when it allocates
        self._view = False  # a row's view of another cache's storage (see row()): never re-allocates
        self._start()

    def _start(self) -> None:
        """The state of one sequence, declared once: a new cache starts with it and `reset` returns to it."""
        self.slots: Slots | None = None
        self.rules: Rules | None = None
        self.store: Store | None = None  # evicted tokens of rows that recall (`engine/store.py`)
        self.columns = 0  # token columns fed, padding included: what the model calls "seen"
        self.forward: Forward | None = None
        self.probe = None  # snap's pass 1 (`snap.Probe`), while it runs
        self.observation = None  # snap's pass 2 (`snap.Observation`), while it runs
        self.renumbered = False  # some row's keys are rotated at other than their true positions
        self._skipped: torch.Tensor | None = None  # (B,) tokens to count as read before the next chunk
        self._rows: list[_Group] = []  # each row's group, set when storage is allocated
        self._row_columns: list[int] = []  # per row: columns fed (rows refilled with new prompts differ)
        # per row, counted from its own tokens (never its padding): an upper bound on the next position a key is
        # rotated at; a row renumbers when it would pass its window, exactly when it would alone
        self._bound: list[int] = []
        self._switched: list[bool] = []  # per row: passed the trained context and renumbers from now on
        self._warned: set[str] = set()  # notices given once per sequence

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        policy: Policy | list[Policy],
        positions: str | list[str] = "absolute",
        context: int | None = None,
        rows: list[int] | None = None,
        kv_quant: str = "none",
    ) -> H2OCache:
        """`positions`: absolute (keys keep their true positions, the paper's default), rolling (renumbered by
        order among the held tokens whenever they would pass a window of twice the budget) or auto (true
        positions within the trained context, renumbered when they would pass it). Several policies: `rows[g]`
        consecutive batch rows follow `policy[g]` (and `positions[g]` when a list). `kv_quant`: "8bit" stores the held
        keys and values in int8 with a scale per token (`quant.py`)."""
        return cls(policy, positions=positions, rows=rows, kv_quant=kv_quant, **model_facts(model, context))

    # -- description --------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        """The policy (of the first group, when rows follow several)."""
        return self.groups[0].policy

    @property
    def positions(self) -> str:
        return self.groups[0].positions

    @property
    def rolling(self) -> bool:
        """Whether some row's tokens are numbered by their order among the held tokens."""
        return any(self._switched) or (not self._rows and any(g.positions == "rolling" for g in self.groups))

    def capacity_for(self, tokens: int) -> int:
        """Slots per layer once `tokens` more are read: the storage's, or what it will allocate."""
        if self.slots is None:
            return self._capacity(self.columns + tokens)
        if all(g.policy.capacity is not None for g in self.groups):
            return self.slots.capacity
        return max(self.slots.capacity, self.columns + tokens)

    def storage_bytes(self) -> int:
        """Bytes the storage occupies now (0 before the first token)."""
        return 0 if self.slots is None else sum(t.numel() * t.element_size() for t in self.slots.buffers())

    def _capacity(self, need: int = 0) -> int:
        """Slots per layer for storage allocated now: the largest budget, or room for a full cache's tokens."""
        budgets = [g.policy.capacity for g in self.groups]
        capacity = max((b for b in budgets if b is not None), default=0)
        if None in budgets:
            capacity = max(capacity, _FULL_INITIAL, self._reserved, need)
        return capacity

    def _limit(self, row: int) -> int:
        return self._rows[row].policy.capacity or self.slots.capacity

    # -- the transformers Cache protocol ----------------------------------------------------------
    def h2o_layer(self, layer_idx: int) -> H2OLayer:
        """Called by the attention hook before the layer's update: the layer, if a forward has begun."""
        if self.forward is None:
            raise CacheUsageError(
                "the H2O cache was used outside a forward it began: call h2o_chat.prepare_model(model) before "
                "using an H2OCache, and run the model (or its base module), not its layers one by one"
            )
        return self.layers[layer_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        fwd = self.forward
        if fwd is None:
            raise CacheUsageError(
                "the H2O cache was updated by attention that does not go through h2o-chat: "
                "call h2o_chat.prepare_model(model) before using an H2OCache"
            )
        if self.slots is None:
            self.allocate(key_states, value_states)
        slots = self.slots
        if key_states.device != slots.keys.device:  # a layer placed elsewhere by accelerate
            key_states, value_states = key_states.to(slots.keys.device), value_states.to(slots.keys.device)
        if fwd.kind == "chunk":  # the layer's attention stashes the chunk; end() places it
            return key_states, value_states
        spare = slots.capacity  # a decode step: the new token goes into the spare slot; shapes never change
        slots.write((layer_idx, slice(None), slice(None), spare), key_states[:, :, 0], value_states[:, :, 0])
        if slots.quantized:  # attend() reads the layer's slots (int8 and scales), the new token's included
            return key_states, value_states
        return slots.keys[layer_idx], slots.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if torch.compiler.is_compiling() and self.slots is not None:
            # a traced step would bake a host counter in (and retrace every step): give a device value, as
            # transformers' StaticCache does; h2o-chat passes position ids itself anyway
            return self.slots.seen.max()
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return (self.policy.capacity or -1) if len(self.groups) == 1 else -1

    def reset(self) -> None:
        """Forget the sequence (storage, recall's store, positions and their numbering): the next one is read
        as by a new cache. Captured steps are stale (the version says so); a full cache's reservation stays."""
        self._start()
        self.version += 1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (no assisted decoding)")

    # -- storage --------------------------------------------------------------------------------------
    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """First update: storage for every layer, shaped after the first layer's keys and values."""
        B = key.shape[0]
        counts = [g.rows for g in self.groups]
        if None in counts:
            counts = [B]
        elif sum(counts) != B:
            raise CacheUsageError(f"the cache's policies cover {sum(counts)} rows, the batch has {B}")
        self._rows = [g for g, n in zip(self.groups, counts, strict=True) for _ in range(n)]
        if len(self._bound) != B:  # before_forward was not told each row's real tokens: every column counts
            self._bound = [self.columns] * B
        self._row_columns = [self.columns] * B
        self._switched = [g.positions == "rolling" and self.rope is not None for g in self._rows]
        self._install(Slots.allocate(len(self.layers), key, value, self._capacity(self.columns), self.kv_quant))
        self._make_store()

    def _make_store(self) -> None:
        """A store of evicted tokens when some row recalls (one block size for the whole batch)."""
        recalling = [g.policy for g in self._rows if isinstance(g.policy, Recall)]
        if not recalling or self.slots is None:
            self.store = None
            return
        blocks = {p.block for p in recalling}
        if len(blocks) > 1:
            raise ConfigError("rows of one batch recall in blocks of one size")
        block = blocks.pop()
        recalled = [g.policy.recalled if isinstance(g.policy, Recall) else 0 for g in self._rows]
        s = self.slots
        if self.store is not None and self.store.shape[1] == s.batch and self.store.block == block:
            self.store.set_recalled(recalled)  # a policy change: what was evicted stays recallable
            return
        first = (0, slice(None), slice(None), slice(0, 1))  # a template: shapes and the model's dtype
        self.store = Store(
            len(self.layers), s.read("keys", first), s.read("values", first), recalled, block, quant=s.quantized
        )

    def _install(self, slots: Slots) -> None:
        """New storage (and the rules sized for it): captured decode steps are stale (the version says so)."""
        self.slots = slots
        self.rules = Rules.of([g.policy for g in self._rows], slots.capacity, slots.keys.device)
        self.version += 1
        slots.mark_static()

    @_inference
    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens per row up front (only a full cache grows; a budget is fixed)."""
        if all(g.policy.capacity is not None for g in self.groups):
            return
        need = self.columns + tokens
        if self.slots is None:
            self._reserved = max(self._reserved, need)
        elif need > self.slots.capacity:
            self._resize(need)

    @_inference
    def _resize(self, capacity: int) -> None:
        if self._view:
            raise CacheUsageError("a full cache's rows must be reserved before a prompt is read into one of them")
        s = self.slots
        keep = torch.arange(s.capacity, device=s.pos.device).expand(*s.pos.shape[:3], s.capacity)
        self._install(s.moved(keep, capacity))

    @_inference
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` (finished rows leave the batch)."""
        if self.slots is None:
            return
        index = index.to(self.slots.seen.device)
        picks = index.tolist()
        self._rows = [self._rows[i] for i in picks]
        self._bound = [self._bound[i] for i in picks]
        self._switched = [self._switched[i] for i in picks]
        self._row_columns = [self._row_columns[i] for i in picks]
        self.columns = max(self._row_columns, default=0)
        self._install(self.slots.rows(index))
        if self.store is not None:
            self.store.rows(index)

    # -- copies and rows ----------------------------------------------------------------------------
    def _twin(self, slots: Slots | None) -> H2OCache:
        twin = copy.copy(self)
        twin.layers = [H2OLayer(twin, i) for i in range(len(self.layers))]
        twin.slots, twin.forward, twin.probe, twin.observation, twin._skipped = slots, None, None, None, None
        twin.store = None  # a copy (snap's probe) keeps nothing it evicts
        twin.groups = [copy.copy(g) for g in self.groups]
        twin._rows, twin._bound, twin._switched = list(self._rows), list(self._bound), list(self._switched)
        twin._warned = set(self._warned)
        twin._view = False
        return twin

    @_inference
    def fork(self) -> H2OCache:
        """An independent copy (snap's probe reads a prompt into one and throws it away)."""
        twin = self._twin(None if self.slots is None else self.slots.copy())
        twin.notices = []
        return twin

    def row(self, r: int) -> H2OCache:
        """Row r as a cache of its own that shares this cache's storage: a prompt read into it lands in row r
        while the other rows keep theirs (continuous batching). Notes go to this cache. `absorb` takes its host
        bookkeeping back, and what the prompt evicted into this cache's store when the row recalls (the view
        keeps its own while it reads: its chunks recall only what this prompt evicted)."""
        view = self._twin(self.slots.row(r))
        view.rules = self.rules.rows(torch.tensor([r], device=self.slots.seen.device))
        view._rows, view._bound, view._switched = [self._rows[r]], [self._bound[r]], [self._switched[r]]
        view.columns = self._row_columns[r]
        view._row_columns = [view.columns]
        view.groups = [_Group(self._rows[r].policy, None, self._rows[r].positions)]
        view.host_managed = True
        view._view = True
        view._make_store()
        return view

    def absorb(self, view: H2OCache, r: int) -> None:
        """Row r's host bookkeeping back from its view, after a prompt was read into it."""
        if view.slots is None or view.slots.keys.data_ptr() != self.slots.row(r).keys.data_ptr():
            raise CacheUsageError("a row's storage was re-allocated while a prompt was read into it")
        self._bound[r], self._switched[r] = view._bound[0], view._switched[0]
        self._row_columns[r] = view.columns
        self.columns = max(self._row_columns)
        if self.store is not None and view.store is not None:
            self.store.put_row(r, view.store)
        self.renumbered |= view.renumbered
        self._warned |= view._warned

    @_inference
    def clear_row(self, r: int) -> None:
        """Empty row r for a new prompt; the other rows are untouched."""
        self.slots.clear_row(r)
        if self.store is not None:
            self.store.clear_row(r)
        self._bound[r], self._row_columns[r] = 0, 0
        self._switched[r] = self._rows[r].positions == "rolling" and self.rope is not None

    @_inference
    def clear(self) -> None:
        """Empty every row in place, storage kept (a captured step stays valid): the next prompt is read from
        position 0, as into a new cache (a conversation re-reads its transcript)."""
        for r in range(self.slots.batch if self.slots is not None else 0):
            self.clear_row(r)
        if self.store is not None:
            self.store.clear()
            self._warned.discard("store-full")  # an emptied store may fill again: say so again
        self.columns = 0

    @_inference
    def snapshot(self) -> dict:
        """What the cache holds now, copied to the host: `restore` brings it back (e.g. when the user stops the
        reading of a long message, the conversation continues from before it)."""
        host = {k: list(getattr(self, k)) for k in ("_rows", "_bound", "_switched", "_row_columns")}
        state = {"columns": self.columns, "renumbered": self.renumbered, "host": host}
        # the store only grows (a count), and is renumbered in place (which a restore cannot take back)
        state["stored"] = None if self.store is None else (self.store.count, self.store.renumbers)
        state["slots"] = None if self.slots is None else self.slots.copy("cpu")
        return state

    @_inference
    def restore(self, state: dict) -> None:
        """Back to a snapshot; storage of the same shape is overwritten in place (captured steps stay valid)."""
        self.forward = None
        self.columns, self.renumbered = state["columns"], state["renumbered"]
        for k, v in state["host"].items():
            setattr(self, k, list(v))
        if self.store is not None:
            count, renumbers = state.get("stored") or (0, self.store.renumbers)
            if renumbers != self.store.renumbers:  # its keys follow positions the restored slots no longer have
                self.store.clear()
                self._warn_once(
                    "store-restored",
                    "the evicted tokens kept for recall were dropped: they were renumbered for the message taken back",
                )
            self.store.truncate(count)
        saved = state["slots"]
        if saved is None:
            self.slots, self.rules = None, None
            self.version += 1
        elif self.slots is not None and self.slots.keys.shape == saved.keys.shape:
            self.slots.load(saved)
        else:
            self._install(saved.copy(self.slots.keys.device if self.slots is not None else None))

    # -- a forward ----------------------------------------------------------------------------------
    @_inference
    def before_forward(self, new_tokens: int, real: list[int] | None = None) -> None:
        """Host bookkeeping before a forward of `new_tokens` columns (never inside a captured step): stop models
        that cannot go on, warn once, renumber rows whose positions would pass their window, make room in a
        full cache; then count the columns. `real`: each row's own tokens among them, host ints (a left-padded
        row has fewer); None: every column of every row (a decode step, an unpadded prompt)."""
        if real is None:
            real = [new_tokens] * len(self._bound)
        elif not self._bound:  # the first rows' counts, before storage exists (allocate keeps them)
            self._bound = [self.columns] * len(real)
        self._check_context(new_tokens, real)
        if self.slots is not None and any(g.policy.capacity is None for g in self.groups):
            need = self.columns + new_tokens
            if need > self.slots.capacity:
                self._resize(max(2 * self.slots.capacity, need))
        self.columns += new_tokens
        self._bound = [b + n for b, n in zip(self._bound, real, strict=True)]
        self._row_columns = [c + new_tokens for c in self._row_columns]

    def begin(self, kind: str, mask: torch.Tensor | None = None, columns: int = 1, batch: int | None = None):
        """Begin a forward of `columns` new columns: kind "step" (one token per row, every row real) or
        "chunk" (a prompt chunk; `mask` (B, T) marks real tokens, None = all). Returns the position ids (B, T)
        the model must give its rotary embedding. Called by the decode engine (host bookkeeping done before, by
        `before_forward`), or by the model's hook for `model.generate`."""
        if self.forward is not None:  # the last forward never ended (an exception inside the model)
            self.abort()
        if not self.host_managed:  # model.generate: a prompt's mask is read once (it syncs on it already)
            self.before_forward(columns, None if mask is None else mask.sum(-1).tolist())
        if kind == "step":
            return self._begin_step()
        if kind != "chunk":
            raise CacheUsageError(f"unknown kind of forward {kind!r}")
        return self._begin_chunk(mask, columns, batch)

    def _begin_step(self) -> torch.Tensor:
        s = self.slots
        if s is None:
            raise CacheUsageError("a decode step needs a prompt first: begin with a chunk")
        spare = s.capacity
        s.pos[..., spare] = s.seen[None, :, None]
        s.rot[..., spare] = s.next_rot[None, :, None]
        self.forward = Forward("step", 1, valid=s.valid()[:, None, :], layers=len(self.layers))
        return s.next_rot[:, None]

    @_inference
    def _begin_chunk(self, mask: torch.Tensor | None, T: int, batch: int | None) -> torch.Tensor:
        s = self.slots
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
        skipped, self._skipped = self._skipped, None
        if skipped is not None:  # tokens counted as read (and evicted) without being fed: see skip()
            seen, next_rot = seen + skipped, next_rot + skipped
        steps = real.cumsum(-1) - 1
        before = self.columns - T
        capacity = s.capacity if s is not None else self._capacity(self.columns)
        limits = [g.policy.capacity or capacity for g in self.groups]
        fwd = Forward(
            "chunk",
            T,
            real=real,
            pos_new=(seen[:, None] + steps).masked_fill(~real, -1),
            rot_new=(next_rot[:, None] + steps).masked_fill(~real, -1),
            attend_from=min(capacity, before) if s is not None else 0,
            fits=before + T <= min(limits),
            track_mass=any(g.policy.by_score for g in self.groups)
            and (self.observation is None or self.observation.track_mass),
            fused=real.device.type == "cuda",
            probe=self.probe,
            observation=self.observation,
            layers=len(self.layers),
            skipped=skipped,
        )
        if fwd.attend_from:
            fwd.stored_valid = s.valid()[:, : fwd.attend_from]
        self.forward = fwd
        return fwd.rot_new.clamp(min=0)

    @_inference
    def end(self) -> None:
        """Finish the forward that ran: place its tokens and advance the rows."""
        fwd, s = self.forward, self.slots
        self.forward = None
        if fwd is None:
            return
        if fwd.kind == "step":
            evict.step(s, self.rules, self.store)
            s.seen += 1
            s.next_rot += 1
            self._store_full_note()
            return
        if fwd.score is None:  # nothing reached the attention (an empty model?)
            return
        extra = [fwd.observation.new_obs] if fwd.observation is not None else []
        new = evict.NewTokens(fwd.keys, fwd.values, fwd.pos_new, fwd.rot_new, fwd.score, extra)
        priority = None
        if fwd.observation is not None and not fwd.fits:
            priority = fwd.observation.priority(self, new)
        evict.chunk(s, new, self.rules, fwd.fits, priority, self.store)
        added = fwd.real.sum(-1) if fwd.skipped is None else fwd.real.sum(-1) + fwd.skipped
        s.seen += added
        s.next_rot += added
        self._store_full_note()

    def _store_full_note(self) -> None:
        if self.store is not None and self.store.full:
            self._warn_once(
                "store-full",
                f"the store of evicted tokens for recall stopped growing at {self.store.nbytes() / 1e6:,.0f} MB: "
                "the host's memory is nearly used up; tokens evicted from now on cannot be recalled",
            )

    @_inference
    def skip(self, real: torch.Tensor, columns: int) -> None:
        """Count `columns` columns (`real` (B,) real tokens per row) as read and evicted without feeding them:
        the next chunk's tokens get the positions they would have after them (snap's probe reads only the end of
        a long prompt)."""
        self.before_forward(columns, real.tolist())  # snap's probe, once per prompt
        self._skipped = real if self._skipped is None else self._skipped + real

    def abort(self) -> None:
        """Forget a forward that did not finish (nothing of its chunk was placed; a step's spare is cleared)."""
        if self.forward is not None and self.forward.kind == "step" and self.slots is not None:
            self.slots.clear_spare()
        self.forward = None

    # -- positions ----------------------------------------------------------------------------------
    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.notices.append(text)

    def _check_context(self, new_tokens: int, real: list[int]) -> None:
        """`real`: each row's own tokens among the `new_tokens` columns (empty before storage exists and rows
        are known)."""
        if self.context is None:
            return
        ends = [b + n for b, n in zip(self._bound, real, strict=True)] or [self.columns + new_tokens]
        if max(ends) > self.context and (self.rope is None and self.rope_problem is None):
            raise ContextLimitError(
                f"the model's learned positions end at {self.context} tokens (OPT): it cannot read or write past "
                "them, whatever the budget; start a new conversation (/reset) or shorten the input"
            )
        if not self._rows:  # nothing stored yet: the first chunk starts at position 0
            if max(ends) > self.context:
                self._past_context_warning()
            return
        renumber = []
        for r, group in enumerate(self._rows):
            limit = group.policy.capacity
            if group.positions == "absolute" or self.rope is None or limit is None:
                if ends[r] > self.context:
                    self._past_context_warning()
                continue
            window = self.context if group.positions == "auto" else min(self.context, 2 * limit)
            window = max(window, limit + real[r])
            if ends[r] > window:
                renumber.append(r)
        if renumber:
            self._renumber(renumber)
            over = max(self._bound[r] + real[r] for r in renumber)
            if over > self.context:
                self._warn_once(
                    "window",
                    f"the budget plus this chunk ({over} positions) is more than the trained context "
                    f"({self.context}): quality degrades; a smaller budget or --chunk-size keeps within it",
                )

    def _past_context_warning(self) -> None:
        why = (
            f"renumbered positions are not possible ({self.rope_problem})"
            if self.rope_problem
            else "--positions auto or rolling renumbers positions within the context"
        )
        self._warn_once(
            "absolute",
            f"passed the trained context ({self.context} tokens) with absolute positions: quality degrades from "
            f"here; {why}",
        )

    @_inference
    def _renumber(self, rows: list[int]) -> None:
        """Number the held tokens of `rows` 0, 1, 2, ... by true position (per layer and head) and rotate each
        key by the change; new tokens continue after them."""
        s = self.slots
        if any(not self._switched[r] for r in rows):
            self._warn_once(
                "switched",
                f"passed the trained context ({self.context} tokens): from here the kept tokens are renumbered "
                "by their order whenever positions would pass it, so generation can go on",
            )
        selected = torch.zeros(s.batch, dtype=torch.bool, device=s.pos.device)
        selected[rows] = True
        big = torch.iinfo(s.pos.dtype).max
        for i in range(len(self.layers)):  # one layer at a time: the rotation's transients stay small
            pos, rot = s.pos[i], s.rot[i]
            held = pos >= 0
            order = torch.where(held, pos, big).argsort(dim=-1)
            rank = torch.empty_like(order).scatter_(
                -1, order, torch.arange(pos.shape[-1], device=pos.device).expand_as(order)
            )
            change = torch.where(held & selected[:, None, None], rank - rot, 0)
            s.write((i,), self.rope.rotate_by(s.read("keys", (i,)), change))
            rot.copy_(torch.where(selected[:, None, None], torch.where(held, rank, -1), rot))
        s.next_rot.copy_(torch.where(selected, s.held(), s.next_rot))
        if self.store is not None:  # evicted tokens are numbered where they stand among the held ones
            self.store.renumber(rows, s.pos[..., : s.capacity], self.rope)
        for r in rows:
            self._switched[r] = True
            self._bound[r] = self._limit(r)
        self.renumbered = True

    # -- policy changes -------------------------------------------------------------------------------
    @_inference
    def set_policy(self, policy: Policy) -> None:
        """Change budget or policy while keeping what is cached: a smaller budget keeps the new policy's best
        slots (evicted tokens do not come back), a larger one re-allocates."""
        if len(self.groups) > 1:
            raise CacheUsageError("set_policy changes a cache with one policy for all rows")
        self.groups[0].policy = policy
        s = self.slots
        if s is None:
            return
        self._rows = [self.groups[0]] * s.batch
        held = int(s.held().max())
        capacity = policy.capacity or max(held, self.columns, _FULL_INITIAL)
        C = s.capacity
        if held > capacity:
            rules = Rules.of([policy] * s.batch, capacity, s.pos.device)
            prio = rules.priority(s.score[..., :C], s.pos[..., :C], s.seen - 1)
            keep = evict.order(prio, evict.tie(s.pos[..., :C])).topk(capacity, dim=-1).indices.sort(-1).values
        else:  # the held tokens first (they fill the first slots already)
            keep = torch.arange(min(C, capacity), device=s.pos.device).expand(*s.pos.shape[:3], min(C, capacity))
        self._install(s.moved(keep, capacity))
        self._make_store()
        self._bound = [min(b, capacity) if self._switched[r] else b for r, b in enumerate(self._bound)]

    # -- inspection -------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return self._stats(slice(None))

    def group_stats(self) -> list[CacheStats]:
        """One snapshot per policy group (rows side by side)."""
        out, start = [], 0
        for g in self.groups:
            n = g.rows if g.rows is not None else (self.slots.batch if self.slots is not None else 1)
            out.append(self._stats(slice(start, start + n), g))
            start += n
        return out

    def _stats(self, rows: slice, group: _Group | None = None) -> CacheStats:
        group = group or self.groups[0]
        policy = group.policy
        label = self.positions_label(group, rows)
        s = self.slots
        if s is None:
            return CacheStats(
                policy.name, policy.budget, policy.split(), len(self.layers), 0, 0.0, 0, 0, 0.0, 0, 0, 0, label
            )
        pos = s.pos[:, rows, :, : s.capacity]
        kept = (pos >= 0).sum(-1)  # (L, b, H)
        slot_bytes = s.token_bytes()  # K+V of one token in one slot, as stored
        full_bytes = (s.keys.shape[-1] + s.values.shape[-1]) * torch.empty(0, dtype=s.dtype).element_size()
        slots_allocated = s.keys.shape[0] * pos.shape[1] * s.keys.shape[2] * s.keys.shape[3]
        seen = s.seen[rows]
        return CacheStats(
            policy=policy.name,
            budget=policy.budget,
            split=policy.split(),
            layers=len(self.layers),
            seen=int(seen.max()),
            kept=float(kept.float().mean()),
            kept_min=int(kept.min()),
            kept_max=int(kept.max()),
            evicted=float((seen[None, :, None] - kept).float().mean()),  # every real token seen is held or gone
            kv_bytes=slots_allocated * slot_bytes,
            kv_used_bytes=int(kept.sum()) * slot_bytes,
            full_kv_bytes=int(seen.sum()) * full_bytes * s.keys.shape[0] * s.keys.shape[2],
            positions=label,
            store_bytes=0 if self.store is None else self.store.nbytes() * len(seen) // s.batch,
            kv_quant="8bit" if s.quantized else "none",
        )

    def positions_label(self, group: _Group | None = None, rows: slice | None = None) -> str:
        """For the panel: how tokens are numbered now and why (in `rows`, a group's rows: each row renumbers
        on its own, so one row that passed the trained context says nothing of the others)."""
        group = group or self.groups[0]
        switched = self._switched[rows] if rows is not None and self._switched else None
        rolling = any(switched) if switched is not None else self.rolling
        now = "renumbered by order among the held tokens" if rolling else "absolute"
        trained = f"trained context {self.context}" if self.context else "trained context unknown"
        if group.positions != "auto":
            return f"{group.positions}: {now}, {trained}" if group.positions == "rolling" else f"{now}, {trained}"
        return f"auto: {now}, {'passed the ' if rolling else ''}{trained}"

    def kept_fraction(self, start: int, end: int, row: int = 0) -> float:
        """Share of positions [start, end) still held, averaged over layers and heads (for /evicted)."""
        if end <= start or self.slots is None:
            return 1.0
        pos = self.slots.pos[:, row, :, : self.slots.capacity]  # (L, H, S)
        inside = ((pos >= start) & (pos < end)).sum(-1).float()  # (L, H)
        return float(inside.mean()) / (end - start)

    def row_stats(self, row: int) -> dict:
        """Seen, kept and evicted tokens of one batch row (per layer and head), for batch records."""
        s = self.slots
        seen = int(s.seen[row])
        kept = float((s.pos[:, row, :, : s.capacity] >= 0).sum(-1).float().mean())
        return {"seen": seen, "kept": kept, "evicted": seen - kept}

    def pop_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out
