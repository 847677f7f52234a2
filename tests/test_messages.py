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


class _Pieces:
    """A tokenizer whose tokens are the given strings (what `TextStream` needs: decode)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, **_):
        return "".join(self.pieces[i] for i in ids)


def test_a_reply_cut_by_a_stop_string_knows_what_its_cache_read_past_the_cut():
    from h2o_chat.engine.step.generate import TextStream

    pieces = ["Hello", " there", "\n", "User", ":", " 5"]
    stream = TextStream(_Pieces(pieces), 100, set(), ("\nUser:",))
    said = [stream.add(t) for t in range(5)]
    assert "".join(t for t, _ in said) == "Hello there" and said[-1][1] == "stop"
    assert stream.seam(4) == ("", "\nUser")  # every token but the last read: "\nUser" is past the reply
    assert stream.seam(5) == ("", "\nUser:")
    inside = TextStream(_Pieces(pieces), 100, set(), ("re",))  # cut inside " there": " the" is the reply's
    assert "".join(inside.add(t)[0] for t in range(2)) == "Hello the" and inside.seam(1) == (" the", "")
    plain = TextStream(_Pieces(pieces), 2, set(), ("\nUser:",))
    assert [plain.add(t)[1] for t in range(2)] == [None, "length"] and plain.seam(1) is None


def test_the_next_turn_after_a_cut_reply_reads_what_the_cache_lacks_and_skips_what_it_read():
    """A base model's reply ends at "\\nUser:" (a stop string): "\\nUser" is in its cache, and the template's next
    turn begins with it; the next turn reads only what follows (before, "\\nUser:" was read twice). A cut the
    template does not continue: None for the server (it reads the conversation again), the chat keeps it."""
    from conftest import tiny_tokenizer
    from h2o_chat.app.chat.template import turn_ids
    from h2o_chat.app.messages import encode, use_chat_template

    tok = tiny_tokenizer()
    tok.chat_template = None
    assert use_chat_template(tok)  # User:/Assistant: lines
    before = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]
    new = [{"role": "user", "content": "w7"}]
    after = "\nUser: w7\nAssistant:"
    assert turn_ids(tok, before, new, 9, None, None) == [9, *encode(tok, after)]
    assert turn_ids(tok, before, new, 9, None, ("", "\nUser")) == encode(tok, after[len("\nUser") :])
    assert turn_ids(tok, before, new, 9, None, (" w8", "")) == encode(tok, " w8" + after)
    assert turn_ids(tok, before, new, 9, None, ("", " w9")) is None
    assert turn_ids(tok, before, new, 9, None, ("", " w9"), strict=False) == encode(tok, after)
    # a message that quotes the sentinel does not move the split
    quoting = [{"role": "user", "content": "w5 \x00h2o-chat-reply\x00 w6"}, {"role": "assistant", "content": "w6"}]
    assert turn_ids(tok, quoting, new, None, None, None) == encode(tok, after)


def test_a_message_that_quotes_a_special_token_is_read_as_text_not_as_a_control_token():
    """A message holding "</s>" (or "<|im_start|>system ...") was tokenized as the control token itself, so any
    client's text could end a turn or open one of another role. Only the template writes control tokens now:
    each path from messages to ids (a whole conversation, the chat's turns, the server's) reads a quote as
    characters; a message without one is read as before."""
    from conftest import tiny_tokenizer
    from h2o_chat.app.chat.template import ChatTemplate, turn_ids
    from h2o_chat.app.messages import chat_ids, encode

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"  # the template's own </s>
    eos = tok.convert_tokens_to_ids("</s>")
    quoting = [{"role": "user", "content": "w5 </s> w6"}, {"role": "assistant", "content": "w7"}]
    ids = chat_ids(tok, quoting)
    assert ids.count(eos) == 2 and len(ids) > len(chat_ids(tok, [{"role": "user", "content": "w5 w6"}, quoting[1]]))
    assert ChatTemplate(tok).whole(quoting)[0] == ids
    plain = [{"role": "user", "content": "w5 w6"}]
    assert chat_ids(tok, plain) == tok(tok.apply_chat_template(plain, tokenize=False), add_special_tokens=False)[
        "input_ids"]  # fmt: skip
    new = turn_ids(tok, quoting, [{"role": "user", "content": "</s>"}], None, None, None)  # " </s> </s> </s> "
    assert new.count(eos) == 2 and new == encode(tok, " </s> </s> </s> ", [(6, 10)])  # the reply's, quote, turn's
