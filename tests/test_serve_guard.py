"""h2o-chat serve against hostile and unlucky requests, on a loopback port with a tiny random model: a dead engine
thread answers at once, limits answer with OpenAI's JSON errors, a drain reads no more prompts, conversations stay
within their client's scope, a fifth kind of cache gets a lane, and the served model names itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")

from serving import client, get, load_tiny, post, request, serving  # noqa: E402

from h2o_chat.app.serve import rows as rows_module  # noqa: E402
from h2o_chat.app.serve import server as server_module  # noqa: E402
from h2o_chat.app.serve.api import Limits  # noqa: E402
from h2o_chat.app.serve.rows import Lane  # noqa: E402

WORDS = " ".join(f"w{4 + i % 250}" for i in range(200_000))  # 200,000 tokens of the tiny word-level tokenizer
RUNS_ON = "w7 w8 w9"  # greedy, the tiny model's reply to this runs 400 tokens without its end of text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine thread too: OpenMP barriers on a busy 2-core machine cost more
    yield load_tiny(tmp_path_factory.mktemp("guard") / "tiny-llama")
    torch.set_num_threads(before)


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    th = threading.Thread(target=lambda: out.append(_caught(fn, *args)), daemon=True)
    th.start()
    return th, out


def _caught(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # a timeout: the test says which call hung
        return e


# -- item 2: the engine thread dies ----------------------------------------------------------------------------
def test_a_dead_engine_answers_everything_at_once_with_a_json_500(tiny, monkeypatch):
    """A bug in a step: the request decoding, one queued behind it and a /v1/stats waiting for the thread all get
    a JSON 500 at once (stats used to wait for ever, queued jobs too); later requests too; /health says so."""
    entered, release = threading.Event(), threading.Event()

    def broken_step(self):
        entered.set()
        release.wait(30)
        raise RuntimeError("a bug in a decode step")

    monkeypatch.setattr(Lane, "step", broken_step)
    monkeypatch.setattr(server_module, "STATS_WAIT", 60)  # stats waits for the thread, not for its last figures
    body = {"prompt": "w5 w6", "max_tokens": 4}
    with serving(tiny) as (server, port):
        decoding, got_a = in_thread(post, port, "/v1/completions", body, None, 15)
        assert entered.wait(30)
        queued, got_b = in_thread(post, port, "/v1/completions", body, None, 15)
        stats, got_c = in_thread(get, port, "/v1/stats", None, 15)
        deadline = time.monotonic() + 10
        while server.scheduler.inbox.qsize() < 2 and time.monotonic() < deadline:  # both wait for the thread
            time.sleep(0.02)
        release.set()
        for th in (decoding, queued, stats):
            th.join(20)
        for name, got in (("decoding", got_a), ("queued", got_b), ("stats", got_c)):
            assert got and not isinstance(got[0], Exception), f"{name}: {got}"
            status, answer = got[0]
            assert (
                status == 500
                and "the engine stopped: RuntimeError: a bug in a decode step" in (answer["error"]["message"])
            ), (name, answer)
        t = time.monotonic()
        assert get(port, "/v1/stats", timeout=5)[0] == 500
        assert post(port, "/v1/completions", body, timeout=5)[0] == 500
        assert time.monotonic() - t < 2
        status, health = get(port, "/health")
        assert status == 503 and health["status"] == "failed"


# -- item 3: limits ----------------------------------------------------------------------------------------------
def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = [
    ("10,000 stop strings", {"prompt": "w5", "stop": [f"w{i}" for i in range(10_000)]}, 400, "at most 16 strings"),
    ("a stop string of 1,000 characters", {"prompt": "w5", "stop": "x" * 1000}, 400, "at most 64 characters"),
    ("a body nested 20,000 deep", nested(20_000), 400, "nests deeper than 32 levels"),
    ("a body nested 40 deep", nested(40), 400, "nests deeper than 32 levels"),
]


@pytest.mark.parametrize(("case", "body", "status", "words"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_a_json_4xx_and_the_server_serves_on(tiny, case, body, status, words):
    with serving(tiny) as (_, port):
        got, answer = post(port, "/v1/completions", body)
        assert got == status and isinstance(answer, dict), answer  # JSON, not a plain-text 500
        assert words in answer["error"]["message"] and "\n" not in answer["error"]["message"]
        assert post(port, "/v1/completions", {"prompt": "w5", "max_tokens": 2})[0] == 200


def test_a_prompt_beyond_the_limit_is_refused_before_the_engine_and_a_stream_flows_on(tiny):
    """A 200,000-token prompt used to be tokenized and read in the engine thread while every stream stood still;
    now it is refused (400, context_length_exceeded) by its size alone, at once, and a reply streaming meanwhile
    never pauses. A prompt one token over --max-prompt-tokens is refused after tokenizing; one at it is read."""
    with serving(tiny, ends=False, limits=Limits(budget=64)) as (_, port):  # --max-prompt-tokens: the default
        gaps: list[float] = []

        def stream():
            last = time.perf_counter()
            for _ in client(port).completions.create(model="m", prompt=RUNS_ON, max_tokens=300, stream=True):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        streaming, done = in_thread(stream)
        while len(gaps) < 20:
            time.sleep(0.01)
        t = time.perf_counter()
        status, answer = post(port, "/v1/completions", {"prompt": WORDS, "max_tokens": 2}, timeout=10)
        assert time.perf_counter() - t < 3
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert "--max-prompt-tokens 8192" in answer["error"]["message"]
        chat = {"messages": [{"role": "user", "content": WORDS}], "max_tokens": 2}
        assert post(port, "/v1/chat/completions", chat, timeout=10)[0] == 400
        streaming.join(60)
        assert done == [None] and len(gaps) > 250 and max(gaps[20:]) < 1.0, max(gaps)
    with serving(tiny, limits=Limits(max_prompt_tokens=64)) as (_, port):
        words = lambda n: " ".join(["w5"] * n)  # noqa: E731
        status, answer = post(port, "/v1/completions", {"prompt": words(65), "max_tokens": 2})
        assert status == 400 and "65 prompt tokens" in answer["error"]["message"]
        assert post(port, "/v1/completions", {"prompt": words(64), "max_tokens": 2})[0] == 200


def test_sigterm_stops_reading_prompts_at_once_and_finishes_replies_under_way(tiny):
    """The command drains: a prompt being read stops at its next chunk (503), so does another sent after it (read
    in turn with it), the reply decoding before the signal ends whole, and the command exits 0 in seconds (it
    used to read the whole prompt first: minutes)."""
    folder = tiny.spec.source
    command = [sys.executable, "-m", "h2o_chat", "serve", "-m", folder, "--device", "cpu", "--port", "0",
               "--chunk-size", "16", "--max-prompt-tokens", "1000000", "--temperature", "0"]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stderr.readline()
        assert "serving" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        chunks: list = []
        stream = client(port, timeout=60).completions.create(model="m", prompt=RUNS_ON, max_tokens=200, stream=True)
        first = next(iter(stream))
        reading, got_long = in_thread(post, port, "/v1/completions", {"prompt": WORDS, "max_tokens": 2}, None, 60)
        time.sleep(2)  # tokenized, and being read in chunks of 16
        waiting, got_wait = in_thread(post, port, "/v1/completions", {"prompt": WORDS, "max_tokens": 2}, None, 60)
        time.sleep(2)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        reading.join(30)
        waiting.join(30)
        chunks = [first, *stream]
        assert proc.wait(30) == 0
        assert time.monotonic() - t < 15
        assert got_long and got_long[0][0] == 503, got_long
        assert "shutting down" in got_long[0][1]["error"]["message"]
        assert got_wait and got_wait[0][0] == 503, got_wait
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")  # the reply under way ended whole
        said = proc.stderr.read()
        assert "Traceback" not in said
        # the reply decoding, or none if it ended already: the two prompts being read are not replies under way
        assert re.search(r"stopping: finishing [01] repl(y|ies) under way", said), said
    finally:
        proc.kill()


# -- item 4: conversations stay within their scope -----------------------------------------------------------------
def test_a_conversation_is_continued_only_within_its_key_and_user(tiny):
    keys = ("key-a", "key-b")
    with serving(tiny, api_keys=keys, limits=Limits(budget=64)) as (_, port):
        a, b = client(port, "key-a"), client(port, "key-b")
        messages = [{"role": "user", "content": "w5 w6 w7"}]
        one = a.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        messages += [
            {"role": "assistant", "content": one.choices[0].message.content},
            {"role": "user", "content": "w9"},
        ]
        conv = one.h2o["conversation"]

        def cached(c, **extra) -> tuple[int, str]:
            r = c.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0, **extra)
            return r.usage.prompt_tokens_details.cached_tokens, r.h2o["conversation"]

        # another key, or the same key for another user or salt, replays the whole transcript: it reads it all
        for c, extra in ((b, {}), (a, {"user": "someone else"}), (a, {"extra_body": {"cache_salt": "s"}})):
            got, other = cached(c, **extra)
            assert got == 0 and other != conv, extra
        got, same = cached(a)  # the owner's next turn still finds its conversation
        assert got == one.h2o["seen"] and same == conv
        assert conv.startswith("conv-") and len(conv) == len("conv-") + 16  # random: no count of the others
        status, stats = get(port, "/v1/stats", {"Authorization": "Bearer key-b"})
        assert status == 200 and "conv-" not in json.dumps(stats)  # no other conversation's id


# -- item 6: a fifth kind of cache -----------------------------------------------------------------------------------
def test_a_fifth_kind_of_cache_gets_a_lane_while_four_stay_busy(tiny):
    """Four budgets keep four lanes busy, each with a next reply admitted before its last one ends (so no lane
    ever empties by itself); a request for a fifth budget used to wait until they all stopped. Now the least busy
    lane takes no new rows, empties, and the fifth gets its place within a reply or two."""
    rounds, length = 6, 40
    ended: dict[int, list[float]] = {}
    with serving(tiny, ends=False, rows=16, limits=Limits(policy="h2o", budget=16)) as (server, port):

        def chain(budget: int) -> None:
            c, ended[budget] = client(port), []

            def start():
                body = {"budget": budget, "temperature": 0}
                return c.completions.create(model="m", prompt=RUNS_ON, max_tokens=length, stream=True, extra_body=body)

            current = start()
            for _ in range(rounds):
                following = None
                for n, _ in enumerate(current):
                    if n == length // 2:
                        following = start()  # admitted (a second row of its lane) before this one ends
                ended[budget].append(time.monotonic())
                current = following
            for _ in current:
                pass

        chains = [threading.Thread(target=chain, args=(b,), daemon=True) for b in (16, 24, 32, 40)]
        for th in chains:
            th.start()
        while len(server.scheduler.lanes) < 4 or server.scheduler.busy < 4:
            time.sleep(0.01)
        status, answer = post(port, "/v1/completions", {"prompt": "w5", "max_tokens": 4, "budget": 48}, timeout=120)
        fifth = time.monotonic()
        for th in chains:
            th.join(300)
        assert status == 200, answer
        assert all(len(times) == rounds for times in ended.values()), ended
        assert sum(t < fifth for times in ended.values() for t in times) <= 4 * 3, "the fifth waited for the rest"


# -- item 11: the served model's name ------------------------------------------------------------------------------
def test_replies_name_the_served_model_whatever_the_request_says(tiny):
    with serving(tiny) as (_, port):
        c = client(port)
        reply = c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "w5"}], max_tokens=2)
        assert reply.model == "tiny-llama"
        chunks = list(c.completions.create(model="gpt-4", prompt="w5", max_tokens=2, stream=True))
        assert {ch.model for ch in chunks} == {"tiny-llama"}
        assert [m.id for m in c.models.list()] == ["tiny-llama"] and c.models.retrieve("tiny-llama").id == "tiny-llama"
        status, answer = request(port, "GET", "/v1/models/gpt-4")
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        assert "serves 'tiny-llama'" in answer["error"]["message"]


def test_the_command_and_the_server_default_to_one_prompt_limit():
    from h2o_chat.app.serve import api as serve_api
    from h2o_chat.app.serve import command as servecli

    assert servecli.MAX_PROMPT_TOKENS == serve_api.MAX_PROMPT_TOKENS == Limits().max_prompt_tokens


# -- issue 49.4: a long prompt is read between the other rows' steps ------------------------------------------------
def test_a_long_prompt_is_read_a_chunk_at_a_time_while_the_other_rows_keep_decoding(tiny):
    """A reply under way keeps streaming while another client's long prompt is read: the prompt is read a chunk
    (of --chunk-size tokens) per turn of the engine's loop, with a step of the other rows between chunks. Before,
    the whole prompt was read at once and the reply under way got no token until it was read (0 here). The long
    prompt's own reply is the one it gets read alone, and the row it used serves the next client."""
    from h2o_chat.app.serve.rows import EngineSettings

    prompt = " ".join(f"w{4 + (7 * i) % 250}" for i in range(1500))
    with serving(tiny, ends=False, engine=EngineSettings(decode="eager", chunk_size=16)) as (server, port):
        alone = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})[1]
        arrivals: list[float] = []

        def stream_one() -> None:
            for _ in client(port).completions.create(model="m", prompt=RUNS_ON, max_tokens=3000, stream=True):
                arrivals.append(time.monotonic())

        streaming = threading.Thread(target=stream_one, daemon=True)
        streaming.start()
        deadline = time.monotonic() + 30
        while len(arrivals) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        status, read = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
        t1 = t0 + read["h2o"]["time_to_first_token"]
        during = sum(t0 < t < t1 for t in arrivals)
        stats = get(port, "/v1/stats")[1]
        streaming.join(60)
    assert status == 200 and read["h2o"]["read_tokens"] == alone["h2o"]["read_tokens"] > 1000
    assert read["choices"][0]["text"] == alone["choices"][0]["text"]
    assert during >= 1500 // 16 // 2, (during, read["h2o"]["time_to_first_token"])
    assert stats["rows_busy"] == 1 and len(arrivals) > 1000


def test_a_short_prompt_sent_while_a_long_one_is_read_waits_a_chunk_not_the_whole(tiny):
    """Prompts are read a chunk of each in turn: a short request sent while a 1,500-token prompt is being read
    (16-token chunks) has its whole reply before the long prompt's first token. Before, prompts were read the
    oldest first, so the short one waited for every chunk of the long one (the audit's client: 27 s)."""
    from h2o_chat.app.serve.rows import EngineSettings

    prompt = " ".join(f"w{4 + (7 * i) % 250}" for i in range(1500))
    with serving(tiny, ends=False, engine=EngineSettings(decode="eager", chunk_size=16)) as (_, port):
        alone = post(port, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 2, "temperature": 0})[1]
        t0 = time.monotonic()
        long_th, long_out = in_thread(post, port, "/v1/completions", {"prompt": prompt, "max_tokens": 2}, None, 120)
        reading = False
        while not reading and time.monotonic() - t0 < 60:  # the long prompt's reading has begun
            lanes = get(port, "/v1/stats")[1]["lanes"]
            reading = any("reading" in row for lane in lanes for row in lane["active"])
        status, short = post(port, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 2, "temperature": 0})
        short_done = time.monotonic()
        long_th.join(120)
    long_status, long_reply = long_out[0]
    assert reading and status == 200 and long_status == 200
    assert short["choices"][0]["text"] == alone["choices"][0]["text"]
    long_first = t0 + long_reply["h2o"]["time_to_first_token"]  # from its submission: at least as early as t0
    assert short_done < long_first, (short_done - t0, long_first - t0)


def test_stats_answer_within_a_second_while_a_chunk_is_read_with_the_last_figures(tiny, monkeypatch):
    """/v1/stats is read in the engine thread between two turns; a turn that reads a prompt's chunk can take
    seconds on a busy CPU (the audit's client waited 7-40 s, and its 5 s timeout fired). After a second it gets
    the last turn's figures and how old they are; the next one, once the turn ends, is fresh again."""
    entered, release = threading.Event(), threading.Event()
    advance = rows_module.Reading.advance

    def slow_chunk(self):
        if self.total > 100:  # the long prompt's chunk takes as long as the test holds it
            entered.set()
            release.wait(30)
        return advance(self)

    monkeypatch.setattr(rows_module.Reading, "advance", slow_chunk)
    monkeypatch.setattr(server_module, "STATS_WAIT", 0.2)
    with serving(tiny) as (_, port):
        assert "stale_seconds" not in get(port, "/v1/stats")[1]
        long_th, _ = in_thread(post, port, "/v1/completions", {"prompt": " ".join(["w5"] * 200), "max_tokens": 2})
        assert entered.wait(30)
        t = time.monotonic()
        status, stats = get(port, "/v1/stats", timeout=10)
        waited = time.monotonic() - t
        release.set()
        long_th.join(30)
        status_after, after = get(port, "/v1/stats")
    assert status == 200 and stats["stale_seconds"] >= 0 and waited < 5, (stats, waited)
    assert stats["rows_max"] == after["rows_max"] and status_after == 200 and "stale_seconds" not in after


def test_a_step_that_falls_back_says_why_on_stderr_and_in_the_stats(tiny, monkeypatch, capfd):
    """A lane whose step cannot be compiled (or captured) decodes eagerly and says why. The server used to drop
    its engines' notices: on the H200 its lanes ran eagerly and nothing said why."""
    from h2o_chat.app.serve.rows import EngineSettings
    from h2o_chat.engine.step import compiled

    if compiled.unavailable():
        pytest.skip(compiled.unavailable())

    def broken(*args, **kwargs):
        raise RuntimeError("the compiler is missing")

    monkeypatch.setattr(compiled, "program", broken)
    with serving(tiny, engine=EngineSettings(decode="compile")) as (server, port):
        status, _ = post(port, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 4})
        stats = get(port, "/v1/stats")[1]
    assert status == 200
    said = "decode steps run eagerly: compiling one failed (the compiler is missing)"
    assert any(said in n for lane in stats["lanes"] for n in lane["notices"]), stats["lanes"]
    assert f"h2o-chat: {said}" in capfd.readouterr().err


def test_a_prompt_read_while_its_lane_shrinks_enters_the_row_it_moved_to(tiny):
    """Rows move when a lane is resized (its busy rows go to the front). A prompt still being read when the lane
    shrank entered the row number it was given, which no longer existed (or was another's): it must follow its
    row. Five replies take rows 0-4 (the lane grown to 8) and a long prompt row 5; the clients of replies 1-4
    leave once that prompt's reading has begun, the lane shrinks from 8 rows to 4 while it is read, once the
    reply of row 0 has decoded `SHRINK_AFTER` steps so, and the prompt's reply is still the one it gets alone.
    To 2 rows after that reply, and idle (row 0's client gone too) back to one row in one copy. Replies end when
    their clients leave, not after a number of tokens: the tiny model decodes a few hundred tokens in less time
    than the next client takes to join on some machines, and the lane never reached 8 rows."""
    from h2o_chat.app.serve.reading import Reader
    from h2o_chat.app.serve.rows import EngineSettings

    prompt = " ".join(f"w{4 + (11 * i) % 250}" for i in range(2000))
    sizes: list[tuple[int, bool]] = []  # each resize: the rows, and whether a prompt was being read
    real_resize, real_begin = Lane.resize, Reader.begin
    reading, replied = threading.Event(), threading.Event()

    with serving(tiny, ends=False, rows=8, engine=EngineSettings(decode="eager", chunk_size=16)) as (server, port):

        def resize(lane, rows: int) -> None:
            sizes.append((rows, bool(server.scheduler.reader.readings)))
            real_resize(lane, rows)

        def begin(reader, job, lane, r) -> None:
            real_begin(reader, job, lane, r)
            if len(job.turn.ids) > 1000:  # the long prompt (the replies' prompts are read this way too)
                reading.set()

        alone = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})[1]
        firsts = [threading.Event() for _ in range(5)]

        def reply(i: int) -> None:
            body = {"model": "m", "prompt": RUNS_ON, "max_tokens": 20_000, "temperature": 0, "stream": True}
            with client(port).completions.create(**body) as stream:
                for _ in stream:
                    firsts[i].set()
                    if i and reading.is_set():
                        break  # replies 1-4: their clients leave while the prompt is read
                    if not i and replied.is_set() and sizes[-1][0] == 2:
                        break  # row 0's, once its lane has shrunk to 2 rows after the prompt's reply

        threads = []
        Lane.resize, Reader.begin = resize, begin
        try:
            for i in range(5):  # one at a time: rows 0 to 4, the lane grown to 8
                threads.append(threading.Thread(target=reply, args=(i,), daemon=True))
                threads[-1].start()
                assert firsts[i].wait(30)
            status, read = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
            replied.set()
            for th in threads:
                th.join(60)
                assert not th.is_alive()
            deadline = time.monotonic() + 30  # the row of a client gone is freed at the engine's next turn
            while get(port, "/v1/stats")[1]["lanes"][0]["rows"] != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            lanes = get(port, "/v1/stats")[1]["lanes"]
        finally:
            Lane.resize, Reader.begin = real_resize, real_begin
    assert status == 200, read
    assert read["choices"][0]["text"] == alone["choices"][0]["text"]
    # grown one job at a time with no prompt being read; to 4 while the prompt was read, to 2 after its reply
    # (row 0 decoding on), idle: 1
    assert sizes == [(2, False), (4, False), (8, False), (4, True), (2, False), (1, False)], sizes
    assert [lane["rows"] for lane in lanes] == [1]


def test_a_burst_grows_its_lane_once_and_memory_decides_how_far(tiny, monkeypatch):
    """Jobs arriving together: the lane grows once to the power of two that holds them all, not a doubling (a copy
    of every row's cache) per job: 1 -> 8 rows, where it went 1 -> 2 -> 4 -> 8. Where memory allows fewer rows,
    the largest half that fits, and a 503 only when not even a doubling fits. A lane with busy rows in a quarter of
    it shrinks after `SHRINK_AFTER` of its steps, not at once."""
    from types import SimpleNamespace

    from h2o_chat.app.serve.api import ApiError
    from h2o_chat.app.serve.lanes import SHRINK_AFTER, Lanes
    from h2o_chat.app.serve.rows import EngineSettings, LaneKey
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.errors import H2OChatError

    key, policy = LaneKey("h2o", 16, False, False), make_policy("h2o", 16)
    sizes: list[int] = []
    real_resize = Lane.resize
    monkeypatch.setattr(Lane, "resize", lambda lane, rows: (sizes.append(rows), real_resize(lane, rows))[1])
    lanes = Lanes(tiny, EngineSettings(decode="eager"), max_rows=8)
    lane, r = lanes.place(key, policy, 8)  # the default lane: one row
    lane.jobs[r] = SimpleNamespace(reading=None)
    for want in (5, 4, 3, 2, 1):  # five more jobs waiting at once, placed in turn
        lane, r = lanes.place(key, policy, 8, want)
        lane.jobs[r] = SimpleNamespace(reading=None)
    assert lane.size == 8 and sizes == [8] and lane.active == 6

    lane.jobs = [lane.jobs[0], *[None] * 7]  # five replies end: 1 of 8 busy
    for _ in range(SHRINK_AFTER):
        lanes.tidy(waiting=False)
        assert lane.size == 8
        lane.step()
    lanes.tidy(waiting=False)
    assert lane.size == 4 and sizes == [8, 4]

    # a lane opened beside one with 6 of the 8 rows busy holds the 2 rows that can be busy, not its 5 jobs' 8
    lanes = Lanes(tiny, EngineSettings(decode="eager"), max_rows=8)
    for want in range(6, 0, -1):
        lane, r = lanes.place(key, policy, 8, want)
        lane.jobs[r] = SimpleNamespace(reading=None)
    other = LaneKey("h2o", 16, True, True)
    for want in (5, 4):
        lane, r = lanes.place(other, policy, 8, want)
        lane.jobs[r] = SimpleNamespace(reading=None)
        assert lane.key == other and lane.size == 2
    assert lanes.busy == 8 and lanes.place(other, policy, 8, 3) is None  # the rest wait for a row

    # memory for two more rows at a time only: seven jobs at once get the rows that fit, doubling at most
    room = tiny.check_budget

    def check_budget(budget, rows, **kw):
        if rows > 2:
            raise H2OChatError(f"{rows} more rows do not fit")
        return room(budget, rows=rows, **kw)

    monkeypatch.setattr(tiny, "check_budget", check_budget)
    lanes = Lanes(tiny, EngineSettings(decode="eager"), max_rows=8)
    got = []
    for want in range(7, 3, -1):
        lane, r = lanes.place(key, policy, 8, want)
        lane.jobs[r] = SimpleNamespace(reading=None)
        got.append(lane.size)
    assert got == [1, 2, 4, 4]  # a new lane of 1 (+ its reading cache: 2 rows), then doublings of <= 2 rows
    with pytest.raises(ApiError, match="no memory"):
        lanes.place(key, policy, 8, 3)  # 4 -> 8 needs four rows more


def test_a_stopped_server_frees_its_lanes_and_their_caches(tiny):
    """The engine thread freezes what is alive when it starts (`gc.freeze`: the model's objects are then not scanned
    by each collection), the server's own objects among them; frozen objects are never freed. A stopped server left
    its lane, the lane's two caches and its event loop alive for the rest of the process (and a later test that
    counted the caches alive saw them); the thread now unfreezes them when it ends."""
    import gc
    import weakref

    with serving(tiny) as (server, port):
        body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "w5 w6"}]}
        status, _ = post(port, "/v1/chat/completions", body)
        assert status == 200
        kept = [weakref.ref(o) for lane in server.scheduler.lanes for o in (lane, lane.cache, lane.engine)]
        kept.append(weakref.ref(server))
    assert len(kept) >= 4
    del server
    gc.collect()
    assert [r() for r in kept] == [None] * len(kept)
