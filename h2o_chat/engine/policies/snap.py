"""Question-aware prompt compression in bounded memory (the `snap` policy).

The paper's H2O scores a token by the attention it has received so far, so while a long prompt streams in it
keeps what the text attends to, not what a question at its end will need. SnapKV instead lets the prompt's
last `window` queries (the observation window, usually the question) choose what to keep. Done naively that
needs the whole prompt's keys at once; here it runs in two chunked passes:

1. Probe: prefill the whole prompt into a throw-away copy of the cache (same budget, evicting as h2o does) only
   to capture, in every layer, the last `window` queries. Peak: two budgets + one chunk. The probe reads the whole
   prompt, not only its end: the final queries of a question must have read the text to look for what it asks
   (issue 41.7: a probe of the last chunk alone lost needles the whole-prompt probe finds, for half the prompt
   time; docs/policies.md has the measurement).
2. Select: prefill again into the real cache. Every chunk's keys (and the keys already held) are scored by
   those observation queries: logits max-pooled over `kernel` neighbouring positions so a selected token keeps
   its neighbours, normalised by a running log-sum-exp over every key seen, so each query spreads one unit of
   mass as in SnapKV. Eviction during the prompt keeps the highest mass; the window and sinks are protected.
   The observation logits live beside the slots (an extra per-slot buffer, (L, B, H, S, G*window) floats) and
   move with them. The attention mass is not tracked in this pass for rows being compressed: their H2O
   scores start from the observation mass when the prompt ends.

Rows of a batch are independent: a row is compressed only if its own tokens overflow its budget (left padding
never counts), and padding queries of a short row take no part in the observation. Scoring happens in the
true-position frame: after positions were renumbered (past the trained context), keys and queries are rotated
back to their true positions first. The probe's queries come from a compressed context, so they approximate the
queries the full prompt would give; the cost is a second prefill of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator

import torch

from h2o_chat.engine.policies import INF, Snap, pool_logits


def _true_frame(cache, x: torch.Tensor, pos: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Keys or queries (..., N, D) rotated at `rot`, moved to their true positions `pos` (..., N)."""
    if not cache.seq.renumbered:
        return x
    return cache.rope.rotate_by(x, torch.where(pos >= 0, pos - rot, 0))


class Probe:
    """Pass 1: per layer, the prompt's last `window` scaled queries in the true-position frame, (B, Hq, W, D),
    and their positions (B, W); -1 for padding. Captures only in the chunks that can hold those columns."""

    def __init__(self, cache, window: int, last_column: int):
        self.cache, self.window, self.last_column = cache, window, last_column
        self.q: list[torch.Tensor | None] = [None] * len(cache.layers)
        self.pos: torch.Tensor | None = None

    def capture(self, i: int, q: torch.Tensor, rot_new: torch.Tensor, pos_new: torch.Tensor) -> None:
        if self.cache.seq.columns <= self.last_column - self.window:  # this chunk ends before the window starts
            return
        q = _true_frame(self.cache, q, pos_new[:, None, :], rot_new[:, None, :])
        if self.q[i] is not None:
            q = torch.cat((self.q[i], q), dim=2)
        self.q[i] = q[:, :, -self.window :].clone()
        if i == 0:
            pos = pos_new if self.pos is None else torch.cat((self.pos, pos_new), dim=1)
            self.pos = pos[:, -self.window :].clone()


class Observation:
    """Pass 2: scores held and new tokens by the probe's queries; lives until the prompt ends.

    `rows` (B,) bool: the rows whose prompt overflows the budget (the others stay plain h2o); `windows` (B,):
    each row's observation window (rows of an evaluation may differ)."""

    def __init__(self, probe: Probe, cache, rows: torch.Tensor, windows: torch.Tensor, kernel: int, track_mass: bool):
        self.cache, self.rows, self.kernel = cache, rows, kernel
        self.all_rows = bool(rows.all())  # host-known once per prompt
        self.track_mass = track_mass  # rows left to plain h2o still need their attention mass in this pass
        self.probe, self.windows = probe, windows
        self.q: list[torch.Tensor] = []
        self.new_obs: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        # a CPU batch's rows are scored each alone, in the shapes they have alone (set at the first chunk)
        self.by_row = False

    def _each_row(self, fn: Callable[..., torch.Tensor], *xs: torch.Tensor, dim: int) -> torch.Tensor:
        """`fn` of tensors whose dim `dim` is the batch row; in a CPU batch, of each row's alone, contiguous as
        alone (`score_chunk` says why), the rows' results concatenated."""
        if not self.by_row:
            return fn(*xs)
        rows = xs[0].shape[dim]
        return torch.cat([fn(*(x.narrow(dim, b, 1).contiguous() for x in xs)) for b in range(rows)], dim=dim)

    def _start(self) -> None:
        """At the first chunk of pass 2 (storage exists from its first update): queries grouped as in attention,
        and the tokens held from earlier turns scored too (their logits unpooled), with the log-sum-exp so far."""
        s, probe = self.cache.slots, self.probe
        L, B, H = s.keys.shape[:3]
        W = probe.q[0].shape[2]  # the window, or the whole prompt when it is shorter
        G = probe.q[0].shape[1] // H
        self.q = [q.reshape(B, H, G * W, -1).to(s.dtype) for q in probe.q]
        self.q_pos = probe.pos.repeat(1, G)  # (B, G*W): query rows ordered (group head, window step)
        in_window = torch.arange(W, device=self.rows.device) >= W - self.windows[:, None]  # (B, W): a row's own
        self.q_ok = ((probe.pos >= 0) & in_window).repeat(1, G)  # padding queries of a short row observe nothing
        self.protect_from = probe.pos.max(-1).values - self.windows + 1  # (B,): the window itself is kept
        if self.by_row:
            rows = [slice(b, b + 1) for b in range(B)]
            held = torch.stack(
                [
                    torch.cat([self._logits(i, s.read("keys", (i,))[b], s.pos[i, b], s.rot[i, b], b) for b in rows])
                    for i in range(L)
                ]
            )  # (L, B, H, Q, S)
        else:
            held = torch.stack([self._logits(i, s.read("keys", (i,)), s.pos[i], s.rot[i]) for i in range(L)])
        self.lse = self._each_row(lambda x: x.logsumexp(-1), held, dim=1)  # (L, B, H, Q)
        s.extra = [held.transpose(-1, -2).contiguous()]  # (L, B, H, S, Q), moved with the slots

    def _logits(
        self, i: int, keys: torch.Tensor, pos: torch.Tensor, rot: torch.Tensor, rows: slice | None = None
    ) -> torch.Tensor:
        """(B, H, N, D) keys of layer i -> (B, H, Q, N) fp32 logits; empty slots, padding and keys after the
        observing query (causal, as its real attention) are -inf. `rows`: the batch rows the keys are of (None:
        all)."""
        keys = _true_frame(self.cache, keys, pos, rot)
        q, q_pos = (self.q[i], self.q_pos) if rows is None else (self.q[i][rows], self.q_pos[rows])
        logits = (q @ keys.transpose(-1, -2)).float()
        hidden = (pos < 0)[:, :, None, :] | (pos[:, :, None, :] > q_pos[:, None, :, None])
        return logits.masked_fill(hidden, -torch.inf)

    def score_chunk(self, i: int, key: torch.Tensor, fwd) -> None:
        """Layer i's chunk keys (B, H, T, D): pooled observation logits into `new_obs`, the log-sum-exp updated.

        A CPU batch's rows (`fwd.rows`) are scored one by one over their own columns, in the shapes they have
        alone (as `forward.own_rows` attends them), and so are their log-sum-exps and masses: a row then gets
        the bits it gets alone. Over the padded batch they came out in other last bits: a left-padded row's keys
        sit in other vector lanes, and PyTorch computes `exp` and `log` of a tensor's last few elements (its
        tail) with other code than the rest, so a row's values moved with the rows beside it. An eviction by
        those scores could go another way."""
        if self.lse is None:
            self.by_row = bool(fwd.rows)
            self._start()
        B, H, T, _ = key.shape
        if i == 0:
            self.new_obs = torch.empty(len(self.q), B, H, T, self.q[0].shape[2], device=key.device)
        pos = fwd.pos_new[:, None, :].expand(B, H, T)
        rot = fwd.rot_new[:, None, :].expand(B, H, T)
        if fwd.rows:
            logits = key.new_full((B, H, self.q[0].shape[2], T), -torch.inf, dtype=torch.float32)
            lse = torch.full(logits.shape[:-1], -torch.inf, device=key.device)
            for row in fwd.rows:
                b, own = slice(row.row, row.row + 1), slice(T - row.tokens, T)
                if row.tokens:  # none of its tokens in this chunk: alone it has no such chunk
                    got = self._logits(i, key[b, :, own], pos[b, :, own], rot[b, :, own], b)
                    logits[b, ..., own], lse[b] = got, got.logsumexp(-1)
        else:
            logits = self._logits(i, key, pos, rot)  # (B, H, Q, T)
            lse = logits.logsumexp(-1)
        self.lse[i] = self._each_row(torch.logaddexp, self.lse[i], lse, dim=0)
        self.new_obs[i] = pool_logits(logits, self.kernel).transpose(-1, -2)

    def _mass(self, obs: torch.Tensor) -> torch.Tensor:
        """(L, B, H, N, Q) logits -> (L, B, H, N) softmax mass summed over each row's real window queries."""

        def mass(obs: torch.Tensor, lse: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
            return (obs - lse[:, :, :, None, :]).exp().masked_fill(~ok[0, :, None, None, :], 0.0).sum(-1)

        return self._each_row(mass, obs, self.lse, self.q_ok[None], dim=1)

    def priority(self, cache, new) -> torch.Tensor:
        """Keep-priority of held slots then new tokens, (L, B, H, C + T): observation mass in observed rows (the
        window and sinks kept), the rules' priority elsewhere."""
        s = cache.slots
        C, (L, B, H, T) = s.capacity, new.score.shape
        pos = torch.cat((s.pos[..., :C], new.pos[None, :, None, :].expand(L, B, H, T)), dim=-1)
        mass = self._mass(torch.cat((s.extra[0][..., :C, :], self.new_obs), dim=3))
        keep = pos >= self.protect_from[:, None, None]
        if cache.rules.any_protected_sinks:
            keep |= (pos >= 0) & (pos < cache.rules.sinks[:, None, None])
        observed = cache.rules.within_limits(mass.masked_fill(keep, INF).masked_fill(pos < 0, -INF), stored=C)
        if self.all_rows:
            return observed
        newest = new.pos.max(-1).values.clamp(min=0).maximum(s.seen - 1)
        plain = cache.rules.priority(torch.cat((s.score[..., :C], new.score), dim=-1), pos, newest, stored=C)
        return torch.where(self.rows[:, None, None], observed, plain)

    def finish(self) -> None:
        """Hand over to H2O: in compressed rows each held token's score starts at its observation mass."""
        s = self.cache.slots
        if self.lse is None:  # pass 2 never began (interrupted)
            return
        mass = self._mass(s.extra[0]).masked_fill(s.pos < 0, 0.0)
        s.score.copy_(torch.where(self.rows[:, None, None], mass, s.score))
        s.extra = []


def _overflowing_rows(cache, real: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows following a policy that compresses prompts whose held plus real prompt tokens exceed
    their budget."""
    B = real.shape[0]
    held = cache.slots.held() if cache.slots is not None else torch.zeros_like(real)
    compress, budgets = [], []
    groups = cache.row_groups(B)
    for g in groups:
        compress.append(g.policy.compresses_prompts)
        budgets.append(g.policy.capacity or 0)
    compress = torch.tensor(compress, device=real.device)
    budgets = torch.tensor(budgets, device=real.device)
    return compress & (held.to(real.device) + real > budgets)


def columns_read(cache, tokens: int) -> int:
    """Columns a prompt of `tokens` will be read for in all, known on the host before reading it: snap reads
    an overflowing prompt twice, its probe then the read that keeps (progress bars show both from the start)."""
    budgets = [g.policy.capacity for g in cache.groups if g.policy.compresses_prompts]
    if not budgets or min(min(budgets), cache.seq.columns) + tokens <= min(budgets):
        return tokens
    return 2 * tokens


@torch.inference_mode()
def compress_prompt(cache, mask: torch.Tensor, prefill: Callable[..., Iterator]) -> Generator:
    """Prefill a prompt with question-aware selection for the rows whose policy compresses prompts and whose
    own tokens overflow the budget; a generator that yields after each chunk read (over both passes) and returns
    the last logits. `mask` (B, L) marks the prompt's real tokens; `prefill(cache, total)` is the plain chunked
    prefill of the prompt into a cache (the probe's copy or the real one), a generator likewise, `total` the
    columns read over every pass (for progress)."""
    L = mask.shape[1]
    rows = _overflowing_rows(cache, mask.sum(-1))
    if not bool(rows.any()):  # it all fits: nothing to choose (one host sync per prompt)
        return (yield from prefill(cache, L))
    groups = cache.row_groups(mask.shape[0])
    snaps = [g.policy for g in groups if isinstance(g.policy, Snap)]
    kernels = {p.kernel for p in snaps}
    if len(kernels) > 1:
        raise ValueError("rows of one batch compress prompts with one pooling kernel")
    windows = torch.tensor([g.policy.window if isinstance(g.policy, Snap) else 1 for g in groups], device=mask.device)
    window = int(windows.max())
    # every row's probe reads its whole prompt, evicting as h2o does at its own budget, as it would alone
    probe_cache = cache.fork()
    probe_cache.probe = Probe(probe_cache, window, cache.seq.columns + L)
    yield from prefill(probe_cache, 2 * L)
    probe = probe_cache.probe
    del probe_cache

    plain = [not r and g.policy.by_score for g, r in zip(groups, rows.tolist(), strict=True)]
    cache.observation = Observation(probe, cache, rows, windows, kernels.pop(), track_mass=any(plain))
    try:
        return (yield from prefill(cache, 2 * L))
    finally:
        cache.observation.finish()
        cache.observation = None
