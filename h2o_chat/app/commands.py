"""The chat's slash commands: each a small method over the conversation, printing through the view.

`SlashCommands(conv, view)` holds the settings a session remembers between commands (the budget while the
full cache is active, the heavy ratio); `run(line)` dispatches and returns "exit" to end the session.
"""

from __future__ import annotations

from h2o_chat.app.chat_view import ChatView
from h2o_chat.app.conversation import Conversation
from h2o_chat.engine.policies import DEFAULT_POLICY
from h2o_chat.errors import H2OChatError, InputError

HELP = """\
/help              this list
/budget N          set the cache budget (tokens per layer); a smaller one evicts now
/policy NAME       h2o | snap | sink | recent | full
/system TEXT       set the system prompt (the conversation is re-read on the next turn)
/reset             start over, keeping the system prompt
/save FILE         save the conversation as JSON
/load FILE         load a saved conversation (read on the next turn)
/stats             show the cache and memory panel
/evicted           which messages are no longer fully in the cache
/exit              leave (or Ctrl-D); Ctrl-C stops a reply
Enter sends; Alt-Enter (or Esc then Enter) adds a line; pasted text keeps its lines."""


class SlashCommands:
    """/help, /budget, /policy, /system, /reset, /save, /load, /stats, /evicted, /exit: `cmd_<name>(arg)`."""

    def __init__(self, conv: Conversation, view: ChatView):
        self.conv, self.view = conv, view
        self.heavy_ratio = getattr(conv.policy, "heavy_ratio", 0.5)
        # policy and budget are independent settings: the budget is remembered while `full` (none) is active
        self.budget = conv.policy.budget or 512

    def run(self, line: str) -> str | None:
        """Run one command line; "exit" when the session should end. Errors are shown, never raised."""
        name, _, arg = line.partition(" ")
        handler = getattr(self, "cmd_" + name[1:].lower(), None)
        if handler is None:
            self.view.say(f"unknown command {name}; /help lists the commands")
            return None
        try:
            return handler(arg.strip())
        except H2OChatError as e:
            self.view.error(e)
            return None

    def cmd_help(self, arg: str) -> None:
        self.view.say(HELP)

    def cmd_exit(self, arg: str) -> str:
        return "exit"

    cmd_quit = cmd_exit

    def _set_policy(self, name: str, budget: int | None) -> None:
        from h2o_chat.engine.policies import make_policy, with_budget

        old = self.conv.policy
        if name == old.name and old.budget is not None:  # a new budget: keep the other settings (sinks, window)
            policy = with_budget(old, budget)
        else:
            policy = make_policy(name, budget, heavy_ratio=self.heavy_ratio)
        before = self.conv.cache.stats().evicted
        self.conv.set_policy(policy)
        if policy.budget is not None:
            self.budget = policy.budget
        dropped = self.conv.cache.stats().evicted - before
        extra = f"; evicted {dropped:.0f} tokens now" if dropped else ""
        self.view.say(f"cache: {policy.describe()}{extra}")

    def cmd_budget(self, arg: str) -> None:
        if not arg:
            self.view.say(f"cache: {self.conv.policy.describe()}")
            return
        try:
            budget = int(arg)
        except ValueError:
            raise InputError(f"/budget takes a number of tokens, got {arg!r}") from None
        name = self.conv.policy.name
        self._set_policy(DEFAULT_POLICY if name == "full" else name, budget)

    def cmd_policy(self, arg: str) -> None:
        if not arg:
            self.view.say(f"cache: {self.conv.policy.describe()}")
            return
        self._set_policy(arg, self.budget)

    def cmd_system(self, arg: str) -> None:
        if not arg:
            current = next((m["content"] for m in self.conv.messages if m["role"] == "system"), None)
            self.view.say(f"system prompt: {current!r}" if current else "no system prompt")
            return
        self.conv.set_system(arg)
        self.view.say("system prompt set; the conversation is re-read on the next turn")

    def cmd_reset(self, arg: str) -> None:
        self.conv.reset()
        self.view.say("conversation reset")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise InputError("/save needs a file name")
        path = self.conv.save(arg)
        self.view.say(f"saved {len(self.conv.messages)} messages to {path}")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise InputError("/load needs a file name")
        count = self.conv.load(arg)
        self.view.say(f"loaded {count} messages from {arg}; they are read into the cache on the next turn")

    def cmd_stats(self, arg: str) -> None:
        self.view.stats(self.conv.cache.stats())

    def cmd_evicted(self, arg: str) -> None:
        self.view.evictions(self.conv.evictions())
