"""The h2o-chat command line: options in, calls out. No torch import at module level (fast --help)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from h2o_chat.app.options import (
    CacheOptions,
    Command,
    Group,
    ModelOptions,
    ModelsFile,
    PolicyKnobs,
    SamplingOptions,
    grouped,
    guard_stdout,
    reported,
    stdout_failed,
    store_of,
)
from h2o_chat.errors import StdoutError
from h2o_chat.models.registry import load_registry


class PromptOrCommand(Group):
    """`h2o-chat "What is 2+2?"`: words that are not a subcommand are a prompt for one reply (like llm and
    ollama). A first word that names a subcommand (models, batch, bench, soak, eval) runs it."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        args, words = list(args), []
        while True:  # options stop at the first positional word: take it out and look again
            _, rest, _ = self.make_parser(ctx).parse_args(args=list(args))
            if not rest or (not words and rest[0] in self.commands):
                break
            at = len(args) - len(rest)  # rest is what follows the options parsed so far
            words.append(args.pop(at))
        if words:
            ctx.meta[PROMPT] = " ".join(words)
        return super().parse_args(ctx, args)


def read_prompt_file(path: Path) -> str:
    """-f FILE: its text, or one clear line on why it cannot be the prompt."""
    from h2o_chat.errors import InputError
    from h2o_chat.files import read_user_text

    text = read_user_text(path, "prompt file").removeprefix("\ufeff")
    if not text.strip():
        raise InputError(f"the prompt file {path} is empty")
    return text


def read_chat_template(path: Path) -> tuple[str, str]:
    """--chat-template FILE: (its name, its text) once it parses as a Jinja template, else one clear line."""
    from h2o_chat.app.messages import check_template
    from h2o_chat.files import read_user_text

    text = read_user_text(path, "chat template")
    check_template(text, str(path))
    return str(path), text


PROMPT = "h2o_chat.prompt"
MODELS_FILE = "h2o_chat.models_file"  # --models before `models`


def _options_before(ctx: typer.Context, command: str) -> None:
    """Options before a command's name are the chat's, which that command would silently ignore
    (`h2o-chat --budget 5 batch ...`): refused, saying where they go. --models before `models` is honoured."""
    given = [p for p in ctx.command.params if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"]
    ignored = [p.opts[0] for p in given if not (command == "models" and p.name == "models_file")]
    if ignored:
        from h2o_chat.errors import InputError

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
    'h2o-chat "PROMPT" replies once to PROMPT (text on stdout, as with a pipe).',
    subcommand_metavar="[PROMPT] | COMMAND [ARGS]...",
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
            help="Prompt from a UTF-8 file (piped: the prompt; chat: its first message)",
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
    argument = ctx.meta.get(PROMPT)
    with reported():
        cached = None
        if prompt_cache is not None:  # before the checks: --max-new-tokens 0 reads the prompt into the file only
            from h2o_chat.app.prompt_cache import options as prompt_cache_options

            chat = argument is None and sys.stdin.isatty()
            cached, sampling = prompt_cache_options(prompt_cache, chat, resume, sampling)
        for group in (models, cache, sampling):
            group.check()
        interactive = argument is None and sys.stdin.isatty()
        if interactive and (json_out or raw):  # the chat would ignore them
            from h2o_chat.errors import InputError

            given = " and ".join(flag for flag, on in (("--json", json_out), ("--raw", raw)) if on)
            raise InputError(
                f"{given} {'need' if json_out and raw else 'needs'} piped input or a prompt argument "
                f'(h2o-chat {given.replace(" and ", " ")} "PROMPT"); the interactive chat takes neither'
            )
        if stop is not None and not all(stop):
            from h2o_chat.errors import InputError

            raise InputError("--stop needs some text to stop at")
        budget = cache.tokens(models)  # a memory or a share: the tokens it comes to
        policy = cache.build(knobs, budget, cache.store_tokens(models, budget))
        if resume is not None:  # the saved model and cache settings, where not given (one line for a bad file)
            from h2o_chat.app.resume import given_options, resumed_settings

            models, cache, policy = resumed_settings(resume, given_options(ctx), models, cache, policy)
        if argument is not None and not argument.strip():
            from h2o_chat.errors import InputError

            raise InputError('the prompt is empty: h2o-chat "What is 2+2?"')
        # read before the weights load: a file that cannot be used is one line, at once
        first = read_prompt_file(prompt_file) if prompt_file is not None else None
        template = read_chat_template(chat_template) if chat_template is not None else None
        if interactive:
            prompt = None
        else:  # piped or one-shot: the argument, then the file, then piped text, as one prompt
            from h2o_chat.app.piped import combine_prompt

            prompt = combine_prompt(argument, first)
        if not sys.stdin.isatty():
            from h2o_chat.app.piped import combine_prompt, read_stdin_prompt

            # fail fast, before loading weights; with a prompt argument, piped text follows it (as in ollama)
            piped = read_stdin_prompt(sys.stdin.buffer.read(), required=prompt is None)
            prompt = combine_prompt(prompt, piped)
        from h2o_chat.app.conversation import ChatSettings
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
            ),
            panel=not no_panel,
            json=json_out,
            raw=raw,
            resume=resume,
            prompt_cache=cached,
        )
        loaded = models.load(kv_tokens=policy.budget, kv_quant=cache.kv_quant, store_tokens=store_of(policy))
        if interactive:
            from h2o_chat.app.chat import run_interactive

            run_interactive(loaded, options, history, first)
        else:
            from h2o_chat.app.piped import run_piped

            run_piped(loaded, options, prompt)


@app.command("models", cls=Command)
def models_command(ctx: typer.Context, models_file: ModelsFile = None) -> None:
    """List the model aliases and whether their weights are on this machine."""
    models_file = models_file or ctx.meta.get(MODELS_FILE)
    with reported():
        from h2o_chat.app.ui import make_console, models_tables
        from h2o_chat.files import user_cache_dir
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
            "* the default model; dtype/quant are the defaults on CUDA (CPU runs float32)\n"
            f"Converted weights are kept in {user_cache_dir()} (H2O_CHAT_CACHE sets another folder)."
        )
        for i, table in enumerate(models_tables(rows, caption, console.width)):
            if i:
                console.print()
            console.print(table)


from h2o_chat.app.batchcli import batch_command  # noqa: E402  (commands in their own modules)
from h2o_chat.app.benchcli import bench_command, soak_command  # noqa: E402
from h2o_chat.app.evalcli import eval_app  # noqa: E402
from h2o_chat.app.servecli import serve_command  # noqa: E402

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
