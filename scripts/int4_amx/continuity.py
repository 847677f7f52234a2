#!/usr/bin/env python
"""What reading prompt chunks through the AMX kernel (h2o_chat/models/native) does to a conversation continued
from its cache against the same one read fresh (issue 47.4), and what it saves in prompt time.

    python scripts/int4_amx/continuity.py [--conversations 12] [--threads 2]

With the embedded model, greedy, a budget that evicts nothing, for each conversation (a passage of one of the
embedded texts, a reply, a question, a second reply):
- continued: the passage read, its reply decoded step by step (the compiled step), then the question read into
  the same cache and the second reply decoded;
- fresh: the passage, the first reply and the question read as one prompt by a new cache, then the second reply.

Prints, with PyTorch's kernel for every product (as with `H2O_CHAT_NATIVE=0`) and then with prompt chunks through
the AMX kernel (as h2o-chat reads them by default where it runs): how many second replies are the same continued and
fresh, the largest difference of the first logits, and the seconds spent reading the prompts.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.decode import Engine
from h2o_chat.models import cpu_quant, native
from h2o_chat.models.loading import load
from h2o_chat.models.registry import load_registry

DATA = Path(cpu_quant.__file__).parents[1] / "data"
REPLY = 32
QUESTION = "\n\nQuestion: what happens next, and why?\nAnswer:"


def passages(tokenizer, n: int) -> list[list[int]]:
    out = []
    for name in ("alice.txt", "moby_dick.txt", "as_you_like_it.txt", "workshop.txt"):
        ids = tokenizer(DATA.joinpath(name).read_text(encoding="utf-8"))["input_ids"]
        out += [ids[i : i + 160] for i in range(2000, 2000 + 3000 * (n // 4 + 1), 3000)][: n // 4 + 1]
    return out[:n]


def greedy(engine: Engine, logits: torch.Tensor, steps: int) -> list[int]:
    return [row[0] for row in engine.tokens(logits, steps)]


MODE = ["compile"]  # --decode


def engine_for(model) -> Engine:
    return Engine(model, H2OCache.for_model(model, [make_policy("h2o", 1024)]), MODE[0])


def run(model, tokenizer, conversations: list[list[int]]) -> tuple[int, float, float]:
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    same, worst, reading = 0, 0.0, 0.0
    for passage in conversations:
        a = engine_for(model)
        t0 = time.perf_counter()
        logits = a.prefill(torch.tensor([passage]))
        reading += time.perf_counter() - t0
        reply = greedy(a, logits, REPLY)  # its last token is not fed yet: it opens the next prompt
        t0 = time.perf_counter()
        continued_logits = a.prefill(torch.tensor([reply[-1:] + question]))
        reading += time.perf_counter() - t0
        continued = greedy(a, continued_logits, REPLY)
        b = engine_for(model)
        t0 = time.perf_counter()
        fresh_logits = b.prefill(torch.tensor([passage + reply + question]))
        reading += time.perf_counter() - t0
        fresh = greedy(b, fresh_logits, REPLY)
        assert a.cache.stats().evicted == 0 and b.cache.stats().evicted == 0
        same += continued == fresh
        worst = max(worst, (continued_logits.float() - fresh_logits.float()).abs().max().item())
    return same, worst, reading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", default="compile", choices=["compile", "eager"])
    args = parser.parse_args()
    MODE[0] = args.decode
    os.environ.pop("H2O_CHAT_NATIVE", None)  # the kernel is on unless it is turned off
    if native.main([]) != 0 or native.int4_mm(background=False) is None:
        raise SystemExit(f"the AMX kernel is not used here: {native.why_not()}")
    torch.set_num_threads(args.threads)
    loaded = load(load_registry().resolve(None), device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    conversations = passages(tokenizer, args.conversations)
    kernel = native._state["op"]
    print("| prompt products | second reply the same continued and fresh | first logits, largest difference | "
          "seconds reading prompts |")  # fmt: skip
    print("|---|---:|---:|---:|")
    with torch.inference_mode():
        for name, op in (("PyTorch's kernel", None), ("AMX", kernel)):
            native._state.clear()
            native._state.update({"op": op} if op is not None else {"why": "compared"})
            same, worst, reading = run(model, tokenizer, conversations)
            print(f"| {name} | {same} of {len(conversations)} | {worst:.3g} | {reading:.2f} |", flush=True)


if __name__ == "__main__":
    main()
