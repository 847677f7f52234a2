"""--prompt-cache FILE for piped runs (llama-cli's habit): a long text read once, then any number of questions.

What the file holds, exactly: the cache after reading the prompt's text -- with the chat template, the
conversation rendered up to the end of that text (the template's start of turn in, its end of turn out) -- all but
its last token. With --prompt-cache a run reads its prompt in two steps: (1) that text but its last token, (2) the
rest: that last token and whatever follows the text (a later run's question, the template's end of turn and
generation prompt), read as the next turn of a chat is. A run whose text begins with the text the file was made
from restores step 1 instead of reading it and reads only step 2; its reply is the one the same two steps give
without the file (`tests/test_resume_cli.py` checks it, token for token). A run whose text does not begin with it
reads both steps and replaces the file with its own step 1 (said on stderr); a run that used the file leaves it as
it is.

Why two steps and not the prompt as one: `snap` (the default) reads a prompt that overflows the budget twice and
keeps what its last queries attend to. The cache after a document read alone is kept by the document's own last
queries; read with a question behind it, the question's queries choose. Only the first can be reused, so a later
question chooses among what the document left (with its own queries, in step 2), as a chat's next message does.
The last token is always read in step 2 so that step 2 is never empty: its logits start the reply (llama-cli too
reads the last cached token again).

The file is a state file (`app/statefile.py`) of kind "prompt": the state, and the text's length, SHA-256 and token
count (never the text). One from another model, policy or format version is refused in one line, as a damaged one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_chat.app import statefile
from h2o_chat.app.chat.conversation import Conversation
from h2o_chat.app.chat.template import sentinel_for
from h2o_chat.app.messages import encode, render
from h2o_chat.app.ui import human_bytes, plural
from h2o_chat.engine.storage import persist
from h2o_chat.errors import InputError
from h2o_chat.models.memory import prefill_chunk


@dataclass(frozen=True)
class PromptCacheOptions:
    path: Path
    read_only: bool = False  # --max-new-tokens 0: read the prompt into the file, generate nothing


def options(path: Path | None, interactive: bool, resume: Path | None, sampling):
    """--prompt-cache checked against the other options, before anything loads: (its options or None, the
    sampling options, where --max-new-tokens 0 means: read and save the prompt only)."""
    if path is None:
        return None, sampling
    if interactive:
        raise InputError("--prompt-cache is for piped runs and prompt arguments; a chat keeps its cache with /save")
    if resume is not None:
        raise InputError("--prompt-cache and --resume both give the cache to start from: give one")
    file = Path(path).expanduser()
    if file.is_dir():
        raise InputError(f"--prompt-cache {path} is a folder; give a file")
    if not file.parent.is_dir():
        raise InputError(f"--prompt-cache {path}: the folder {file.parent} does not exist")
    read_only = sampling.max_new_tokens == 0
    if read_only:  # the checks want a positive count; no token is generated
        sampling = dataclasses.replace(sampling, max_new_tokens=1)
    return PromptCacheOptions(file, read_only), sampling


@dataclass(frozen=True)
class Split:
    """A prompt as --prompt-cache reads it: `text` (raw, or the conversation rendered up to the end of the
    prompt), its token ids, and what the rendering adds after it."""

    text: str
    ids: list[int]
    after: str


def split(conv: Conversation, prompt: str, raw: bool) -> Split:
    if raw:
        return Split(prompt, conv.tokenizer(prompt)["input_ids"], "")
    sentinel = sentinel_for([*conv.messages, {"content": prompt}])
    user = {"role": "user", "content": prompt + sentinel}
    head, found, after = render(conv.tokenizer, [*conv.messages, user]).partition(sentinel)
    if not found:  # a template that drops the text it is given: the whole rendering is the text
        head = render(conv.tokenizer, [*conv.messages, {"role": "user", "content": prompt}])
        after = ""
    return Split(head, encode(conv.tokenizer, head), after)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_first(conv: Conversation, ids: list[int], progress=None) -> None:
    """Read `ids` into the conversation's cache, generating nothing (step 1), checked against free memory as a
    turn is."""
    chunk, smaller = prefill_chunk(conv.loaded.model, conv.cache, 1, len(ids), conv.settings.chunk_size)
    if smaller:
        conv.cache.notices.append(smaller)
    conv.pending, conv.pending_messages = len(ids), 1
    if progress is not None:
        progress(0, conv.reads(len(ids)))
    conv.cache.reserve(len(ids))  # a full cache, once
    conv.engine.prefill(torch.tensor([ids]), chunk_size=chunk, progress=progress)
    conv.fed += len(ids)


class PromptCache:
    """One run's use of --prompt-cache: `start` restores or reads step 1 and gives the ids of step 2; what it did
    is in `cached` (tokens from the file), `read` (step 1's tokens read now, in `seconds`), `saved` (bytes
    written) and `note` (said on stderr)."""

    def __init__(self, options: PromptCacheOptions):
        self.options, self.path = options, options.path
        self.cached = self.read = self.saved = 0
        self.seconds = 0.0
        self.note: str | None = None

    def start(self, conv: Conversation, prompt: str, raw: bool, progress=None) -> list[int]:
        """Step 1 for `prompt` (raw, or with the chat template), restored from the file or read and saved to it;
        returns step 2's ids. A file that cannot be used (damaged, another model, policy or version) is one line,
        before anything is read or written."""
        s = split(conv, prompt, raw)
        here = statefile.identity(conv.loaded, conv.cache)
        file = None
        if self.path.exists():
            file = statefile.read(self.path, kind="prompt")
            file.check(here, "this run")
        mark = file.header.get("prompt") if file is not None else None
        if file is not None and file.state is not None and self._begins(s, mark, raw):
            return self._restore(conv, file, s, mark, raw)
        if file is not None:
            self.note = (
                f"the prompt does not begin with the text {self.path} was made from: it is read whole, and "
                f"{self.path} now holds this prompt"
            )
        return self._read_and_save(conv, s, raw, here, progress)

    @staticmethod
    def _begins(s: Split, mark, raw: bool) -> bool:
        try:
            n = int(mark["chars"])
            return mark["raw"] == raw and len(s.text) >= n and _sha(s.text[:n]) == mark["sha256"]
        except (KeyError, TypeError, ValueError):
            return False

    def _restore(self, conv: Conversation, file, s: Split, mark: dict, raw: bool) -> list[int]:
        text = s.text[: mark["chars"]]
        ids = conv.tokenizer(text)["input_ids"] if raw else encode(conv.tokenizer, text)
        if len(ids) - 1 != mark["tokens"]:
            raise statefile.StateError(
                f"{self.path} holds {mark['tokens']:,} tokens of its text, which reads as {len(ids) - 1:,} here: "
                "refused"
            )
        file.apply(conv.cache, file.unpack(conv.cache, conv.loaded))
        conv.fed = self.cached = mark["tokens"]
        return ids[-1:] + encode(conv.tokenizer, s.text[mark["chars"] :] + s.after)

    def _read_and_save(self, conv: Conversation, s: Split, raw: bool, here: dict, progress) -> list[int]:
        first = s.ids[:-1]
        if not first:  # a one-token text: nothing worth keeping
            self.note = f"the prompt is one token: {self.path} is left as it was"
            return s.ids + encode(conv.tokenizer, s.after)
        t = time.perf_counter()
        read_first(conv, first, progress)
        self.seconds, self.read = time.perf_counter() - t, len(first)
        values, tensors = persist.capture(conv.cache)
        mark = {"chars": len(s.text), "sha256": _sha(s.text), "tokens": len(first), "raw": raw}
        self.saved = statefile.write(self.path, "prompt", here, values, tensors, prompt=mark)
        return s.ids[-1:] + encode(conv.tokenizer, s.after)

    # -- what the run says ------------------------------------------------------------------------------------
    def summary(self) -> str:
        """The piped summary's part: the prompt's tokens that came from the file, or what was saved to it."""
        if self.cached:
            return f"prompt cache: {self.cached:,} prompt tokens from {self.path}"
        if self.saved:
            return (
                f"prompt cache: {self.read:,} prompt tokens read in {self.seconds:.1f} s and saved to {self.path} "
                f"({human_bytes(self.saved)})"
            )
        return f"prompt cache: {self.path} not used"

    def amend(self, record: dict, read_now: int) -> None:
        """The --json record with the prompt's tokens from the file (`cached_prompt_tokens`), the whole prompt's
        (`prompt_tokens`: from the file, read in step 1, read with the reply: `read_now`) and what the file did."""
        record["prompt_tokens"] = self.cached + self.read + read_now
        record["cached_prompt_tokens"] = self.cached
        record["prompt_cache"] = {"file": str(self.path), "used": bool(self.cached), "saved_bytes": self.saved}


def read_only_line(cache: PromptCache) -> str:
    """What a --max-new-tokens 0 run says: what it read and saved, or that the file held the prompt already."""
    if cache.cached:
        held = plural(cache.cached, "token")
        return f"{cache.path} holds this prompt's text already ({held}): nothing read or generated (--max-new-tokens 0)"
    return f"{cache.summary().removeprefix('prompt cache: ')}; nothing generated (--max-new-tokens 0)"
