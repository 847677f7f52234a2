#!/usr/bin/env python
"""Load figures for `h2o-chat serve`: aggregate tokens/s with 1, 4 and 16 conversations at once against the same
conversations run one after another, time to first token, and the server's peak resident memory.

Starts `h2o-chat serve` (its own process, so the clients here never hold its interpreter lock) on a free
loopback port, drives it with the `openai` client (streamed, greedy), and prints a Markdown table.

    python scripts/serve_load.py                        # the embedded model, 2 turns of 32 tokens each
    python scripts/serve_load.py --turns 3 --max-tokens 64 -- --budget 256 --threads 2
    python scripts/serve_load.py --top-p 0.8,0.9,0.95   # sampled (temperature 0.7, a seed each), top-p in turn
    (arguments after -- go to h2o-chat serve)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import openai
import psutil


def start_server(extra: list[str]) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "h2o_chat", "serve", "--port", "0", *extra]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if "serving" in line and "http://" in line:
            return proc, int(line.split("http://")[1].split("/")[0].rsplit(":", 1)[1])
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


class Peak:
    """The server's peak resident memory, sampled every 50 ms."""

    def __init__(self, pid: int):
        self.process, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        return self.peak


def conversation(client, name: str, turns: int, max_tokens: int, firsts: list[float], sampling=None) -> int:
    """One conversation of `turns` turns (greedy, or `sampling`); returns tokens generated, appends each turn's
    time to first token."""
    messages, tokens = [], 0
    for t in range(turns):
        messages.append({"role": "user", "content": f"{name}: tell me something about the number {t + 7}."})
        t0, first, text = time.perf_counter(), None, []
        stream = client.chat.completions.create(
            model="m", messages=messages, stream=True, max_tokens=max_tokens,
            stream_options={"include_usage": True}, **(sampling or {"temperature": 0}),
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens
        firsts.append(first or 0.0)
        messages.append({"role": "assistant", "content": "".join(text)})
    return tokens


def run(client, tag: str, n: int, together: bool, turns: int, max_tokens: int, top_p=()) -> tuple[float, list[float]]:
    """n conversations, at once or one after another: (tokens/s over the wall time, times to first token).
    `top_p`: conversation i samples at top_p[i % len] (temperature 0.7, seed i) instead of greedily."""
    firsts: list[float] = []
    counts = [0] * n

    def one(i: int) -> None:
        sampling = {"temperature": 0.7, "top_p": top_p[i % len(top_p)], "seed": i} if top_p else None
        counts[i] = conversation(client, f"{tag}-{i}", turns, max_tokens, firsts, sampling)

    t0 = time.perf_counter()
    if together:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    else:
        for i in range(n):
            one(i)
    return sum(counts) / (time.perf_counter() - t0), firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--conversations", default="1,4,16")
    parser.add_argument("--top-p", default="", help="comma-separated: conversations sample, at these top-p in turn")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    top_p = tuple(float(x) for x in args.top_p.split(",") if x)
    proc, port = start_server(extra)
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep its pipe drained
    peak = Peak(proc.pid)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        conversation(client, "warm-up", 1, 4, [])
        rows = []
        for n in (int(x) for x in args.conversations.split(",")):
            alone, _ = run(client, f"seq{n}", n, False, args.turns, args.max_tokens, top_p)
            together, firsts = run(client, f"par{n}", n, True, args.turns, args.max_tokens, top_p)
            p90 = statistics.quantiles(firsts, n=10)[-1] if len(firsts) > 1 else firsts[0]
            rows.append((n, together, alone, statistics.median(firsts), p90))
            print(f"{n} at once: {together:.1f} tok/s, one after another {alone:.1f} tok/s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(120)
    how = f"temperature 0.7 at top-p {args.top_p} in turn" if top_p else "greedy"
    print(f"\n{args.turns} turns of up to {args.max_tokens} tokens per conversation, {how}; server: "
          f"h2o-chat serve {' '.join(extra)}; peak resident memory {peak.stop() / 2**20:,.0f} MB\n")  # fmt: skip
    print("| conversations | tok/s at once | tok/s one after another | speed-up | first token, median | p90 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, together, alone, median, p90 in rows:
        print(f"| {n} | {together:.1f} | {alone:.1f} | {together / alone:.2f}x | {median:.2f} s | {p90:.2f} s |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
