"""The chat template a conversation is rendered with, and the tokens each turn adds to what the cache has seen.

The cache has seen the conversation up to the end of the last reply. To find the new text of a turn we render
the whole conversation with the chat template, with a sentinel in place of the last reply's content: what
follows the sentinel (end-of-turn tokens, the new user message, the generation prompt) is exactly what the
cache has not seen. This works for any template without decoding tokens back to text.
"""

from __future__ import annotations

import bisect
import copy

from h2o_chat.app.messages import encode, encode_with_starts, quotes, render, template_problem, use_chat_template
from h2o_chat.errors import InputError

SENTINEL = "\x00h2o-chat-reply\x00"


def sentinel_for(messages: list[dict]) -> str:
    """SENTINEL, or a variant of it that no message's text holds (a message that quotes it must not move the
    split)."""
    sentinel, k = SENTINEL, 0
    while any(sentinel in m["content"] for m in messages):
        k += 1
        sentinel = f"\x00h2o-chat-reply-{k}\x00"
    return sentinel


def turn_ids(
    tokenizer,
    messages: list[dict],
    new: list[dict],
    unfed: int | None,
    fed_stop: int | None,
    seam: tuple[str, str] | None,
    strict: bool = True,
) -> list[int] | None:
    """The ids a cache that has read `messages` up to the end of their last reply has not read, for the `new`
    messages that follow. `unfed`: the reply's last token when the cache has not read it; `fed_stop`: the stop
    token the cache has read already (the template adds it again); `seam`: a reply cut by a stop string
    (`TextStream.seam`): the reply's text the cache lacks (read now) and the text past it that the cache has read
    (then it must be what the template renders next: a base model's "\nUser:"). None when the cache cannot be
    continued: the template does not render the reply where it was, or (`strict`) the cache read text past the
    reply that the conversation does not hold; not strict, that text stays and the rest is read after it."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    sentinel = sentinel_for([*messages, *new])
    marked = [dict(m) for m in messages]
    marked[last]["content"] = sentinel
    full = render(tokenizer, [*marked, *new])
    if sentinel not in full:
        return None
    cut = full.index(sentinel) + len(sentinel)
    text = full[cut:]
    quoted = [(a - cut, b - cut) for a, b in quotes(tokenizer, [*marked, *new], full) if a >= cut]
    if seam is not None:
        missing, extra = seam
        continues = text.startswith(extra)
        if strict and not continues:
            return None
        dropped = len(extra) if continues else 0
        text, unfed = missing + text[dropped:], None  # the last token was the stop string's, or its text is missing
        shift = len(missing) - dropped
        quoted = [(a + shift, b + shift) for a, b in quoted]
    ids = encode(tokenizer, text, quoted)
    if fed_stop is not None and ids and ids[0] == fed_stop:
        ids = ids[1:]  # the end-of-turn token the template adds is in the cache already
    return ([unfed] if unfed is not None else []) + ids


def reply_end(tokens: list[int], fed_last: bool, stop_ids) -> tuple[int, int | None, int | None]:
    """What a cache has read of a reply's `tokens`, the one rule of the chat and the server: (how many were fed,
    `unfed`, `fed_stop`). Every token but the last is fed, the last too when the engine ran ahead (`fed_last`);
    a last token not fed is read first by the next turn, unless it is a stop token (the template writes its
    own); a stop token fed is skipped there (`turn_ids`)."""
    if not tokens:
        return 0, None, None
    last = tokens[-1]
    if fed_last:
        return len(tokens), None, last if last in stop_ids else None
    return len(tokens) - 1, None if last in stop_ids else last, None


class ChatTemplate:
    """A tokenizer with the template that renders a conversation: the tokenizer's own, one given with
    --chat-template (`chat_template`: its file and its Jinja text), or plain User:/Assistant: lines."""

    def __init__(self, tokenizer, chat_template: tuple[str, str] | None = None):
        self.tokenizer = tokenizer
        self.source = "the tokenizer's"  # for /show
        if chat_template is not None:
            name, text = chat_template
            self.tokenizer = copy.copy(tokenizer)  # the loaded model's tokenizer stays as it was
            self.tokenizer.chat_template = text
            problem = template_problem(self.tokenizer)
            if problem:
                raise InputError(f"--chat-template {name} cannot render a message: {problem}")
            self.source = name
        self.plain = use_chat_template(self.tokenizer)
        if self.plain:
            self.source = "plain User:/Assistant: lines (the model has no chat template)"

    def next_turn(
        self, messages: list[dict], user: dict, unfed: int | None, fed_stop: int | None, seam=None
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids a cache that has seen `messages` (up to the end of the last reply) has not seen yet, for a new
        user message (`turn_ids`), and where it ends in them: [(len(messages), end offset)]. What the cache read
        past a reply cut by a --stop string stays in it (the chat's cache is the conversation as the model saw
        it)."""
        ids = turn_ids(self.tokenizer, messages, [user], unfed, fed_stop, seam, strict=False)
        if ids is None:  # checked when the template was chosen (`template_problem`): a bug if it happens
            raise InputError("the chat template does not render the last reply where it was")
        return ids, [(len(messages), len(ids))]

    def whole(self, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
        """Render the conversation once, and each prefix of it, to find the token offset where every message's
        rendering ends. A message whose prefix does not render as a prefix of the whole (a template that
        folds the system prompt into the first user turn, or refuses a partial conversation) shares the span
        of the message after it."""
        text = render(self.tokenizer, messages)
        ids, starts = encode_with_starts(self.tokenizer, text, quotes(self.tokenizer, messages, text), starts=True)
        ends = []
        for k in range(1, len(messages)):
            try:
                prefix = render(self.tokenizer, messages[:k], False)
            except Exception:  # jinja raises whatever the template's author chose
                continue
            if prefix and text.startswith(prefix):
                end = (
                    bisect.bisect_left(starts, len(prefix))
                    if starts is not None
                    else len(encode(self.tokenizer, prefix, quotes(self.tokenizer, messages[:k], prefix, False)))
                )
                if 0 < end < len(ids) and (not ends or end > ends[-1][1]):
                    ends.append((k - 1, end))
        ends.append((len(messages) - 1, len(ids)))
        return ids, ends
