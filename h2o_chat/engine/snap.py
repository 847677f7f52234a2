"""Question-aware prompt compression in bounded memory (the `snap` policy).

The paper's H2O scores a token by the attention it has received so far, so while a long prompt streams in it
keeps what the text attends to, not what a question at its end will need. SnapKV instead lets the prompt's
last `window` queries (the observation window, usually the question) choose what to keep. Done naively that
needs the whole prompt's keys at once; here it runs in two chunked passes:

1. Probe: prefill the prompt into a throw-away copy of the cache (same budget) only to capture, in every
   layer, the last `window` queries. Peak: two budgets + one chunk.
2. Select: prefill again into the real cache. Every chunk's keys (and the keys already held) are scored by
   those observation queries: logits max-pooled over `kernel` neighbouring positions so a selected token keeps
   its neighbours, normalised by a running log-sum-exp over every key seen, so each query spreads one unit of
   mass as in SnapKV. Eviction during the prompt keeps the highest mass; the window and sinks are protected.
   The observation logits live beside the slots: (B, H, slots, G*window) floats per layer.

Rows of a batch are independent: a row is compressed only if its own tokens overflow the budget (left padding
never counts), and padding queries of a short row take no part in the observation. After the prompt, each held
token's H2O score in a compressed row starts at its observation mass, and generation goes on with plain H2O
eviction. The probe's queries come from a compressed context, so they approximate the queries the full prompt
would give; the cost is a second prefill of the prompt.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from h2o_chat.engine.policies import Snap, observation_mass, pool_logits


class Probe:
    """Pass 1, per layer: the prompt's last `window` scaled queries in the true-position frame, (B, Hq, W, D),
    and their absolute positions (B, W); -1 for padding."""

    def __init__(self, window: int):
        self.window = window
        self.q: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None

    def capture(self, layer, query: torch.Tensor, pos_new: torch.Tensor, scaling: float) -> None:
        q = query * scaling  # (B, Hq, T, D)
        if layer.rolling:  # raw queries: rotate to their true positions, like stored absolute keys
            q = layer.cache.rope.rotate(q, pos_new.clamp(min=0)[:, None, :].expand(*q.shape[:3]))
        q = q if self.q is None else torch.cat((self.q, q), dim=2)
        pos = pos_new if self.pos is None else torch.cat((self.pos, pos_new), dim=1)
        self.q, self.pos = q[:, :, -self.window :].clone(), pos[:, -self.window :].clone()


class Observation:
    """Pass 2, per layer: scores held and new tokens by the probe's queries; lives until the prompt ends."""

    def __init__(self, probe: Probe, policy: Snap, rows: torch.Tensor):
        self.probe, self.policy = probe, policy
        self.rows = rows  # (B,) bool: the rows whose prompt overflows the budget (the others stay plain h2o)
        self.obs: torch.Tensor | None = None  # (B, H, S, Q) pooled logits per slot
        self.lse: torch.Tensor | None = None  # (B, H, Q) log-sum-exp over every prompt key seen
        self._new: torch.Tensor | None = None

    def _logits(self, layer, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) keys at positions pos -> (B, H, Q, N) fp32 logits; empty or padding slots, and keys
        after the observing query (causal, as its real attention), -inf. Rolling layers store raw keys: they
        are rotated to their true positions, the frame of the probe's queries."""
        if layer.rolling:
            keys = layer.cache.rope.rotate(keys, pos.clamp(min=0))
        logits = (self.q @ keys.transpose(-1, -2)).float()
        hidden = (pos < 0)[:, :, None, :] | (pos[:, :, None, :] > self.q_pos[:, None, :, None])
        return logits.masked_fill(hidden, -torch.inf)

    def _start(self, layer) -> None:
        B, Hq, W, D = self.probe.q.shape
        H = layer.num_heads
        self.q = self.probe.q.reshape(B, H, (Hq // H) * W, D).to(layer.dtype)  # groups as in attention
        self.q_pos = self.probe.pos.repeat(1, Hq // H)  # (B, G*W): rows ordered (group head, window step)
        self.q_ok = self.q_pos >= 0  # padding queries of a row shorter than the window observe nothing
        self.protect_from = self.probe.pos.max(-1).values - W + 1  # (B,): the window itself is kept
        held = self._logits(layer, layer.keys, layer.pos)  # tokens held from earlier turns compete too
        self.obs = held.transpose(-1, -2).contiguous()  # (B, H, S, Q)
        self.lse = held.logsumexp(-1)

    def _mass(self, obs: torch.Tensor) -> torch.Tensor:
        return observation_mass(obs, self.lse, self.q_ok)

    def score_new(self, layer, k_new: torch.Tensor, pos_new: torch.Tensor) -> torch.Tensor:
        """Observation logits of a chunk, (B, H, T, Q), pooled over neighbours; updates the log-sum-exp."""
        if self.obs is None:
            self._start(layer)
        logits = self._logits(layer, k_new, pos_new)  # (B, H, Q, T)
        self.lse = torch.logaddexp(self.lse, logits.logsumexp(-1))
        self._new = pool_logits(logits, self.policy.kernel).transpose(-1, -2)
        return self._new

    def priority(self, layer, pos_new: torch.Tensor) -> torch.Tensor:
        """Keep-priority of held slots (spare excluded) then new tokens, (B, H, C+T): observation mass, window
        and sinks kept."""
        C = layer.capacity
        mass = self._mass(torch.cat((self.obs[:, :, :C], self._new), dim=2))
        pos = torch.cat((layer.pos[:, :, :C], pos_new), dim=-1)
        keep = pos >= self.protect_from.view(-1, 1, 1)
        if self.policy.sinks:
            keep |= (pos >= 0) & (pos < self.policy.sinks)
        return mass.masked_fill(keep, torch.inf).masked_fill(pos < 0, -torch.inf)

    def finish(self, layer) -> None:
        """Hand over to H2O: in compressed rows each held token's score starts at its observation mass."""
        if self.obs is not None:
            mass = self._mass(self.obs).masked_fill(layer.pos < 0, 0.0)
            layer.score.copy_(torch.where(self.rows[:, None, None], mass, layer.score))
        layer.observation = None


def h2o_layers(cache) -> list:
    """Every H2OLayer of a cache, in a fixed order (a GroupedCache's layers come group by group)."""
    groups = getattr(cache, "groups", [cache])
    return [layer for g in groups for layer in g.layers]


def compresses(cache) -> bool:
    return any(g.policy.compresses_prompts for g in getattr(cache, "groups", [cache]))


def _overflowing_rows(layer, real: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows whose held tokens plus their real prompt tokens exceed the budget."""
    held = (layer.pos >= 0).sum(-1).max(-1).values if layer.is_initialized else torch.zeros_like(real)
    return held.to(real.device) + real > layer.policy.budget


@torch.inference_mode()
def compress_prompt(
    model,
    cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prefill: Callable[[object, int], torch.Tensor],
) -> torch.Tensor:
    """Prefill a prompt with question-aware selection in the layers whose policy compresses prompts, for the rows
    whose own tokens overflow the budget; returns the last logits. `prefill(cache, passes)` is the plain chunked
    prefill of this prompt into a cache (the probe's copy or the real one); `passes` says how many times the
    prompt will be read in all (for progress)."""
    layers = h2o_layers(cache)
    groups = getattr(cache, "groups", [cache])
    row_groups = getattr(cache, "rows", [input_ids.shape[0]])
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    real = mask.sum(-1)  # (B,) real tokens per row
    per_layer = len(layers) // len(groups)

    overflow: dict[int, torch.Tensor] = {}
    start = 0
    for g, (group, n) in enumerate(zip(groups, row_groups, strict=True)):
        if group.policy.compresses_prompts:
            rows = _overflowing_rows(group.layers[0], real[start : start + n])
            if bool(rows.any()):  # one host sync per prompt
                for i in range(per_layer):
                    overflow[g * per_layer + i] = rows
        start += n
    if not overflow:  # it all fits: nothing to choose
        return prefill(cache, 1)

    probe_cache = copy.deepcopy(cache)
    probe_layers = h2o_layers(probe_cache)
    probes = {i: Probe(layers[i].policy.window) for i in overflow}
    for i, probe in probes.items():
        probe_layers[i].probe = probe
    prefill(probe_cache, 2)
    del probe_cache, probe_layers

    for i, probe in probes.items():
        layers[i].observation = Observation(probe, layers[i].policy, overflow[i])
    try:
        logits = prefill(cache, 2)
    finally:
        for i in overflow:
            if layers[i].observation is not None:
                layers[i].observation.finish(layers[i])
    return logits
