"""serve --session-dir: idle conversations that the memory limit would drop go to disk and come back on their next
turn, each reply then equal to the one a server that kept them in memory gives (greedy), rows decoding together.
A tiny random LLaMA (a word-level tokenizer) behind the real server and the `openai` client."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest
import torch

pytest.importorskip("openai")

from serving import client, get, load_tiny, serving  # noqa: E402

from h2o_chat.app.serve.api import Limits  # noqa: E402

LIMITS = Limits(policy="h2o", budget=24, max_tokens=5, temperature=0.0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_tiny(tmp_path_factory.mktemp("disk") / "tiny-llama")
    torch.set_num_threads(before)


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(4, 256)}" for _ in range(n))


def converse(port: int, i: int, turns: int, out: dict) -> None:
    """Conversation i: `turns` long messages (past the budget), each with the replies so far."""
    try:
        c, messages, h2o = client(port), [], []
        for t in range(turns):
            messages.append({"role": "user", "content": words(100 * i + t, 30)})
            r = c.chat.completions.create(model="t", messages=messages)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            h2o.append(r.h2o)
        out[i] = (messages, h2o)
    except BaseException as e:  # noqa: BLE001 -- handed to the test's thread
        out[i] = e


def run_all(port: int, clients: int, turns: int) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=converse, args=(port, i, turns, out)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    for value in out.values():
        if isinstance(value, BaseException):
            raise value
    return out


def test_idle_conversations_on_disk_continue_as_those_kept_in_memory(tiny, tmp_path):
    """Three conversations at once (rows of one engine), every idle one written to disk (a memory limit of one
    byte): each turn after the first restores its row from a file, says so, reads only its new message, and
    replies as the server that kept everything in memory does. The files go when the server stops."""
    clients, turns = 3, 3
    with serving(tiny, ends=False, limits=LIMITS, rows=4) as (_, port):
        kept = run_all(port, clients, turns)
    folder = tmp_path / "sessions"
    with serving(tiny, ends=False, limits=LIMITS, rows=4, memory_limit=1, session_dir=folder) as (server, port):
        spilled = run_all(port, clients, turns)
        stats = get(port, "/v1/stats")[1]["idle_conversations"]
        assert stats["count"] == clients and stats["on_disk"] == clients and stats["bytes"] == 0
        assert stats["restored_from_disk"] == clients * (turns - 1) and not stats["disk_errors"]
        assert len(list(folder.glob("*.h2o"))) == clients
    assert not list(folder.iterdir())  # the server's memory, not an archive
    for i in range(clients):
        assert spilled[i][0] == kept[i][0], f"conversation {i}"
        for t, h in enumerate(spilled[i][1]):
            assert h["restored_from_disk"] == (t > 0) and not h["read_again"]
            assert h["cached_tokens"] == kept[i][1][t]["cached_tokens"] and h["seen"] > LIMITS.budget
        assert not any(h["restored_from_disk"] for h in kept[i][1])


def test_a_damaged_file_is_read_again_from_the_start(tiny, tmp_path):
    """A session file that cannot be read back (here, cut short) drops that conversation as the memory limit would
    have: its next request is read again from the start and says so; the server serves on."""
    folder = tmp_path / "sessions"
    with serving(tiny, ends=False, limits=LIMITS, memory_limit=1, session_dir=folder) as (server, port):
        c = client(port)
        messages = [{"role": "user", "content": words(1, 30)}]
        one = c.chat.completions.create(model="t", messages=messages)
        (path,) = folder.glob("*.h2o")
        path.write_bytes(path.read_bytes()[:-10])
        messages.append({"role": "assistant", "content": one.choices[0].message.content})
        messages.append({"role": "user", "content": "w5"})
        two = c.chat.completions.create(model="t", messages=messages)
        assert two.h2o["read_again"] and not two.h2o["restored_from_disk"] and two.h2o["cached_tokens"] == 0
        errors = get(port, "/v1/stats")[1]["idle_conversations"]["disk_errors"]
        assert len(errors) == 1 and "truncated" in errors[0]


def test_serve_refuses_a_session_dir_it_cannot_use_in_one_line(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "h2o_chat", "serve", "--session-dir", str(taken)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert f"--session-dir {taken} cannot be used" in result.stderr and "Traceback" not in result.stderr
