"""The H2O KV cache: a transformers `Cache` whose storage is allocated once and evicts in place.

Storage (`Slots`) holds every layer stacked: keys/values (L, B, H, S, D), each slot's true position and the
position its key was rotated at, and its accumulated attention mass in fp32; S is the capacity plus one spare
slot. Each (layer, row, KV head) keeps its own set of tokens; each row may follow its own policy (`Rules`).

Its parts are objects of their own: the storage (`storage/storage.py`: slots, rules and recall's store, allocated
once; everything that replaces a buffer happens there), the sequence's bookkeeping (`sequence.Sequence`: each row's
`RowState`, the columns fed; declared once, started anew by `reset`), the numbering of positions
(`positions.Numbering`), the forward now running (`forward.Step` or `forward.Chunk`) and the eviction
(`policies/evict.py`). Its copies and row views are `views.CacheViews`; what transformers calls, `protocol.py`.

A forward is begun and ended explicitly -- by the decode engine, or for `model.generate` by hooks on the
model's base module -- and says what it is: `before_forward(T, counts)` (host only, never inside a captured
step: context checks, renumbering, room in a full cache), `begin(kind, mask)`, the model, `end()`.
"""

from __future__ import annotations

import torch

from h2o_chat.engine import forward as fw
from h2o_chat.engine import stats
from h2o_chat.engine.layer import H2OLayer
from h2o_chat.engine.policies import Policy
from h2o_chat.engine.positions import POSITIONS, Group, Numbering, RowState, check_positions
from h2o_chat.engine.protocol import CacheProtocol
from h2o_chat.engine.rope import Rope, RopeUnsupported
from h2o_chat.engine.sequence import Sequence
from h2o_chat.engine.storage.quant import check_mode
from h2o_chat.engine.storage.slots import inference
from h2o_chat.engine.storage.storage import Storage
from h2o_chat.engine.views import CacheViews
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


class H2OCache(CacheViews, CacheProtocol):
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
        # how the held keys and values are stored (`storage/quant.py`), and where
        self.storage = Storage(num_layers, check_mode(kv_quant))
        self.numbering = Numbering(rope, context, rope_problem)
        policies = [policy] if isinstance(policy, Policy) else list(policy)
        modes = [positions] * len(policies) if isinstance(positions, str) else list(positions)
        if rows is None and len(policies) > 1:
            rows = [1] * len(policies)
        for mode in modes:
            self.numbering.check_mode(mode)
        self.groups = [Group(p, n, m) for p, n, m in zip(policies, rows or [None], modes, strict=True)]
        self.host_managed = False  # True when a decode engine begins and ends forwards itself
        self.notices: list[str] = []  # things the user should be told once (the UI pops them)
        self._start()

    def _start(self) -> None:
        """A new sequence: its bookkeeping (`sequence.Sequence`, declared once) and no forward running."""
        self.seq = Sequence()
        self.forward: fw.Forward | None = None
        self.probe = None  # snap's pass 1 (`snap.Probe`), while it runs
        self.observation = None  # snap's pass 2 (`snap.Observation`), while it runs
        # recall: per row, whether it had stored evicted tokens before this forward (`before_forward`)
        self.stored_rows: list[bool] = []

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
    slots = property(lambda self: self.storage.slots, doc="Every layer's slots (`Slots`), None before a token.")
    rules = property(lambda self: self.storage.rules, doc="Each row's policy as tensors, sized for the slots.")
    store = property(lambda self: self.storage.store, doc="Recall's evicted tokens (`Store`), or None.")
    version = property(lambda self: self.storage.version, doc="Bumps whenever a buffer is replaced.")
    kv_quant = property(lambda self: self.storage.kv_quant, doc="none | 8bit: how keys and values are held.")

    @property
    def stored_before(self) -> bool:
        """recall: some row had stored evicted tokens before this forward (then a prompt chunk ranks the store)."""
        return any(self.stored_rows)

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
        if self.seq.rows:
            return any(r.switched for r in self.seq.rows)
        return any(self.numbering.starts_switched(g) for g in self.groups)

    def row_groups(self, batch: int) -> list[Group]:
        """Each of `batch` rows' group: as allocated, or as the groups will give them."""
        if self.seq.rows:
            return [r.group for r in self.seq.rows]
        return [g for g in self.groups for _ in range(g.rows or batch)]

    def _budgets(self) -> list[int | None]:
        return [g.policy.capacity for g in self.groups]

    def capacity_for(self, tokens: int) -> int:
        """Slots per layer once `tokens` more are read: the storage's, or what it will allocate."""
        return self.storage.capacity_for(self.seq.columns + tokens, self._budgets())

    def storage_bytes(self) -> int:
        """Bytes the storage occupies now (0 before the first token)."""
        return self.storage.nbytes()

    def limit(self, row: int) -> int:
        """Tokens row `row` may hold: its policy's capacity, or the storage's (a full cache)."""
        return self.seq.rows[row].group.policy.capacity or self.slots.capacity

    def warn_once(self, key: str, text: str) -> None:
        if key not in self.seq.warned:
            self.seq.warned.add(key)
            self.notices.append(text)

    def pop_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out

    def reset(self) -> None:
        """Forget the sequence (storage, recall's store, positions and their numbering): the next one is read
        as by a new cache. Captured steps are stale (the version says so); a full cache's reservation stays."""
        self._start()
        self.storage.drop()

    # -- storage -------------------------------------------------------------------------------------
    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """First update: storage for every layer, shaped after the first layer's keys and values (B, H, T, D)."""
        B = key.shape[0]
        counts = [g.rows for g in self.groups]
        if None not in counts and sum(counts) != B:
            raise CacheUsageError(f"the cache's policies cover {sum(counts)} rows, the batch has {B}")
        counted = len(self.seq.rows) == B  # `before_forward` counted the first chunk's tokens already
        bounds = [r.bound for r in self.seq.rows] if counted else [self.seq.columns] * B
        seen = [r.seen for r in self.seq.rows] if counted else [0] * B
        self.seq.rows = [
            RowState(g, self.seq.columns, b, self.numbering.starts_switched(g), n)
            for g, b, n in zip(self.row_groups(B), bounds, seen, strict=True)
        ]
        self.storage.allocate(key, value, self.capacity_for(0), self.seq.rows)

    @inference
    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens per row up front (only a full cache grows; a budget is fixed)."""
        if None in self._budgets():
            self.storage.reserve(self.seq.columns + tokens, self.seq.rows)

    @inference
    def set_policy(self, policy: Policy) -> None:
        """Change budget or policy while keeping what is cached: a smaller budget keeps the new policy's best
        slots (evicted tokens do not come back), a larger one re-allocates."""
        if len(self.groups) > 1:
            raise CacheUsageError("set_policy changes a cache with one policy for all rows")
        group = self.groups[0]
        group.policy = policy
        if self.slots is None:
            return
        for r in self.seq.rows:
            r.group = group
        capacity = self.storage.change_policy(policy, self.seq.columns, self.seq.rows)
        for r in self.seq.rows:
            if r.switched:
                r.bound = min(r.bound, capacity)

    # -- a forward ----------------------------------------------------------------------------------
    @inference
    def before_forward(self, new_tokens: int, counts: list[int] | None = None) -> None:
        """Host bookkeeping before a forward of `new_tokens` columns (never inside a captured step): stop models
        that cannot go on, warn once, renumber rows whose positions would pass their window, make room in a
        full cache; then count the columns. `counts`: each row's own tokens among them, host ints (a left-padded
        row has fewer); None: every column of every row (a decode step, an unpadded prompt)."""
        if counts is None:
            counts = [new_tokens] * len(self.seq.rows)
        elif not self.seq.rows:  # the first rows' counts, before storage exists (allocate keeps them)
            self.seq.rows = [RowState(g, self.seq.columns, self.seq.columns) for g in self.row_groups(len(counts))]
        self.numbering.check(self, new_tokens, counts)
        if None in self._budgets():
            self.storage.grow(self.seq.columns + new_tokens, self.seq.rows)
        store = self.store
        self.stored_rows = []
        if store is not None:  # recall: what each row will have evicted, and the stored keys' basis when it is due
            rows = self.seq.rows
            limits = [self.limit(r) for r in range(len(rows))]
            # whether a prompt chunk ranks the store: some recalling row had evicted (so stored) tokens before it,
            # from the rows' counts. Not the store's count, which includes what this chunk will evict and which a
            # cache whose storage comes at this forward has not made: a fresh cache skipped ranking its first chunk
            # where a refilled row of a batch ranked an empty store, and read its prompt otherwise (bit for bit)
            self.stored_rows = [bool(store.recalled[r]) and row.seen > limits[r] for r, row in enumerate(rows)]
            store.counted(counts, limits, [row.seen for row in rows])
            due = store.due(self.stored_rows)
            if due:
                store.fit(due, self.slots)
        self.seq.count(new_tokens, counts)

    def begin(self, kind: str, mask: torch.Tensor | None = None, columns: int = 1, batch: int | None = None):
        """Begin a forward of `columns` new columns: kind "step" (one token per row, every row real) or
        "chunk" (a prompt chunk; `mask` (B, T) marks real tokens, None = all). Returns the position ids (B, T)
        the model must give its rotary embedding."""
        if self.forward is not None:  # the last forward never ended (an exception inside the model)
            self.abort()
        if not self.host_managed:  # model.generate: a prompt's mask is read once (it syncs on it already)
            self.before_forward(columns, None if mask is None else mask.sum(-1).tolist())
        if kind == "step":
            self.forward, positions = fw.Step.begin(self)
        elif kind == "chunk":
            self.forward, positions = fw.Chunk.begin(self, mask, columns, batch)
        else:
            raise CacheUsageError(f"unknown kind of forward {kind!r}")
        return positions

    @inference
    def end(self) -> None:
        """Finish the forward that ran: place its tokens and advance the rows."""
        fwd, self.forward = self.forward, None
        if fwd is not None:
            fwd.end(self)

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

    def room(self, row: int = 0) -> int | None:
        """Tokens row `row` can still be fed before the model's learned positions end (None: no end). A reply may
        be one token longer: its last token is never fed."""
        return self.numbering.room(self.seq.rows[row].bound if self.seq.rows else 0)

    def kept_fraction(self, start: int, end: int, row: int = 0) -> float:
        """Share of positions [start, end) still held, averaged over layers and heads (for /evicted)."""
        return stats.kept_fraction(self, start, end, row)

    def row_stats(self, row: int) -> dict:
        """Seen, kept and evicted tokens of one batch row (per layer and head), for batch records."""
        return stats.row_stats(self, row)
