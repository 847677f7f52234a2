"""What a chat turn costs: per-turn prompt time and per-step decode time of `recall` beside `snap` and `h2o`,
through the chat's own Conversation (greedy replies), on the recall evaluation's conversations.

    python scripts/recall_cost.py [--conversations 3] [--turns 10] [--budget-pct 10] [--reply-tokens 24]

Policies take turns conversation by conversation (the same machine drift hits each alike). Prints one JSON
line per policy: median and largest prompt seconds per turn, median decode ms per step, and the mean extra prompt
seconds per turn against snap.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from h2o_chat.app.chat.conversation import ChatSettings, Conversation
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.sampling import Sampler
from h2o_chat.measure import dialogues as dl
from h2o_chat.measure import evaluate as ev
from h2o_chat.models.loading import load
from h2o_chat.models.registry import load_registry

POLICIES = ("h2o", "snap", "recall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--budget-pct", type=float, default=10.0)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    loaded = load(load_registry().resolve(None), device=args.device)
    texts = {name: ev.read_text(shipped=name) for name in dl.RECALL_TEXTS}
    convs = dl.dialogues(loaded.tokenizer, texts, args.conversations, args.turns, seed=args.seed)
    settings = ChatSettings(
        max_new_tokens=args.reply_tokens, sampler=Sampler(temperature=0, repetition_penalty=1.0), positions="absolute"
    )
    prompt = {p: {} for p in POLICIES}  # (conversation, turn) -> seconds to read the turn and give a first token
    steps = {p: [] for p in POLICIES}  # seconds per decode step, one figure per turn
    for c, d in enumerate(convs):
        budget = round(args.budget_pct * d.tokens / 100)
        users = [m["content"] for m in d.messages if m["role"] == "user"]
        for name in POLICIES:
            conv = Conversation(loaded, make_policy(name, budget), settings)
            for turn, text in enumerate(users):
                first = last = None
                for r in conv.send(text):
                    first, last = first or r, r
                prompt[name][c, turn] = first.prompt_seconds
                if last.generation_tokens > 1:
                    steps[name].append(last.generation_seconds / (last.generation_tokens - 1))
    for name in POLICIES:
        times = prompt[name]
        print(
            json.dumps(
                {
                    "policy": name,
                    "budget_pct": args.budget_pct,
                    "turns": len(times),
                    "prompt_s_median": round(statistics.median(times.values()), 4),
                    "prompt_s_max": round(max(times.values()), 4),
                    "extra_prompt_s_per_turn_vs_snap": round(
                        statistics.mean(times[k] - prompt["snap"][k] for k in times), 4
                    ),
                    "decode_ms_per_step_median": round(1000 * statistics.median(steps[name]), 2),
                    "threads": torch.get_num_threads(),
                }
            )
        )


if __name__ == "__main__":
    main()
