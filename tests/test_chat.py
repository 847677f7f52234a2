"""The interactive session, driven through prompt-toolkit's pipe input, and the real command in a pty."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from h2o_chat.app import ui
from h2o_chat.app.chat.conversation import ChatSettings, Conversation
from h2o_chat.app.chat.interactive import ChatSession, make_prompt_session
from h2o_chat.app.piped import RunOptions
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.generate import Sampler


def session(
    embedded, tmp_path, budget=64, max_new_tokens=16, panel=False, terminal=False, policy=None, width=100, **settings
):
    console = Console(file=io.StringIO(), force_terminal=terminal, width=width, no_color=True)
    options = RunOptions(
        policy=policy or make_policy("h2o", budget),
        settings=ChatSettings(
            max_new_tokens=max_new_tokens, sampler=settings.pop("sampler", Sampler(temperature=0)), **settings
        ),
        panel=panel,
    )
    return ChatSession(embedded, options, console)


def plain(screen: str) -> str:
    """Terminal output without its escape sequences (styles, cursor moves)."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)


def drive(chat: ChatSession, tmp_path: Path, keys: str) -> str:
    with create_pipe_input() as pipe:
        chat.prompt = make_prompt_session(tmp_path / "history", chat, input=pipe, output=DummyOutput())
        pipe.send_text(keys)
        chat.run()
    return chat.console.file.getvalue()


def test_slash_commands_budget_save_load(embedded, tmp_path):
    chat = session(embedded, tmp_path)
    saved = tmp_path / "talk.json"
    out = drive(
        chat,
        tmp_path,
        "What is two plus two?\r/budget 32\r/stats\r/policy sink\r/evicted\r"
        f"/save {saved}\r/load {saved}\rAnd three plus three?\r/nope\r/budget x\r/exit\r",
    )
    assert "cache: h2o 32 = 16 heavy + 16 recent; evicted" in out
    assert "cache: sink 32 = 4 sink + 28 recent" in out
    assert "KV cache" in out  # /stats panel
    assert "user" in out and "assistant" in out and "%" in out  # /evicted table
    assert f"saved 2 messages to {saved}" in out
    assert "loaded 2 messages" in out
    assert "unknown command /nope" in out
    assert "error: /budget takes a number of tokens (512), a memory (64MB) or a share of the trained" in out
    data = json.loads(saved.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert [m["role"] for m in chat.conv.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.conv.cache.stats().kept <= 32
    history = (tmp_path / "history").read_text()
    assert "What is two plus two?" in history and "/budget 32" in history


def test_unwritable_history_turns_history_off_and_the_session_runs(embedded, tmp_path):
    blocker = tmp_path / "home-is-a-file"  # as root, permission bits stop nothing: a file in the path does
    blocker.write_text("")
    chat = session(embedded, tmp_path, max_new_tokens=4)
    with create_pipe_input() as pipe:
        chat.prompt = make_prompt_session(blocker / "h2o-chat" / "history", chat, input=pipe, output=DummyOutput())
        pipe.send_text("Say hi.\r/exit\r")
        chat.run()
    out = chat.console.file.getvalue()
    notes = [line for line in out.splitlines() if "history is off" in line]
    assert len(notes) == 1 and str(blocker / "h2o-chat" / "history") in notes[0]
    assert [m["role"] for m in chat.conv.messages] == ["user", "assistant"]  # the turn still ran


def test_the_history_file_keeps_a_long_paste_capped_and_the_session_keeps_it_whole(embedded, tmp_path):
    """Issue 48.13: a pasted ~4,900-token message landed whole in the history file, for every later session to
    load. The file keeps the first 4,096 characters of an entry, cut between words; Up in this session still
    brings the whole message back."""
    from h2o_chat.app.chat.interactive import HISTORY_ENTRY_CHARS

    chat = session(embedded, tmp_path)
    with create_pipe_input() as pipe:
        prompt = make_prompt_session(tmp_path / "history", chat, input=pipe, output=DummyOutput())
    paste = " ".join(f"Note {i}: the red box on shelf {i} holds 1234567 beads." for i in range(200))  # ~10 KB
    prompt.history.append_string(paste)
    prompt.history.append_string("Say hi.")
    kept = (tmp_path / "history").read_text()
    assert len(kept) < HISTORY_ENTRY_CHARS + 200 and "+Say hi." in kept
    entry = next(line for line in kept.splitlines() if line.startswith("+Note 0"))[1:]
    assert entry.endswith(" …") and paste.startswith(entry[:-2]) and paste[len(entry) - 2] == " "  # whole words
    assert list(prompt.history.get_strings())[-2] == paste  # this session's Up: the whole message


def test_budget_change_keeps_the_policy_settings(embedded, tmp_path):
    chat = session(embedded, tmp_path, policy=make_policy("snap", 64, sinks=2, window=8, kernel=3))
    chat.commands.cmd_budget("48")
    assert chat.conv.policy == make_policy("snap", 48, sinks=2, window=8, kernel=3)
    chat.commands.cmd_policy("h2o")
    assert chat.conv.policy == make_policy("h2o", 48)
    chat.commands.cmd_policy("snap")  # a default window (12 at budget 48) follows the budget down
    chat.commands.cmd_budget("12")
    assert chat.conv.policy == make_policy("snap", 12) and chat.conv.policy.window == 3
    chat.commands.cmd_policy("full")
    chat.commands.cmd_budget("40")  # from the full cache a budget means the default policy again
    assert chat.conv.policy == make_policy("snap", 40)
    per_token = 30 * 3 * (2 * 64 * 4 + 20)  # the embedded model's slot of a token (fp32 K, V; position, score)
    chat.commands.cmd_budget("2MB")  # a memory: the tokens whose keys and values fit in it
    assert chat.conv.policy == make_policy("snap", 2**21 // per_token)
    out = chat.console.file.getvalue()
    assert "cache: snap 48 = 2 sink + 22 heavy + 24 recent; prompts kept by their last 8 queries" in out
    # the switch from full is said, not only the new policy named
    assert (
        "cache: snap 40 = 20 heavy + 20 recent; prompts kept by their last 10 queries (was full, which has no "
        "budget: a budget is snap's; /policy full goes back)" in out
    )


def test_policy_and_budget_are_independent_settings(embedded, tmp_path):
    chat = session(embedded, tmp_path, budget=512, policy=make_policy("snap", 512))
    out = drive(chat, tmp_path, "/budget 64\r/policy full\r/policy snap\r/policy h2o\r/exit\r")
    assert chat.conv.policy == make_policy("h2o", 64)  # not back to 512 after a detour through full
    assert "cache: snap 64 = 32 heavy + 32 recent" in out


def test_cache_carries_over_between_turns(embedded, tmp_path):
    chat = session(embedded, tmp_path, budget=4096)
    drive(chat, tmp_path, "Say hello.\rNow say goodbye.\r/exit\r")
    conv = chat.conv
    stats = conv.cache.stats()
    assert conv.fed == stats.seen  # every token counted once: the second turn prefilled only new text
    second_user = conv.ledger.spans[2]
    assert second_user.role == "user" and second_user.end - second_user.start < 25


def test_a_chat_on_cpu_runs_the_compiled_step_from_the_first_reply_it_is_ready_for(embedded, monkeypatch):
    """--decode auto on a CPU: a chat runs the compiled step from its first decode step when the step's package is
    on disk (the install builds the default kinds); a kind not built yet is asked of the builder (a process of its
    own) once, and its replies decode eagerly until it is there, then compiled -- the same tokens either way.
    (The program here is the exported module run as it is, so that the suite compiles nothing.)"""
    from h2o_chat.engine.step import compiled

    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    built = {"now": False}
    monkeypatch.setattr(compiled, "ready", lambda *a: built["now"])

    class Eagerly:
        def __init__(self, model, cache, sampler, keyword, status=None):
            self.model, self.keyword = model, keyword

        def __call__(self, tokens, positions, cache, sampler):
            step = compiled.StepModule(self.model, cache, sampler, self.keyword)
            span = torch.zeros(cache.forward.width or cache.slots.capacity, dtype=torch.long)
            return step(tokens, positions, span, *compiled.state_of(cache, sampler))

        def take_seconds(self):  # a loaded package compiles nothing at a call
            return 0.0

    monkeypatch.setattr(compiled, "program", Eagerly)
    texts = ("Count from one to twenty.", "Go on.", "Again, please.")
    replies = {}
    for mode in ("eager", "auto"):
        settings = ChatSettings(max_new_tokens=8, sampler=Sampler(0.7, seed=5), stop=(), decode=mode)
        conv = Conversation(embedded, make_policy("recall", 64), settings)
        asked, modes = [], []
        conv.engine.builder = asked.append
        out = []
        for i, text in enumerate(texts):
            built["now"] = i > 0  # the build finishes during the first reply
            out.append("".join(r.text for r in conv.send(text)))
            modes.append(conv.engine.describe())
        replies[mode] = out
        if mode == "auto":
            assert asked == [compiled.StepKind(recalls=True, sampler=(True, False, False, False))], asked
            assert modes[0] == "eager (the compiled step is being built)" and modes[2].startswith("compiled"), modes
    assert replies["auto"] == replies["eager"]


def test_second_turn_feeds_only_the_template_tail(embedded):
    conv = Conversation(embedded, make_policy("h2o", 512), ChatSettings(max_new_tokens=8, sampler=Sampler(0)))
    list(conv.send("Hi"))
    ids, _ = conv._new_turn({"role": "user", "content": "Again"})
    text = embedded.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")
    assert "Hi" not in text and "system" not in text


def test_ctrl_c_stops_the_reply_and_keeps_the_session(embedded, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = ui.StreamView.update

    def update(self, piece, stats_fn):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, handled between tokens
        return real(self, piece, stats_fn)

    monkeypatch.setattr(ui.StreamView, "update", update)
    chat = session(embedded, tmp_path, max_new_tokens=60)
    out = drive(chat, tmp_path, "Write a long poem about the sea.\rWhat did you write about?\r/exit\r")
    assert "(reply stopped)" in out
    messages = chat.conv.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert 0 < len(messages[1]["content"]) < 60  # the stopped reply, kept as far as it got
    assert chat.conv.fed == chat.conv.cache.stats().seen


def test_evicted_after_load_lists_every_message_with_its_role_and_tokens(embedded, tmp_path):
    tok = embedded.tokenizer
    messages = [
        {"role": "system", "content": "You are terse."},
        *(
            {"role": role, "content": f"{role} message {i}: " + " ".join(["lorem ipsum"] * (3 + i))}
            for i, role in enumerate(["user", "assistant"] * 3)
        ),
    ]
    saved = tmp_path / "talk.json"
    saved.write_text(json.dumps({"format": "h2o-chat/1", "messages": messages}))
    chat = session(embedded, tmp_path, budget=48, max_new_tokens=4)
    out = drive(chat, tmp_path, f"/load {saved}\rAnd now?\r/evicted\r/exit\r")

    def length(msgs, generation_prompt=False):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    question = [*messages, {"role": "user", "content": "And now?"}]
    expected = [length(messages[:1])] + [length(messages[: k + 1]) - length(messages[:k]) for k in range(1, 7)]
    expected.append(length(question, True) - length(messages))
    table = out[out.rindex("/evicted") if "/evicted" in out else 0 :]
    rows = re.findall(r"^\s*(\d+)\s+(system|user|assistant)\s+(\d+)\s+(\d+)%", table, re.M)
    assert [(int(i), role) for i, role, _, _ in rows] == [(i, m["role"]) for i, m in enumerate(question)] + [
        (8, "assistant")
    ]
    assert [int(n) for _, _, n, _ in rows[:8]] == expected  # each message's own tokens, not one 1,000-token span
    assert int(rows[7][3]) == 100 and int(rows[1][3]) < 100  # the question is cached; old messages were evicted
    assert 'your message "And now?"' not in out  # the note no longer blames the question


def test_a_long_message_shows_reading_progress_and_a_budget_note(embedded, tmp_path):
    chat = session(embedded, tmp_path, max_new_tokens=2, panel=True, terminal=True, policy=make_policy("snap", 16))
    long = " ".join(f"Item {i} is a small red box." for i in range(16))  # ~150 tokens: over 8x the budget
    calls = []
    send = chat.conv.send
    chat.conv.send = lambda text, **kw: send(text, progress=lambda d, t: (calls.append((d, t)), kw["progress"](d, t)))
    out = plain(drive(chat, tmp_path, f"{long}\r/exit\r"))
    n = chat.conv.pending
    # issue 22.19: the total counts snap's two passes from the first call (it no longer jumps from n to 2n)
    assert calls[0] == (0, 2 * n) and calls[-1] == (2 * n, 2 * n) and {t for _, t in calls} == {2 * n}
    assert "reading your message (twice: snap)" in out and f"/{2 * n} tokens" in out and "ETA" in out
    note = next(line for line in out.splitlines() if "budget of 16" in line)
    assert f"the prompt is {n:,} tokens" in note
    assert out.index(note) < out.index("reading your message")  # said before the reading starts


def test_notes_come_when_a_message_falls_below_half_and_a_tenth_once_each(embedded, tmp_path):
    """Issue 38.5: no note while 1% goes; one when a message falls below half held, one below a tenth."""
    chat = session(embedded, tmp_path, budget=40, max_new_tokens=12, width=400)
    turns = ["Please remember the word pineapple.", "Tell me about oceans.", "And rivers?", "And lakes?", "The word?"]
    out = drive(chat, tmp_path, "\r".join(turns) + "\r/exit\r")
    notes = [line for line in out.splitlines() if line.startswith("note: your message")]
    shares = [int(re.search(r" (\d+)% cached", note).group(1)) for note in notes]
    assert notes and all(s < 50 for s in shares), notes  # nothing at 95% or "100% kept"
    first = [s for n, s in zip(notes, shares, strict=True) if "pineapple" in n]
    assert first and len(first) <= 2 and (len(first) == 1 or first[1] < 10 <= first[0]), notes
    kept = {r.index: r.kept for r in chat.conv.evictions() if r.role == "user"}
    assert all(kept[i] < level for i, level in chat.conv.ledger.warned.items())


def test_a_recall_chat_says_at_most_one_note_a_turn(embedded, tmp_path):
    """Issue 38.5: with -p recall a note of what was recalled came on top of the eviction note every turn."""
    chat = session(embedded, tmp_path, max_new_tokens=12, width=400, policy=make_policy("recall", 40))
    turns = ["My name is Ada and I live in Paris.", "Tell me about oceans.", "And rivers?", "And lakes?", "My name?"]
    out = drive(chat, tmp_path, "\r".join(turns) + "\r/exit\r")
    per_turn = [part.count("\nnote: ") for part in out.split("\n> ")[1:]]
    assert len(per_turn) == 6 and max(per_turn) <= 1, out


def test_the_panel_shows_what_the_recall_store_holds_and_what_it_dropped(embedded, tmp_path):
    """The store is allocated once: the panel gives its bytes as allocated, the evicted tokens it holds of its
    capacity and how many it dropped (none until it is full)."""
    chat = session(embedded, tmp_path, max_new_tokens=12, panel=True, terminal=True, width=220)
    chat.conv.set_policy(make_policy("recall", 40, store=64))
    out = plain(drive(chat, tmp_path, "My name is Ada and I live in Paris.\rTell me about oceans.\r/exit\r"))
    stats = chat.conv.stats()
    assert stats.store_bytes == chat.conv.cache.store.nbytes() and stats.store_capacity == 64
    assert 0 < stats.store_tokens <= 64 and stats.store_dropped == max(0, stats.evicted - 64)
    flat = " ".join(out.replace("│", " ").split())
    assert f"kept for recall: {ui.describe_store(stats)}" in flat


def test_undo_takes_back_the_last_exchange_and_the_cache_goes_back(embedded, tmp_path, monkeypatch):
    """/undo, as ollama's and llama-cli's users expect: the message and its reply go, and the cache is restored
    to before them (a small cache is copied before each turn), so the next reply is the one a session without
    the undone exchange gives. Without a copy, the conversation is re-read (said)."""
    from h2o_chat.app.chat import conversation

    chat = session(embedded, tmp_path, budget=48, max_new_tokens=8)
    out = drive(chat, tmp_path, "Hello there.\rName a colour.\r/undo\rName a fruit.\r/exit\r")
    assert 'took back "Name a colour." and its reply; the cache is as it was before them' in out
    alone = session(embedded, tmp_path, budget=48, max_new_tokens=8)
    drive(alone, tmp_path, "Hello there.\rName a fruit.\r/exit\r")
    assert chat.conv.messages == alone.conv.messages
    assert chat.conv.fed == alone.conv.fed == chat.conv.cache.stats().seen
    assert torch.equal(chat.conv.cache.slots.pos, alone.conv.cache.slots.pos)

    monkeypatch.setattr(conversation, "UNDO_SNAPSHOT_BYTES", 0)  # no copy kept: /undo re-reads, and says so
    rereading = session(embedded, tmp_path, budget=48, max_new_tokens=8)
    out = drive(rereading, tmp_path, "Hello there.\rName a colour.\r/undo\r/undo\r/undo\r/exit\r")
    assert "the cache could not go back" in out and "re-read on the next turn" in out
    assert "there is nothing to undo yet" in out and rereading.conv.messages == []


def test_show_clear_and_help_name_the_new_commands(embedded, tmp_path):
    """/show says what the chat runs (model, chat template source, settings, policy and budget); /clear clears
    the screen; /help lists them."""
    chat = session(embedded, tmp_path, terminal=True, width=200, system="Be brief.")
    out = plain(drive(chat, tmp_path, "/show\r/clear\r/help\r/exit\r"))
    assert "model: smollm2-135m (embedded:" in out and "chat template: the tokenizer's" in out
    assert "cache: h2o 64" in out
    assert "temperature 0" in out and "max_new_tokens 16" in out and "system prompt: 'Be brief.'" in out
    assert "\x1b[2J" in chat.console.file.getvalue() or "\x1b[H" in chat.console.file.getvalue()
    for command in ("/undo", "/show", "/clear"):
        assert f"\n{command} " in out
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    custom = session(embedded, tmp_path, chat_template=("mine.jinja", template))
    assert "chat template: mine.jinja" in drive(custom, tmp_path, "/show\r/exit\r")
    assert embedded.tokenizer.chat_template != custom.conv.tokenizer.chat_template


def _first_message_in_a_pty(args: list[str], tmp_path) -> str:
    """Run the installed command on a pseudo-terminal until it answered (Paris) and shows the prompt again, then
    /exit: the screen as plain text."""
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color", XDG_DATA_HOME=str(tmp_path))
    env.pop("NO_COLOR", None)
    term = Pty(args, env, 40, 120)
    try:
        assert term.read_until(b"Paris", 300), term.screen[-2000:]
        assert term.read_until(b"\x1b[?2004h", 60), term.screen[-2000:]  # then the prompt, for the next message
        term.write(b"/exit\r")
        term.read_until(b"\x00never", 3)
    finally:
        term.close()
    return plain(term.screen.decode(errors="replace"))


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_a_prompt_file_is_the_chats_first_message(tmp_path):
    """-f FILE on a terminal: the chat opens with the file's text sent as its first message, then goes on."""
    (tmp_path / "first.txt").write_text("What is the capital of France?", encoding="utf-8")
    args = ["-f", str(tmp_path / "first.txt"), "--temperature", "0", "--max-new-tokens", "12"]
    drawn = _first_message_in_a_pty(args, tmp_path)
    assert "> What is the capital of France?" in drawn  # echoed as the first message, before the reply
    assert drawn.index("> What is the capital of France?") < drawn.index("Paris")


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_chat_by_name_opens_the_chat_with_its_words_as_the_first_message(tmp_path):
    """Issue 48.8: `h2o-chat chat` replied once to the prompt "chat"; it opens the chat (as ollama's and llm's
    habits expect), the words after it sent as the first message."""
    words = ["What", "is", "the", "capital", "of", "France?"]
    drawn = _first_message_in_a_pty(["chat", "--temperature", "0", "-n", "12", *words], tmp_path)
    assert "> What is the capital of France?" in drawn and "/help for commands" in drawn  # the chat's banner


def test_panel_renders_on_a_terminal(embedded, tmp_path):
    chat = session(embedded, tmp_path, panel=True, terminal=True)
    out = drive(chat, tmp_path, "Hello!\r/exit\r")
    for label in ("policy", "h2o 64", "tokens", "evicted", "KV cache", "memory", "RSS", "decode"):
        assert label in out
    assert "tok/s (eager)" in out  # how decode steps run (the embedded model runs on the CPU here)


def test_panel_separates_allocated_from_in_use_kv(embedded, tmp_path):
    """Issue 48.13: "in use" read above what a full cache would hold while nothing was evicted: it counted the
    slots' positions and scores, which a full cache's figure does not. It counts the held keys and values."""
    chat = session(embedded, tmp_path, budget=512, panel=True, terminal=True)
    drive(chat, tmp_path, "Hello!\r/exit\r")
    stats, slots = chat.conv.stats(), chat.conv.cache.stats()
    assert stats.kv_used_bytes < stats.kv_bytes  # a first short turn fills a fraction of the budget
    text = " ".join(plain(chat.console.file.getvalue()).replace("│", " ").split())
    expected = (
        f"{ui.human_bytes(stats.kv_bytes)} allocated, {ui.human_bytes(stats.kv_used_bytes)} in use; "
        f"a full cache would hold {ui.human_bytes(stats.full_kv_bytes)}"
    )
    assert expected in text
    assert stats.seen == stats.kept and stats.kv_used_bytes == stats.full_kv_bytes  # nothing evicted yet
    assert slots.kv_used_bytes > slots.full_kv_bytes  # the library's figure: every field of the held slots


def test_an_impossible_budget_is_refused_and_the_session_goes_on(embedded, tmp_path, monkeypatch):
    """Issue 22.1: /budget gets the memory check --budget gets; a rejected setting never ends the session. (A budget
    within the trained context, 8,192, on a machine with 64 MB left: a larger one is capped to the context.)"""
    from h2o_chat.models import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 64 * 2**20)
    chat = session(embedded, tmp_path, budget=64)
    out = drive(chat, tmp_path, "/budget 8000\rSay hi.\r/exit\r")
    line = next(line for line in out.splitlines() if "error:" in line)
    assert "/budget 8000: a 8000-token KV cache needs" in line
    fits = int(re.search(r"/budget (\d+) fits", line).group(1))
    assert 64 <= fits < 8000
    assert chat.conv.policy == make_policy("h2o", 64)  # the old budget stays
    assert [m["role"] for m in chat.conv.messages] == ["user", "assistant"] and chat.conv.messages[1]["content"]


def test_out_of_memory_in_a_turn_keeps_the_session_and_the_conversation(embedded, tmp_path, monkeypatch):
    """Issue 22.1: an out-of-memory during a turn is told, the turn is taken back, the rest stays."""
    from h2o_chat.engine.step.decode import Engine

    real, calls = Engine.prefill, []

    def prefill(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "prefill", prefill)
    chat = session(embedded, tmp_path)
    saved = tmp_path / "after.json"
    out = drive(chat, tmp_path, f"What is two plus two?\rAnd three plus three?\rSay hi.\r/save {saved}\r/exit\r")
    assert "error: out of memory (" in out and "this message was taken back" in out
    roles = [m["role"] for m in chat.conv.messages]
    assert roles == ["user", "assistant", "user", "assistant"]  # the failed turn is gone, the rest is kept
    assert chat.conv.messages[2]["content"] == "Say hi." and chat.conv.fed == chat.conv.cache.stats().seen
    assert len(json.loads(saved.read_text())["messages"]) == 4


def test_load_refuses_devices_and_huge_files_and_ctrl_c_stops_only_the_command(embedded, tmp_path, monkeypatch):
    """Issue 22.2: /load reads only regular files, up to a limit; Ctrl-C stops the command, not the session."""
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(65 * 2**20)  # sparse: no disk used
    chat = session(embedded, tmp_path)
    out = drive(chat, tmp_path, f"/load /dev/null\r/load {huge}\r/load {tmp_path}\r/exit\r")
    assert "error: conversation file /dev/null is not a regular file (a device, a pipe or a socket)" in out
    assert f"conversation file {huge} is 65 MB; h2o-chat reads at most 64 MB" in out
    assert f"conversation file {tmp_path} is a folder" in out

    def interrupted(self, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(Conversation, "load", interrupted)
    chat = session(embedded, tmp_path, max_new_tokens=4)
    try:
        out = drive(chat, tmp_path, "/load big.json\rSay hi.\r/exit\r")
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during /load ended the session")
    assert "(stopped)" in out and [m["role"] for m in chat.conv.messages] == ["user", "assistant"]


def test_save_into_a_missing_folder_says_so_and_the_session_goes_on(embedded, tmp_path):
    """/save of a state file into a folder that does not exist ended the session in a traceback (safetensors'
    own error, not an OSError), and the conversation with it."""
    chat = session(embedded, tmp_path, max_new_tokens=4)
    missing = tmp_path / "nodir" / "x.h2o"
    out = drive(chat, tmp_path, f"Say hi.\r/save {missing}\r/save {tmp_path / 'x.h2o'}\r/exit\r")
    assert f"cannot write {missing}: the folder {missing.parent} does not exist" in out
    assert "Traceback" not in out and (tmp_path / "x.h2o").is_file()  # the session went on, and saved


def test_a_state_file_that_safetensors_cannot_write_is_one_error(monkeypatch, tmp_path):
    """safetensors reports its own I/O failures (a full disk) as SafetensorError: one StateError line, no file
    half written under the name or beside it."""
    import safetensors.torch
    from safetensors import SafetensorError

    from h2o_chat.app import statefile
    from h2o_chat.engine.storage.persist import StateError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(StateError, match="cannot write .*x.h2o: Error while serializing: I/O error: No space"):
        statefile.write(tmp_path / "x.h2o", "conversation", {}, None, {"t": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_load_warns_before_replacing_an_unsaved_conversation(embedded, tmp_path):
    """Issue 22.8: the first /load over unsaved messages says so; the same /load again replaces them."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"messages": [{"role": "user", "content": "Old question"}]}))
    chat = session(embedded, tmp_path, max_new_tokens=4)
    out = drive(chat, tmp_path, f"Say hi.\r/load {other}\r/exit\r")
    assert "2 unsaved messages" in out and f"/load {other} again replaces them" in out
    assert chat.conv.messages[0]["content"] == "Say hi."  # nothing replaced yet
    out = drive(chat, tmp_path, f"/load {other}\r/exit\r")
    assert "loaded 1 message from" in out and chat.conv.messages == [{"role": "user", "content": "Old question"}]
    saved = tmp_path / "saved.json"
    chat = session(embedded, tmp_path, max_new_tokens=4)
    out = drive(chat, tmp_path, f"Say hi.\r/save {saved}\r/load {other}\r/exit\r")  # saved: no question asked
    assert "unsaved" not in out and chat.conv.messages == [{"role": "user", "content": "Old question"}]
    # a file that cannot load says so at once, not after asking to replace the unsaved messages
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    chat = session(embedded, tmp_path, max_new_tokens=4)
    out = drive(chat, tmp_path, f"Say hi.\r/load {tmp_path / 'none.json'}\r/load {broken}\r/load {tmp_path}\r/exit\r")
    assert "unsaved" not in out and out.count("error:") == 3, out
    assert "is not a saved conversation (invalid JSON" in out and chat.conv.messages[0]["content"] == "Say hi."


def test_a_load_s_go_ahead_does_not_outlive_a_new_message_and_counts_only_what_is_unsaved(embedded, tmp_path):
    """A /load answered 'again replaces them', then a new message, then the same /load: it replaced the
    conversation without a word, the message sent after the question lost with it. It asks again, counting the
    messages not in the file last saved (a saved conversation continued by one exchange has 2 unsaved, not all)."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"messages": [{"role": "user", "content": "Old question"}]}))
    saved = tmp_path / "saved.json"
    chat = session(embedded, tmp_path, max_new_tokens=4)
    out = drive(chat, tmp_path, f"First message.\r/load {other}\rImportant second message.\r/load {other}\r/exit\r")
    assert out.count("again replaces them") == 2 and "4 unsaved messages" in out, out
    assert [m["content"] for m in chat.conv.messages if m["role"] == "user"] == [
        "First message.",
        "Important second message.",
    ]
    out = drive(chat, tmp_path, f"/save {saved}\rOne more.\r/load {other}\r/exit\r")
    assert "its 2 unsaved messages" in out, out
    out = drive(chat, tmp_path, f"/load {other}\r/exit\r")  # at once: the go-ahead
    assert chat.conv.messages == [{"role": "user", "content": "Old question"}]


def test_save_and_load_keep_the_system_prompt(embedded, tmp_path):
    """Issue 22.7: a save/load round trip keeps the persona (set by --system or /system)."""
    saved = tmp_path / "persona.json"
    chat = session(embedded, tmp_path, max_new_tokens=4, system="You are a pirate.")
    drive(chat, tmp_path, f"Say hi.\r/system You are a cat.\rSay hi.\r/save {saved}\r/exit\r")
    assert json.loads(saved.read_text())["messages"][0] == {"role": "system", "content": "You are a cat."}
    fresh = session(embedded, tmp_path, max_new_tokens=4)
    drive(fresh, tmp_path, f"/load {saved}\r/exit\r")
    assert fresh.conv.messages[0] == {"role": "system", "content": "You are a cat."}
    assert fresh.conv.messages == chat.conv.messages


def test_load_takes_a_bare_list_and_names_what_is_wrong(embedded, tmp_path):
    """Issue 22.14: a list of messages loads as a saved conversation does; a bad one says what is wrong."""
    bare, robot = tmp_path / "bare.json", tmp_path / "robot.json"
    bare.write_text('[{"role":"user","content":"hi"}]')
    robot.write_text('{"messages": [{"role":"user","content":"hi"}, {"role":"robot","content":"beep"}]}')
    chat = session(embedded, tmp_path)
    out = drive(chat, tmp_path, f"/load {robot}\r/load {bare}\r/exit\r")
    assert "message 2 has role 'robot': expected one of system, user, assistant" in out
    assert chat.conv.messages == [{"role": "user", "content": "hi"}]


def test_set_changes_sampling_for_the_next_replies(embedded, tmp_path):
    """Issue 22.20: /set NAME VALUE, checked as the command line checks it."""
    chat = session(embedded, tmp_path, max_new_tokens=4)
    out = drive(
        chat,
        tmp_path,
        "/set temperature 0.3\r/set top-k 5\r/set min_p 0.05\r/set max_new_tokens 3\r/set temperature inf\r"
        "/set top_k lots\r/set colour 3\rSay hi.\r/set\r/exit\r",
    )
    sampler = chat.conv.settings.sampler
    assert (sampler.temperature, sampler.top_k, sampler.min_p) == (0.3, 5, 0.05)
    assert (
        chat.conv.settings.max_new_tokens == 3
        and len(embedded.tokenizer(chat.conv.messages[1]["content"])["input_ids"]) <= 3
    )
    assert "temperature set to 0.3 from the next reply on" in out
    assert "error: temperature must be between 0 (greedy) and 10, got inf" in out
    assert "error: /set top_k takes a whole number, got 'lots'" in out and "/set takes one of temperature" in out
    assert "temperature 0.3, top_p 1.0, top_k 5, min_p 0.05" in out


@pytest.mark.parametrize("seed", [None, 7])
def test_each_reply_draws_fresh_noise_unless_a_seed_asks_for_repetition(embedded, monkeypatch, seed):
    """Issue 48.5: an unseeded chat kept one automatic seed for every turn and each prompt restarted the draw
    count, so every reply's k-th draw had the same noise as the first reply's. Now each reply draws anew; with
    --seed (or /set seed) the noise repeats, turn after turn, as a seed promises."""
    from h2o_chat.engine.step.sampling import RowSampler

    noise, real = [], RowSampler._exponential

    def exponential(self, ids):
        out = real(self, ids)
        noise.append(out.clone())
        return out

    monkeypatch.setattr(RowSampler, "_exponential", exponential)
    sampler = Sampler(temperature=1.0, top_p=1.0, seed=seed)  # top-p 1: each draw's noise covers the vocabulary
    conv = Conversation(embedded, make_policy("h2o", 64), ChatSettings(max_new_tokens=3, sampler=sampler))
    firsts = []
    for text in ("Name a colour.", "Name another."):
        noise.clear()
        list(conv.send(text))
        firsts.append(noise[:2])  # each turn's first and second draws
    for k in range(2):
        same = torch.equal(firsts[0][k], firsts[1][k])
        assert same == (seed is not None), (k, seed)


def test_decode_that_collapses_on_a_busy_cpu_is_a_note_in_the_chat(embedded, tmp_path, monkeypatch):
    """Issue 48.14: the chat says it as it happens, once a session (the piped summary: test_cli_usage)."""
    from h2o_chat.app.chat import slowdown

    now = [0.0]

    def clock():  # 20 ms steps, then 800 ms ones from the fourth window on
        now[0] += 0.02 if now[0] < 0.25 else 0.8
        return now[0]

    monkeypatch.setattr(slowdown, "clock", clock)
    monkeypatch.setattr(slowdown, "load_average", lambda: 5.0)
    monkeypatch.setattr(slowdown, "torch_threads", lambda: 2)
    monkeypatch.setattr(slowdown, "WINDOW", 4)
    chat = session(embedded, tmp_path, max_new_tokens=24, ignore_eos=True)
    out = drive(chat, tmp_path, "Count to five.\rCount to six.\r/exit\r")
    notes = [line for line in out.splitlines() if "decode slowed to" in line]
    assert len(notes) == 1 and notes[0].startswith("note: decode slowed to") and "--threads 1 may help" in notes[0]


def test_regen_answers_the_last_message_again(embedded, tmp_path):
    """Issue 22.20: /regen drops the last reply and generates it again (the conversation is re-read)."""
    chat = session(embedded, tmp_path, max_new_tokens=6)
    out = drive(chat, tmp_path, "/regen\rWhat is two plus two?\r/regen\r/exit\r")
    assert "error: there is no reply to generate again yet" in out
    assert "temperature is 0 (greedy): the same reply comes again" in out
    messages = chat.conv.messages
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "What is two plus two?"
    assert chat.conv.fed == chat.conv.cache.stats().seen  # the cache restarted and re-read the conversation
    first = out.split("> /regen")[2]
    assert messages[1]["content"].strip()[:10] in first  # the new reply was shown


def test_regen_at_temperature_0_repeats_the_reply_from_the_state_before_it(embedded, tmp_path):
    """Issue 47.4: /regen goes back to the cache the reply began from (as /undo does) and answers again: greedy,
    the same reply, and the cache as the first reply left it, bit for bit. (It re-read the conversation, whose
    replies a prompt chunk computed otherwise than the decode steps had: another reply.)"""
    chat = session(embedded, tmp_path, budget=512, max_new_tokens=24)
    drive(chat, tmp_path, "Hello there.\rName three fruits and say why you like them.\r/exit\r")
    first, keys, pos = list(chat.conv.messages), chat.conv.cache.slots.keys.clone(), chat.conv.cache.slots.pos.clone()
    out = drive(chat, tmp_path, "/regen\r/exit\r")
    assert "temperature is 0 (greedy): the same reply comes again" in out
    assert chat.conv.messages == first
    assert torch.equal(chat.conv.cache.slots.pos, pos) and torch.equal(chat.conv.cache.slots.keys, keys)


def test_a_chats_second_turn_equals_the_same_turns_read_fresh(embedded, tmp_path):
    """Issue 47.4: a conversation continued from its cache (the first reply decoded step by step) gives the reply
    that reading the same messages fresh gives (the first reply then read as a prompt chunk), greedy, with
    nothing evicted: a decode step and a prompt chunk compute a token alike."""
    chat = session(embedded, tmp_path, budget=512, max_new_tokens=24)
    saved = tmp_path / "first.json"
    drive(chat, tmp_path, f"Tell me a short story about a fox.\r/save {saved}\rWhat happened next?\r/exit\r")
    fresh = session(embedded, tmp_path, budget=512, max_new_tokens=24)
    drive(fresh, tmp_path, f"/load {saved}\rWhat happened next?\r/exit\r")
    assert chat.conv.cache.stats().evicted == 0
    assert [m["content"] for m in fresh.conv.messages] == [m["content"] for m in chat.conv.messages]


def test_a_new_engine_is_wired_to_the_view_at_once(embedded, tmp_path):
    """Issue 18: /reset and /load make a new engine; it is told where to say a capture starts without waiting
    for the next turn to re-wire it."""
    chat = session(embedded, tmp_path)
    chat.commands.run("/reset")
    assert chat.conv.engine.on_setup == chat.view.setup


def test_a_setup_notice_never_glues_to_the_reply(embedded, tmp_path, monkeypatch):
    """Issue 22.11: a capture (or compilation) announced mid-reply starts a line of its own."""
    from h2o_chat.engine.step.decode import Engine

    real = Engine.decode

    def decode(self, tokens=None):
        if self.on_setup is not None and not self.captures:
            self.captures = 1
            self.on_setup("capturing the decode step as a CUDA graph (once)")
        return real(self, tokens)

    monkeypatch.setattr(Engine, "decode", decode)
    chat = session(embedded, tmp_path, max_new_tokens=8)
    out = drive(chat, tmp_path, "What is the capital of France?\r/exit\r")
    line = next(line for line in out.splitlines() if "capturing" in line)
    assert line == "capturing the decode step as a CUDA graph (once) ..."


def test_long_lines_wrap_at_words_on_a_narrow_terminal(embedded, tmp_path):
    """Issue 22.12: the banner and notes wrap to a 40-column terminal at word boundaries."""
    chat = session(embedded, tmp_path, terminal=True, width=40)
    chat.view.banner(chat.conv.policy.describe())
    chat.view.note("the prompt is 4,360 tokens, 68x the budget of 64: the cache keeps about 1% of it")
    lines = plain(chat.console.file.getvalue()).splitlines()
    assert len(lines) > 2 and all(len(line) <= 40 for line in lines), lines
    words = " ".join(lines).split()
    assert "/help" in words and "commands," in words and "68x" in words and "keeps" in words  # none cut


def _installed_command() -> list[str]:
    script = Path(sys.executable).with_name("h2o-chat")
    return [str(script)] if script.exists() else [sys.executable, "-m", "h2o_chat"]


class Pty:
    """The real command on a pseudo-terminal of a given size; everything it draws is kept."""

    def __init__(self, args: list[str], env: dict, rows: int, columns: int):
        import fcntl
        import pty
        import struct
        import termios

        size = struct.pack("HHHH", rows, columns, 0, 0)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the real command on a terminal of that size from its first line
            fcntl.ioctl(0, termios.TIOCSWINSZ, size)
            os.execvpe(_installed_command()[0], [*_installed_command(), *args], env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, size)
        self.rows, self.columns, self.screen = rows, columns, b""

    def read_until(self, needle: bytes, timeout: float, start: int = 0) -> bool:
        """Read until `needle` (bytes, or a compiled bytes regex) has been drawn since `start`."""
        found = needle.search if isinstance(needle, re.Pattern) else lambda screen: needle in screen
        end = time.time() + timeout
        while time.time() < end:
            ready, _, _ = select.select([self.fd], [], [], 0.5)
            if ready:
                try:
                    self.screen += os.read(self.fd, 65536)
                except OSError:
                    return bool(found(self.screen[start:]))
            if found(self.screen[start:]):
                return True
        return False

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        os.waitpid(self.pid, 0)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_long_paste_and_ctrl_c_leave_a_clean_scrollback(tmp_path):
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color", XDG_DATA_HOME=str(tmp_path))
    env.pop("NO_COLOR", None)
    term = Pty(["--temperature", "0", "--max-new-tokens", "200", "-b", "64"], env, rows=24, columns=100)
    paste = "\n".join(f"Note {i:02d}: red box on shelf {i}." for i in range(1, 27))
    paste += "\n\nWrite a long story about these boxes."
    try:
        assert term.read_until(b"\x1b[?2004h", 120), term.screen[-2000:]  # the prompt is up (bracketed paste on)
        term.write(b"\x1b[200~" + paste.encode() + b"\x1b[201~")  # a bracketed paste, taller than the terminal
        term.read_until(b"\x00never", 1)  # keep reading while waiting: a full pty buffer blocks the command
        term.write(b"\r")
        assert term.read_until(b"reading your message", 60), term.screen[-2000:]  # the prompt's progress bar
        assert term.read_until(re.compile(rb"prefill [1-9]\d* tok/s"), 300), term.screen[-2000:]  # replying
        term.read_until(b"\x00never", 0.5)  # some of the reply, ending mid-line (before it may end by itself)
        term.write(b"\x03")  # Ctrl-C
        assert term.read_until(b"(reply stopped)", 60), term.screen[-2000:]
        assert term.read_until(b"\x1b[?2004h", 30, start=len(term.screen) - 200)  # the next prompt
        term.write(b"/exit\r")
        term.read_until(b"\x00never", 3)
    finally:
        term.close()
    drawn = plain(term.screen.decode(errors="replace"))
    # the whole paste reaches the scrollback once, as sent (the terminal only ever showed its last lines)
    assert drawn.count("> " + paste.replace("\n", "\r\n")) == 1, drawn[-3000:]
    # Ctrl-C is not echoed into the live area (an echoed ^C wrapped the full-width panel line, so the redraw
    # went up one line short and the line being written was printed twice)
    stopped = drawn.index("(reply stopped)")
    assert "^C" not in drawn[drawn.index("Write a long story about these boxes.") : stopped + 200]


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_installed_command_in_a_pty(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color", XDG_DATA_HOME=str(tmp_path))
    env.pop("NO_COLOR", None)
    pid, fd = pty.fork()
    if pid == 0:  # child: the real command on a terminal
        os.execvpe(
            _installed_command()[0], [*_installed_command(), "--temperature", "0", "--max-new-tokens", "24"], env
        )
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    screen = b""

    def read_until(needle: bytes, timeout: float) -> bool:
        nonlocal screen
        end = time.time() + timeout
        while time.time() < end:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    screen += os.read(fd, 65536)
                except OSError:
                    return needle in screen
            if needle in screen:
                return True
        return False

    try:
        assert read_until(b"\x1b[?2004h", 120), screen[-2000:]  # the prompt is up, under the banner
        assert b"/help" in screen  # the banner wraps at words to the terminal's width
        os.write(fd, b"What is the capital of France?\r")
        assert read_until(b"KV cache", 120), screen[-2000:]
        assert read_until(b"Paris", 60), screen[-2000:]
        assert read_until(b"decode", 30)
        os.write(fd, b"/exit\r")
        read_until(b"\x00never", 5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)


def ctrl_c_at_chunk(monkeypatch, n: int):
    """Send a real Ctrl-C (SIGINT to this process) during the n-th prompt chunk's forward (a forward of more than
    one token); returns the chunk counter (reset it to count again) and the engine's real forward."""
    from h2o_chat.engine.step import decode

    chunks = {"n": 0}
    real = decode.Engine._forward

    def forward(self, ids, positions, cache):
        out = real(self, ids, positions, cache)
        if ids.shape[1] > 1:
            chunks["n"] += 1
            if chunks["n"] == n:
                os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(decode.Engine, "_forward", forward)
    return chunks, real


@pytest.mark.parametrize("policy", ["h2o", "snap"])
def test_ctrl_c_while_a_long_message_is_read_stops_within_a_chunk_and_the_session_answers_on(
    embedded, tmp_path, monkeypatch, policy
):
    """Issue 17.5: a real Ctrl-C after the second chunk of a long message: reading stops after that chunk,
    the message is taken back (the cache exactly as before it), the user is told, and the next message gets
    the reply it gets in a session where the long message never was."""
    from h2o_chat.engine.step import decode

    chunks, real = ctrl_c_at_chunk(monkeypatch, 2)  # a real Ctrl-C, during the second chunk's forward
    long = " ".join(["The river ran past the old mill and on towards the sea."] * 40)  # ~500 tokens
    chat = session(embedded, tmp_path, budget=64, max_new_tokens=8, chunk_size=64, policy=make_policy(policy, 64))
    drive(chat, tmp_path, "Hello there.\r/exit\r")
    chunks["n"] = 0
    out = plain(drive(chat, tmp_path, f"{long}\rWhat is two plus two?\r/exit\r"))
    done, total = (int(x.replace(",", "")) for x in re.search(r"after ([\d,]+) of ([\d,]+) tokens", out).groups())
    assert done <= 2 * 64 < total and "it was not added" in out  # stopped at the end of the second chunk
    messages = chat.conv.messages
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Hello there.", "What is two plus two?"]

    monkeypatch.setattr(decode.Engine, "_forward", real)
    alone = session(embedded, tmp_path, budget=64, max_new_tokens=8, chunk_size=64, policy=make_policy(policy, 64))
    drive(alone, tmp_path, "Hello there.\rWhat is two plus two?\r/exit\r")
    assert alone.conv.messages == messages  # the same replies: nothing of the stopped message remains
    assert chat.conv.fed == alone.conv.fed == chat.conv.cache.stats().seen
    assert torch.equal(chat.conv.cache.slots.pos, alone.conv.cache.slots.pos)
    torch.testing.assert_close(chat.conv.cache.slots.score, alone.conv.cache.slots.score)


def test_ctrl_c_while_a_one_chunk_message_is_read_takes_it_back_with_no_empty_reply(embedded, tmp_path, monkeypatch):
    """A Ctrl-C while a message of one chunk is read stops after that chunk, the message read whole and the reply
    not begun: it left an empty assistant message, which the next turn then read. It takes the message back, as
    a longer one's, and the next message gets the reply it gets where the stopped one never was."""
    chunks, real = ctrl_c_at_chunk(monkeypatch, 2)  # the second message's only chunk
    chat = session(embedded, tmp_path, budget=64, max_new_tokens=6)
    out = plain(drive(chat, tmp_path, "Hello there.\rWrite a long story about a dragon.\rAnd then?\r/exit\r"))
    assert "stopped before the reply: your message was not added" in out, out[-800:]
    assert [m["role"] for m in chat.conv.messages] == ["user", "assistant", "user", "assistant"]
    assert all(m["content"] for m in chat.conv.messages)
    from h2o_chat.engine.step import decode

    monkeypatch.setattr(decode.Engine, "_forward", real)
    alone = session(embedded, tmp_path, budget=64, max_new_tokens=6)
    drive(alone, tmp_path, "Hello there.\rAnd then?\r/exit\r")
    assert alone.conv.messages == chat.conv.messages and alone.conv.fed == chat.conv.fed


def test_a_stopped_reading_counts_the_messages_tokens_and_the_panel_shows_the_reading_speed(
    embedded, tmp_path, monkeypatch
):
    """Issue 38.11: snap reads a long message first (its probe), then the message again: a Ctrl-C while it was
    read said 'after 192 of 640 tokens' (columns over both passes) for 550; it says the message's own. While
    the message was read the panel said 'prefill 0 tok/s, decode 0.0 tok/s'."""
    ctrl_c_at_chunk(monkeypatch, 12)  # Ctrl-C in the second read (the probe's ~9 chunks of 64 come first)
    long = " ".join(["The river ran past the old mill and on towards the sea."] * 40)  # ~500 tokens
    chat = session(
        embedded, tmp_path, max_new_tokens=2, chunk_size=64, policy=make_policy("snap", 64), panel=True, terminal=True
    )
    out = plain(drive(chat, tmp_path, f"{long}\r/exit\r"))
    done, total = (int(x.replace(",", "")) for x in re.search(r"after ([\d,]+) of ([\d,]+) tokens", out).groups())
    probe = -(-total // 64)  # the probe's chunks: the whole message (issue 41.7)
    assert total == chat.conv.pending and 0 < done <= (12 - probe) * 64 < total, out[-500:]  # the probe's not counted
    assert "prefill 0 tok/s" not in out and "decode 0.0 tok/s" not in out
    assert re.search(r"reading [\d,]+ tok/s so far", out), out[-2000:]


def test_the_one_step_ahead_bookkeeping_holds_on_cpu(embedded, tmp_path, monkeypatch):
    """On CUDA the engine feeds a token before the host has read it (`fed_last`); forced on here, a chat's
    replies, token accounting and cache are what they are without it."""
    from h2o_chat.engine.step import decode

    def run(lookahead: bool):
        real_init = decode.Engine.__init__

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            self.lookahead = lookahead

        monkeypatch.setattr(decode.Engine, "__init__", init)
        chat = session(embedded, tmp_path, budget=48, max_new_tokens=12)
        drive(chat, tmp_path, "Name a colour.\rAnd another one?\rThanks, one more.\r/exit\r")
        monkeypatch.setattr(decode.Engine, "__init__", real_init)
        return chat.conv

    ahead, behind = run(True), run(False)
    assert ahead.messages == behind.messages
    assert ahead.fed == behind.fed == ahead.cache.stats().seen
    assert torch.equal(ahead.cache.slots.pos, behind.cache.slots.pos)


def test_a_turn_s_penalty_window_starts_with_what_the_cache_read_before_it(embedded, monkeypatch):
    """Each turn reads only its new text: the repetition window now starts with the conversation's last tokens
    the cache read (the earlier turns, replies included), as reading the conversation whole would."""
    from h2o_chat.app.chat import conversation as conversation_module
    from h2o_chat.engine.step.sampling import PENALTY_WINDOW

    turns = []
    real = conversation_module.stream_generate

    def recording(model, tokenizer, cache, prompt_ids, **kwargs):
        turn = {"ids": list(prompt_ids), "history": list(kwargs["history"]), "tokens": [], "fed": False}
        turns.append(turn)
        for r in real(model, tokenizer, cache, prompt_ids, **kwargs):
            turn["tokens"].append(r.token)
            turn["fed"] = r.fed
            yield r

    monkeypatch.setattr(conversation_module, "stream_generate", recording)
    sampler = Sampler(0.0, repetition_penalty=1.1)
    conv = Conversation(embedded, make_policy("h2o", 512), ChatSettings(max_new_tokens=6, sampler=sampler))
    story = " ".join(f"The fox ran past tree number {i}." for i in range(40))  # ~400 tokens: past the window
    for text in (f"Summarise: {story}", "And then?", "Why?"):
        list(conv.send(text))
    one, two, three = turns
    assert one["history"] == []
    read = one["ids"] + one["tokens"][: len(one["tokens"]) - 1 + one["fed"]]
    assert two["history"] == read[-PENALTY_WINDOW:]
    read += two["ids"] + two["tokens"][: len(two["tokens"]) - 1 + two["fed"]]
    assert three["history"] == read[-PENALTY_WINDOW:] and len(read) > PENALTY_WINDOW
