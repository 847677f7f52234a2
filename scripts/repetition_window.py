"""Does the repetition penalty's window (PENALTY_WINDOW, 64 tokens) let long stories loop? (issue 48.13)

Generates long stories with the embedded model at the chat's default sampling (temperature 0.7, top-p 0.9,
repetition penalty 1.1, snap 512), the same prompts and seeds for each window, and counts repetition in each
story: the share of its token 4-grams that came earlier in it, how often its most repeated line comes, and
whether its last quarter is a loop (under 30% distinct token 8-grams). A story ends at its first end-of-turn
token, or at --tokens.

    python scripts/repetition_window.py --tokens 2000 --windows 64,256,1024 --seeds 2 > windows.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from h2o_chat.app.messages import chat_ids
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step import sampling
from h2o_chat.engine.step.decode import Engine, left_pad
from h2o_chat.engine.step.generate import stop_token_ids
from h2o_chat.models.loading import load
from h2o_chat.models.registry import load_registry

PROMPTS = (
    "Write a very long story, in many chapters, about a lighthouse keeper who finds a message in a bottle.",
    "Tell me a long adventure story about two children who get lost in a forest and the creatures they meet.",
    "Write a long story about a robot who works in a bakery and wants to become a painter.",
)


def repeated_ngrams(tokens: list[int], n: int) -> float:
    """Share of the n-grams that came earlier in the same text."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen: set[tuple] = set()
    again = 0
    for g in grams:
        again += g in seen
        seen.add(g)
    return again / max(1, len(grams))


def most_repeated_line(text: str) -> int:
    """How many times the most frequent line of 20 characters or more comes."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if len(line) >= 20:
            counts[line] = counts.get(line, 0) + 1
    return max(counts.values(), default=0)


def loops(tokens: list[int]) -> bool:
    """The last quarter is a loop: under 30% of its 8-grams are distinct."""
    tail = tokens[-len(tokens) // 4 :]
    if len(tail) < 100:
        return False
    return 1 - repeated_ngrams(tail, 8) < 0.3


def stories(loaded, window: int, seeds: int, steps: int, base: int) -> list[list[int]]:
    """Every prompt `seeds` times (each row its own seed from the `base`, the same for every window)."""
    sampling.PENALTY_WINDOW = window  # read by the RowSampler at construction and at each draw
    model, tok = loaded.model, loaded.tokenizer
    rows = [chat_ids(tok, [{"role": "user", "content": p}]) for p in PROMPTS for _ in range(seeds)]
    cache = H2OCache.for_model(model, make_policy("snap", 512), "auto", loaded.context)
    engine = Engine(model, cache, "eager")
    sampler = sampling.Sampler(0.7, 0.9, None, 1.1, _auto_seed=base)
    engine.set_sampler(sampler, len(rows))
    ids, mask = left_pad(rows, tok.pad_token_id or 0)
    out: list[list[int]] = [[] for _ in rows]
    t0 = time.perf_counter()
    for n, step in enumerate(engine.tokens(engine.prefill(ids, mask, 512), steps), start=1):
        for r, t in enumerate(step):
            out[r].append(t)
        if n % 250 == 0:
            print(f"window {window}: {n} steps, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--windows", default="64,256,1024")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="1: a busy machine's OpenMP barriers cost more")
    parser.add_argument("--base", type=int, default=20261201, help="the rows' seeds follow from it")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(load_registry().resolve(None), device="cpu")
    stops = stop_token_ids(loaded.tokenizer, loaded.model)
    for window in (int(w) for w in args.windows.split(",")):
        t0 = time.perf_counter()
        for row, tokens in enumerate(stories(loaded, window, args.seeds, args.tokens, args.base)):
            end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
            story = tokens[:end]
            text = loaded.tokenizer.decode(story, skip_special_tokens=True)
            record = {
                "window": window,
                "prompt": row // args.seeds,
                "seed": f"{args.base}+{row % args.seeds}",
                "tokens": len(story),
                "ended": end < len(tokens),
                "rep4": round(repeated_ngrams(story, 4), 3),
                "top_line": most_repeated_line(text),
                "loop": loops(story),
                "text": text,
            }
            print(json.dumps(record), flush=True)
        print(f"window {window}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
