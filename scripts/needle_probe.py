"""snap's probe, side by side: needle hits and prompt speed of the last-chunk probe ("tail") and the whole-prompt
probe ("whole") in one run, on the embedded model and the four shipped texts (issue 41.7).

    OMP_NUM_THREADS=1 python scripts/needle_probe.py [--seeds 0 1] [--depths 0.1 0.3 0.5] [--out FILE.json]

It needs the two probes, so it runs on a checkout of commit 95e6fae, where `snap.PROBE` still chose between them
(the last-chunk probe was removed after this comparison; docs/policies.md has the figures it gave).

For each seed, the full cache once (which codes are answerable at all), then snap at each budget with each probe
(the probes' order alternates by seed, so drift hits both alike). Then prompt speed: one prompt of each length
read by snap at 10% of it with each probe in turn, `--rounds` times (min and median seconds; tokens/s =
prompt tokens / seconds). Prints one markdown table of hits per (probe, budget, depth) with Wilson 90%
intervals, the trials where the probes disagree, and the speed table; `--out` keeps every record.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections import defaultdict

import torch

from h2o_chat.engine.policies import make_policy, snap
from h2o_chat.engine.step.decode import Engine
from h2o_chat.measure import evaluate as ev
from h2o_chat.measure import tasks
from h2o_chat.models.loading import load
from h2o_chat.models.registry import load_registry

TEXTS = ("alice.txt", "moby_dick.txt", "workshop.txt", "as_you_like_it.txt")
PROBES = ("tail", "whole")


def wilson(k: int, n: int, z: float = 1.645) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials (z 1.645: 90%)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def run_needle(loaded, trials, configs, probe: str) -> tuple[list[dict], float]:
    snap.PROBE = probe
    t0 = time.perf_counter()
    records = tasks.needle(loaded.model, loaded.tokenizer, trials, configs)
    return records, time.perf_counter() - t0


def prompt_seconds(loaded, ids: list[int], budget: int, probe: str) -> float:
    snap.PROBE = probe
    cache = ev.make_eval_cache(loaded.model, [make_policy("snap", budget)])
    engine = Engine(loaded.model, cache)
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    engine.prefill(x)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    parser.add_argument("--budgets", nargs="+", default=["10%", "20%"])
    parser.add_argument("--haystack-tokens", type=int, default=1500)
    parser.add_argument("--speed-lengths", type=int, nargs="*", default=[1580, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not hasattr(snap, "PROBE"):
        raise SystemExit("this checkout has one probe (the whole prompt): run this script at commit 95e6fae")

    loaded = load(load_registry().resolve(None), device="cpu")
    tok = loaded.tokenizer
    texts = {name: ev.read_text(shipped=name) for name in TEXTS}
    specs = [ev.BudgetSpec.parse(b) for b in args.budgets]
    records: list[dict] = []
    seconds: dict[str, float] = defaultdict(float)
    for k, seed in enumerate(args.seeds):
        trials = tasks.needle_trials(tok, texts, args.depths, args.haystack_tokens, seed)
        longest = max(len(t.ids) for t in trials)
        full, *snaps = ev.make_configs(["snap"], specs, longest)
        out, secs = run_needle(loaded, trials, [full], "tail")
        records += [{**r, "seed": seed, "probe": "-"} for r in out]
        seconds["full"] += secs
        for probe in PROBES if k % 2 == 0 else PROBES[::-1]:
            out, secs = run_needle(loaded, trials, snaps, probe)
            records += [{**r, "seed": seed, "probe": probe} for r in out]
            seconds[probe] += secs
            print(f"seed {seed} {probe}: {secs:.0f} s", flush=True)

    # hits per (probe, budget, depth) over seeds and texts
    cells: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    answers: dict[tuple, dict] = {}
    for r in records:
        key = (r["probe"], r["spec"], r["depth"])
        cells[key][0] += r["correct"]
        cells[key][1] += r["trials"]
        for a in r["answers"]:
            answers[(r["probe"], r["spec"], r["depth"], r["seed"], a["haystack"])] = a
    lines = [
        f"needle: {len(TEXTS)} texts x seeds {args.seeds} per cell, prompts of <= {longest} tokens; "
        f"hits (Wilson 90% interval)",
        "",
        "| probe | budget | " + " | ".join(f"depth {d:g}" for d in args.depths) + " | all |",
        "|---|---|" + "---:|" * (len(args.depths) + 1),
    ]
    rows = [("-", None)] + [(p, str(s)) for p in PROBES for s in specs]
    for probe, spec in rows:
        cols, tk, tn = [], 0, 0
        for d in args.depths:
            k, n = cells[(probe, spec, d)]
            lo, hi = wilson(k, n)
            cols.append(f"{k}/{n} ({lo:.2f}-{hi:.2f})")
            tk, tn = tk + k, tn + n
        lo, hi = wilson(tk, tn)
        name = "full" if probe == "-" else f"snap, {probe}"
        lines.append(f"| {name} | {spec or 'full'} | " + " | ".join(cols) + f" | {tk}/{tn} ({lo:.2f}-{hi:.2f}) |")
    lines.append("")
    for spec in specs:
        only = {p: [] for p in PROBES}
        for (probe, s, d, seed, hay), a in answers.items():
            if probe == "tail" and s == str(spec):
                other = answers[("whole", s, d, seed, hay)]
                if a["correct"] != other["correct"]:
                    only["tail" if a["correct"] else "whole"].append(f"{hay}@{d:g}/seed {seed}")
        lines.append(f"{spec}: found by whole only {only['whole']}; by tail only {only['tail']}")
    lines.append(f"seconds (needle runs, all rows together): {dict((k, round(v)) for k, v in seconds.items())}")

    # prompt speed, interleaved
    speed = []
    alice = ev.token_ids(tok, texts["alice.txt"])
    for n in args.speed_lengths:
        ids = ev.chat_ids(tok, tok.decode(alice[: n - 20]))[:n]
        budget = round(0.1 * len(ids))
        times = {p: [] for p in PROBES}
        prompt_seconds(loaded, ids[:600], 60, "tail")  # warm-up
        for _ in range(args.rounds):
            for probe in PROBES:
                times[probe].append(prompt_seconds(loaded, ids, budget, probe))
        for probe in PROBES:
            best, med = min(times[probe]), statistics.median(times[probe])
            speed.append({"prompt_tokens": len(ids), "budget": budget, "probe": probe, "seconds": times[probe]})
            lines.append(
                f"prompt {len(ids)} tokens, snap {budget}, {probe}: min {best:.2f} s ({len(ids) / best:.0f} tok/s), "
                f"median {med:.2f} s ({len(ids) / med:.0f} tok/s)"
            )
    snap.PROBE = "tail"
    machine = f"{platform.machine()}, torch threads {torch.get_num_threads()}"
    lines.append(f"machine: {machine}; {time.strftime('%Y-%m-%d', time.gmtime())}")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"needle": records, "speed": speed, "summary": lines}, f, indent=1)


if __name__ == "__main__":
    main()
