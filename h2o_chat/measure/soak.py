"""Soak: read far past the trained context with a fixed budget, and watch memory and perplexity per window.

Every configuration (absolute vs rolling positions, with and without attention sinks, and auto; of one policy, h2o
by default) reads the same text as a row of one grouped cache, teacher-forced token by token; after each window of
tokens the process memory and each configuration's perplexity over that window are recorded. A bounded cache should
give flat memory after warm-up; positions decide whether perplexity stays flat past the trained context.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2o_chat.engine.policies import Policy, make_policy
from h2o_chat.measure.evaluate import streaming_nll
from h2o_chat.models.memory import process_memory


@dataclass(frozen=True)
class SoakConfig:
    label: str
    policy: Policy
    positions: str


SOAK_POLICIES = ("h2o", "snap", "recall")  # the policies with heavy hitters (and sinks) a soak compares


def soak_configs(budget: int, sinks: int, policy: str = "h2o") -> list[SoakConfig]:
    plain, pinned = make_policy(policy, budget), make_policy(policy, budget, sinks=sinks)
    return [
        SoakConfig("absolute", plain, "absolute"),
        SoakConfig("rolling", plain, "rolling"),
        SoakConfig(f"absolute + {sinks} sinks", pinned, "absolute"),
        SoakConfig(f"rolling + {sinks} sinks", pinned, "rolling"),
        SoakConfig(f"auto + {sinks} sinks", pinned, "auto"),
    ]


def run_soak(
    model,
    ids: torch.Tensor,
    configs: list[SoakConfig],
    window: int = 1000,
    context: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    decode: str = "auto",
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One record per window: tokens seen, the window's tokens (`window`: its first and last, counted from 1; the
    text's first token is read but not scored), memory, KV bytes, and each configuration's perplexity over the
    window's tokens. `progress(tokens done, tokens total)` after each token; `on_record(record)` as soon as each
    window is done."""
    device = next(model.parameters()).device
    records: list[dict] = []

    def on_step(t: int, cache, nll: torch.Tensor) -> None:
        if (t + 1) % window == 0 or t == ids.shape[1] - 1:
            stats = cache.group_stats()
            memory = process_memory(device)
            first = records[-1]["window"][1] + 1 if records else 1
            start = max(0, first - 2)  # nll[:, i] predicts token i + 2 (counted from 1)
            means = nll[:, start:t].mean(dim=1).tolist()
            records.append(
                {
                    "seen": t + 1,
                    **memory,
                    "kv_bytes": sum(s.kv_bytes for s in stats),
                    "positions": [s.positions for s in stats],
                    "window": [first, t + 1],
                    "ppl": {c.label: round(math.exp(means[g]), 3) for g, c in enumerate(configs)},
                }
            )
            if on_record is not None:
                on_record(records[-1])

    streaming_nll(
        model,
        ids,
        [c.policy for c in configs],
        [c.positions for c in configs],
        progress=progress,
        on_step=on_step,
        context=context,
        decode=decode,
    )
    return records


def flatness(records: list[dict], key: str = "rss", warmup: int = 1) -> float:
    """max / min of a memory figure over the windows after warm-up."""
    values = [r[key] for r in records[warmup:]] or [r[key] for r in records]
    return max(values) / min(values)
