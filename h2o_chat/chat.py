"""The turn loops: piped (stdin is the prompt) and interactive. They wire a Conversation to the UI."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from h2o_chat.conversation import ChatSettings, Conversation
from h2o_chat.errors import InputError
from h2o_chat.loading import Loaded
from h2o_chat.policies import Policy
from h2o_chat.ui import summary_line


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
    if options.raw:
        from h2o_chat.generate import stream_generate

        ids = loaded.tokenizer(prompt)["input_ids"]
        stream = stream_generate(
            loaded.model,
            loaded.tokenizer,
            conv.cache,
            ids,
            sampler=options.settings.sampler,
            max_new_tokens=options.settings.max_new_tokens,
            chunk_size=options.settings.chunk_size,
        )
    else:
        stream = conv.send(prompt)
    out = sys.stdout
    pieces, last = [], None
    for r in stream:
        last = r
        pieces.append(r.text)
        if not options.json and r.text:
            out.write(r.text)
            out.flush()
    stats = conv.cache.stats()
    record = {
        "model": loaded.spec.name,
        "text": "".join(pieces),
        "finish_reason": last.finish_reason,
        "prompt_tokens": last.prompt_tokens,
        "generated_tokens": last.generation_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "decode_tps": round(last.generation_tps, 2),
        "cache": stats.as_dict(),
    }
    if options.json:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
        print(f"h2o-chat: {summary_line(last, stats)}", file=sys.stderr)
    out.flush()
    return record
