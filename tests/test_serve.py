"""h2o-chat serve: the real server on a loopback port (port 0: a free one), driven by the real `openai` client and
by raw HTTP. The embedded model answers the client's requests; a tiny random model serves the limits' tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")

from serving import client, get, load_tiny, post, serving  # noqa: E402

from h2o_chat.app.serve.api import Limits  # noqa: E402

CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def one_thread():
    """A server's engine thread on one CPU thread: on a busy 2-core machine, OpenMP barriers between two
    threads make each step many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedded_server(embedded, one_thread):
    limits = Limits(budget=64, max_tokens=8)
    with serving(embedded, limits=limits, max_body=64 * 1024, rows=4) as (server, port):
        yield server, port


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random LLaMA with a word-level tokenizer, loaded as a model folder is."""
    return load_tiny(tmp_path_factory.mktemp("serve") / "tiny-llama")


# -- the openai client -----------------------------------------------------------------------------------------
def test_chat_streamed_and_not_give_one_reply_with_usage_and_cache_stats(embedded_server):
    _, port = embedded_server
    c = client(port)
    whole = c.chat.completions.create(model="any", messages=CHAT, temperature=0, max_tokens=6)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens > 0
    assert whole.model == "smollm2-135m"  # the served model, whatever the request named
    h2o = whole.h2o  # ours: the conversation's cache
    assert h2o["policy"] == "snap" and h2o["budget"] == 64 and h2o["seen"] == whole.usage.prompt_tokens + 5
    assert h2o["kept"] <= 64 and h2o["evicted"] == h2o["seen"] - h2o["kept"] and not h2o["read_again"]
    stream = c.chat.completions.create(
        model="any", messages=CHAT, temperature=0, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6  # the usage chunk, as asked
    assert chunks[-2].h2o["seen"] == h2o["seen"]


def test_completions_and_stop_strings(embedded_server):
    _, port = embedded_server
    c = client(port)
    free = c.completions.create(model="m", prompt="One, two, three, four,", temperature=0, max_tokens=6)
    text = free.choices[0].text
    assert free.choices[0].finish_reason == "length" and len(text.split()) >= 2
    stop = text[text.index(text.split()[1]) :][:3]  # the second word's start: the reply ends before it
    cut = c.completions.create(model="m", prompt="One, two, three, four,", temperature=0, max_tokens=6, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    chat = c.chat.completions.create(model="m", messages=CHAT, temperature=0, max_tokens=8, stop=["e"])
    assert "e" not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"


def test_a_seed_gives_the_same_sampled_text(embedded_server):
    _, port = embedded_server
    c = client(port)
    ask = {"model": "m", "messages": CHAT, "temperature": 1.5, "max_tokens": 8}
    first, again = (c.chat.completions.create(**ask, seed=11).choices[0].message.content for _ in range(2))
    assert first == again
    others = {c.chat.completions.create(**ask, seed=s).choices[0].message.content for s in (12, 13, 14)}
    assert others - {first}


def test_requests_differing_in_top_p_seed_or_greedy_filters_share_one_lane_each_as_alone(embedded_server, monkeypatch):
    """Lanes were keyed by the top-p value: requests at top-p 0.8 and 0.95 (and a greedy one at top-p 1) took
    three lanes, each stepping its few rows apart, and a fifth value closed a busy lane. A lane now serves every
    top-p below 1 (each row its own), and a greedy request the defaults' lane; each reply is its text alone."""
    from concurrent.futures import ThreadPoolExecutor

    from h2o_chat.app.serve.lanes import Lanes

    server, port = embedded_server
    c = client(port)
    asks = [
        {"temperature": 1.5, "top_p": 0.8, "seed": 3},
        {"temperature": 1.5, "top_p": 0.95, "seed": 4},
        {"temperature": 1.2, "seed": 5},  # the server's top-p, 0.9
        {"temperature": 0, "top_p": 1.0, "extra_body": {"top_k": 2}},  # greedy: its filters change nothing
    ]

    def reply(ask: dict) -> str:
        return c.chat.completions.create(model="m", messages=CHAT, max_tokens=8, **ask).choices[0].message.content

    keys, place = [], Lanes.place
    monkeypatch.setattr(Lanes, "place", lambda lanes, key, *a: (keys.append(key), place(lanes, key, *a))[1])
    alone = [reply(ask) for ask in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(reply, asks))
    assert together == alone and len(set(alone[:3])) > 1
    assert len(keys) >= 2 * len(asks) and len(set(keys)) == 1, set(keys)


def test_a_conversation_reads_only_its_new_turn_and_says_when_it_was_read_again(embedded_server):
    _, port = embedded_server
    c = client(port)
    messages = [{"role": "user", "content": "Hello there."}]
    one = c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=4)
    messages += [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "Go on."},
    ]
    two = c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=4)
    assert two.h2o["conversation"] == one.h2o["conversation"] and not two.h2o["read_again"]
    assert two.h2o["cached_tokens"] == one.h2o["seen"] == two.usage.prompt_tokens_details.cached_tokens
    assert two.h2o["read_tokens"] < one.h2o["read_tokens"]
    # a history this server never generated: read again from the start, and said so
    messages[1]["content"] = "Something I never said."
    three = c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=4)
    assert three.h2o["read_again"] and three.h2o["cached_tokens"] == 0
    assert three.h2o["conversation"] != one.h2o["conversation"]


def test_a_reply_cut_by_a_stop_string_is_continued_only_where_its_cache_holds_what_the_client_was_sent(
    embedded_server,
):
    """A stop string's tokens may be in the reply's cache although its text was cut off. Cut at a token's start,
    the cache holds the reply as sent (its last token, the stop's, is dropped): continued. Cut past tokens the
    cache read (" in this": " in" was read): the client's history is not what the cache read, so the next turn
    reads the conversation again. Before, it continued, the model seeing text the client never got."""
    _, port = embedded_server
    c = client(port)
    ask = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    whole = c.chat.completions.create(model="m", messages=ask, temperature=0).choices[0].message.content
    assert whole.startswith("The numbers in this"), whole  # greedy: the tokens The, numbers, in, this, ...
    for stop, continued in ((" this", True), (" in this", False)):
        one = c.chat.completions.create(model="m", messages=ask, temperature=0, stop=[stop], extra_body={
            "cache_salt": stop})  # fmt: skip
        sent = one.choices[0].message.content
        assert sent == whole[: whole.index(stop)] and one.choices[0].finish_reason == "stop"
        messages = [*ask, {"role": "assistant", "content": sent}, {"role": "user", "content": "Why?"}]
        two = c.chat.completions.create(model="m", messages=messages, temperature=0, extra_body={"cache_salt": stop})
        assert two.h2o["read_again"] is not continued, (stop, two.h2o)
        assert (two.h2o["conversation"] == one.h2o["conversation"]) is continued
        fresh = c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=1,
                                          extra_body={"cache_salt": f"fresh {stop}"})  # fmt: skip
        assert two.usage.prompt_tokens == fresh.usage.prompt_tokens  # the continued cache: no token of the stop


def test_a_continued_conversation_s_penalty_window_holds_what_its_cache_read(embedded_server, monkeypatch):
    """A request that continues a kept conversation reads only its new turn; the row's repetition window now
    starts with the conversation's last tokens (its earlier prompt and reply), as a fresh read of the whole
    would hold them: before, it held the new turn alone, and the same greedy request got another reply
    depending on whether its conversation was kept."""
    from h2o_chat.engine.step.sampling import PENALTY_WINDOW, RowSampler

    _, port = embedded_server
    seen: list[list[int]] = []
    real = RowSampler.start_row

    def recording(self, r, ids, seed=None, history=None):
        seen.append(list(history or []))
        return real(self, r, ids, seed, history)

    monkeypatch.setattr(RowSampler, "start_row", recording)
    c = client(port)
    messages = [{"role": "user", "content": "Name three fruits."}]
    one = c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=4)
    messages += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "More?"}]
    two = c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=4)
    assert not two.h2o["read_again"] and seen[0] == []
    assert len(seen[1]) == min(PENALTY_WINDOW, two.h2o["cached_tokens"]) > 0


def test_models_health_and_stats(embedded_server):
    _, port = embedded_server
    assert [m.id for m in client(port).models.list()] == ["smollm2-135m"]
    assert get(port, "/health") == (200, {"status": "ok", "model": "smollm2-135m", "draining": False})
    status, stats = get(port, "/v1/stats")
    assert status == 200 and stats["rows_max"] == 4 and stats["idle_conversations"]["count"] >= 1
    assert stats["memory"]["rss"] > 0 and all(lane["budget"] for lane in stats["lanes"])


# -- bad input: one clear status and message each, and the server serves on ---------------------------------------
BAD = [
    ("malformed JSON", b'{"messages": [', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "must be a JSON object"),
    ("unknown field", {"messages": CHAT, "tempreature": 0.5}, 400, 'unknown field "tempreature"'),
    ("wrong type", {"messages": CHAT, "max_tokens": "10"}, 400, '"max_tokens": input should be a valid integer'),
    ("wrong type in a message", {"messages": [{"role": "user", "content": 5}]}, 400, '"messages.0.content"'),
    ("no messages", {"temperature": 0}, 400, '"messages" is required'),
    ("an unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, '"messages.0.role"'),
    ("n above 1", {"messages": CHAT, "n": 2}, 400, '"n" must be 1'),
    ("a temperature out of range", {"messages": CHAT, "temperature": -1}, 400, '"temperature" must be between'),
    ("budget zero", {"messages": CHAT, "budget": 0}, 400, '"budget" must be a positive number'),
    ("budget above the limit", {"messages": CHAT, "budget": 10**9}, 400, "above this server's limit of 4096"),
    ("budget too small for snap", {"messages": CHAT, "budget": 1}, 400, "snap needs a budget of at least 2"),
    ("a policy not served", {"messages": CHAT, "policy": "full"}, 400, "\"policy\" 'full' is not served"),
    ("huge body", b'{"messages": "' + b"a" * 200_000 + b'"}', 413, "larger than this server's limit of 65,536"),
    ("an image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, '"messages.0.content.0": only text parts are supported (type "text"), got a part of type "image_url"'),
    ("a text part without its text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     '"messages.0.content.0.text" is required'),
    ("an unknown field in a message", {"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, 400,
     'unknown field "messages.0.colour"; a message takes: role, content, name'),
    ("an unknown stream option", {"messages": CHAT, "stream": True, "stream_options": {"continuous": True}}, 400,
     'unknown field "stream_options.continuous"; "stream_options" takes: include_usage'),
    ("a tool call sent back", {"messages": [*CHAT, {"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}]},
     400, '"messages.1.tool_calls": "tool_calls" is not supported by this server'),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "status", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_one_clear_error_and_the_server_serves_on(embedded_server, case, body, status, words):
    _, port = embedded_server
    got, answer = post(port, "/v1/chat/completions", body)
    assert got == status, answer
    message = answer["error"]["message"]
    assert words in message and "\n" not in message and "Traceback" not in message
    ok, reply = post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    assert ok == 200 and reply["usage"]["completion_tokens"] == 1


def test_a_reply_sent_back_as_openai_clients_dump_it_and_null_fields_are_taken():
    """`messages.append(reply.choices[0].message.model_dump())` sends the reply back with OpenAI's empty fields
    (refusal, tool_calls, ... null or empty), and clients send null where a field has a default (stream)."""
    from h2o_chat.app.serve.api import ApiError, parse_request

    dumped = {"role": "assistant", "content": "Blue.", "refusal": None, "tool_calls": None, "function_call": None,
              "audio": None, "annotations": []}  # fmt: skip
    req = parse_request({"messages": [*CHAT, dumped, {"role": "user", "content": "Another?"}], "stream": None},
                        "chat", Limits())  # fmt: skip
    assert req.messages[1] == {"role": "assistant", "content": "Blue."} and req.stream is False
    assert ApiError(503, "busy").body()["error"]["type"] == "server_error"  # OpenAI's type for its 5xx
    assert ApiError(400, "bad").body()["error"]["type"] == "invalid_request_error"


def test_an_api_key_is_required_when_set(tiny, one_thread):
    with serving(tiny, api_keys=("sesame",)) as (_, port):
        body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
        for headers, why in (({}, "no API key"), ({"Authorization": "Bearer wrong"}, "a wrong API key")):
            status, answer = post(port, "/v1/chat/completions", body, headers)
            assert status == 401 and why in answer["error"]["message"]
            assert get(port, "/v1/models", headers)[0] == 401
        with pytest.raises(openai.AuthenticationError):
            client(port, "wrong").models.list()
        reply = client(port, "sesame").chat.completions.create(model="t", **body)
        assert reply.usage.completion_tokens == 2


def test_a_cache_that_cannot_fit_is_a_503_and_the_server_serves_on(tiny, one_thread, monkeypatch):
    from h2o_chat.models import memory

    with serving(tiny) as (server, port):
        monkeypatch.setattr(memory, "available_memory", lambda: 2**20)  # 1 MB left: no new lane fits
        body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2, "budget": 3000}
        status, answer = post(port, "/v1/chat/completions", body)
        assert status == 503 and "no memory for this conversation's cache" in answer["error"]["message"]
        assert '"budget"' in answer["error"]["message"]  # says which budget would fit
        monkeypatch.undo()
        assert post(port, "/v1/chat/completions", body)[0] == 200
        assert server.scheduler.busy == 0


def test_a_client_gone_mid_stream_frees_its_row_at_the_next_step(embedded_server, monkeypatch):
    """...and --verbose says so in a line of its own (such a reply had none)."""
    server, port = embedded_server
    served, said = server.scheduler.served, []
    monkeypatch.setattr(server.scheduler.replies, "log", said.append)
    body = json.dumps({"messages": CHAT, "max_tokens": 5000, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data: ") < 3:  # the role, then text: the reply is under way
            got += sock.recv(65536)
        assert get(port, "/v1/stats")[1]["rows_busy"] == 1
    deadline = time.monotonic() + 30
    while get(port, "/v1/stats")[1]["rows_busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = get(port, "/v1/stats")[1]
    assert stats["rows_busy"] == 0 and server.scheduler.served == served  # freed, not finished: 5000 tokens
    gone = r"conv-\w+: the client went away after \d+ generated tokens; its row is free"
    assert len(said) == 1 and re.fullmatch(gone, said[0]), said


def test_the_command_serves_and_stops_cleanly_on_sigterm(tiny):
    folder = tiny.spec.source
    command = [sys.executable, "-m", "h2o_chat", "serve", "-m", folder, "--device", "cpu", "--port", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "serving" in line and "http://127.0.0.1:" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        body = {"prompt": "w5 w6", "max_tokens": 3}
        status, reply = post(port, "/v1/completions", body)
        assert status == 200 and reply["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        out = proc.stderr.read()
        assert proc.wait(30) == 0 and "stopped" in out and "Traceback" not in out
    finally:
        proc.kill()


def test_the_command_refuses_what_it_cannot_serve_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "h2o_chat", "serve", "--policy", "full"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--policy full is not served" in result.stderr


def test_an_address_it_cannot_serve_is_one_line_before_the_weights_load():
    """A port in use, or a host that is not this machine's: uvicorn said so in its own log line (status 3) once the
    weights had loaded, after a warning about listening without a key. The socket is now bound first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = (
            (["--port", str(port)], f"cannot serve on 127.0.0.1:{port}: port {port} is in use by another program"),
            (["--host", "999.1.1.1"], "--host 999.1.1.1: not an address this machine can listen on"),
        )
        for args, said in cases:
            command = [sys.executable, "-m", "h2o_chat", "serve", *args]
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
            assert result.returncode == 2 and result.stderr.startswith("h2o-chat: error: "), result.stderr
            assert said in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_kv_memory_is_every_rows_together_as_recall_memory_and_batch_take_it():
    """--kv-memory SIZE with --batch-size N: each conversation's budget is what SIZE holds for N rows (the fit check
    counts N rows of it), said on stderr before the weights load; --max-budget below it stops there in one line."""

    def budget_for(rows: int) -> tuple[int, int]:
        command = [sys.executable, "-m", "h2o_chat", "serve", "--kv-memory", "12MB", "--max-budget", "1"]
        result = subprocess.run([*command, "--batch-size", str(rows)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        said, refused = result.stderr.splitlines()
        each = f" for each of {rows} rows" if rows > 1 else ""
        assert said.startswith("h2o-chat: --kv-memory 12MB: a budget of ") and f" tokens{each} (" in said, said
        tokens = int(said.split("a budget of ")[1].split(" tokens")[0].replace(",", ""))
        per_token = int(said.split(" (")[1].split(" bytes")[0].replace(",", ""))
        assert f"--budget {tokens} is above --max-budget 1" in refused
        return tokens, per_token

    (one, per_token), (four, same) = budget_for(1), budget_for(4)
    assert same == per_token and one == (12 << 20) // per_token and four == (12 << 20) // (4 * per_token)


# -- under load ---------------------------------------------------------------------------------------------------
def resident() -> int:
    """This process's resident memory once the C heap has given back what it freed (glibc keeps freed blocks, and
    the resident figure would then follow the allocator's history, not what is held)."""
    import ctypes

    import psutil

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def settled(server) -> tuple[int, int, list[int]]:
    """(bytes of every live tensor, resident bytes, each lane's rows) once the idle server has shrunk its lanes
    (the engine thread's loop halves an idle lane per turn: lanes follow the peak of concurrent replies, so between
    two moments their rows differ by chance), measured in the engine thread between steps."""
    import gc

    def measure() -> tuple[int, int, list[int]]:
        gc.collect()
        storages = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.layout == torch.strided:
                storage = o.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values()), resident(), [lane.size for lane in server.scheduler.lanes]

    for _ in range(8):
        server.scheduler.call(lambda: None).result(60)
    return server.scheduler.call(measure).result(60)


def test_sixteen_conversations_at_once_each_equal_to_it_alone(embedded, one_thread):
    """16 streaming clients, 7 turns each, decode together: every reply is complete and each conversation's text
    is what the chat path (app/chat/conversation.py) gives it alone (greedy); once every conversation is open the
    process's resident memory stays flat; clients killed mid-stream leave no busy row. Short messages keep the
    test quick: a turn then reads about a dozen tokens."""
    from h2o_chat.app.chat.conversation import ChatSettings, Conversation
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step.sampling import Sampler

    clients, turns, budget, max_tokens = 16, 7, 64, 3
    limits = Limits(policy="h2o", budget=budget, max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.1)
    replies: dict[int, list[str]] = {}
    held: list[tuple[int, int, list[int]]] = []
    errors: list[BaseException] = []
    running: list = []  # the server, for the barrier's measurement
    opened = threading.Barrier(clients, action=lambda: held.append(settled(running[0])))

    def converse(i: int, port: int) -> None:
        try:
            c, messages = client(port), []
            for t in range(turns):
                messages.append({"role": "user", "content": f"{i}-{t}"})
                chunks = list(c.chat.completions.create(model="m", messages=messages, stream=True))
                end = [ch for ch in chunks if ch.choices][-1]
                assert end.choices[0].finish_reason in ("stop", "length") and not end.h2o["read_again"]
                assert (end.h2o["cached_tokens"] > 0) == (t > 0)  # each turn after the first reads only itself
                messages.append({"role": "assistant", "content": "".join(ch.choices[0].delta.content or ""
                                                                         for ch in chunks if ch.choices)})  # fmt: skip
                if t in (1, 4):  # every conversation has its cache: memory must stay flat from here
                    opened.wait(300)
            replies[i] = [m["content"] for m in messages if m["role"] == "assistant"]
        except BaseException as e:
            errors.append(e)
            opened.abort()

    def killed(port: int) -> None:
        stream = client(port).chat.completions.create(model="m", messages=CHAT, stream=True, max_tokens=2000)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        stream.close()  # the connection goes: its row must be freed at the next step

    with serving(embedded, limits=limits, rows=16, max_sessions=16) as (server, port):
        running.append(server)
        threads = [threading.Thread(target=converse, args=(i, port)) for i in range(clients)]
        threads += [threading.Thread(target=killed, args=(port,)) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        assert not errors, errors[0]
        deadline = time.monotonic() + 30
        while (server.scheduler.busy or server.scheduler.waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        held.append(settled(server))
        stats = get(port, "/v1/stats")[1]
        assert stats["rows_busy"] == 0 and stats["waiting"] == 0
        assert stats["idle_conversations"]["count"] == 16
    # after turn 2 every conversation's cache exists (budget 64: 3 MB each) and a settled server holds the same
    # tensors from then on, to the byte. The process's resident memory also follows the C heap's history and
    # Python's objects (it moved by 10-25 MB from one moment to the next, either way, once beyond 48 MB), so it
    # only has to stay under what keeping one copy per conversation and turn would add: 48 MB a turn, 240 in all
    tensors, rss, lanes = zip(*held, strict=True)
    assert all(size == [1] for size in lanes), lanes
    assert tensors[0] == tensors[1] == tensors[2], f"live tensors: {[t / 2**20 for t in tensors]} MB"
    assert max(rss[1:]) - rss[0] < 96 * 2**20, f"resident memory: {[r / 2**20 for r in rss]} MB"

    for i in range(clients):
        settings = ChatSettings(max_new_tokens=max_tokens, sampler=Sampler(repetition_penalty=1.1), decode="eager")
        alone = Conversation(embedded, make_policy("h2o", budget), settings)
        for t in range(turns):
            text = "".join(r.text for r in alone.send(f"{i}-{t}"))
            assert text == replies[i][t], (i, t)


def test_recall_conversations_continued_from_their_snapshots_equal_each_alone(embedded, one_thread):
    """Issue 46.4: the server serves recall. Its rows' snapshots carry the store (what each conversation evicted),
    so three conversations decoding together, each put aside between turns and continued from its snapshot,
    give what the chat path gives each alone (greedy), with the store counted in the idle conversations' bytes
    and a store small enough that it fills and drops."""
    from h2o_chat.app.chat.conversation import ChatSettings, Conversation
    from h2o_chat.app.serve.sessions import snapshot_bytes
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step.sampling import Sampler

    clients, turns, budget, store, max_tokens = 3, 5, 32, 32, 6
    limits = Limits(policy="recall", budget=budget, max_tokens=max_tokens, temperature=0.0, store=store)
    replies: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def converse(i: int, port: int) -> None:
        try:
            c, messages = client(port), []
            for t in range(turns):
                messages.append({"role": "user", "content": f"Tell me about the number {10 * i + t}."})
                reply = c.chat.completions.create(model="m", messages=messages)
                assert (reply.h2o["cached_tokens"] > 0) == (t > 0) and not reply.h2o["read_again"]
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            replies[i] = [m["content"] for m in messages if m["role"] == "assistant"]
        except BaseException as e:
            errors.append(e)

    with serving(embedded, limits=limits, rows=4, max_sessions=8) as (server, port):
        threads = [threading.Thread(target=converse, args=(i, port)) for i in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        assert not errors, errors[0]
        idle = list(server.store._idle.values())
        assert len(idle) == clients
        for session in idle:
            held = session.state["store"]
            assert held is not None and session.nbytes == snapshot_bytes(session.state) > held.nbytes() > 0
            assert held.capacity == store and float(held.dropped()[0]) > 0  # it filled and dropped
    for i in range(clients):
        settings = ChatSettings(max_new_tokens=max_tokens, sampler=Sampler(repetition_penalty=1.1), decode="eager")
        alone = Conversation(embedded, make_policy("recall", budget, store=store), settings)
        for t in range(turns):
            text = "".join(r.text for r in alone.send(f"Tell me about the number {10 * i + t}."))
            assert text == replies[i][t], (i, t)


@pytest.mark.parametrize("policy", ["snap", "recall"])
def test_new_conversations_arriving_together_are_read_in_one_batch_each_as_alone(embedded, one_thread, policy):
    """Three new conversations that arrive while the engine thread is busy are read in one left-padded batch
    (their prompts 32 to 45 tokens, over the budget of 24: each is compressed, recall's store filled), and each
    reply is what the chat path gives it alone (greedy); a continued turn is read alone, as before."""
    from h2o_chat.app.chat.conversation import ChatSettings, Conversation
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step.sampling import Sampler

    asks = ["Hi.", "Tell me something about the number seven, please, in a long answer.", "Name three animals."]
    budget, max_tokens = 24, 6
    limits = Limits(policy=policy, budget=budget, max_tokens=max_tokens, temperature=0.0)
    replies: dict[int, list[str]] = {}
    with serving(embedded, limits=limits, rows=4) as (server, port):
        gate = threading.Event()
        server.scheduler.call(gate.wait)  # the engine thread waits: the three requests queue up meanwhile

        def converse(i: int) -> None:
            c, messages = client(port), []
            for ask in (asks[i], "Why?"):
                messages.append({"role": "user", "content": ask})
                reply = c.chat.completions.create(model="m", messages=messages).choices[0].message.content
                messages.append({"role": "assistant", "content": reply})
            replies[i] = [m["content"] for m in messages if m["role"] == "assistant"]

        threads = [threading.Thread(target=converse, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 60
        while server.scheduler.inbox.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for th in threads:
            th.join(300)
        assert get(port, "/v1/stats")[1]["prompts_read_together"] == 3
    for i, ask in enumerate(asks):
        settings = ChatSettings(max_new_tokens=max_tokens, sampler=Sampler(repetition_penalty=1.1), decode="eager")
        alone = Conversation(embedded, make_policy(policy, budget), settings)
        texts = ["".join(r.text for r in alone.send(text)) for text in (ask, "Why?")]
        assert texts == replies[i], i
