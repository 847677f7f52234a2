"""`h2o-chat bench`: decode speed and KV memory as the context grows, and throughput at equal memory.

No torch import at module level (start-up stays fast for --help).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from h2o_chat.app.options import (
    Budget,
    ModelOptions,
    build_policy,
    check_positive,
    grouped,
    int_list,
)
from h2o_chat.app.reporting import Finished, reported, status
from h2o_chat.app.ui import describe_machine, describe_weights, progress_bar
from h2o_chat.errors import H2OChatError


def _in_table(say: Callable[[str], None]) -> Callable[[str], None]:
    """The bench's progress lines, less those of the h2o twin parked at the first length: it only serves the
    flatness ratio under the table, and a line of it read like a row missing from the table."""
    return lambda line: None if line.lstrip().startswith("h2o@first") else say(line)


def _load(models: ModelOptions, shape: str | None, kv_tokens: int):
    """The named model, or a random-weight model of a real shape (no download needed)."""
    models.check()
    if shape is None:
        return models.load(kv_tokens=kv_tokens)
    if models.model is not None:
        raise H2OChatError("give either --model or --shape, not both")
    device, dtype, quantize = models.device, models.dtype, models.quantize
    models.use_threads()
    from h2o_chat.models.loading import load, resolve_settings
    from h2o_chat.models.registry import ModelSpec
    from h2o_chat.models.shapes import SHAPES, random_model

    if shape not in SHAPES:
        raise H2OChatError(f"unknown --shape {shape!r}; choose from {', '.join(SHAPES)}")
    spec = ModelSpec(name=f"{shape} (random weights)", source=shape, family=SHAPES[shape]["model_type"])
    _, torch_dtype, _ = resolve_settings(spec, device, dtype, quantize)
    status(f"building a random {shape} model (once) ...")
    folder = random_model(shape, torch_dtype if torch_dtype.is_floating_point else None, status=status)
    spec = ModelSpec(name=spec.name, source=str(folder), family=spec.family)
    return load(spec, device=device, dtype=dtype, quantize=quantize, status=status, kv_tokens=kv_tokens)


Shape = Annotated[
    str | None,
    typer.Option(
        help="Instead of --model: random weights of a real shape "
        "(llama-2-7b, llama-2-13b, llama-3-8b, opt-6.7b, mistral-7b; llama-tiny for a smoke test)."
    ),
]


@grouped
def bench_command(
    shape: Shape = None,
    budget: Budget = 512,
    lengths: Annotated[str, typer.Option(help="Tokens seen at which to time decoding, comma-separated.")] = (
        "512,2048,4096,8192"
    ),
    configs: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated: dynamic (transformers DynamicCache), static (StaticCache), static-compiled "
            "(StaticCache + torch.compile), full, h2o, h2o-compiled, snap-compiled, recall-compiled (the CPU's "
            "compiled step), h2o-rolling "
            "(positions renumbered), h2o-nobound (budget above every length), snap, recall; h2o-8bit, snap-8bit, "
            "recall-8bit (keys and values held in int8); llama.cpp (the same GGUF in llama.cpp). Default: dynamic, "
            "full, h2o, h2o-nobound, plus static-compiled on CUDA, llama.cpp on CPU for a GGUF model (when "
            "llama-cpp-python is installed).",
            show_default=False,
        ),
    ] = None,
    steps: Annotated[
        int,
        typer.Option(
            help="Timed decode steps per configuration and length, in 6 rounds of equal size: rounded down to a "
            "multiple of 6 (at least 6)."
        ),
    ] = 24,
    batch: Annotated[int, typer.Option(help="Rows decoded together.")] = 1,
    throughput: Annotated[
        bool,
        typer.Option(
            "--throughput",
            help="Instead: tokens/s over the largest batch that fits "
            "--memory-limit, full cache vs h2o (the paper's metric).",
        ),
    ] = False,
    memory_limit: Annotated[
        float | None, typer.Option(help="GB for --throughput (default: the GPU's free memory; 4 on CPU).")
    ] = None,
    prefill: Annotated[
        bool,
        typer.Option(
            "--prefill",
            help="Instead: seconds, tokens/s and peak memory to read a prompt of each --lengths (and --batch rows): "
            "transformers (one pass and chunked) vs full, h2o and snap (and llama.cpp for a GGUF model on CPU).",
        ),
    ] = False,
    chunk_size: Annotated[int, typer.Option(help="--prefill: tokens per prefill chunk.")] = 512,
    prompt_tokens: Annotated[int, typer.Option(help="--throughput: prompt length per row.")] = 512,
    gen_tokens: Annotated[int, typer.Option(help="--throughput: tokens generated per row.")] = 1536,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON record per line instead of a table.")] = False,
    models: ModelOptions = ModelOptions(),
) -> None:
    """Decode speed and KV memory as the context grows: full cache vs h2o, side by side."""
    with reported():
        import json

        from h2o_chat.app.ui import bench_table, make_console, throughput_table
        from h2o_chat.measure import bench
        from h2o_chat.models.loading import gguf_file

        points = int_list(lengths, "--lengths")
        names = tuple(c.strip() for c in (configs or "dynamic,full,h2o,h2o-nobound").split(",") if c.strip())
        unknown = [] if prefill else [c for c in names if c not in bench.CONFIGS]  # --prefill checks its own
        if unknown:
            raise H2OChatError(f"unknown bench config {unknown[0]!r}; choose from {', '.join(bench.CONFIGS)}")
        for name, value in (
            ("--steps", steps),
            ("--batch", batch),
            ("--prompt-tokens", prompt_tokens),
            ("--gen-tokens", gen_tokens),
        ):
            check_positive(name, value)
        if memory_limit is not None and not (math.isfinite(memory_limit) and memory_limit > 0):
            raise H2OChatError(f"--memory-limit must be a positive finite number of GB, got {memory_limit:g}")
        if prefill:
            check_positive("--chunk-size", chunk_size)
            _prefill_names(configs)
        build_policy("h2o", budget, {})  # validates the budget
        loaded = _load(models, shape, budget)
        tokenizer = None if shape else loaded.tokenizer
        gguf = None if shape else gguf_file(loaded.spec)
        if prefill:
            _prefill_bench(loaded, points, budget, chunk_size, batch, configs, json_out, gguf)
            return
        if throughput:
            from h2o_chat.measure.throughput import as_dicts, run_throughput

            if memory_limit is None:
                import torch

                free = (
                    torch.cuda.mem_get_info()[0] + torch.cuda.memory_allocated() if loaded.device.type == "cuda" else 0
                )
                limit = free or 4 * 2**30
            else:
                limit = int(memory_limit * 2**30)
            out = Finished(json_out, 2, "configurations", dump=lambda r: json.dumps(as_dicts([r])[0]))

            def show(records, _note: str = "") -> None:
                make_console().print(throughput_table(records, loaded.spec.name))

            with out.kept(show), progress_bar("throughput") as bar:
                run_throughput(
                    loaded, limit, prompt_tokens, gen_tokens, budget, progress=bar, decode=models.decode,
                    on_record=out.add,
                )  # fmt: skip
            if not json_out:
                show(out.records)
            return
        if configs is None and loaded.device.type == "cuda":
            names = ("dynamic", "static-compiled", "full", "h2o", "h2o-nobound")
        names = _with_llamacpp(names, configs is None and loaded.device.type == "cpu" and batch == 1, gguf)
        about = f"{loaded.spec.name}, {describe_weights(loaded)}, {describe_machine(loaded)}"

        def show(records, _note: str = "") -> None:
            make_console().print(bench_table(records, bench.ratios(records, budget), about))

        dump = lambda record: bench.as_json_lines([record])  # noqa: E731
        out = Finished(json_out, len(points) * len(names), "measurements", dump=dump, counted=_not_twin)
        with out.kept(show), progress_bar("bench") as bar:
            bench.run_decode_bench(
                loaded.model,
                tokenizer,
                points,
                budget,
                names,
                steps=steps,
                batch=batch,
                status=None if json_out else _in_table(bar.print),
                progress=bar,
                decode=models.decode,
                gguf=gguf,
                on_record=out.add,
            )
        if not json_out:
            show(out.records)


def _not_twin(record) -> bool:
    """A bench record of the table's own (the h2o twin parked at the first length only serves a ratio)."""
    return record.config != "h2o@first"


def _with_llamacpp(names: tuple[str, ...], default: bool, gguf) -> tuple[str, ...]:
    """The llama.cpp anchor row: added by default where it can run (a GGUF model on CPU), else a note says how
    to have it; asked for where it cannot run, one clear error."""
    from h2o_chat.measure import llamacpp

    try:
        if default or llamacpp.CONFIG in names:
            llamacpp.check(gguf)
    except llamacpp.Unavailable as e:
        if llamacpp.CONFIG in names:
            raise H2OChatError(str(e)) from None
        status(f"note: no llama.cpp row: {e}")
        return names
    return (*names, llamacpp.CONFIG) if default and llamacpp.CONFIG not in names else names


def _prefill_names(configs: str | None) -> tuple[str, ...]:
    """--configs for --prefill (its own set), or one clear error naming the first unknown one: checked before the
    model loads."""
    from h2o_chat.measure import prefill

    names = tuple(c.strip() for c in (configs or ",".join(prefill.DEFAULT_CONFIGS)).split(",") if c.strip())
    unknown = [c for c in names if c not in prefill.PREFILL_CONFIGS]
    if unknown:
        raise H2OChatError(f"unknown --prefill config {unknown[0]!r}; choose from {', '.join(prefill.PREFILL_CONFIGS)}")
    return names


def _prefill_bench(loaded, points, budget, chunk, batch, configs, json_out, gguf=None) -> None:
    import json

    import torch

    from h2o_chat.app.ui import make_console, prefill_table
    from h2o_chat.measure import prefill

    anchor = configs is None and loaded.device.type == "cpu" and batch == 1
    names = _with_llamacpp(_prefill_names(configs), anchor, gguf)
    vocab = loaded.model.config.get_text_config().vocab_size
    for length in points:
        ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(length))
        with progress_bar(f"prefill {batch} x {length}") as bar:
            records = prefill.run_prefill_bench(loaded.model, ids, budget, chunk, names, progress=bar, gguf=gguf)
        if json_out:
            typer.echo("\n".join(json.dumps(r) for r in prefill.as_dicts(records)))
        else:
            make_console().print(prefill_table(records, prefill.ratios(records), loaded.spec.name))


@grouped
def soak_command(
    shape: Shape = None,
    tokens: Annotated[int, typer.Option(help="Tokens to read, teacher-forced one by one.")] = 20_000,
    budget: Budget = 256,
    window: Annotated[int, typer.Option(help="Report memory and perplexity every N tokens.")] = 1000,
    sinks: Annotated[int, typer.Option(help="Sink tokens for the configurations with sinks.")] = 4,
    context: Annotated[
        int | None, typer.Option(help="Pretend the model was trained on this many positions (default: its config).")
    ] = None,
    text: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="UTF-8 text file (repeated as needed). Default: the shipped Alice."),
    ] = None,
    policy: Annotated[
        str,
        typer.Option("--policy", "-p", help="The policy every configuration uses: h2o (the paper), snap or recall."),
    ] = "h2o",
    json_out: Annotated[bool, typer.Option("--json", help="One JSON record per window instead of a table.")] = False,
    models: ModelOptions = ModelOptions(),
) -> None:
    """Read far past the trained context with a fixed budget: memory and perplexity per window.

    Compares absolute and rolling positions, with and without attention sinks, for one policy."""
    with reported():
        from h2o_chat.app.ui import make_console, soak_table

        for name, value in (("--tokens", tokens), ("--window", window), ("--context", context)):
            check_positive(name, value)
        if tokens < 2:
            raise H2OChatError(
                f"--tokens must be at least 2 (the first token is context, the rest are scored), got {tokens}"
            )
        if shape and text is not None:
            raise H2OChatError("--text needs a model that reads text: --shape's random weights read random ids")
        if sinks < 0:
            raise H2OChatError(f"--sinks must be >= 0, got {sinks}")
        from h2o_chat.measure.soak import SOAK_POLICIES, flatness, run_soak, soak_configs

        if policy not in SOAK_POLICIES:
            raise H2OChatError(f"--policy for a soak must be one of {', '.join(SOAK_POLICIES)}, got {policy!r}")
        build_policy(policy, budget, {"sinks": sinks})  # validates budget and sinks
        import torch

        from h2o_chat.measure import evaluate as ev

        content = None if shape else ev.read_text(text)
        loaded = _load(models, shape, budget)
        if shape:  # random weights: any ids will do
            vocab = loaded.model.config.get_text_config().vocab_size
            ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
        else:
            base = ev.token_ids(loaded.tokenizer, content)
            ids = torch.tensor([(base * (tokens // max(1, len(base)) + 1))[:tokens]])
        configs = soak_configs(budget, sinks, policy)

        def show(records, _note: str = "") -> None:
            memory = {key: flatness(records, key) for key in ("rss", "gpu_allocated") if key in records[0]}
            make_console().print(soak_table(records, loaded.spec.name, f"{policy} {budget}", memory))

        windows = math.ceil(tokens / window) - (window == 1)  # every window ends on a scored token
        out = Finished(json_out, windows, "windows")
        with out.kept(show), progress_bar("soak") as bar:
            run_soak(loaded.model, ids, configs, window, context, progress=bar, decode=models.decode, on_record=out.add)
        if not json_out:
            show(out.records)
