"""A conversation saved with its cache, and resumed: /save FILE, /load FILE, h2o-chat --resume FILE.

/save writes the conversation's messages and its cache -- every layer's kept keys, values, positions and scores,
recall's store, the rows' bookkeeping (`engine/storage/persist.py`) -- as one state file (`app/statefile.py`), with the
conversation's own bookkeeping of what that cache has seen (`CARRIED`). /load and --resume put both back without
reading anything again: the next turn reads only its new text and continues exactly as if the session had never
stopped (greedy, or with a seed: the same tokens). A FILE named *.json gets the messages alone, as JSON, as before
(read again on /load), and /load still reads those.

Of the sampler, only the conversation's last tokens are saved (`_tail`: the repetition window of the next reply
starts with them, as it would had the conversation been read whole); each reply's draws start from its prompt.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from h2o_chat.app import statefile
from h2o_chat.app.chat.conversation import Conversation, Span
from h2o_chat.app.messages import messages_problem, read_conversation
from h2o_chat.app.options import SETTING_OF_OPTION
from h2o_chat.app.ui import human_bytes, plural
from h2o_chat.engine.storage import persist
from h2o_chat.engine.storage.persist import StateError

# What a Conversation knows about the sequence its cache has seen (`Conversation._restart` sets each, its ledger
# among them): saved and restored with the cache, under the file's name for it -> where it lives. `tests/
# test_session_files.py` checks that every attribute `_restart` sets, and every field of the ledger, is here or in
# `PER_TURN`, so one added there is classified before it can be lost.
CARRIED = {"fed": "fed", "spans": "ledger.spans", "_unfed": "_unfed", "_fed_stop": "_fed_stop", "_seam": "_seam",
           "_tail": "_tail", "warned": "ledger.warned", "_recall_told": "ledger.told"}  # fmt: skip
SINCE = {"_seam": None, "_tail": []}  # carried values that files saved before them lack: what such a file means
PER_TURN = ("cache", "pending", "pending_messages", "_undo", "ledger.recalled", "ledger.recall_note")
# the carried values that JSON cannot hold as they are
_CODECS = {
    "spans": (lambda spans: [dataclasses.asdict(s) for s in spans], lambda v: [Span(**s) for s in v]),
    "warned": (lambda d: {str(k): v for k, v in d.items()}, lambda v: {int(k): float(x) for k, x in v.items()}),
    "_recall_told": (list, tuple),
    "_tail": (list, lambda v: [int(x) for x in v]),
    "_seam": (lambda v: None if v is None else list(v), lambda v: None if v is None else (str(v[0]), str(v[1]))),
}
# the command line's options that set the policy: none given, --resume takes the file's policy whole (the
# positions are the cache's: taken from the file on their own, below)
POLICY_OPTIONS = {"policy", *SETTING_OF_OPTION} - {"positions"}


def save_conversation(conv: Conversation, path) -> tuple[Path, int]:
    """Write `conv` to `path`: its messages and cache as a state file, or its messages alone as JSON (a *.json
    name). Returns the path and the bytes of cache saved (0: none, the messages are read again on /load)."""
    path = Path(path).expanduser()
    if path.suffix.lower() == ".json":
        return conv.save(path), 0
    values, tensors = None, {}
    if conv.fed and conv.cache.slots is not None:
        values, tensors = persist.capture(conv.cache)
    carried = {name: _CODECS.get(name, (_same, _same))[0](_get(conv, where)) for name, where in CARRIED.items()}
    settings = statefile.identity(conv.loaded, conv.cache)
    conversation = {"messages": conv.messages, **carried}
    statefile.write(path, "conversation", settings, values, tensors, conversation=conversation)
    conv._saved = list(conv.messages)
    return path, sum(t.numel() * t.element_size() for t in tensors.values())


def check_conversation_file(path) -> None:
    """What /load can tell of `path` before it asks to replace unsaved messages: a file it can read, a saved
    conversation's JSON whole, or a state file's header (its tensors are checked when it loads)."""
    if statefile.is_state_file(path):
        statefile.read_header(path, kind="conversation")
    else:
        read_conversation(path)


def load_conversation(conv: Conversation, path) -> int:
    """Replace `conv` by the conversation saved in `path`: with its cache when the file holds one (restored in
    place where the storage has its shape), else its messages, read again on the next turn. Everything is read
    and checked before anything changes. Returns the message count."""
    if not statefile.is_state_file(path):
        return conv.load(path)  # a saved list of messages (JSON)
    file = statefile.read(path, kind="conversation")
    saved = file.header.get("conversation")
    problem = messages_problem(saved.get("messages")) if isinstance(saved, dict) else "it holds no conversation"
    if problem:
        raise StateError(f"{file.path} is damaged: {problem}")
    messages = [{"role": m["role"], "content": m["content"]} for m in saved["messages"]]
    if file.state is None:  # saved before its cache read anything: read again
        conv.messages, conv._saved = messages, list(messages)
        conv._restart()
        return len(messages)
    file.check(statefile.identity(conv.loaded, conv.cache), "this chat")
    try:
        raw = {name: saved.get(name, SINCE[name]) if name in SINCE else saved[name] for name in CARRIED}
        carried = {name: _CODECS.get(name, (_same, _same))[1](value) for name, value in raw.items()}
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise StateError(f"{file.path} is damaged (its conversation's bookkeeping is not valid)") from None
    state = file.unpack(conv.cache, conv.loaded)  # the last check: from here on nothing can refuse it
    conv.messages, conv._saved = messages, list(messages)
    conv._restart(new_cache=False)
    file.apply(conv.cache, state)
    for name, value in carried.items():
        owner, _, attribute = CARRIED[name].rpartition(".")
        setattr(_get(conv, owner) if owner else conv, attribute, value)
    return len(messages)


def _get(conv: Conversation, where: str):
    """The attribute at a dotted path of `conv` (`ledger.spans`)."""
    value = conv
    for part in where.split("."):
        value = getattr(value, part)
    return value


def _same(value):
    return value


def saved_line(conv: Conversation, path: Path, cache_bytes: int) -> str:
    """What /save says."""
    what = plural(len(conv.messages), "message")
    if not cache_bytes:
        return f"saved {what} to {path}"
    stats = conv.stats()
    return (
        f"saved {what} and their cache ({stats.seen:,} tokens seen, {stats.kept:.0f} kept; "
        f"{human_bytes(path.stat().st_size)}) to {path}: /load or --resume continues without reading them again"
    )


def loaded_line(conv: Conversation, count: int, path) -> str:
    """What /load (and --resume) says: whether the cache came back, or the messages are read on the next turn."""
    if not conv.fed:
        return f"loaded {plural(count, 'message')} from {path}; they are read into the cache on the next turn"
    stats = conv.stats()
    return (
        f"loaded {plural(count, 'message')} and their cache from {path} ({stats.seen:,} tokens seen, "
        f"{stats.kept:.0f} kept): the next reply reads only your message"
    )


# -- --resume FILE ----------------------------------------------------------------------------------------------
def resumed_settings(path: Path, given: set[str], models, cache, policy):
    """--resume FILE, before anything loads: the file's model, policy (with every setting), positions and KV
    storage, for each that the command line did not give (a given one must match the file's: the restore says
    which does not). A file that is no conversation is one line now. Returns (models, cache, policy)."""
    from h2o_chat.models.registry import load_registry

    if not statefile.is_state_file(path):
        read_conversation(path)  # a saved list of messages: read again with the command line's settings
        return models, cache, policy
    header = statefile.read_header(path, kind="conversation")
    saved = header["settings"]
    if header.get("state") is None:
        return models, cache, policy
    if "model" not in given:  # the file's model, unless it is the one that loads anyway (the default)
        registry = load_registry(models.models_file)
        known = registry.models.get(saved.get("model_name"))
        name = saved.get("model_name") if known is not None and known.source == saved.get("model_source") else None
        default = registry.resolve(None)
        if (default.name, default.source) != (saved.get("model_name"), saved.get("model_source")):
            models = dataclasses.replace(models, model=name or saved.get("model_source"))
    cache = dataclasses.replace(cache, **{k: saved[k] for k in ("positions", "kv_quant") if k not in given})
    if not given & POLICY_OPTIONS:
        policy = persist.policy_of(saved["policy"])
    return models, cache, policy
