"""The h2o-chat command line: options in, calls out. No torch import at module level (fast --help)."""

from __future__ import annotations

import dataclasses
import difflib
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from h2o_chat.app.options import (
    CacheOptions,
    Command,
    Group,
    IgnoreEos,
    ModelOptions,
    ModelsFile,
    PolicyKnobs,
    SamplingOptions,
    given_options,
    grouped,
    refuse_unused,
    store_of,
)
from h2o_chat.app.reporting import guard_stdout, reported, require_stdout, stdout_failed
from h2o_chat.errors import InputError, StdoutError
from h2o_chat.models.registry import load_registry


class PromptOrCommand(Group):
    """`h2o-chat "What is 2+2?"`: words that are not a subcommand are a prompt for one reply (like llm and
    ollama). A first word that names a subcommand (models, list, batch, bench, soak, eval, serve) runs it; `chat`
    opens the chat (the words after it are its first message) and `run MODEL` names the model (as ollama's: a chat,
    or one reply to the words after it), each with every option of the main command."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        args, words = list(args), []
        while True:  # options stop at the first positional word: take it out and look again
            _, rest, _ = self.make_parser(ctx).parse_args(args=list(args))
            if not rest or (not words and rest[0] in self.commands):
                break
            at = len(args) - len(rest)  # rest is what follows the options parsed so far
            words.append(args.pop(at))
        if words[:1] == ["chat"]:
            ctx.meta[CHAT], words = True, words[1:]
        elif words[:1] == ["run"]:
            ctx.meta[RUN], words = " ".join(words[1:2]), words[2:]  # "": no model named (said once options are read)
        if words:
            ctx.meta[PROMPT] = " ".join(words)
        return super().parse_args(ctx, args)


def read_prompt_file(path: Path) -> str:
    """-f FILE: its text, or one clear line on why it cannot be the prompt. FILE may be a pipe (`-f <(...)`,
    /dev/stdin) or `-`, standard input."""
    from h2o_chat.files import read_user_text

    text = read_user_text(path, "prompt file", streams=True).removeprefix("\ufeff")
    if not text.strip():
        name = "standard input (-f -)" if str(path) == "-" else path
        raise InputError(f"the prompt file {name} is empty")
    return text


def read_chat_template(path: Path) -> tuple[str, str]:
    """--chat-template FILE: (its name, its text) once it parses as a Jinja template, else one clear line."""
    from h2o_chat.app.messages import check_template
    from h2o_chat.files import read_user_text

    text = read_user_text(path, "chat template")
    check_template(text, str(path))
    return str(path), text


PROMPT = "h2o_chat.prompt"
CHAT = "h2o_chat.chat"  # `h2o-chat chat`: the chat, asked for by name
RUN = "h2o_chat.run"  # `h2o-chat run MODEL`: the model named as ollama names it
MODELS_FILE = "h2o_chat.models_file"  # --models before `models`


def _options_before(ctx: typer.Context, command: str) -> None:
    """Options before a command's name are the chat's, which that command would silently ignore
    (`h2o-chat --budget 5 batch ...`): refused, saying where they go. --models before `models` is honoured."""
    given = [p for p in ctx.command.params if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"]
    ignored = [p.opts[0] for p in given if not (command in ("models", "list") and p.name == "models_file")]
    if ignored:
        it = "it" if len(ignored) == 1 else "them"
        raise InputError(
            f"{', '.join(ignored)} before '{command}' would be ignored: put {it} after it "
            f"(h2o-chat {command} {ignored[0]} ...)"
        )


app = typer.Typer(
    cls=PromptOrCommand,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Chat and long-form generation in bounded memory with the H2O heavy-hitter KV cache.\n\n"
    "With a terminal on stdin it chats; with a pipe it generates once for the whole of stdin; "
    'h2o-chat "PROMPT" replies once to PROMPT (text on stdout, as with a pipe). '
    "h2o-chat chat [MESSAGE] opens the chat; h2o-chat run MODEL [PROMPT] is -m MODEL (as ollama's run).",
    subcommand_metavar="[PROMPT] | chat | run MODEL | COMMAND [ARGS]...",
    epilog="Environment: H2O_CHAT_CACHE is where converted weights (GGUF to safetensors) and the bench's random "
    "models are kept (default: ~/.cache/h2o-chat, or $XDG_CACHE_HOME/h2o-chat); NO_COLOR gives plain text.",
)


def _version(value: bool) -> None:
    if value:
        from h2o_chat import __version__

        typer.echo(f"h2o-chat {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
@grouped
def main_command(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    system: Annotated[str | None, typer.Option(help="System prompt (batch: for lines without one).")] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option("--stop", help="End the reply before this text (repeat for several).", show_default=False),
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Piped: continue stdin as plain text, without the chat template.")
    ] = False,
    no_panel: Annotated[bool, typer.Option("--no-panel", help="Plain streamed text, no live panel.")] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Piped: print one JSON record (text and stats) instead of streamed text.")
    ] = False,
    history: Annotated[Path | None, typer.Option(help="Input history file (interactive).")] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            "-f",
            metavar="FILE",
            help="Prompt from a UTF-8 file, a pipe, or - for stdin (piped: the prompt; chat: its first message)",
        ),
    ] = None,
    chat_template: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="A Jinja chat template file, used instead of the tokenizer's."),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Continue a conversation saved by /save, with its cache (nothing is read again); its model and "
            "cache settings unless given (piped: the prompt is its next message).",
        ),
    ] = None,
    prompt_cache: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Piped: keep the cache after reading the prompt's text in FILE; a later prompt that begins with "
            "that text reads only the rest (--max-new-tokens 0: read and save only).",
        ),
    ] = None,
    ignore_eos: IgnoreEos = False,
    models: ModelOptions = ModelOptions(),
    cache: CacheOptions = CacheOptions(),
    knobs: PolicyKnobs = PolicyKnobs(),
    sampling: SamplingOptions = SamplingOptions(),
) -> None:
    """Chat (terminal) or generate once for the whole of stdin (pipe)."""
    if ctx.invoked_subcommand is not None:
        with reported():
            _options_before(ctx, ctx.invoked_subcommand)
        ctx.meta[MODELS_FILE] = models.models_file  # `h2o-chat --models m.toml models` lists that file's aliases too
        return
    argument, chat = ctx.meta.get(PROMPT), ctx.meta.get(CHAT, False)
    with reported():
        require_stdout()
        models = _run_model(ctx.meta.get(RUN), models)
        cached = None
        if prompt_cache is not None:  # before the checks: --max-new-tokens 0 reads the prompt into the file only
            from h2o_chat.app.prompt_cache import options as prompt_cache_options

            in_chat = chat or (argument is None and sys.stdin.isatty())
            cached, sampling = prompt_cache_options(prompt_cache, in_chat, resume, sampling)
        if sampling.max_new_tokens == 0 and cached is None:  # a reply of none is only a prompt cache's read
            raise InputError("--max-new-tokens 0 only reads a prompt into --prompt-cache FILE; a reply needs 1 or more")
        for group in (models, cache, sampling):
            group.check()
        if chat and not sys.stdin.isatty():
            raise InputError("chat needs a terminal on stdin; for one reply to piped text, leave out 'chat'")
        interactive = chat or (argument is None and sys.stdin.isatty())
        if interactive and (json_out or raw):  # the chat would ignore them
            given = " and ".join(flag for flag, on in (("--json", json_out), ("--raw", raw)) if on)
            raise InputError(
                f"{given} {'need' if json_out and raw else 'needs'} piped input or a prompt argument "
                f'(h2o-chat {given.replace(" and ", " ")} "PROMPT"); the interactive chat takes neither'
            )
        if stop is not None and not all(stop):
            raise InputError("--stop needs some text to stop at")
        if raw and resume is not None:  # a chat's cache ends in its template: plain text after it is neither
            raise InputError("--raw continues plain text and --resume a saved chat: give one")
        if raw and system is not None:  # plain text has no system turn: the prompt was read without it, silently
            raise InputError(
                "--system needs the chat template, which --raw leaves out: put the system text at the start of the "
                "prompt, or leave out --raw"
            )
        refuse_unused(ctx, cache.policy)  # --resume keeps the saved policy only when no setting of one is given
        policy = _policy(cache, knobs, models)
        if resume is not None:  # the saved model and cache settings, where not given (one line for a bad file)
            from h2o_chat.app.chat.resume import resumed_settings

            models, cache, policy = resumed_settings(resume, given_options(ctx), models, cache, policy)
        if argument is not None and not argument.strip():
            raise InputError('the prompt is empty: h2o-chat "What is 2+2?"')
        # read before the weights load: a file that cannot be used is one line, at once
        first = read_prompt_file(prompt_file) if prompt_file is not None else None
        template = read_chat_template(chat_template) if chat_template is not None else None
        from h2o_chat.app.piped import combine_prompt, read_stdin_prompt

        # the argument, then the file: the chat's first message, or (then piped text) the one prompt
        prompt = combine_prompt(argument, first)
        if interactive:
            first, prompt = prompt, None
        if not sys.stdin.isatty():
            # fail fast, before loading weights; with a prompt argument, piped text follows it (as in ollama)
            piped = read_stdin_prompt(sys.stdin.buffer.read(), required=prompt is None)
            prompt = combine_prompt(prompt, piped)
        from h2o_chat.app.chat.conversation import ChatSettings
        from h2o_chat.app.piped import RunOptions

        options = RunOptions(
            policy=policy,
            settings=ChatSettings(
                max_new_tokens=sampling.max_new_tokens,
                chunk_size=cache.chunk_size,
                system=system,
                positions=cache.positions,
                kv_quant=cache.kv_quant,
                sampler=sampling.sampler(),
                decode=models.decode,
                stop=tuple(stop or ()),
                chat_template=template,
                ignore_eos=ignore_eos,
            ),
            panel=not no_panel,
            json=json_out,
            raw=raw,
            resume=resume,
            prompt_cache=cached,
        )
        loaded = models.load(kv_tokens=policy.budget, kv_quant=cache.kv_quant, store_tokens=store_of(policy))
        if interactive:
            from h2o_chat.app.chat.interactive import run_interactive

            run_interactive(loaded, options, history, first)
        else:
            from h2o_chat.app.piped import run_piped

            run_piped(loaded, options, prompt)


def _run_model(model: str | None, models: ModelOptions) -> ModelOptions:
    """`h2o-chat run MODEL`: MODEL is --model (`model` is None without `run`, "" for `run` alone)."""
    if model is None:
        return models
    if not model:
        raise InputError("run needs a model: h2o-chat run MODEL [PROMPT] (h2o-chat models lists them)")
    if models.model is not None:
        raise InputError(f"run {model} and --model {models.model} both name the model: give one")
    return dataclasses.replace(models, model=model)


def _policy(cache: CacheOptions, knobs: PolicyKnobs, models: ModelOptions):
    """The policy at the budget asked for (a memory or a share: the tokens it comes to). A policy name that is no
    policy is often a prompt, where llama-cli's -p is the prompt: said so."""
    from h2o_chat.engine.policies import POLICIES

    name = cache.policy
    if name not in POLICIES and not difflib.get_close_matches(name, POLICIES, n=1):
        raise InputError(
            f"unknown policy {name!r}: -p is --policy here ({', '.join(POLICIES)}); give the prompt as an argument: "
            f"h2o-chat {shlex.quote(name)}"
        )
    budget = cache.tokens(models)
    return cache.build(knobs, budget, cache.store_tokens(models, budget))


@app.command("models", cls=Command)
def models_command(ctx: typer.Context, models_file: ModelsFile = None) -> None:
    """List the model aliases and whether their weights are on this machine."""
    models_file = models_file or ctx.meta.get(MODELS_FILE)
    with reported():
        require_stdout()
        from h2o_chat.app.ui import make_console, models_tables
        from h2o_chat.files import kept_in
        from h2o_chat.models.loading import is_present

        registry = load_registry(models_file)
        console = make_console()
        rows = [
            (
                name + (" *" if name == registry.default else ""),
                "yes" if is_present(spec) else "no",
                spec.family,
                f"{spec.dtype}/{spec.quantize}",
                str(spec.context or "?"),
                spec.source,
                spec.note,
            )
            for name, spec in registry.models.items()
        ]
        caption = (
            "* the default model; dtype/quant are the defaults on CUDA; on a CPU a GGUF model (the embedded one) runs "
            "from its own 4-bit weights, others in float32\n"
            f"Converted weights are kept in {kept_in()} (H2O_CHAT_CACHE sets another folder)."
        )
        for i, table in enumerate(models_tables(rows, caption, console.width)):
            if i:
                console.print()
            console.print(table)


from h2o_chat.app.batch.command import batch_command  # noqa: E402  (commands in their own modules)
from h2o_chat.app.benchcli import bench_command, soak_command  # noqa: E402
from h2o_chat.app.evalcli import eval_app  # noqa: E402
from h2o_chat.app.serve.command import serve_command  # noqa: E402

app.command("list", cls=Command, help="The same as models (ollama's name for it).")(models_command)
app.command("batch", cls=Command)(batch_command)
app.command("bench", cls=Command)(bench_command)
app.command("soak", cls=Command)(soak_command)
app.command("serve", cls=Command)(serve_command)
app.add_typer(eval_app, name="eval")


def main() -> None:
    import signal

    if hasattr(signal, "SIGPIPE"):  # `h2o-chat ... | head`: when the reader goes, end quietly as other tools do
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    guard_stdout()
    try:
        try:
            app()
        finally:
            sys.stdout.flush()  # here, where a failure can be told on one line, not at the interpreter's exit
    except StdoutError as e:  # > /dev/full, a full disk: one line, for every command
        stdout_failed(e)


if __name__ == "__main__":
    main()
