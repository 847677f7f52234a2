"""What the command modules share: option types and option groups, model and policy construction (error
reporting is `reporting.py`).

Options that several commands take are declared once, in groups (`ModelOptions`, `CacheOptions`, `PolicyKnobs`,
`SamplingOptions`): a command decorated with `@grouped` names a group as one parameter, optionally with its own
defaults (`sampling: SamplingOptions = SamplingOptions(temperature=0.0)`), and receives it filled in.
No torch import at module level (start-up stays fast for --help).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer
from typer.core import TyperCommand, TyperGroup

from h2o_chat.app.budget import BudgetText, StoreText, within_context
from h2o_chat.app.reporting import status
from h2o_chat.engine.policies import DEFAULT_POLICY
from h2o_chat.errors import H2OChatError
from h2o_chat.models.registry import load_registry


# -- help ------------------------------------------------------------------------------------------------
class _FlagsTakeNoValue:
    """In --help, a plain flag (--json, --no-panel, -h) shows no value type: Typer would print <bool>."""

    def get_params(self, ctx) -> list:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class Command(_FlagsTakeNoValue, TyperCommand):
    """The class of every h2o-chat command (pass as cls=)."""


class Group(_FlagsTakeNoValue, TyperGroup):
    """The class of every h2o-chat command group (pass as cls=). As the top command, it says a usage error (a
    missing option, an unknown one, a value of the wrong type) in two plain lines, as every other error is said,
    where Typer draws a box."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)  # Exit(n) comes back as n
        except typer.TyperException as e:  # click's exceptions, Typer's own copy of them
            usage_error(e)
        except typer.Abort:  # end of input at a prompt Typer asked
            typer.echo("h2o-chat: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


# options of llama-cli and ollama that h2o-chat spells another way, or that mean something else here: what to use
FOREIGN_OPTIONS = {
    "--ctx-size": "llama.cpp's context size; the nearest here is --budget (-b), the tokens the cache keeps per layer "
    "(512 by default) however long the text grows",
    "--prompt": 'give the prompt as an argument (h2o-chat "PROMPT"), or -f FILE',
    "--n-predict": "the most tokens to generate is -n (--max-new-tokens) here",
    "--temp": "use --temperature",
    "--repeat-penalty": "use --repetition-penalty",
}
FOREIGN_OPTIONS["-c"] = FOREIGN_OPTIONS["--ctx-size"]


def usage_error(error: typer.TyperException) -> typing.NoReturn:
    """`h2o-chat: error: Missing option '--output' / '-o' (see 'h2o-chat batch --help')`, one line, then exit 2. An
    option another tool takes says what it is here (click would suggest the nearest spelling: --chunk-size for
    --ctx-size)."""
    if type(error).__name__ == "NoArgsIsHelpError":  # `h2o-chat eval`: Typer has printed the help
        sys.exit(error.exit_code)
    message = error.format_message()
    name = getattr(error, "option_name", None)
    ctx = getattr(error, "ctx", None)
    if type(error).__name__ == "NoSuchOption" and name in FOREIGN_OPTIONS:
        message = f"No such option: {name}: {FOREIGN_OPTIONS[name]}."
    elif type(error).__name__ == "NoSuchOption" and ctx is not None and (owners := _commands_taking(ctx, name)):
        # click would suggest the nearest spelling here (--version for --session-dir): the commands that take it
        message = f"No such option: {name}: an option of {' and '.join(owners)}."
    if ctx is not None:
        message = f"{message.rstrip('.')} (see '{ctx.command_path} --help')"
    typer.echo(f"h2o-chat: error: {message}", err=True)
    sys.exit(error.exit_code)


def _commands_taking(ctx, name: str) -> list[str]:
    """The commands of h2o-chat that take the option `name` ("'h2o-chat serve'"; the main command, the chat and
    one-shot runs, as "'h2o-chat' (the chat and one-shot replies)"), found from the command line's context."""
    root = ctx.find_root()
    found: list[str] = []

    def visit(command, path: str) -> None:
        if any(name in (*p.opts, *p.secondary_opts) for p in command.params):
            found.append(f"'{path}'" + (" (the chat and one-shot replies)" if command is root.command else ""))
        for sub_name, sub in (getattr(command, "commands", None) or {}).items():  # a group's (Typer's own click)
            visit(sub, f"{path} {sub_name}")

    visit(root.command, root.info_name or "h2o-chat")
    return found if len(found) <= 3 else [*found[:2], f"{len(found) - 2} more commands"]


# -- options shared by several commands ------------------------------------------------------------------
Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Alias from models.toml, Hugging Face repo id, "
        "local folder or .gguf file. Default: the embedded SmolLM2-135M.",
    ),
]
Budget = Annotated[int, typer.Option("--budget", "-b", help="KV cache budget in tokens per layer (and head).")]
CacheBudget = Annotated[
    str | None,
    typer.Option(
        "--budget",
        "-b",
        metavar="TOKENS|SIZE|SHARE",
        help="KV cache budget per layer (and head): tokens (512, the default), the memory its keys and values take "
        "(64MB, as --kv-memory) or a share of the model's trained context (10%).",
        show_default=False,
    ),
]
HeavyRatio = Annotated[
    float, typer.Option(help="Share of the budget for heavy hitters (h2o); the rest is the recent window.")
]
PolicyName = Annotated[
    str,
    typer.Option(
        "--policy",
        "-p",
        help="snap (prompt kept by what its last queries attend to, then h2o) | recall (snap, and each step brings "
        "back the evicted tokens it attends to most, from a store off the GPU) | h2o (the paper) | sink | recent "
        "| full",
    ),
]
Sinks = Annotated[
    int | None,
    typer.Option(
        help="Always keep the first K tokens (snap, h2o: 0 by default, as the soak measured no gain; sink: 4)."
    ),
]
SnapWindow = Annotated[
    int | None,
    typer.Option(
        help="snap: how many of the prompt's last queries choose what it keeps (default 16, at most a quarter "
        "of the budget)."
    ),
]
SnapKernel = Annotated[
    int | None, typer.Option(help="snap: neighbouring positions a chosen token keeps, an odd number (default 11).")
]
ChunkSize = Annotated[
    int | None,
    typer.Option(
        help="Prompt tokens per prefill step (peak KV = budget + chunk); default 512 on a CPU, 1024 on a GPU."
    ),
]
Positions = Annotated[
    str,
    typer.Option(
        help="auto: absolute within the trained context, rolling past it | absolute: keys keep their "
        "true positions (the paper) | rolling: tokens numbered by their rank among the held tokens (StreamingLLM)."
    ),
]
KvQuant = Annotated[
    str,
    typer.Option(
        help="none: the held keys and values in the model's dtype | 8bit: in int8 with a scale per token "
        "(half the bytes of float16, a quarter of float32: twice or four times the budget in the same memory).",
    ),
]
KvMemory = Annotated[
    str | None,
    typer.Option(
        "--kv-memory",
        metavar="SIZE",
        help="The KV cache's memory instead of --budget, e.g. 256MB or 1.5GB (MB = 2^20 bytes, as the panel "
        "shows): the budget becomes the most tokens whose keys and values fit, as --kv-quant stores them (with "
        "--batch-size, for all rows together).",
    ),
]
RecallMemory = Annotated[
    str | None,
    typer.Option(
        "--recall-memory",
        metavar="SIZE|TOKENS|Nx",
        help="recall: how many evicted tokens its store keeps, allocated once beside the KV cache: a memory (64MB), "
        "tokens per layer and head (4096) or a multiple of the budget (8x, the default); once full it drops the "
        "latest of them: it keeps the earliest positions evicted (the conversation's opening).",
    ),
]
Device = Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N (one GPU of several)")]
Decode = Annotated[
    str,
    typer.Option(
        help="How decode steps run: auto (graph on CUDA; compile on CPU, eager while its package is built, or "
        "$H2O_CHAT_DECODE) | eager | graph (the step captured as one CUDA graph, in seconds) | compile (CPU: the "
        "step compiled ahead of time by inductor, once per machine and model, a few minutes; CUDA: compiled by "
        "inductor at the first step of each run, then captured as one CUDA graph)."
    ),
]
RepetitionPenalty = Annotated[
    float,
    typer.Option(
        help="Make tokens of the last 256 less likely (1 = off, llama.cpp's default; ollama's is 1.1, over 64).",
    ),
]
Dtype = Annotated[str, typer.Option(help="auto | float32 | float16 | bfloat16")]
Quantize = Annotated[
    str | None,
    typer.Option(
        help="none | 4bit | 8bit: weight-only (bitsandbytes on CUDA; PyTorch's int4/int8 kernels on CPU). Default: "
        "the model's setting on CUDA; on CPU a GGUF model (the embedded one) runs from its own 4-bit weights."
    ),
]
ModelsFile = Annotated[Path | None, typer.Option("--models", help="Extra models.toml (adds or overrides aliases).")]
Download = Annotated[bool, typer.Option("--download", help="Allow fetching weights from the Hugging Face Hub.")]
MaxNewTokens = Annotated[
    int, typer.Option("--max-new-tokens", "-n", help="Most tokens per reply (batch: for lines without max_new_tokens).")
]
Temperature = Annotated[float, typer.Option(help="0 = greedy (batch: for lines without temperature).")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling threshold (1 = off).")]
TopK = Annotated[
    int, typer.Option(help="Sample among the K most likely tokens (0 = off; batch: for lines without top_k).")
]
MinP = Annotated[
    float,
    typer.Option(
        help="Drop tokens less likely than this share of the most likely one (0 = off; batch: for lines without min_p)."
    ),
]
Seed = Annotated[
    int | None, typer.Option("--seed", "-s", help="Seed for repeatable sampling (-1: random, the default).")
]
Threads = Annotated[
    int | None,
    typer.Option(
        "--threads", "-t", help="CPU threads for torch (default: torch's choice, usually the physical cores)."
    ),
]
IgnoreEos = Annotated[
    bool,
    typer.Option(
        "--ignore-eos",
        help="Write on past the end-of-sequence token, to --max-new-tokens (as llama-cli's): a generation of a known "
        "length, e.g. to time it.",
    ),
]


# -- option groups ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelOptions:
    """Which model, where, how its decode steps run."""

    PANEL: ClassVar[str] = "Model"

    model: Model = None
    device: Device = "auto"
    dtype: Dtype = "auto"
    quantize: Quantize = None
    decode: Decode = "auto"
    models_file: ModelsFile = None
    download: Download = False
    threads: Threads = None

    def check(self) -> None:
        from h2o_chat.engine.step.decode import resolve_decode
        from h2o_chat.models.loading import resolve_device

        check_positive("--threads", self.threads)
        resolve_decode(self.decode, resolve_device(self.device))  # the one check of --decode, on this device

    def use_threads(self) -> None:
        """--threads: torch's CPU threads for this process (before the model loads), at most the CPUs this process
        may run on (more only wait for each other: --threads 1000 on 2 cores decoded at 0.4 tok/s)."""
        if self.threads is not None:
            import os

            import torch

            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            if self.threads > cpus:
                status(f"--threads {self.threads}: this process may run on {cpus} CPUs; using {cpus}")
            torch.set_num_threads(min(self.threads, cpus))

    def spec(self):
        """The model's `ModelSpec`: --model resolved in the registry (models.toml, a folder, a .gguf, a repo id)."""
        return load_registry(self.models_file).resolve(self.model)

    def kv_token_bytes(self, kv_quant: str = "none") -> int:
        """Bytes a token's keys and values take per row, as `kv_quant` stores them (from the model's config:
        nothing is loaded)."""
        from h2o_chat.models.loading import kv_token_bytes_of

        spec = self.spec()
        return kv_token_bytes_of(spec, self.device, self.dtype, self.quantize, self.downloads(spec), kv_quant)

    def downloads(self, spec) -> bool:
        """--download, once the Hub is known to answer (app/download.py): each place that may contact it asks."""
        from h2o_chat.app.download import downloads

        return downloads(spec, self.download, status)

    def trained_context(self) -> int | None:
        """The model's trained context in tokens (models.toml, else its config), as Loaded.context gives it, before
        anything loads."""
        spec = self.spec()
        if spec.context:
            return spec.context
        from h2o_chat.models.loading import read_config, weights_location

        download = self.downloads(spec)
        config = read_config(spec, weights_location(spec, download, status), download)
        return getattr(config.get_text_config(), "max_position_embeddings", None)

    def store_sizes(self) -> tuple[int, int]:
        """Bytes one evicted token takes in recall's store per row, and the store's fixed bytes per row (from the
        model's config: nothing loads)."""

        from h2o_chat.engine.storage.store import store_bytes, store_entry_bytes
        from h2o_chat.models.loading import read_config, weights_location
        from h2o_chat.models.memory import _kv_shape

        spec = self.spec()
        download = self.downloads(spec)
        config = read_config(spec, weights_location(spec, download, status), download)
        L, H, D = (_kv_shape(config)[k] for k in ("layers", "kv_heads", "head_dim"))
        return store_entry_bytes(L, 1, H, D, D), store_bytes(L, 1, H, D, D, 0)

    def load(self, kv_tokens: int | None = None, kv_rows: int = 1, kv_quant: str = "none", store_tokens: int = 0):
        self.use_threads()
        download = self.downloads(self.spec())
        return load_model(
            self.model, self.models_file, self.device, self.dtype, self.quantize, download, kv_tokens, kv_rows,
            kv_quant, store_tokens,
        )  # fmt: skip


@dataclass(frozen=True)
class PolicyKnobs:
    """A policy's settings beyond its name and budget."""

    PANEL: ClassVar[str] = "Policy settings"

    heavy_ratio: HeavyRatio = 0.5
    sinks: Sinks = None
    snap_window: SnapWindow = None
    snap_kernel: SnapKernel = None

    def kwargs(self) -> dict:
        """As keyword arguments for make_policy, checked first in the command line's words (the policies say
        `heavy_ratio`, as a library's keyword is named)."""
        if not 0 <= self.heavy_ratio < 1:
            raise H2OChatError(
                f"--heavy-ratio must be in [0, 1) so that the newest token is always kept, got {self.heavy_ratio:g}"
            )
        if self.sinks is not None and self.sinks < 0:
            raise H2OChatError(f"--sinks must be >= 0, got {self.sinks}")
        return policy_knobs(self.heavy_ratio, self.sinks, self.snap_window, self.snap_kernel)


@dataclass(frozen=True)
class CacheOptions:
    """The cache of a chat, a piped run or a batch: policy, budget, prefill chunk, positions."""

    PANEL: ClassVar[str] = "Cache"

    budget: CacheBudget = None  # 512 tokens
    policy: PolicyName = DEFAULT_POLICY
    chunk_size: ChunkSize = None
    positions: Positions = "auto"
    kv_quant: KvQuant = "none"
    kv_memory: KvMemory = None
    recall_memory: RecallMemory = None

    def check(self) -> None:
        if self.chunk_size is not None:
            check_positive("--chunk-size", self.chunk_size)
        check_positions(self.positions)
        check_kv_quant(self.kv_quant)
        if self.recall_memory is not None:
            StoreText.parse(self.recall_memory)
        if self.kv_memory is not None and self.budget is not None:  # one would be ignored
            raise H2OChatError(
                f"--budget {self.budget} and --kv-memory {self.kv_memory} both set the budget: give one "
                f"(--budget takes a memory too: --budget {self.kv_memory})"
            )
        self.asked()

    def asked(self) -> BudgetText:
        """The budget as typed: --budget (tokens, a memory or a share), --kv-memory (a memory), else 512 tokens."""
        if self.kv_memory is not None:
            return BudgetText.of_memory("--kv-memory", self.kv_memory)
        return BudgetText.parse("--budget", "512" if self.budget is None else self.budget)

    def tokens(self, models: ModelOptions, rows: int = 1) -> int:
        """The budget in tokens for each of `rows` rows (a memory is theirs together); how a memory or a share
        became that many is said on stderr. Nothing loads: the model's config gives its sizes."""
        if self.positions == "rolling" and models.spec().family == "opt":
            raise H2OChatError(  # said before the weights load (and quantize), not after: the family tells
                "--positions rolling needs rotary position embeddings; this model has learned absolute positions "
                "(OPT), which cannot be re-assigned: it stops at its trained context (--positions auto)"
            )
        asked = self.asked()
        tokens, how = asked.resolve(
            lambda: models.kv_token_bytes(self.kv_quant), models.trained_context, rows, self.kv_quant
        )
        if how:
            status(how)
        if self.policy == "full":  # no budget: the cache holds every token
            return tokens
        tokens, capped = within_context(tokens, models.trained_context(), asked.head)
        if capped:
            status(capped)
        return tokens

    def store_tokens(self, models: ModelOptions, budget: int, rows: int = 1) -> int | None:
        """--recall-memory in evicted tokens per row, layer and head for a budget of `budget` (None: the policy's
        default); how a memory became that many is said on stderr. Nothing loads."""
        if self.recall_memory is None or self.policy != "recall":
            return None
        tokens, how = StoreText.parse(self.recall_memory).resolve(budget, models.store_sizes, rows)
        if how:
            status(how)
        return tokens

    def build(self, knobs: PolicyKnobs, budget: int | None, store: int | None = None):
        """The policy at `budget` tokens (the command's, or e.g. a batch line's own); `store`: recall's store
        in tokens (`store_tokens`)."""
        extra = {"store": store} if store is not None and self.policy == "recall" else {}
        return build_policy(self.policy, budget, {**knobs.kwargs(), **extra})


@dataclass(frozen=True)
class SamplingOptions:
    """How replies are sampled."""

    PANEL: ClassVar[str] = "Sampling"

    max_new_tokens: MaxNewTokens = 512
    temperature: Temperature = 0.7
    top_p: TopP = 0.9
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.1
    seed: Seed = None

    def check(self) -> None:
        check_positive("--max-new-tokens", self.max_new_tokens)
        if self.seed is not None and self.seed < -1:
            raise H2OChatError(f"--seed must be a whole number >= 0, or -1 for a random one, got {self.seed}")
        self.sampler()  # the Sampler checks its settings

    @property
    def given_seed(self) -> int | None:
        """The seed asked for; None for a random one (no --seed, or -1 as llama.cpp reads it)."""
        return None if self.seed == -1 else self.seed

    def sampler(self):
        from h2o_chat.engine.step.sampling import Sampler

        return Sampler(
            self.temperature, self.top_p, self.given_seed, self.repetition_penalty, top_k=self.top_k, min_p=self.min_p
        )


def _in_panel(annotation, panel: str):
    """Annotated[T, typer.Option(...)] with the option shown under its group's heading in --help."""
    base, *extras = typing.get_args(annotation)
    extras = [copy.copy(x) for x in extras]
    for x in extras:
        if hasattr(x, "rich_help_panel"):
            x.rich_help_panel = panel
    return Annotated[(base, *extras)]


def grouped(func: Callable) -> Callable:
    """Let a Typer command take option groups: each parameter annotated with a group class becomes the group's
    options in --help (at the end, with the parameter's default instance giving their defaults) and reaches the
    command as one filled-in group."""
    hints = typing.get_type_hints(func, include_extras=True)
    params, fields_of = [], {}
    for name, param in inspect.signature(func).parameters.items():
        kind = hints.get(name)
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            params.append(param.replace(annotation=hints.get(name, param.annotation)))
            continue
        defaults = param.default if param.default is not inspect.Parameter.empty else kind()
        group_hints = typing.get_type_hints(kind, include_extras=True)
        fields_of[name] = (kind, [f.name for f in dataclasses.fields(kind)])
        for f in dataclasses.fields(kind):
            default = getattr(defaults, f.name)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default))
            params[-1] = params[-1].replace(annotation=_in_panel(group_hints[f.name], kind.PANEL))
    names = [p.name for p in params]
    assert len(names) == len(set(names)), f"{func.__name__}: an option is declared twice"
    params.sort(key=lambda p: p.kind == inspect.Parameter.KEYWORD_ONLY)  # plain parameters first, groups after

    @functools.wraps(func)
    def command(**kwargs):
        for name, (kind, fields) in fields_of.items():
            kwargs[name] = kind(**{f: kwargs.pop(f) for f in fields})
        return func(**kwargs)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def load_model(
    model, models_file, device, dtype, quantize, download, kv_tokens: int | None = None, kv_rows: int = 1,
    kv_quant: str = "none", store_tokens: int = 0,
):  # fmt: skip
    """Resolve the name and load; `kv_tokens` (the budget) for each of `kv_rows` rows, stored as `kv_quant`
    says, sizes the memory check."""
    from h2o_chat.models.loading import load

    spec = load_registry(models_file).resolve(model)
    return load(
        spec,
        device=device,
        dtype=dtype,
        quantize=quantize,
        download=download,
        status=status,
        kv_tokens=kv_tokens,
        kv_rows=kv_rows,
        kv_quant=kv_quant,
        store_tokens=store_tokens,
    )


def policy_knobs(
    heavy_ratio: float | None, sinks: int | None, snap_window: int | None = None, snap_kernel: int | None = None
) -> dict:
    """The policy settings a command was given, as keyword arguments for make_policy."""
    return {"heavy_ratio": heavy_ratio, "sinks": sinks, "window": snap_window, "kernel": snap_kernel}


def given_options(ctx) -> set[str]:
    """The options the command line (or the environment) gave, by parameter name."""
    sources = ("COMMANDLINE", "ENVIRONMENT")
    return {p.name for p in ctx.command.params if getattr(ctx.get_parameter_source(p.name), "name", None) in sources}


# the command line's options that set a policy's settings (`kinds.uses`), by parameter name (--resume's too)
SETTING_OF_OPTION = {
    "budget": "budget", "kv_memory": "budget", "heavy_ratio": "heavy_ratio", "sinks": "sinks",
    "snap_window": "window", "snap_kernel": "kernel", "recall_memory": "store", "positions": "positions",
}  # fmt: skip


def refuse_unused(ctx, policy: str) -> None:
    """One line for an option the policy would ignore (`-p h2o --recall-memory 64MB`, `-p full --budget 256`):
    a run that silently did without what was asked for is worse than none."""
    from h2o_chat.engine.policies import POLICIES
    from h2o_chat.engine.policies.kinds import uses

    if policy not in POLICIES:  # said by the policy's own check, with a suggestion
        return
    given = given_options(ctx)
    unused = [p for p, setting in SETTING_OF_OPTION.items() if p in given and not uses(policy, setting)]
    if not unused:
        return
    flags = " and ".join("--" + p.replace("_", "-") for p in unused)
    readers = [n for n in POLICIES if all(uses(n, SETTING_OF_OPTION[p]) for p in unused)]
    what = "holds every token" if policy == "full" else "does not use " + ("them" if len(unused) > 1 else "it")
    instead = f", or choose -p {' | '.join(readers)}" if readers else ""
    raise H2OChatError(
        f"{flags} {'do' if len(unused) > 1 else 'does'} nothing under -p {policy}, which {what}: "
        f"leave {'them' if len(unused) > 1 else 'it'} out{instead}"
    )


def store_of(policy) -> int:
    """The evicted tokens a policy's store keeps per row, layer and head (0: it keeps none)."""
    return getattr(policy, "store", 0) or 0


def build_policy(policy: str, budget: int, knobs: dict):
    from h2o_chat.engine.policies import make_policy

    return make_policy(policy, budget, **knobs)


def check_kv_quant(value: str) -> str:
    from h2o_chat.engine.storage.quant import check_mode  # torch: only once a command runs, never for --help

    return check_mode(value)


def check_positions(value: str) -> str:
    from h2o_chat.engine.cache import check_positions as check  # torch: only once a command runs, never for --help

    return check(value)


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise H2OChatError(f"{name} must be a positive integer, got {value}")


def int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise H2OChatError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise H2OChatError(f"{name} must be positive integers, got {text!r}")
    return values
