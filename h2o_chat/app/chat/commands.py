"""The chat's slash commands: each a small method over the conversation, printing through the view.

`SlashCommands(conv, view, reply)` holds the settings a session remembers between commands (the budget while
the full cache is active, the heavy ratio, a /load waiting to be confirmed); `run(line)` dispatches and returns
"exit" to end the session. `reply(text)` runs a turn (for /regen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from h2o_chat.app.chat.conversation import Conversation
from h2o_chat.app.chat.resume import (
    check_conversation_file,
    load_conversation,
    loaded_line,
    save_conversation,
    saved_line,
)
from h2o_chat.app.chat.view import ChatView
from h2o_chat.app.ui import describe_device, plural, quote
from h2o_chat.engine.policies import DEFAULT_POLICY
from h2o_chat.engine.step.prefill import default_chunk
from h2o_chat.errors import DeviceError, H2OChatError, InputError, out_of_memory

HELP = """\
/help              this list
/budget N|SIZE|%   set the budget: tokens, a memory (64MB) or a share of the context (10%); a smaller one evicts now
/policy NAME       snap | recall | h2o | sink | recent | full
/set NAME VALUE    temperature | top_p | top_k | min_p | repetition_penalty | max_new_tokens | seed (random: -1)
/regen             answer the last message again, from the cache as it was before the reply
/undo              take back your last message and its reply
/show              the model, chat template, settings, policy and budget
/clear             clear the screen (the conversation stays)
/system TEXT       set the system prompt (the conversation is re-read on the next turn)
/reset             start over, keeping the system prompt
/save FILE         save the conversation and its cache (FILE.json: the messages alone, as JSON)
/load FILE         load a saved conversation (with its cache: nothing is read again)
/stats             show the cache and memory panel
/evicted           which messages are no longer fully in the cache
/exit              leave (or Ctrl-D); Ctrl-C stops a reply
Enter sends; Alt-Enter (or Esc then Enter) adds a line; pasted text keeps its lines."""


# /set NAME: the sampler's settings, and the turn's length (ChatSettings)
SAMPLER_SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float}
SAMPLER_SETTINGS |= {"repetition_penalty": float, "seed": int}


class SlashCommands:
    """/help, /budget, /policy, /set, /regen, /undo, /show, /clear, /system, /reset, /save, /load, /stats,
    /evicted, /exit: `cmd_<name>(arg)`."""

    def __init__(self, conv: Conversation, view: ChatView, reply: Callable[[str], None]):
        self.conv, self.view, self.reply = conv, view, reply
        self.heavy_ratio = getattr(conv.policy, "heavy_ratio", 0.5)
        # policy and budget are independent settings: the budget is remembered while `full` (none) is active
        self.budget = conv.policy.budget or 512
        # a /load that would lose unsaved messages, said once: the file and the messages it would replace
        self.replacing: tuple[str, list[dict]] | None = None
        self.overwriting: str | None = None  # a /save over an existing file, said once
        self.saved_to: Path | None = None  # the file this session saved to last: saved again without a word

    def run(self, line: str) -> str | None:
        """Run one command line; "exit" when the session should end. Errors are shown, never raised; a rejected
        setting leaves the session as it was."""
        name, _, arg = line.partition(" ")
        handler = getattr(self, "cmd_" + name[1:].lower(), None)
        if handler is None:
            self.view.say(f"unknown command {name}; /help lists the commands")
            return None
        try:
            return handler(arg.strip())
        except H2OChatError as e:
            self.view.error(e)
        except Exception as e:
            if not out_of_memory(e):
                raise
            self.view.error(DeviceError(f"out of memory ({str(e).splitlines()[0]}); the conversation is kept"))
        return None

    def cmd_help(self, arg: str) -> None:
        self.view.say(HELP)

    def cmd_exit(self, arg: str) -> str:
        return "exit"

    cmd_quit = cmd_exit

    def _set_policy(self, name: str, budget: int | None, why: str = "") -> None:
        from h2o_chat.engine.policies import make_policy, with_budget

        old = self.conv.policy
        if name == old.name and old.budget is not None:  # a new budget: keep the other settings (sinks, window)
            policy = with_budget(old, budget)
        else:
            policy = make_policy(name, budget, heavy_ratio=self.heavy_ratio)
        if policy.budget is not None and policy.budget != old.budget:  # as --budget is checked before loading
            self.conv.loaded.check_budget(policy.budget, flag="/budget", kv_quant=self.conv.settings.kv_quant)
        before = self.conv.cache.stats().evicted
        self.conv.set_policy(policy)
        if policy.budget is not None:
            self.budget = policy.budget
        dropped = self.conv.cache.stats().evicted - before
        extra = f"; evicted {dropped:.0f} tokens now" if dropped else ""
        self.view.say(f"cache: {policy.describe()}{extra}{why}")

    def cmd_budget(self, arg: str) -> None:
        if not arg:
            self.view.say(f"cache: {self.conv.policy.describe()}")
            return
        budget = self._tokens(arg)
        if self.conv.policy.name != "full":
            self._set_policy(self.conv.policy.name, budget)
            return
        # the full cache holds every token: a budget is one of a policy that evicts, the default (said so)
        why = f" (was full, which has no budget: a budget is {DEFAULT_POLICY}'s; /policy full goes back)"
        self._set_policy(DEFAULT_POLICY, budget, why)

    def _tokens(self, arg: str) -> int:
        """/budget as --budget reads it: tokens, a memory (the most tokens whose keys and values fit, as this
        chat's cache stores them) or a share of the model's trained context."""
        from h2o_chat.app.budget import BudgetText, within_context
        from h2o_chat.models.memory import kv_token_bytes

        loaded, kv_quant = self.conv.loaded, self.conv.settings.kv_quant
        asked = BudgetText.parse("/budget", arg)
        tokens, how = asked.resolve(
            lambda: kv_token_bytes(loaded.model.config, loaded.dtype, kv_quant), lambda: loaded.context, 1, kv_quant
        )
        if how:
            self.view.say(how)
        tokens, capped = within_context(tokens, loaded.context, asked.head)
        if capped:
            self.view.say(capped)
        return tokens

    def cmd_policy(self, arg: str) -> None:
        if not arg:
            self.view.say(f"cache: {self.conv.policy.describe()}")
            return
        self._set_policy(arg, self.budget)

    def cmd_set(self, arg: str) -> None:
        """/set NAME VALUE, checked as the command line checks --NAME; /set alone shows the settings."""
        settings = self.conv.settings
        sampler = settings.sampler
        if not arg:
            shown = [f"{name} {_shown(getattr(sampler, name))}" for name in SAMPLER_SETTINGS]
            self.view.say(", ".join([*shown, f"max_new_tokens {settings.max_new_tokens}"]))
            return
        name, _, value = arg.partition(" ")
        name, value = name.lower().replace("-", "_"), value.strip()
        kind = int if name == "max_new_tokens" else SAMPLER_SETTINGS.get(name)
        if kind is None:
            names = ", ".join([*SAMPLER_SETTINGS, "max_new_tokens"])
            raise InputError(f"/set takes one of {names}, got {name!r}")
        try:
            number = None if (name, value.lower()) == ("seed", "random") else kind(value)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise InputError(f"/set {name} takes {what}, got {value!r}") from None
        if name == "seed" and number is not None and number < 0:
            if number != -1:
                raise InputError(f"/set seed takes a whole number >= 0, or random (or -1), got {number}")
            number = None  # -1: a random seed, as llama.cpp reads it
        if name == "max_new_tokens":
            if number <= 0:
                raise InputError(f"max_new_tokens must be a positive integer, got {number}")
            self.conv.set_sampling(max_new_tokens=number)
        else:
            # the Sampler checks; its errors name the setting as /set does (top_p)
            sampler = dataclasses.replace(sampler, **{name: number})
            self.conv.set_sampling(sampler=sampler)
        self.view.say(f"{name} set to {_shown(number)} from the next reply on")

    def cmd_regen(self, arg: str) -> None:
        """Answer the last message again: the message and its reply are taken back as /undo takes them (the cache
        goes back to the state the reply began from, where a copy was kept; else the conversation is re-read), the
        message is sent again and a new reply sampled."""
        if not any(m["role"] == "assistant" for m in self.conv.messages):
            raise InputError("there is no reply to generate again yet")
        sampler = self.conv.settings.sampler
        if sampler.temperature == 0:
            self.view.note("temperature is 0 (greedy): the same reply comes again; /set temperature 0.7 varies it")
        text, _ = self.conv.undo_last_turn()
        self.conv.set_sampling(sampler=sampler.reseeded())  # another draw than the reply it replaces
        self.reply(text)

    def cmd_undo(self, arg: str) -> None:
        """Take back the last exchange: the cache goes back to before it (a copy kept from then), or, where no copy
        was kept, restarts and re-reads the conversation on the next turn (said)."""
        if not any(m["role"] == "user" for m in self.conv.messages):
            raise InputError("there is nothing to undo yet")
        text, restored = self.conv.undo_last_turn()
        preview = quote(text)
        if not any(m["role"] == "user" for m in self.conv.messages):
            self.view.say(f'took back "{preview}" and its reply; the conversation is empty again')
        elif restored and not self.conv.fed:  # the copy is of a cache that had restarted (/regen, /load, /system)
            self.view.say(
                f'took back "{preview}" and its reply; the cache held none of the conversation before them (it had '
                "restarted), so the conversation is read again at the next turn"
            )
        elif restored:
            self.view.say(f'took back "{preview}" and its reply; the cache is as it was before them')
        else:
            self.view.say(
                f'took back "{preview}" and its reply; the cache could not go back (no copy of it was kept), so the '
                "conversation is re-read on the next turn"
            )

    def cmd_show(self, arg: str) -> None:
        """What this chat runs: the model, the chat template's source, the settings, the policy and budget."""
        conv, settings = self.conv, self.conv.settings
        system = next((m["content"] for m in conv.messages if m["role"] == "system"), None)
        sampler = [f"{name} {_shown(getattr(settings.sampler, name))}" for name in SAMPLER_SETTINGS]
        lines = [
            f"model: {conv.loaded.spec.name} ({conv.loaded.spec.source}) on {describe_device(conv.loaded)}",
            f"chat template: {conv.template.source}",
            f"cache: {conv.policy.describe()}",
            f"settings: {', '.join(sampler)}, max_new_tokens {settings.max_new_tokens}",
            f"reading: chunks of {settings.chunk_size or default_chunk(conv.engine.device)} tokens; "
            f"positions {settings.positions}; "
            f"KV {'in 8 bits' if settings.kv_quant == '8bit' else 'in the model dtype'}; decode {settings.decode}",
            f"system prompt: {system!r}" if system else "no system prompt",
        ]
        if settings.stop:
            lines.append("stop at: " + ", ".join(repr(s) for s in settings.stop))
        if settings.ignore_eos:
            lines.append("replies run past the end-of-sequence token to max_new_tokens (--ignore-eos)")
        self.view.say("\n".join(lines))

    def cmd_clear(self, arg: str) -> None:
        self.view.clear()

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
        """Save the conversation; over an existing file only when the same /save comes twice (as /load asks
        before replacing unsaved messages), or when it is the file this session saved to last."""
        if not arg:
            raise InputError("/save needs a file name")
        target = Path(arg).expanduser().resolve()
        if target.exists() and not target.is_dir() and self.overwriting != arg and target != self.saved_to:
            self.overwriting = arg
            self.view.say(f"{arg} exists: /save {arg} again replaces it")
            return
        self.overwriting = None
        path, cache_bytes = save_conversation(self.conv, arg)  # with its cache (a *.json name: messages alone)
        self.saved_to = target
        self.view.say(saved_line(self.conv, path, cache_bytes))

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise InputError("/load needs a file name")
        unsaved = self.conv.unsaved
        # said once; the same /load again goes ahead, unless the conversation changed in between (a message sent
        # after the question is one more to lose: it is asked again)
        if unsaved and self.replacing != (arg, self.conv.messages):
            check_conversation_file(arg)  # a file that cannot load says so first, not after the question
            self.replacing = (arg, [dict(m) for m in self.conv.messages])
            self.view.say(
                f"/load replaces this conversation and its {plural(unsaved, 'unsaved message')}: /save FILE keeps "
                f"them; /load {arg} again replaces them"
            )
            return
        self.replacing = None
        count = load_conversation(self.conv, arg)
        self.view.say(loaded_line(self.conv, count, arg))

    def cmd_stats(self, arg: str) -> None:
        self.view.stats(self.conv.stats())

    def cmd_evicted(self, arg: str) -> None:
        self.view.evictions(self.conv.evictions())


def _shown(value) -> str:
    """A setting as /set shows it: no seed is a random one."""
    return "random" if value is None else str(value)
