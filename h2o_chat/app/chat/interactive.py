"""The interactive chat: the turn loop wires input, slash commands, the conversation and the view together.

Each part is small and testable on its own: `SlashCommands` (app/chat/commands.py) runs /commands, `ChatView`
(app/chat/view.py) renders, `Conversation` holds the turns and the cache. The loop reads a line and hands it on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from h2o_chat.app.chat.commands import SlashCommands
from h2o_chat.app.chat.conversation import Conversation
from h2o_chat.app.chat.resume import load_conversation, loaded_line
from h2o_chat.app.chat.view import ChatView
from h2o_chat.app.piped import ReadingForecast, RunOptions
from h2o_chat.app.ui import PanelView, describe_device, make_console, plural
from h2o_chat.engine.step.decode import PrefillInterrupted
from h2o_chat.errors import H2OChatError, out_of_memory
from h2o_chat.files import user_data_dir
from h2o_chat.models.loading import Loaded
from h2o_chat.models.memory import process_memory


@contextlib.contextmanager
def interruptible() -> Iterator[threading.Event]:
    """Ctrl-C sets an event instead of raising: the reply loop stops between tokens, never mid-forward
    (which would leave the cache half-updated)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatSession:
    """The turn loop: read a line, run a slash command or a reply."""

    def __init__(self, loaded: Loaded, options: RunOptions, console: Console, prompt_session=None):
        self.loaded, self.console, self.prompt = loaded, console, prompt_session
        self.conv = Conversation(loaded, options.policy, options.settings)
        self.conv.budget_hint = "/budget"
        plain = bool(os.environ.get("NO_COLOR"))  # the README promises plain text: no boxed panel
        device = describe_device(loaded)
        panel = PanelView(loaded.spec.name, device, plain=plain, memory=process_memory) if options.panel else None
        self.view = ChatView(console, panel, loaded.spec.name, device, memory=process_memory)
        self.commands = SlashCommands(self.conv, self.view, self.reply)
        self.conv.on_setup = self.view.setup  # every engine the conversation makes (/reset, /load restart it)

    @property
    def panel(self) -> PanelView | None:
        return self.view.panel

    def run(self, first: str | None = None, resume: Path | None = None) -> None:
        """The session; `first` (-f FILE) is sent as the first message, after the conversation saved in `resume`
        (--resume FILE) is loaded (a file that cannot be is one line, and the command ends)."""
        self.view.banner(self.conv.policy.describe())
        if resume is not None:
            self.view.say(loaded_line(self.conv, load_conversation(self.conv, resume), resume))
        if first is not None:
            self.view.echo(first)
            self.reply(first)
        while True:
            try:
                text = self.prompt.prompt().strip()
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            if not text:
                continue
            self.view.echo(text)
            if not text.startswith("/"):
                self.reply(text)
                continue
            try:
                if self.commands.run(text) == "exit":
                    break
            except KeyboardInterrupt:  # Ctrl-C stops a command (a long /load), never the session
                self.view.say("(stopped)")

    def reply(self, text: str) -> None:
        """One turn: the message is read (with progress), the reply streams until it ends or Ctrl-C. Nothing
        that goes wrong in a turn ends the session: out of memory takes the turn back, keeping the rest."""
        conv, view = self.conv, self.view
        forecast = ReadingForecast()

        def progress(done: int, total: int) -> None:
            for notice in [*conv.cache.pop_notices(), forecast(done, total, conv.pending)]:
                if notice:
                    view.note(notice)
            view.reading(done, total, conv.pending, conv.pending_messages, conv.stats)

        last = None
        try:
            with (
                interruptible() as stop,
                view.reply(conv.cache.stats().evicted, conv.engine.describe()),
                contextlib.closing(conv.send(text, progress=progress)) as stream,
            ):
                for last in stream:
                    view.token(last, conv.engine.describe(), conv.speeds(last), conv.stats)
                    for notice in conv.cache.pop_notices():  # e.g. decode slowed on a busy CPU: said as it happens
                        view.note(notice)
                    if stop.is_set():
                        break
        except PrefillInterrupted as e:  # Ctrl-C while the message was read: stopped after that chunk
            # the message's own tokens: snap's first pass (its probe) is not counted
            read = max(0, e.done - max(0, e.total - conv.pending))
            if read >= conv.pending:
                where = "before the reply: your message was not added"
            else:
                where = f"reading your message after {read:,} of {conv.pending:,} tokens: it was not added"
            view.say(f"(stopped {where}, and the conversation is as it was before it; Up brings the message back)")
            return
        except H2OChatError as e:  # e.g. a model that cannot read past its context: the session stays
            advice = getattr(e, "advice", None)
            view.error(f"{e}; {advice}" if advice else e)
            return
        except Exception as e:
            if not out_of_memory(e):
                raise
            conv.drop_last_turn()  # the cache may be half-updated: it restarts, the conversation stays
            view.error(
                f"out of memory ({str(e).splitlines()[0]}); this message was taken back (Up sends it again) and "
                f"the conversation before it is kept ({plural(len(conv.messages), 'message')}); a smaller /budget "
                "needs less"
            )
            return
        finally:
            for notice in conv.cache.pop_notices():
                view.note(notice)
        view.reply_ended(
            stop.is_set(), last, conv.newly_evicted_user_messages(), conv.policy.brings_back, conv.ledger.recall_note
        )

    def toolbar(self, width: int | None = None) -> str:
        if width is None:
            from prompt_toolkit.application import get_app_or_none

            app = get_app_or_none()
            width = app.output.get_size().columns if app is not None else 120
        return self.view.toolbar(self.conv.stats(), width)


HISTORY_ENTRY_CHARS = 4096  # what the history file keeps of one entry (this session's Up keeps it whole)


def history_entry(text: str, limit: int = HISTORY_ENTRY_CHARS) -> str:
    """What the history file keeps of an entry: a pasted document (~20 KB for 4,900 tokens) landed whole in it,
    for every later session to load; it keeps the first `limit` characters, cut between words, marked " …"."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit))
    return text[: cut if cut > 0 else limit].rstrip() + " …"


def make_prompt_session(history: Path | None, chat: ChatSession, **kwargs):
    """prompt-toolkit input: persistent history, Alt-Enter for a new line, stats in the bottom toolbar."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.layout.dimension import Dimension

    class CappedHistory(FileHistory):
        def store_string(self, string: str) -> None:
            super().store_string(history_entry(string))

    path = (history or user_data_dir() / "history").expanduser()
    try:  # a read-only home must not end the session that has just loaded its model
        path.parent.mkdir(parents=True, exist_ok=True)
        path.open("a", encoding="utf-8").close()
        past = CappedHistory(str(path))
    except OSError as e:
        chat.view.note(f"input history is off for this session: cannot write {path} ({e.strerror})")
        past = InMemoryHistory()
    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    class Prompt(PromptSession):
        def _get_default_buffer_control_height(self):
            """The input stays below the terminal's height (a long paste scrolls inside it). An input area of
            the terminal's full height is cleared from the top-left corner when it is done, and terminals such
            as tmux (scroll-on-clear) then push the whole screen into the scrollback: a second, partial copy
            of the paste above the session's own echo of it."""
            height = super()._get_default_buffer_control_height()
            rows = self.app.output.get_size().rows
            return Dimension(min=height.min, max=max(1, min(height.max, rows - 4)))

    return Prompt(
        message="> ",
        history=past,
        key_bindings=keys,
        multiline=False,
        bottom_toolbar=chat.toolbar if chat.panel is not None else None,
        erase_when_done=True,  # the session echoes the whole input itself (ChatSession.echo)
        **kwargs,
    )


def run_interactive(loaded: Loaded, options: RunOptions, history: Path | None = None, first: str | None = None) -> None:
    console = make_console()
    chat = ChatSession(loaded, options, console)
    chat.prompt = make_prompt_session(history, chat)
    chat.run(first, options.resume)
