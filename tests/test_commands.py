"""The chat's parts on their own: slash commands over a conversation with a recording view, no prompt loop."""

from __future__ import annotations

import io
import json

from rich.console import Console

from h2o_chat.app.chat.commands import SlashCommands
from h2o_chat.app.chat.conversation import ChatSettings, Conversation
from h2o_chat.app.chat.view import ChatView
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.sampling import Sampler


class RecordingView:
    """Stands in for ChatView: keeps what the commands asked to show."""

    def __init__(self):
        self.said, self.errors, self.shown, self.notes = [], [], [], []

    def say(self, text):
        self.said.append(text)

    def note(self, text):
        self.notes.append(text)

    def error(self, error):
        self.errors.append(str(error))

    def stats(self, stats):
        self.shown.append(("stats", stats.policy))

    def evictions(self, reports):
        self.shown.append(("evicted", len(reports)))


def commands(embedded, policy=None):
    conv = Conversation(embedded, policy or make_policy("snap", 64), ChatSettings(sampler=Sampler(0)))
    view = RecordingView()
    return SlashCommands(conv, view, lambda text: list(conv.send(text))), conv, view


def test_commands_change_settings_and_report_through_the_view(embedded, tmp_path):
    cmds, conv, view = commands(embedded)
    assert cmds.run("/budget 48") is None and conv.policy == make_policy("snap", 48)
    cmds.run("/policy full")
    cmds.run("/policy h2o")  # the budget is remembered through the full cache
    assert conv.policy == make_policy("h2o", 48)
    cmds.run("/system Be brief.")
    assert conv.messages[0] == {"role": "system", "content": "Be brief."}
    cmds.run(f"/save {tmp_path / 'c.json'}")
    assert json.loads((tmp_path / "c.json").read_text())["messages"] == conv.messages
    cmds.run("/stats")
    cmds.run("/evicted")
    assert view.shown == [("stats", "h2o"), ("evicted", 0)]
    assert cmds.run("/exit") == "exit" and cmds.run("/QUIT") == "exit"
    assert view.said[0] == "cache: snap 48 = 24 heavy + 24 recent; prompts kept by their last 12 queries"


def test_bad_commands_are_shown_not_raised(embedded):
    cmds, conv, view = commands(embedded)
    assert cmds.run("/nope") is None and view.said == ["unknown command /nope; /help lists the commands"]
    cmds.run("/budget lots")
    cmds.run("/budget 0")
    cmds.run("/load /nonexistent.json")
    cmds.run("/budget 1KB")  # a size, but not one token's slots (47,880 bytes here)
    assert view.errors[0] == (
        "/budget takes a number of tokens (512), a memory (64MB) or a share of the trained context (10%), got 'lots'"
    )
    assert "positive" in view.errors[1] and "not found" in view.errors[2]
    assert view.errors[3] == "/budget 1KB holds no token: a token takes 47,880 bytes in the cache"
    assert conv.policy == make_policy("snap", 64)  # nothing changed


def test_the_view_draws_what_it_is_given():
    console = Console(file=io.StringIO(), width=200, no_color=True)
    view = ChatView(console, None, "tiny", "cpu, float32")

    class Report:
        preview, kept = "remember the word pineapple", 0.4

    class Last:
        finish_reason, generation_tokens = "length", 16

    view.reply_ended(False, Last(), [Report()])
    view.reply_ended(True, Last(), [Report(), Report()])
    out = console.file.getvalue().splitlines()
    assert out == [
        "(reply cut at 16 tokens: --max-new-tokens)",
        'note: your message "remember the word pineapple" is 40% cached: the model sees only part of it; say again '
        "what matters; a larger /budget keeps more",
        "(reply stopped)",
        "note: 2 of your earlier messages are now under half cached: say again what matters; /evicted shows which; "
        "a larger /budget keeps more",
    ]


def test_a_chat_that_cannot_bring_messages_back_is_told_once_how_to_keep_them():
    console = Console(file=io.StringIO(), width=200, no_color=True)
    view = ChatView(console, None, "tiny", "cpu, float32")

    class Report:
        preview, kept = "my name is Ada", 0.4999

    view.reply_ended(False, None, [], recalls=False)  # nothing evicted yet: no hint
    view.reply_ended(False, None, [Report()], recalls=False)
    view.reply_ended(False, None, [Report()], recalls=False)  # once per session
    out = console.file.getvalue().splitlines()
    hint = "; /policy recall keeps what is evicted from now on, for a later question to bring back"
    said = 'note: your message "my name is Ada" is 49% cached: the model sees only part of it; say again what matters'
    assert out == [said + hint, said + "; a larger /budget keeps more"]
    recalling = ChatView(Console(file=io.StringIO(), width=200, no_color=True), None, "tiny", "cpu, float32")
    recalling.reply_ended(False, None, [Report()], recalls=True)  # recall brings messages back
    assert "/policy recall" not in recalling.console.file.getvalue()
    from h2o_chat.engine.policies import POLICIES

    assert {name for name, cls in POLICIES.items() if cls.brings_back} == {"recall"}  # what chat passes


def test_a_turn_says_at_most_one_note_and_never_rounds_a_partial_share_up():
    """Issue 38.5: what recall brought back is said only when no message fell below a level that turn, and a
    share is rounded down (99.6% held reads 99%, never 100%)."""
    console = Console(file=io.StringIO(), width=300, no_color=True)
    view = ChatView(console, None, "tiny", "cpu, float32")

    class Report:
        preview, kept = "What is my name?", 0.0796

    view.reply_ended(False, None, [], recall="this turn brought evicted tokens back: 40% from message 1")
    view.reply_ended(False, None, [Report()], recall="this turn brought evicted tokens back: 40% from message 1")
    out = console.file.getvalue().splitlines()
    assert out == [
        "note: this turn brought evicted tokens back: 40% from message 1",
        'note: your message "What is my name?" is 7% cached: the model has mostly lost it; say again what matters; '
        "a larger /budget keeps more",
    ]
    from h2o_chat.app.chat.conversation import EvictionReport
    from h2o_chat.app.ui import eviction_table

    table = Console(file=io.StringIO(), width=120, no_color=True)
    table.print(eviction_table([EvictionReport("user", 1, "hello", 300, 0.996), EvictionReport("user", 2, "hi", 9, 1)]))
    rows = table.file.getvalue().splitlines()
    assert " 99% " in rows[1] and "100%" not in rows[1] and " 100% " in rows[2]


def test_budget_reads_tokens_a_memory_or_a_share_as_the_command_line_does(embedded):
    """Issue 38.5/38.7: /budget and --budget share one reader: 10% is of the trained context (8,192 here), and
    2.5 is refused (it was 2.5 bytes): a number of tokens is whole, a memory needs its unit."""
    cmds, conv, view = commands(embedded)
    cmds.run("/budget 10%")
    assert conv.policy == make_policy("snap", 819)
    assert view.said[0] == "/budget 10%: a budget of 819 tokens (10% of the trained context, 8,192)"
    cmds.run("/budget 2.5")
    why = "a number of tokens is a whole number, and a memory needs its unit (e.g. 2.5MB)"
    assert view.errors == [f"/budget 2.5: {why}"]
    assert conv.policy == make_policy("snap", 819)


def test_a_budget_beyond_the_trained_context_is_capped_and_said(embedded):
    """Issue 48.10: /budget past the model's trained context (8,192 here) is the context, with why."""
    cmds, conv, view = commands(embedded)
    cmds.run("/budget 100000")
    assert conv.policy == make_policy("snap", 8192) and not view.errors
    assert view.said[0].startswith("/budget 100000: the budget is 8,192 tokens, the model's trained context")


def test_set_speaks_the_chats_words_and_shows_a_random_seed(embedded):
    """Issue 38.7: /set temperature -1 answered with "--temperature must be ..." and /set showed "seed None"."""
    cmds, conv, view = commands(embedded)
    for line in ("/set temperature -1", "/set top_p 0", "/set max_new_tokens 0", "/set repetition-penalty 0"):
        cmds.run(line)
    assert view.errors == [
        "temperature must be between 0 (greedy) and 10, got -1",
        "top_p must be above 0 and at most 1, got 0",
        "max_new_tokens must be a positive integer, got 0",
        "repetition_penalty must be above 0 and at most 10 (1 = off), got 0",
    ]
    cmds.run("/set")
    assert view.said[-1].startswith("temperature 0, top_p 1.0, ") and "seed random, " in view.said[-1]
    cmds.run("/set seed 5")
    assert conv.settings.sampler.seed == 5 and view.said[-1] == "seed set to 5 from the next reply on"
    cmds.run("/set seed random")
    assert conv.settings.sampler.seed is None and view.said[-1] == "seed set to random from the next reply on"


def test_undo_says_what_the_cache_holds_and_quotes_whole_words(embedded, tmp_path):
    """Issue 48.13: /undo said "the cache is as it was before them" where that cache had restarted (0 seen,
    nothing cached: the conversation is read again at the next turn), and its quote cut a number in the middle."""
    cmds, conv, view = commands(embedded)
    conv.set_sampling(max_new_tokens=2)
    list(conv.send("Hello there."))
    saved = tmp_path / "hello.json"  # messages alone: /load reads them again at the next turn
    cmds.run(f"/save {saved}")
    cmds.run(f"/load {saved}")  # the cache restarts
    long = "Please check: the shipment number is 1234567890123 today, and it is late."
    list(conv.send(long))  # the copy /undo keeps is of that empty cache
    cmds.run("/undo")
    assert not view.errors and conv.fed == 0 and len(conv.messages) == 2
    assert view.said[-1] == (
        'took back "Please check: the shipment number is…" and its reply; the cache held none of the conversation '
        "before them (it had restarted), so the conversation is read again at the next turn"
    )
    list(conv.send("Name a colour."))  # reads the whole conversation again
    list(conv.send("Name a fruit."))
    cmds.run("/undo")
    assert view.said[-1] == 'took back "Name a fruit." and its reply; the cache is as it was before them'
    assert conv.fed == conv.cache.stats().seen > 0
    cmds.run("/undo")
    cmds.run("/undo")
    assert view.said[-1] == 'took back "Hello there." and its reply; the conversation is empty again'


def test_set_seed_minus_one_is_random_again(embedded):
    """Issue 48.13: `/set seed -1` showed "seed -1", with no way back to random; -1 is random (as llama.cpp reads
    it), and shown so."""
    cmds, conv, view = commands(embedded)
    cmds.run("/set seed 5")
    cmds.run("/set seed -1")
    assert conv.settings.sampler.seed is None and view.said[-1] == "seed set to random from the next reply on"
    cmds.run("/set")
    assert "seed random" in view.said[-1]
    cmds.run("/set seed -7")
    assert view.errors == ["/set seed takes a whole number >= 0, or random (or -1), got -7"]


def test_save_asks_before_replacing_a_file(embedded, tmp_path):
    """Issue 38.7: /save replaced a file without a word; as /load does before losing unsaved messages, the first
    /save over an existing file says so and the same /save again replaces it. The file this session saved to last
    is saved again without asking."""
    cmds, conv, view = commands(embedded)
    conv.messages = [{"role": "user", "content": "hi"}]
    notes = tmp_path / "notes.json"
    notes.write_text("my notes")
    cmds.run(f"/save {notes}")
    assert notes.read_text() == "my notes" and view.said[-1] == f"{notes} exists: /save {notes} again replaces it"
    cmds.run(f"/save {notes}")
    assert view.said[-1] == f"saved 1 message to {notes}" and json.loads(notes.read_text())["messages"]
    conv.messages.append({"role": "assistant", "content": "hello"})
    cmds.run(f"/save {notes}")  # its own file: no question
    assert view.said[-1] == f"saved 2 messages to {notes}" and len(json.loads(notes.read_text())["messages"]) == 2


def test_show_says_replies_run_past_the_end_of_sequence_token(embedded):
    """Issue 48.8: --ignore-eos reaches the chat's settings, and /show says so."""
    cmds, conv, view = commands(embedded)
    cmds.run("/show")
    assert "--ignore-eos" not in view.said[-1]
    conv.set_sampling(ignore_eos=True)
    cmds.run("/show")
    assert view.said[-1].endswith("replies run past the end-of-sequence token to max_new_tokens (--ignore-eos)")
