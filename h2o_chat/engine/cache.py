"""The H2O KV cache: a transformers `Cache` whose storage is allocated once and evicts in place.

Storage (`Slots`) holds every layer stacked: keys/values (L, B, H, S, D), each slot's true position and the
position its key was rotated at, and its accumulated attention mass in fp32; S is the capacity plus one spare
slot. Each (layer, row, KV head) keeps its own set of tokens; each row may follow its own policy (`Rules`).

The cache's jobs live apart: a forward's beginning and end (`forward.py`), numbering positions
(`positions.py`), row views for continuous batching and snapshots (`rowviews.py`), statistics (`stats.py`),
eviction (`evict.py`), the storage itself (`slots.py`). What one sequence holds is declared once, in
`_start`: a new cache starts with it and `reset` returns to it.

A forward is begun and ended explicitly -- by the decode engine, or for `model.generate` by hooks on the
model's base module -- and says what it is: `before_forward(T, counts)` (host only, never inside a captured
step: context checks, renumbering, room in a full cache), `begin(kind, mask)`, the model, `end()`.
"""

from __future__ import annotations

import torch

from h2o_chat.engine import forward as fw
from h2o_chat.engine import stats
from h2o_chat.engine.layer import H2OLayer
from h2o_chat.engine.policies import Policy, Rules
from h2o_chat.engine.positions import POSITIONS, Group, Numbering, RowState, check_positions
from h2o_chat.engine.protocol import CacheProtocol
from h2o_chat.engine.rope import Rope, RopeUnsupported
from h2o_chat.engine.storage import allocation, rowviews
from h2o_chat.engine.storage.quant import check_mode
from h2o_chat.engine.storage.slots import Slots, inference
from h2o_chat.engine.storage.store import Store
from h2o_chat.errors import CacheUsageError, ConfigError

__all__ = ["POSITIONS", "H2OCache", "check_positions", "model_facts", "unsupported"]


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


class H2OCache(CacheProtocol):
    """A transformers Cache with one `H2OLayer` per decoder layer. One policy for every row, or several side by
    side (`policies` with `rows` each: evaluations compare configurations as rows of one batch).

    Use it with a model prepared by `h2o_chat.prepare_model`, either through `model.generate(...,
    past_key_values=cache)` or h2o-chat's decode engine (`h2o_chat.engine.Engine`), which captures decode steps.
    """

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
        self.numbering = Numbering(rope, context, rope_problem)
        policies = [policy] if isinstance(policy, Policy) else list(policy)
        modes = [positions] * len(policies) if isinstance(positions, str) else list(positions)
        if rows is None and len(policies) > 1:
            rows = [1] * len(policies)
        for mode in modes:
            self.numbering.check_mode(mode)
        self.groups = [Group(p, n, m) for p, n, m in zip(policies, rows or [None], modes, strict=True)]
        self.host_managed = False  # True when a decode engine begins and ends forwards itself
        self.version = 0  # bumps whenever storage is re-allocated (captured steps are then stale)
        self.notices: list[str] = []  # things the user should be told once (the UI pops them)
        self.reserved = 0  # a full cache makes room for this many tokens when it allocates
        self.is_view = False  # a row's view of another cache's storage (see row()): never re-allocates
        self.is_fork = False  # a throw-away copy (snap's probe, `fork()`): keeps nothing it evicts
        self._start()

    def _start(self) -> None:
        """The state of one sequence, declared once: a new cache starts with it, `reset` returns to it, and
        `rowviews` copies and views it (a snapshot carries `rowviews.SNAPSHOT`, the rows, the slots and the store's
        count)."""
        self.slots: Slots | None = None
        self.rules: Rules | None = None
        self.store: Store | None = None  # evicted tokens of rows that recall (`engine/storage/store.py`)
        self.columns = 0  # token columns fed, padding included: what the model calls "seen"
        self.rows: list[RowState] = []  # per batch row, set when storage is allocated (before: counts only)
        self.renumbered = False  # some row's keys are rotated at other than their true positions
        self.warned: set[str] = set()  # notices given once per sequence
        self.forward: fw.Forward | None = None
        self.probe = None  # snap's pass 1 (`snap.Probe`), while it runs
        self.observation = None  # snap's pass 2 (`snap.Observation`), while it runs

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
    def rope(self) -> Rope | None:
        return self.numbering.rope

    @property
    def context(self) -> int | None:
        return self.numbering.context

    @property
    def rolling(self) -> bool:
        """Whether some row's tokens are numbered by their order among the held tokens."""
        if self.rows:
            return any(r.switched for r in self.rows)
        return any(self.numbering.starts_switched(g) for g in self.groups)

    def row_groups(self, batch: int) -> list[Group]:
        """Each of `batch` rows' group: as allocated, or as the groups will give them."""
        if self.rows:
            return [r.group for r in self.rows]
        return [g for g in self.groups for _ in range(g.rows or batch)]

    def capacity_for(self, tokens: int) -> int:
        """Slots per layer once `tokens` more are read: the storage's, or what it will allocate."""
        return allocation.capacity_for(self, tokens)

    def storage_bytes(self) -> int:
        """Bytes the storage occupies now (0 before the first token)."""
        return 0 if self.slots is None else self.slots.nbytes()

    def limit(self, row: int) -> int:
        """Tokens row `row` may hold: its policy's capacity, or the storage's (a full cache)."""
        return self.rows[row].group.policy.capacity or self.slots.capacity

    def warn_once(self, key: str, text: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self.notices.append(text)

    def pop_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out

    def reset(self) -> None:
        """Forget the sequence (storage, recall's store, positions and their numbering): the next one is read
        as by a new cache. Captured steps are stale (the version says so); a full cache's reservation stays."""
        self._start()
        self.version += 1

    # -- storage (`allocation.py`) ---------------------------------------------------------------------
    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """First update: storage for every layer, shaped after the first layer's keys and values."""
        allocation.allocate(self, key, value)

    def make_store(self) -> None:
        allocation.make_store(self)

    def install(self, slots: Slots) -> None:
        """New storage (and the rules sized for it): captured decode steps are stale (the version says so)."""
        self.slots = slots
        self.rules = Rules.of([r.group.policy for r in self.rows], slots.capacity, slots.keys.device)
        self.version += 1
        slots.mark_static()

    @inference
    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens per row up front (only a full cache grows; a budget is fixed)."""
        allocation.reserve(self, tokens)

    @inference
    def set_policy(self, policy: Policy) -> None:
        """Change budget or policy while keeping what is cached: a smaller budget keeps the new policy's best
        slots (evicted tokens do not come back), a larger one re-allocates."""
        rowviews.set_policy(self, policy)

    # -- rows, copies and snapshots (`rowviews.py`) -----------------------------------------------------
    @inference
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` (finished rows leave the batch)."""
        rowviews.select_rows(self, index)

    @inference
    def fork(self) -> H2OCache:
        """An independent copy (snap's probe reads a prompt into one and throws it away)."""
        return rowviews.fork(self)

    def row(self, r: int) -> H2OCache:
        """Row r as a cache of its own sharing this cache's storage (continuous batching): see `rowviews.row`."""
        return rowviews.row(self, r)

    def absorb(self, view: H2OCache, r: int) -> None:
        """Row r's host bookkeeping back from its view, after a prompt was read into it."""
        rowviews.absorb(self, view, r)

    @inference
    def clear_row(self, r: int) -> None:
        """Empty row r for a new prompt; the other rows are untouched."""
        rowviews.clear_row(self, r)

    @inference
    def clear(self) -> None:
        """Empty every row in place, storage kept (a captured step stays valid): the next prompt is read from
        position 0, as into a new cache (a conversation re-reads its transcript)."""
        rowviews.clear(self)

    @inference
    def snapshot(self) -> dict:
        """What the cache holds now, copied to the host: `restore` brings it back."""
        return rowviews.snapshot(self)

    @inference
    def restore(self, state: dict, device: torch.device | str | None = None) -> None:
        """Back to a snapshot; storage of the same shape is overwritten in place (captured steps stay valid).
        A cache without storage yet takes a copy on `device` (default: where the snapshot is)."""
        rowviews.restore(self, state, device)

    # -- a forward ----------------------------------------------------------------------------------
    @inference
    def before_forward(self, new_tokens: int, counts: list[int] | None = None) -> None:
        """Host bookkeeping before a forward of `new_tokens` columns (never inside a captured step): stop models
        that cannot go on, warn once, renumber rows whose positions would pass their window, make room in a
        full cache; then count the columns. `counts`: each row's own tokens among them, host ints (a left-padded
        row has fewer); None: every column of every row (a decode step, an unpadded prompt)."""
        fw.before(self, new_tokens, counts)

    def begin(self, kind: str, mask: torch.Tensor | None = None, columns: int = 1, batch: int | None = None):
        """Begin a forward of `columns` new columns: kind "step" (one token per row, every row real) or
        "chunk" (a prompt chunk; `mask` (B, T) marks real tokens, None = all). Returns the position ids (B, T)
        the model must give its rotary embedding."""
        if self.forward is not None:  # the last forward never ended (an exception inside the model)
            self.abort()
        if not self.host_managed:  # model.generate: a prompt's mask is read once (it syncs on it already)
            self.before_forward(columns, None if mask is None else mask.sum(-1).tolist())
        if kind == "step":
            return fw.begin_step(self)
        if kind != "chunk":
            raise CacheUsageError(f"unknown kind of forward {kind!r}")
        return fw.begin_chunk(self, mask, columns, batch)

    @inference
    def end(self) -> None:
        """Finish the forward that ran: place its tokens and advance the rows."""
        fwd, self.forward = self.forward, None
        if fwd is not None:
            fw.end(self, fwd)

    def abort(self) -> None:
        """Forget a forward that did not finish (nothing of its chunk was placed; a step's spare is cleared)."""
        if self.forward is not None and self.forward.kind == "step" and self.slots is not None:
            self.slots.clear_spare()
        self.forward = None

    # -- inspection (`stats.py`) --------------------------------------------------------------------
    def stats(self) -> stats.CacheStats:
        return stats.of_rows(self, slice(None))

    def group_stats(self) -> list[stats.CacheStats]:
        """One snapshot per policy group (rows side by side)."""
        return stats.of_groups(self)

    def positions_label(self) -> str:
        """How tokens are numbered now and why (the first group's rows)."""
        return stats.positions_label(self, self.groups[0], slice(None))

    def kept_fraction(self, start: int, end: int, row: int = 0) -> float:
        """Share of positions [start, end) still held, averaged over layers and heads (for /evicted)."""
        return stats.kept_fraction(self, start, end, row)

    def row_stats(self, row: int) -> dict:
        """Seen, kept and evicted tokens of one batch row (per layer and head), for batch records."""
        return stats.row_stats(self, row)
