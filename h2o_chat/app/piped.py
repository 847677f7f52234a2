"""Piped and one-shot mode: the whole of stdin (or the prompt argument) is one prompt; only generated text goes
to stdout, streamed; a progress bar (on a terminal), notes and a one-line summary go to stderr."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from h2o_chat.app.conversation import ChatSettings, Conversation, budget_note
from h2o_chat.app.ui import ProgressBar, make_console, reading_label, summary_line
from h2o_chat.engine.policies import Policy
from h2o_chat.errors import InputError
from h2o_chat.models.loading import Loaded


@dataclass(frozen=True)
class RunOptions:
    policy: Policy
    settings: ChatSettings
    panel: bool = True
    json: bool = False
    raw: bool = False  # piped: feed stdin as plain text, no chat template


def read_stdin_prompt(data: bytes) -> str:
    """Decode piped input strictly: one clear error for empty or non-UTF-8 input."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it first, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise InputError("stdin is empty: pipe a prompt, e.g. echo 'Tell me a story' | h2o-chat")
    return text


def run_piped(loaded: Loaded, options: RunOptions, prompt: str) -> dict:
    """Generate for the whole of stdin; text streams to stdout, a summary goes to stderr (or JSON to stdout)."""
    conv = Conversation(loaded, options.policy, options.settings)
    # stderr: a progress bar while a long prompt is read (only on a terminal), and notes before the reading
    bar = ProgressBar(make_console(stderr=True), lambda done, total: reading_label(total, conv.pending), 256)

    def progress(done: int, total: int) -> None:
        for notice in conv.cache.pop_notices():
            bar.console.print(f"h2o-chat: note: {notice}", markup=False, highlight=False)
        bar(done, total)

    conv.engine.on_setup = lambda message: print(f"h2o-chat: {message} ...", file=sys.stderr)

    if options.raw:
        from h2o_chat.engine.generate import stream_generate

        ids = loaded.tokenizer(prompt)["input_ids"]
        conv.pending = len(ids)
        note = budget_note(len(ids), options.policy.budget)
        if note:
            conv.cache.notices.append(note)
        progress(0, len(ids))
        stream = stream_generate(
            loaded.model,
            loaded.tokenizer,
            conv.cache,
            ids,
            sampler=options.settings.sampler,
            max_new_tokens=options.settings.max_new_tokens,
            chunk_size=options.settings.chunk_size,
            progress=progress,
            engine=conv.engine,
        )
    else:
        stream = conv.send(prompt, progress=progress)
    out = sys.stdout
    pieces, last = [], None
    for r in stream:
        if last is None:
            bar.close()  # the prompt is read: stderr's bar gives way to the text on stdout
        last = r
        pieces.append(r.text)
        if not options.json and r.text:
            out.write(r.text)
            out.flush()
        for notice in conv.cache.pop_notices():
            print(f"h2o-chat: note: {notice}", file=sys.stderr)
    stats = conv.cache.stats()
    record = {
        "model": loaded.spec.name,
        "text": "".join(pieces),
        "finish_reason": last.finish_reason,
        "prompt_tokens": last.prompt_tokens,
        "generated_tokens": last.generation_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "decode_tps": round(last.generation_tps, 2),
        "decode": conv.engine.describe(),
        "cache": stats.as_dict(),
    }
    bar.close()
    if options.json:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
        print(f"h2o-chat: {summary_line(last, stats, conv.engine.describe())}", file=sys.stderr)
    out.flush()
    return record


# -- interactive ----------------------------------------------------------------------------------------
