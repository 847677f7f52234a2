"""Messages as h2o-chat reads and writes them: the one check of a message list (saved conversations and batch
lines alike), the chat template from messages to token ids, and the saved-conversation file."""

from __future__ import annotations

import json
from pathlib import Path

from h2o_chat.errors import InputError
from h2o_chat.files import read_user_text

ROLES = ("system", "user", "assistant")
FORMAT = "h2o-chat/1"

# for base models without a chat template (OPT, Pythia)
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
PLAIN_STOP = "\nUser:"


def messages_problem(value) -> str | None:
    """What is wrong with `value` as a list of {"role", "content"} messages, or None when nothing is."""
    if not isinstance(value, list):
        return f"expected a list of messages, got {_kind(value)}"
    if not value:
        return "the list of messages is empty"
    for number, m in enumerate(value, start=1):
        if not isinstance(m, dict):
            return f"message {number} is {_kind(m)}, not an object with a role and a content"
        if "role" not in m or "content" not in m:
            return f'message {number} has no "{"role" if "role" not in m else "content"}"'
        if m["role"] not in ROLES:
            return f"message {number} has role {m['role']!r}: expected one of {', '.join(ROLES)}"
        if not isinstance(m["content"], str):
            return f"message {number}'s content is {_kind(m['content'])}, not text"
    return None


def _kind(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


# -- the chat template ----------------------------------------------------------------------------------
def use_chat_template(tokenizer) -> bool:
    """Give a base model's tokenizer (no chat template) a plain "User:/Assistant:" one; True when it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = PLAIN_TEMPLATE
    return True


def check_template(text: str, name: str) -> None:
    """A --chat-template file parses as transformers compiles chat templates (a sandboxed Jinja environment), and
    reads the messages; one clear line when not."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    try:
        env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"--chat-template {name} is not a Jinja template: line {e.lineno}: {e.message}") from None
    if "messages" not in text:
        raise InputError(f"--chat-template {name} never reads `messages`: it would render no conversation")


def template_problem(tokenizer) -> str | None:
    """Why the tokenizer's chat template cannot render a user's message (None when it can)."""
    probe = "h2o-chat template check"
    try:
        text = render(tokenizer, [{"role": "user", "content": probe}])
    except Exception as e:  # jinja raises whatever the template's author chose
        return " ".join(str(e).split())[:200] or type(e).__name__
    return None if probe in text else "the rendered conversation does not contain the message"


def render(tokenizer, messages: list[dict], generation_prompt: bool = True) -> str:
    """The conversation as the chat template writes it; InputError when the template refuses it (its own
    `raise_exception`: roles that must alternate, a system prompt it does not take)."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise InputError(f"the chat template refuses this conversation: {reason}") from None


def encode(tokenizer, text: str, quoted=()) -> list[int]:
    """Token ids of rendered text (the template wrote its special tokens already); `quoted`: where messages that
    quote a special token's text are in it (`quotes`), read as text."""
    return encode_with_starts(tokenizer, text, quoted)[0]


def encode_with_starts(tokenizer, text: str, quoted=(), starts: bool = False) -> tuple[list[int], list[int] | None]:
    """Token ids of rendered text, and with `starts` each token's start offset in it (None for tokenizers without
    offsets). A special token's text within a `quoted` span (a message that holds "<|im_start|>system") is read
    as the characters it is, as OpenAI's API reads it: only the template writes control tokens, so a message
    cannot end its turn or open one of another role. Text outside such spans is read as it always was."""
    if not quoted and not starts:
        return tokenizer(text, add_special_tokens=False)["input_ids"], None
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # slow tokenizers have no offsets (nor is a quote told apart)
        return tokenizer(text, add_special_tokens=False)["input_ids"], None
    if not quoted:
        return enc["input_ids"], [a for a, _ in enc["offset_mapping"]]
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids, offsets = [], []
    for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        if token in special and any(s <= a and b <= e for s, e in quoted):
            part = tokenizer(
                text[a:b], add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True
            )
            ids += part["input_ids"]
            offsets += [a + x for x, _ in part["offset_mapping"]]
        else:
            ids.append(token)
            offsets.append(a)
    return ids, offsets


QUOTE_MARK = "\x00h2o-chat-quote\x00"


def quotes(tokenizer, messages: list[dict], rendered: str, generation_prompt: bool = True) -> list[tuple[int, int]]:
    """Where in `rendered` (`messages` as `render` writes them) the contents that hold a special token's text are:
    each found by rendering the messages with a mark in its place (a template's own tokens around it, even the
    same text, are not taken for it). Nothing to find, as for almost every message, costs a substring check."""
    names = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    spans = []
    for i, m in enumerate(messages):
        content = m["content"]
        if not any(name in content for name in names):
            continue
        marked = [*messages[:i], {**m, "content": QUOTE_MARK}, *messages[i + 1 :]]
        at = render(tokenizer, marked, generation_prompt).find(QUOTE_MARK)
        if at >= 0 and rendered.startswith(content, at):  # a template that rewrites contents: read as before
            spans.append((at, at + len(content)))
    return spans


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Messages -> the ids of the whole conversation, ready for a reply (their contents read as text)."""
    text = render(tokenizer, messages)
    return encode(tokenizer, text, quotes(tokenizer, messages, text))


# -- saved conversations --------------------------------------------------------------------------------
def write_conversation(path: str | Path, model: str, messages: list[dict]) -> Path:
    path = Path(path).expanduser()
    data = {"format": FORMAT, "model": model, "messages": messages}
    try:
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror}") from None
    return path


def read_conversation(path: str | Path) -> list[dict]:
    """A saved conversation ({"messages": [...]}, as /save writes it) or a bare list of messages."""
    text = read_user_text(path, "conversation file")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InputError(f"{path} is not a saved conversation (invalid JSON: {e})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    elif isinstance(data, dict):
        raise InputError(f'{path} is not a saved conversation: it has no "messages"')
    problem = messages_problem(data)
    if problem:
        raise InputError(f"{path} is not a saved conversation: {problem}")
    return [{"role": m["role"], "content": m["content"]} for m in data]
