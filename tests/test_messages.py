"""Messages: the one check of a message list, the chat template to ids, saved conversation files."""

from __future__ import annotations

import json

import pytest

from h2o_chat.app.messages import chat_ids, messages_problem, read_conversation, write_conversation
from h2o_chat.errors import InputError


@pytest.mark.parametrize(
    "value, problem",
    [
        ([{"role": "user", "content": "hi"}], None),
        ({"role": "user"}, "expected a list of messages, got an object"),
        ([], "the list of messages is empty"),
        (["hi"], "message 1 is a string, not an object with a role and a content"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], 'message 2 has no "role"'),
        ([{"role": "user"}], 'message 1 has no "content"'),
        ([{"role": "robot", "content": "x"}], "message 1 has role 'robot': expected one of system, user, assistant"),
        ([{"role": "user", "content": 3}], "message 1's content is a number, not text"),
    ],
)
def test_a_message_list_problem_is_named(value, problem):
    """Issue 22.14: not one message for every problem, but what is wrong and where."""
    assert messages_problem(value) == problem


def test_saved_conversations_and_bare_lists_load(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    path = write_conversation(tmp_path / "c.json", "tiny", messages)
    assert json.loads(path.read_text())["messages"] == messages and read_conversation(path) == messages
    (tmp_path / "bare.json").write_text(json.dumps(messages[1:]))
    assert read_conversation(tmp_path / "bare.json") == messages[1:]
    (tmp_path / "other.json").write_text('{"text": "hi"}')
    with pytest.raises(InputError, match='has no "messages"'):
        read_conversation(tmp_path / "other.json")


def test_a_base_model_gets_the_plain_template_in_batch_lines_too(tmp_path):
    """Issue 18: one way from messages to ids; a tokenizer without a chat template (OPT, Pythia) gets the plain
    one in batch lines as in the chat (batch lines of such a model were all skipped)."""
    from conftest import tiny_tokenizer
    from h2o_chat.app.batch.run import Defaults, Summary, read_items

    tok = tiny_tokenizer()
    tok.chat_template = None
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"id": 1, "messages": [{"role": "user", "content": "w5 w6"}]}\n')
    summary = Summary()
    items, _ = read_items(lines, tok, Defaults(budget=16), summary, lambda b: b)
    assert summary.malformed == [] and items[0].ids == chat_ids(tok, [{"role": "user", "content": "w5 w6"}])
