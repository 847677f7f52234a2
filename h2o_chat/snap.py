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
   The observation logits live beside the slots: (B, H, budget + chunk, G*window) floats per layer.

After the prompt, each held token's H2O score starts at its observation mass and generation goes on with
plain H2O eviction. The probe's queries come from a compressed context, so they approximate the queries the
full prompt would give; the cost is a second prefill of the prompt.
"""

from __future__ import annotations

import copy

import torch

from h2o_chat.policies import Snap, observation_mass, pool_logits


class Probe:
    """Pass 1, per layer: the prompt's last `window` scaled queries in the true-position frame, (B, Hq, W, D),
    and their absolute positions (B, W)."""

    def __init__(self, window: int):
        self.window = window
        self.q: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None

    def capture(self, layer, query: torch.Tensor, pos_new: torch.Tensor, scaling: float) -> None:
        q = query * scaling  # (B, Hq, T, D)
        if layer.rolling:  # raw queries: rotate to their true positions, like stored absolute keys
            q = layer.rope.rotate(q, pos_new.clamp(min=0)[:, None, :].expand(*q.shape[:3]))
        q = q if self.q is None else torch.cat((self.q, q), dim=2)
        pos = pos_new if self.pos is None else torch.cat((self.pos, pos_new), dim=1)
        self.q, self.pos = q[:, :, -self.window :].clone(), pos[:, -self.window :].clone()


class Observation:
    """Pass 2, per layer: scores held and new tokens by the probe's queries; lives until the prompt ends."""

    def __init__(self, probe: Probe, policy: Snap):
        self.probe, self.policy = probe, policy
        self.obs: torch.Tensor | None = None  # (B, H, cap, Q) pooled logits per slot
        self.lse: torch.Tensor | None = None  # (B, H, Q) log-sum-exp over every prompt key seen
        self._new: torch.Tensor | None = None

    def _logits(self, layer, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) keys at positions pos -> (B, H, Q, N) fp32 logits; empty or padding slots, and keys
        after the observing query (causal, as its real attention), -inf. Rolling layers store raw keys: they
        are rotated to their true positions, the frame of the probe's queries."""
        if layer.rolling:
            keys = layer.rope.rotate(keys, pos.clamp(min=0))
        logits = (self.q @ keys.transpose(-1, -2)).float()
        hidden = (pos < 0)[:, :, None, :] | (pos[:, :, None, :] > self.q_pos[:, None, :, None])
        return logits.masked_fill(hidden, -torch.inf)

    def _start(self, layer) -> None:
        B, Hq, W, D = self.probe.q.shape
        H = layer.num_heads
        self.q = self.probe.q.reshape(B, H, (Hq // H) * W, D).to(layer.dtype)  # groups as in attention
        self.q_pos = self.probe.pos.repeat(1, Hq // H)  # (B, G*W): rows ordered (group head, window step)
        self.protect_from = self.probe.pos.max(-1).values - W + 1  # (B,): the window itself is kept
        n = layer.n
        self.obs = torch.full((B, H, layer.capacity, self.q.shape[2]), -torch.inf, device=layer.device)
        if n:  # tokens held from earlier turns compete too
            held = self._logits(layer, layer.keys[:, :, :n], layer.pos[:, :, :n])
            self.obs[:, :, :n] = held.transpose(-1, -2)
            self.lse = held.logsumexp(-1)
        else:
            self.lse = torch.full((B, H, self.q.shape[2]), -torch.inf, device=layer.device)

    def score_new(self, layer, k_new: torch.Tensor, pos_new: torch.Tensor) -> torch.Tensor:
        """Observation logits of a chunk, (B, H, T, Q), pooled over neighbours; updates the log-sum-exp."""
        if self.obs is None:
            self._start(layer)
        logits = self._logits(layer, k_new, pos_new)  # (B, H, Q, T)
        self.lse = torch.logaddexp(self.lse, logits.logsumexp(-1))
        self._new = pool_logits(logits, self.policy.kernel).transpose(-1, -2)
        return self._new

    def priority(self, layer, pos_new: torch.Tensor) -> torch.Tensor:
        """Keep-priority of held slots then new tokens, (B, H, n+T): observation mass, window and sinks kept."""
        n = layer.n
        mass = observation_mass(torch.cat((self.obs[:, :, :n], self._new), dim=2), self.lse)
        pos = torch.cat((layer.pos[:, :, :n], pos_new), dim=-1)
        keep = pos >= self.protect_from.view(-1, 1, 1)
        if self.policy.sinks:
            keep |= (pos >= 0) & (pos < self.policy.sinks)
        return mass.masked_fill(keep, torch.inf).masked_fill(pos < 0, -torch.inf)

    def finish(self, layer) -> None:
        """Hand over to H2O: each held token's score starts at its observation mass."""
        n = layer.n
        if self.obs is not None and n:
            mass = observation_mass(self.obs[:, :, :n], self.lse)
            layer.score[:, :, :n] = mass.masked_fill(layer.pos[:, :, :n] < 0, 0.0)
        layer.observation = None


def h2o_layers(cache) -> list:
    """Every H2OLayer of a cache, in a fixed order (a GroupedCache's layers hold one per group)."""
    return [sub for layer in cache.layers for sub in getattr(layer, "subs", [layer])]


def compresses(cache) -> bool:
    return any(layer.policy.compresses_prompts for layer in h2o_layers(cache))


@torch.inference_mode()
def compress_prompt(model, cache, input_ids: torch.Tensor, attention_mask, chunk_size: int, prefill, *, progress=None):
    """Prefill a prompt with question-aware selection in the layers whose policy compresses prompts and whose
    budget the prompt overflows (every layer of an H2OCache, or some groups of a GroupedCache); returns the
    last logits. `prefill` is the plain chunked prefill (passed in to keep this module free of the loop).
    `progress(done, total)`: the two passes are one bar over twice the prompt's tokens."""
    layers = h2o_layers(cache)

    def overflows(layer) -> bool:
        held = layer.n if layer.is_initialized else 0
        return layer.policy.compresses_prompts and held + input_ids.shape[1] > layer.policy.budget

    chosen = [i for i, layer in enumerate(layers) if overflows(layer)]
    if not chosen:  # it all fits: nothing to choose
        return prefill(model, cache, input_ids, attention_mask, chunk_size, progress=progress)
    first = second = None
    if progress is not None:
        first, second = (lambda d, t: progress(d, 2 * t)), (lambda d, t: progress(t + d, 2 * t))

    probe_cache = copy.deepcopy(cache)
    probe_layers = h2o_layers(probe_cache)
    probes = {i: Probe(layers[i].policy.window) for i in chosen}
    for i, probe in probes.items():
        probe_layers[i].probe = probe
    prefill(model, probe_cache, input_ids, attention_mask, chunk_size, progress=first)
    del probe_cache, probe_layers

    for i, probe in probes.items():
        layers[i].observation = Observation(probe, layers[i].policy)
    try:
        logits = prefill(model, cache, input_ids, attention_mask, chunk_size, progress=second)
    finally:
        for i in chosen:
            if layers[i].observation is not None:
                layers[i].observation.finish(layers[i])
    return logits
