"""Issue 50 through the real chat and command, on the embedded model (greedy): /save then /load, --resume, and
--prompt-cache continue exactly as the session that never stopped; bad files are one line."""

from __future__ import annotations

import json

from test_chat import drive, session
from test_cli import assert_one_line_error, invoke

from h2o_chat.app import statefile
from h2o_chat.engine.step.sampling import Sampler

FIRST, NEXT = "Name three colours of the rainbow, please.", "And two more?"


def replies(chat) -> list[str]:
    return [m["content"] for m in chat.conv.messages if m["role"] == "assistant"]


def test_save_then_load_and_resume_continue_as_the_chat_that_never_stopped(embedded, tmp_path, fast_load):
    """/save writes the cache with the messages; /load in a new chat and --resume (piped: the prompt is the next
    message) read nothing again, and the next reply is the one the unbroken chat gives, repetition penalty
    included (its window starts with the conversation's last tokens, saved with it). A messages-only file (the
    format /save wrote before, whatever its name) still loads and is read again."""
    saved, old = tmp_path / "talk.h2o", tmp_path / "old-talk"
    greedy = Sampler(temperature=0, repetition_penalty=1.1)  # as the command's defaults with --temperature 0
    unbroken = session(embedded, tmp_path, budget=32, max_new_tokens=8, decode="eager", sampler=greedy)
    out = drive(unbroken, tmp_path, f"{FIRST}\r/save {saved}\r{NEXT}\r/exit\r")
    assert "saved 2 messages and their cache" in out and "/load or --resume continues" in out
    assert statefile.read(saved).kind == "conversation"
    unbroken.conv.save(old)  # the messages alone, as JSON, as /save wrote them before

    loaded = session(embedded, tmp_path, budget=32, max_new_tokens=8, decode="eager", sampler=greedy)
    out = drive(loaded, tmp_path, f"/load {saved}\r{NEXT}\r/exit\r")
    assert "loaded 2 messages and their cache" in out and "the next reply reads only your message" in out
    assert replies(loaded) == replies(unbroken)

    args = ["--resume", str(saved), "--decode", "eager", "--temperature", "0", "--max-new-tokens", "8", "--json"]
    result = invoke(args, NEXT)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["text"] == replies(unbroken)[-1]
    assert record["cache"]["seen"] > unbroken.conv.stats().seen - 20  # the saved tokens were not read again
    # a policy's setting given with --resume sets the policy from the command line (snap, the default), which
    # must read it: refused in one line, before the file's policy is compared
    assert_one_line_error(invoke([*args, "--recall-memory", "4x"], NEXT), "--recall-memory does nothing under -p snap")

    again = session(embedded, tmp_path, budget=32, max_new_tokens=8, decode="eager")
    out = drive(again, tmp_path, f"/load {old}\r/exit\r")
    assert "loaded 4 messages" in out and "read into the cache on the next turn" in out


def test_bad_resume_and_prompt_cache_files_are_one_line(fast_load, tmp_path):
    cut = tmp_path / "cut.h2o"
    cut.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{" + b"x" * 20)
    assert_one_line_error(invoke(["--resume", str(cut)], "hi"), "is damaged")
    assert_one_line_error(invoke(["--resume", str(tmp_path / "none.h2o")], "hi"), "not found")
    assert_one_line_error(invoke(["--prompt-cache", str(tmp_path)], "hi"), "is a folder")
    # a folder that is not there: said before the weights load (it read the prompt, then failed in a traceback)
    missing = tmp_path / "nodir" / "c.cache"
    assert_one_line_error(invoke(["--prompt-cache", str(missing)], "hi"), f"the folder {missing.parent} does not exist")
    assert_one_line_error(invoke(["--prompt-cache", str(cut), "--resume", str(cut)], "hi"), "give one")
    assert_one_line_error(invoke(["--raw", "--resume", str(cut)], "hi"), "--raw continues plain text and --resume")
    assert cut.read_bytes().endswith(b"x" * 20)  # left as it was


def test_prompt_cache_reads_a_document_once_and_answers_as_without_the_file(fast_load, tmp_path):
    """--max-new-tokens 0 reads the document into the file; a prompt that begins with it reads only the rest
    (`cached_prompt_tokens`), and its reply is the one a run that reads both steps itself gives; a prompt that
    does not begin with it is read whole and replaces the file (said on stderr)."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper counted ships every night. " * 12)
    cache, fresh = tmp_path / "doc.cache", tmp_path / "fresh.cache"
    common = ["--raw", "--decode", "eager", "-b", "32", "--temperature", "0", "--json"]

    first = invoke([*common, "-f", str(doc), "--prompt-cache", str(cache), "--max-new-tokens", "0"])
    assert first.exit_code == 0, first.output
    record = json.loads(first.stdout)
    assert record["cached_prompt_tokens"] == 0 and record["text"] == "" and record["prompt_tokens"] > 64
    size = cache.stat().st_size
    assert record["prompt_cache"]["saved_bytes"] == size

    question = "How many ships?"
    ask = [*common, "-f", str(doc), "--max-new-tokens", "4"]
    used = json.loads(invoke([*ask, "--prompt-cache", str(cache)], question).stdout)
    assert used["cached_prompt_tokens"] == record["prompt_tokens"] and used["prompt_cache"]["used"]
    assert used["prompt_tokens"] > used["cached_prompt_tokens"]
    unused = json.loads(invoke([*ask, "--prompt-cache", str(fresh)], question).stdout)
    assert unused["cached_prompt_tokens"] == 0 and unused["text"] == used["text"]
    assert cache.stat().st_size == size  # used, not rewritten

    summary = invoke([c for c in ask if c != "--json"] + ["--prompt-cache", str(cache)], question)
    assert summary.exit_code == 0 and f"prompt cache: {record['prompt_tokens']:,} prompt tokens from" in summary.stderr

    other = invoke([*common, "--prompt-cache", str(cache), "--max-new-tokens", "2"], "Something else entirely.")
    assert other.exit_code == 0 and "does not begin with the text" in other.stderr
    assert abs(cache.stat().st_size - size) < 1024  # the same budget's bytes for another prompt (a header apart)
