#!/usr/bin/env python
"""The server's part of the GPU check (scripts/gpu_check.sh): `h2o-chat serve` on a free loopback port, a few
conversations streamed at once, one of them continued from its cache, then /v1/stats. Standard library only (the
GPU machine has no `openai` client). Prints one JSON line; exits 1 when a reply fails or the continued turn was
read again.

    python scripts/serve_check.py MODEL [--conversations 4] [--max-tokens 128] [-- serve options]
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
import sys
import threading
import time


def start(model: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "h2o_chat", "serve", "-m", model, "--port", "0", *extra]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if "serving" in line and "http://" in line:
            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
            return proc, int(line.split("http://")[1].split("/")[0].rsplit(":", 1)[1])
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def call(port: int, method: str, path: str, body: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"{method} {path}: {response.status} {answer}")
    return answer


def stream(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat reply: its text, our h2o stats, and the client's own time to first token."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"stream: {response.status} {response.read()[:300]}")
    text, first, h2o = [], None, None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"stream: {event['error']['message']}")
        for choice in event["choices"]:
            if choice["delta"].get("content"):
                first = first or time.perf_counter() - t0
                text.append(choice["delta"]["content"])
        h2o = event.get("h2o", h2o)
    return {"text": "".join(text), "first_token": first, "h2o": h2o}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    proc, port = start(args.model, extra)
    try:
        asks = [[{"role": "user", "content": f"Tell me about the number {7 + i}."}] for i in range(args.conversations)]
        replies: list = [None] * len(asks)

        def converse(i: int) -> None:
            try:
                replies[i] = stream(port, asks[i], args.max_tokens)
            except Exception as e:  # reported in the line, not lost in a thread
                replies[i] = e

        threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(asks))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        failed = [str(r) for r in replies if isinstance(r, Exception)]
        out: dict = {"conversations": len(asks), "errors": failed}
        if not failed:
            out["tokens_per_second"] = [r["h2o"]["tokens_per_second"] for r in replies]
            out["first_token"] = [round(r["first_token"] or 0, 3) for r in replies]
            history = [
                *asks[0],
                {"role": "assistant", "content": replies[0]["text"]},
                {"role": "user", "content": "Go on."},
            ]
            again = call(
                port, "POST", "/v1/chat/completions", {"messages": history, "max_tokens": 16, "temperature": 0}
            )
            h = again["h2o"]
            out["continued"] = {"read_tokens": h["read_tokens"], "cached_tokens": h["cached_tokens"],
                                "read_again": h["read_again"]}  # fmt: skip
        stats = call(port, "GET", "/v1/stats")
        out["decode"] = sorted({lane["decode"] for lane in stats["lanes"]})
        out["notices"] = sorted({n for lane in stats["lanes"] for n in lane.get("notices", [])})  # e.g. a fallback
        out["idle_conversations"] = stats["idle_conversations"]["count"]
        print(json.dumps(out))
        ok = not failed and not out["continued"]["read_again"] and out["continued"]["cached_tokens"] > 0
        return 0 if ok else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
