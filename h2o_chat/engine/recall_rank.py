"""What a decode step and a prompt chunk bring back from recall's store (`store.Store`): the ranking of its entries.

A decode step (`Ranking.step`) ranks the stored tokens of each (row, KV head) by their attention logit under the
step's query (the maximum over the group's query heads), takes the `recalled` best, and attends over the held
slots plus those tokens. A prompt chunk (a user's message) recalls too, once for all its queries (`Ranking.chunk`):
twice `recalled` stored tokens, those with the largest logit under any of its real queries, attended by every query
of the chunk beside the held slots (transient: the accelerator holds them while the chunk is read). Both are needed
(measured on the multi-turn recall evaluation's tuning texts at a 10% budget: steps alone kept 0.69 of the
likelihood gain, however many tokens they recalled, chunks alone 0.01, both 0.97, 1.00 when a chunk recalls twice
as many as a step): the answer's own queries are the ones that look for an early fact, but the keys and values of
the question, read as a chunk, must have been computed with the fact in view. Recalled tokens are attended at their
true positions (or at the number the cache renumbered them to: `Store.renumber`) and never enter the slots (nothing
is duplicated; the held set evolves exactly as snap's); their attention mass is not accumulated.

Costs per step and layer: while the store is small, one (G x D) @ (D x stored) product per (row, head), a top-k and
the gather of the recalled tokens' values -- the first half of attention over everything evicted, without its
softmax or values; the step attends with the ranking's own logits of the tokens it recalled (their keys are never
gathered). A store without empty entries (a single row's) is ranked without masks. Reading the stored keys is most
of it once the store is large (they do not stay in the processor's caches), so past `TWO_PASS_FROM` x `CANDIDATES`
x the tokens recalled a step ranks in two passes: the stored keys' coordinates in their `RANK_DIM` principal
directions (per layer, row and KV head; fitted each time the row's tokens double, new entries projected as they
come) choose `CANDIDATES` x the tokens recalled, which are ranked exactly. Each row follows its own schedule (its
own threshold, candidates, basis and refits, from the tokens it holds), so a row recalls what it would alone
whatever its batch neighbours' budgets. It reads a quarter of each stored key's channels plus the candidates' keys,
so a step's cost grows about a third as fast with the store (measured on the embedded model, one CPU thread, budget
512: 1.37x h2o's step at 8,192 tokens seen where exact ranking took 1.76x; see README). On the multi-turn
evaluation it kept the gain (held-out texts, 10% budget: 0.997 with 9/30 hits, exact ranking 0.90 with 4/30).
Cheaper first passes lost the fact: 8 directions (held-out, 10%: 0.79), two candidates per recalled token (tuning
texts, 10%: 0.80), Quest's block bounds in eviction order or by position; so did ranking less often than every step
(every 2nd step with the next 3 tokens of each recalled one kept its gain on the tuning texts, every 4th lost 0.3,
a ranking by the previous step's queries 0.2): the step whose query turns to the fact must find it. SparQ's
approximate first pass over the query's largest channels was measured no faster on CPU (its gathers cost what they
save).

On a CPU each of those operators costs microseconds whatever its size, and a step ran about 17 per layer, two of
them top-k sorts; a store of float32 (the CPU's), float16 or bfloat16 keys (a GPU model's) ranks a step in one call
per layer of `csrc/recall_step.c` instead (`native`: the same ranking in float32 arithmetic, its selections made
without sorting, each head's passes shared by the machine's threads), and falls back to the operators where it
cannot be built or the store is 8-bit or uneven (rows that recall different counts, holes). The C ranking also
lists, during its first pass, the entries that score at least a threshold the same layer and head left at its last
step, and takes the candidates from that list when it holds enough (the same entries: every one above the k-th
best is in it), which spares ranking every entry again.

A chunk's ranking is a (G T x D) @ (D x stored) product, in blocks of queries: what a full cache's attention over
the same tokens costs. On CUDA the store stays on the host, so a step sends each layer's query down and the recalled
tokens up (eager steps: the store grows every step, which a captured graph cannot follow).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from h2o_chat.engine import native

CHUNK_TIMES = 2  # a prompt chunk recalls this many times what a step recalls
RANK_DIM = 16  # principal directions of the stored keys whose coordinates a step's first ranking pass reads
CANDIDATES = 4  # a step ranks exactly this many times what it recalls: the first pass's best
TWO_PASS_FROM = 2  # ... once the store holds this many times the candidates (below, one exact pass costs less)
# the C ranking's store dtypes (`csrc/recall_step.c`'s kinds): keys and values as the model makes them
NATIVE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# the stored keys' coordinates in the basis, whatever the keys' dtype: the first pass reads every entry's
# coordinates each step, and its bytes are its cost; it only chooses candidates (ranked exactly after), which
# bf16's 8 bits of mantissa do not change (measured: the multi-turn evaluation's gain as with fp32), and a bf16
# widens to fp32 by a shift (the C ranking; the operators widen a layer's coordinates first)
LOW_DTYPE = torch.bfloat16
RANK_BLOCK = 1 << 19  # (queries x stored) logits ranked at once by a prompt chunk: 2 MB in fp32, reduced while
# still in the processor's cache (blocks of 64 MB, written out to memory and read back, took twice as long)


def rank_dim_for(key_dim: int) -> int:
    """Principal coordinates kept per stored key for the two-pass ranking (0: exact ranking only, for keys too
    small to gain from it)."""
    return RANK_DIM if key_dim > RANK_DIM else 0


class Recalled(NamedTuple):
    """What a layer's queries bring back from the store, on the queries' device: the stored tokens' values (B, H,
    R, Dv) and whether each is a token (B, H, R; None: every one is). A prompt chunk gets their keys (B, H, R, D)
    to attend with; a decode step gets their logits (B, H, G, R), unscaled, from its own ranking (the step's
    query is the one that ranked them: taking the logits from there spares gathering the keys and a product)."""

    keys: torch.Tensor | None
    values: torch.Tensor
    valid: torch.Tensor | None
    logits: torch.Tensor | None = None


class Ranking:
    """How one store's entries are ranked: per row, when it ranks in two passes and on which basis (the stored
    keys' principal directions, (L, B, H, D, rank_dim), whose coordinates the store keeps in `low`), and the C
    ranking's prepared calls. It reads the store's buffers; the store tells it when rows move (`rows`, `put_row`,
    `clear_row`, `clear`), entries arrive (`appended`) or keys turn (`renumbered`)."""

    def __init__(self, store) -> None:
        self.store = weakref.proxy(store)  # (no cycle: the host buffers go when the cache drops its store)
        self.rank_dim = store.rank_dim
        self.candidates = CANDIDATES if self.rank_dim else 0  # 0: every stored key ranked exactly
        self.basis: torch.Tensor | None = None  # (`fit`; rows never fitted keep zeros: their coordinates go unread)
        # per row, so that a row ranks as it would alone whatever its batch neighbours recall (evaluations compare
        # budgets as rows of one batch): the row's tokens when its basis was last fitted (0: never)
        self.fitted = torch.zeros(store.shape[1], dtype=torch.long)
        self.use_c: bool | None = None  # a step ranks in one C call per layer (`native`): None until the first asks
        self.calls: dict[int, tuple] = {}  # per layer, what its C calls pass but the step (`_native_call`)
        self._version = store.version  # the store's buffers the calls point into
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # the C ranking's, shared by every layer
        self.listed = 0  # (layer, row, head) rankings whose candidates the last step's threshold listed (C ranking)
        self._ones: torch.Tensor | None = None
        self.schedule()

    # -- each row's schedule -----------------------------------------------------------------------
    def schedule(self) -> None:
        """What follows from each row's recall count (`store.recalled`, B): tokens brought back per step (rows
        with fewer mask theirs) and from how many held tokens a row ranks in two passes (-1: it does not recall)."""
        per_row = self.store.recalled
        self.select = int(per_row.max())
        self.uniform = bool((per_row == self.select).all())  # every row recalls as many
        self.two_from = torch.where(per_row > 0, TWO_PASS_FROM * CANDIDATES * per_row, -1)
        self.set_two()

    def set_two(self) -> None:
        """Which rows rank in two passes: None for none, True for all, else a (B,) mask; kept rather than derived
        in every layer of every step."""
        two = (self.fitted > 0) & (self.store.row_tokens > self.two_from)
        self.two = None if not (self.candidates and bool(two.any())) else True if bool(two.all()) else two

    def appended(self, c0: int, c1: int) -> None:
        """Entries c0..c1 were stored: their coordinates in the basis; a row's basis is fitted again (on every key
        it stored) each time its tokens have doubled since it was last fitted, once it is past its threshold."""
        if not self.candidates:
            return
        s = self.store
        if self.basis is not None:
            s.low[..., c0:c1] = self.basis.mT @ s.keys[:, :, :, c0:c1].float().mT
        due = (s.row_tokens > self.two_from) & (s.row_tokens >= 2 * self.fitted) & (s.recalled > 0)
        if bool(due.any()):
            self.fit(due.nonzero().flatten())
        self.set_two()

    def fit(self, rows: torch.Tensor) -> None:
        """Per layer, row (of `rows`) and KV head: the `rank_dim` directions along which the stored keys vary most
        (the top eigenvectors of their uncentred second moment, D x D), and every stored key's coordinates in them.
        One layer at a time (the transient is one layer's keys in fp32); it reads the row's whole store, and runs
        each time the row's tokens double: amortized, a constant cost per stored token."""
        s = self.store
        n, (L, B, H) = s.count, s.shape
        if self.basis is None:
            self.basis = torch.zeros(L, B, H, s.D, self.rank_dim)
        for i in range(L):
            keys = s.keys[i, rows, :, :n].float() * ~s.empty[i, rows, :, :n, None]  # nothing from empty ones
            vectors = torch.linalg.eigh(keys.mT @ keys).eigenvectors  # eigenvalues ascend
            basis = vectors[..., -self.rank_dim :]
            self.basis[i, rows] = basis
            s.low[i, rows, :, :, :n] = (basis.mT @ keys.mT).to(LOW_DTYPE)
        self.fitted[rows] = s.row_tokens[rows]
        self.calls = {}  # a new basis (and its first pass's thresholds are stale)

    def renumbered(self, rows: torch.Tensor) -> None:
        """The keys of rows `rows` ((B,) bool) were turned: their coordinates are fitted again."""
        fitted = ((self.fitted > 0) & rows).nonzero().flatten()
        if len(fitted):
            self.fit(fitted)

    def rows(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (the store kept its own)."""
        if self.basis is not None:
            self.basis = self.basis.index_select(1, index)
        self.fitted = self.fitted.index_select(0, index)
        self.schedule()

    def put_row(self, r: int, other: Ranking) -> None:
        """Row r takes the one row of `other` (`Store.put_row`)."""
        if other.basis is not None and self.basis is None:
            self.basis = torch.zeros(*self.store.shape, self.store.D, self.rank_dim)
        if self.basis is not None:  # (a row never fitted has zeros: its coordinates are not read)
            self.basis[:, r] = 0 if other.basis is None else other.basis[:, 0]
        self.fitted[r] = other.fitted[0]
        self.set_two()

    def clear_row(self, r: int) -> None:
        self.fitted[r] = 0
        self.set_two()

    def clear(self) -> None:
        self.basis, self.calls = None, {}
        self.fitted.zero_()
        self.set_two()

    # -- ranking -----------------------------------------------------------------------------------
    def chunk(self, i: int, query: torch.Tensor, real: torch.Tensor | None) -> Recalled:
        """Layer i's prompt-chunk queries (B, Hq, T, D) -> the stored tokens with the largest logit under any of
        the real ones (`real` (B, T); every query when None), with their keys. The (queries x stored) logits are
        taken `RANK_BLOCK` at a time: a long prompt chunk never holds them all at once."""
        s = self.store
        n, (_, B, H), D, T = s.count, s.shape, s.D, query.shape[2]
        q = query.to(s.device, s.dtype).reshape(B, H, -1, T, D)  # query heads grouped by their KV head
        G, keys = q.shape[2], s.keys[i, :, :, :n].mT
        skip = None if real is None else ~real.to(s.device)[:, None, None, :, None]  # padding queries
        step = max(1, RANK_BLOCK // max(1, B * H * G * n))
        best = None
        for t in range(0, T, step):
            qs = q[:, :, :, t : t + step]
            part = (qs.flatten(2, 3) @ keys).float().view(B, H, G, qs.shape[3], n)
            if skip is not None:
                part.masked_fill_(skip[:, :, :, t : t + step], -torch.inf)
            part = part.amax((2, 3))
            best = part if best is None else torch.maximum(best, part)
        best.masked_fill_(s.empty[i, :, :, :n], -torch.inf)  # (B, H, n)
        many = 1 if real is None else CHUNK_TIMES  # a chunk's queries are many and want different tokens
        k = min(self.select * many, n)
        top = best.topk(k, dim=-1)
        valid = (top.values > -torch.inf) & (torch.arange(k) < many * s.recalled[:, None, None])
        flat = self._mark(i, top.indices.flatten(0, 1), valid.flatten(0, 1))
        keys = s.keys[i].view(-1, D).index_select(0, flat).view(B, H, -1, D)
        values = s.values_at(i, flat)
        return Recalled(*(t.to(query.device) for t in (keys, values, valid)))

    def step(self, i: int, query: torch.Tensor) -> Recalled:
        """Layer i's decode-step query (B, Hq, 1, D) -> what it attends to most, in as few operations as it takes
        (it runs in every layer of every step; on CPU each operation costs microseconds whatever its size): one
        (G x D) @ (D x stored) product per (row, head), its maximum over the group, a top-k, the recall marks and a
        gather of the values; the recalled tokens' logits are the ranking's own. Without holes (padding, rows that
        do not recall) every ranked entry is a token: nothing is masked and the validity is None. A large store is
        ranked in two passes (see the module's docstring)."""
        s = self.store
        n, (_, B, H), device = s.count, s.shape, query.device
        BH, N, D = B * H, s.capacity, s.D
        k = min(self.select, n)
        if self.use_c is None:
            self.use_c = s.dtype in NATIVE_KINDS and not s.quant and native.available()
        if query.device != s.device or query.dtype != s.dtype:
            query = query.to(s.device, s.dtype)  # (the C ranking widens it: the operators' numbers)
        if self.use_c and self.uniform and not s.holes and (self.two is None or self.two is True):
            return self._native_step(i, query.float(), k, device)
        q, keys, empty = query.view(BH, -1, D), s.keys[i].view(BH, N, D), s.empty[i].view(BH, N)
        if self.two is None:
            tok, logits, best = self._exact(q, keys, empty, n, k)
        elif self.two is True:
            tok, logits, best = self._two_pass(i, q, keys, empty, n, k)
        else:  # a batch whose rows rank each as it would alone (evaluations): both rankings, each row its own
            chosen = [self._exact(q, keys, empty, n, k), self._two_pass(i, q, keys, empty, n, k)]
            by_row = self.two.repeat_interleave(H)  # (BH,)
            tok, logits, best = (
                torch.where(by_row.view(-1, *[1] * (a.dim() - 1)), b, a) for a, b in zip(*chosen, strict=True)
            )
        valid = None
        if s.holes or not self.uniform:
            valid = best > -torch.inf
            if not self.uniform:  # rows that recall fewer (or none) mask the rest
                valid &= torch.arange(k) < s.recalled.repeat_interleave(H)[:, None]
        values = s.values_at(i, self._mark(i, tok, valid))
        logits = logits.view(B, H, -1, k).float()
        if valid is not None:
            valid = valid.view(B, H, k)
        if device != s.device:
            values, logits = values.to(device), logits.to(device)
            valid = None if valid is None else valid.to(device)
        return Recalled(None, values, valid, logits)

    def _native_step(self, i: int, query: torch.Tensor, k: int, device: torch.device) -> Recalled:
        """`step` in one call of `csrc/recall_step.c` (every row recalls as many, nothing to mask): the same
        ranking (two passes when `two`, else exact), its selections made without sorting."""
        s = self.store
        if self._version != s.version:  # its buffers were replaced, or their entries moved or turned
            self.calls, self._version = {}, s.version
        n, two = s.count, self.two is True
        G = query.shape[1] // s.shape[2]
        call = self.calls.get(i)
        if call is None or call[0] != (two, k, G):
            call = self.calls[i] = self._native_call(i, two, k, G)
        _, step, logits, values = call
        many = min(self.candidates * self.select, n) if two else n
        q = query.to("cpu", torch.float32).contiguous()  # a name: the pointer handed over stays valid
        self.listed += step(q, n, many, torch.get_num_threads())
        if device != s.device or values.dtype != s.dtype:  # (values come out in float32)
            values, logits = values.to(device, s.dtype), logits.to(device)
        return Recalled(None, values, None, logits)

    def _native_call(self, i: int, two: bool, k: int, G: int) -> tuple:
        """What layer i's calls pass but the step (sizes, buffers, scratch, each (row, head)'s threshold for its
        next first pass) and the outputs they write (the step's attention reads them before the next call for
        this layer: each layer's are reused); kept until the store's buffers change or the call does. The scratch
        is one for all layers (they rank one after the other): when it must grow, every layer's call is prepared
        again."""
        s = self.store
        (_, B, H), N = s.shape, s.capacity
        BH = B * H
        logits, values = torch.empty(B, H, G, k), torch.empty(B, H, k, s.Dv)
        if self._scratch is None or self._scratch[0].numel() < BH * (G + 2) * N:
            self.calls = {}  # they point at the scratch replaced
            self._scratch = torch.empty(BH * (G + 2) * N), torch.empty(BH * 3 * N, dtype=torch.int32)
        step = native.RecallStep(
            G=G, k=k, basis=self.basis[i] if two else None, low=s.low[i] if two else None, keys=s.keys[i],
            values=s.values[i], marks=s.marks[i], thresholds=torch.full((BH,), torch.nan), out_logits=logits,
            out_values=values, scratch=self._scratch,
        )  # fmt: skip
        return (two, k, G), step, logits, values

    def _exact(self, q, keys, empty, n: int, k: int):
        """Every stored key ranked by its logit: the k best entries (BH, k), their logits (BH, G, k) and each
        one's ranking value (-inf: nothing there)."""
        logits = torch.bmm(q, keys[:, :n].mT)  # (BH, G, n)
        return _best(logits, None, empty[:, :n] if self.store.holes else None, k, not self.uniform)

    def _two_pass(self, i: int, q, keys, empty, n: int, k: int):
        """The keys' coordinates in the basis choose `candidates` x what a row recalls (its own count: a row
        ranks as it would alone), which are ranked exactly; as `_exact`."""
        s = self.store
        BH, N, D, r = q.shape[0], keys.shape[1], s.D, self.rank_dim
        many, qf = min(self.candidates * self.select, n), q.float()
        approx = torch.bmm(torch.bmm(qf, self.basis[i].view(BH, D, r)), s.low[i].view(BH, r, N)[:, :, :n].float())
        approx = approx.amax(1)
        if s.holes:
            approx.masked_fill_(empty[:, :n], -torch.inf)
        cand = approx.topk(many, dim=-1, sorted=not self.uniform).indices  # (BH, many)
        near = keys.reshape(-1, D).index_select(0, (cand + s.offsets).view(-1)).view(BH, many, D)
        logits = torch.bmm(qf, near.float().mT)  # (BH, G, many)
        emptied = empty.gather(1, cand) if s.holes else None
        if not self.uniform:  # a row that recalls fewer ranks only its own number of candidates (the best first)
            own = self.candidates * s.recalled.repeat_interleave(s.shape[2])
            beyond = torch.arange(many) >= own[:, None]
            emptied = beyond if emptied is None else emptied | beyond
        return _best(logits, cand, emptied, k, not self.uniform)

    def _mark(self, i: int, tok: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Count layer i's stored entries `tok` (B H, R) as recalled (each valid one, `Store.take_counts`); their
        flat indices into the layer's buffers (B H R,)."""
        marks = self.store.marks[i].view(tok.shape[0], -1)
        if valid is None:
            if self._ones is None or self._ones.shape != tok.shape:
                self._ones = torch.ones(tok.shape, dtype=torch.int32)
            marks.scatter_add_(1, tok, self._ones)
        else:
            marks.scatter_add_(1, tok, valid.int())
        return (tok + self.store.offsets).view(-1)  # one index_select per buffer


def _best(logits, cand, emptied, k: int, ordered: bool):
    """The k entries with the largest logit under any query head of the group (BH, k) (`cand`: the ranked entries'
    indices; None: all of them in order), their logits (BH, G, k) and ranking values (BH, k); `ordered`: best first
    (rows that recall fewer than k keep their first ones)."""
    bound = logits.amax(1)
    if emptied is not None:
        bound.masked_fill_(emptied, -torch.inf)
    top = bound.topk(k, dim=-1, sorted=ordered)
    logits = logits.gather(2, top.indices[:, None, :].expand(-1, logits.shape[1], -1))
    tok = top.indices if cand is None else cand.gather(1, top.indices)
    return tok, logits, top.values
