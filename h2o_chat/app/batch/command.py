"""`h2o-chat batch`: a JSONL file of prompts in, a JSONL file of results out (or stdout), resumable.

Options in, calls out: the work is in `run.py`, the output file's checks and repairs in `output.py`.
No torch import at module level (start-up stays fast for --help).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from h2o_chat.app.options import (
    CacheOptions,
    IgnoreEos,
    ModelOptions,
    PolicyKnobs,
    SamplingOptions,
    check_positive,
    grouped,
    refuse_unused,
    store_of,
)
from h2o_chat.app.reporting import reported, require_stdout, status


@grouped
def batch_command(
    ctx: typer.Context,
    input_path: Annotated[
        Path,
        typer.Argument(
            metavar="INPUT.jsonl",
            help='Lines of {"id", "prompt"} or {"id", "messages"}, optional max_new_tokens, temperature, '
            "top_k, min_p, top_p, seed, repetition_penalty, budget.",
        ),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Results, appended as each row finishes (-: to stdout).")
    ],
    batch_size: Annotated[int, typer.Option(help="Rows generated together.")] = 8,
    system: Annotated[str | None, typer.Option(help="System prompt for lines without one.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help='Feed "prompt" lines as plain text, no chat template.')] = False,
    ignore_eos: IgnoreEos = False,
    models: ModelOptions = ModelOptions(),
    cache: CacheOptions = CacheOptions(),
    knobs: PolicyKnobs = PolicyKnobs(),
    sampling: SamplingOptions = SamplingOptions(max_new_tokens=256, temperature=0.0, top_p=1.0),
) -> None:
    """Generate for every line of a JSONL file; rerun to resume (finished ids are skipped)."""
    with reported():
        from h2o_chat.app.batch.output import check_output, finished_ids, is_stdout
        from h2o_chat.app.batch.run import SKIPPED_EXIT, Defaults, run_batch
        from h2o_chat.app.budget import within_context
        from h2o_chat.app.ui import LOG_EVERY, plural, progress_bar
        from h2o_chat.errors import InputError

        check_positive("--batch-size", batch_size)
        for group in (models, cache, sampling):
            group.check()
        if input_path.is_dir():
            raise InputError(f"input file {input_path} is a folder: give a .jsonl file")
        if str(input_path) == "-":  # as -o - writes to stdout: a reader would expect it to read stdin
            raise InputError(
                "batch reads its lines from a file, not standard input (a rerun resumes by that file): save them to "
                "a .jsonl file and give its name"
            )
        if not input_path.exists():
            raise InputError(f"input file not found: {input_path}")
        check_output(output, input_path)
        if is_stdout(output):
            require_stdout()
        refuse_unused(ctx, cache.policy)
        budget = cache.tokens(models, rows=batch_size)  # a memory or a share: the tokens it comes to, per row
        store = cache.store_tokens(models, budget, rows=batch_size)
        default = cache.build(knobs, budget, store)  # fail before loading weights
        done = finished_ids(output, note=status)  # batch's own output, or refused untouched: before loading
        kv = {"kv_rows": batch_size, "kv_quant": cache.kv_quant, "store_tokens": store_of(default)}
        loaded = models.load(kv_tokens=budget, **kv)

        def policy_for(line_budget: int | None):
            """A line's policy (its budget within the trained context); a budget that does not fit in memory skips
            the line, as a malformed one."""
            if line_budget is not None and line_budget != budget:
                asked = line_budget
                line_budget, capped = within_context(line_budget, loaded.context, f'"budget" {line_budget}')
                if capped:  # the lines run: said as such, not in the words of a refusal
                    status(
                        f'lines with "budget" {asked} run with a budget of {line_budget:,} tokens, the model\'s '
                        "trained context: a larger cache would hold tokens at positions it was never trained on"
                    )
            policy = cache.build(knobs, line_budget, store)
            if policy.budget is not None and policy.budget != budget:  # the default one was checked above
                loaded.check_budget(policy.budget, rows=batch_size, flag='"budget"', kv_quant=cache.kv_quant)
            return policy

        defaults = Defaults(
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            budget=budget,
            system=system,
            raw=raw,
            repetition_penalty=sampling.repetition_penalty,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            top_p=sampling.top_p,
            seed=sampling.given_seed,
            ignore_eos=ignore_eos,
        )
        written: list[str | int] = []
        # tokens of every line's allowance: a bar on a terminal (not while -o - writes there), a line a minute
        # elsewhere; a finished line's status goes above the bar
        bar = progress_bar(lambda done, total: f"batch, {plural(len(written), 'line')} done", every=LOG_EVERY)
        if is_stdout(output) and sys.stdout.isatty():
            bar.enabled = False

        def on_record(record: dict) -> None:
            written.append(record["id"])
            bar.print(f"{record['id']}: {plural(record['generated_tokens'], 'token')}")

        try:
            with bar:
                summary = run_batch(
                    loaded,
                    input_path,
                    output,
                    policy_for,
                    defaults,
                    batch_size=batch_size,
                    chunk_size=cache.chunk_size,
                    on_record=on_record,
                    positions=cache.positions,
                    kv_quant=cache.kv_quant,
                    decode=models.decode,
                    on_skip=lambda problem: status(f"skipped {problem}"),
                    done=done,
                    progress=bar,
                )
        except KeyboardInterrupt:  # every finished row is written: say so, and how to go on
            where = "written to stdout" if is_stdout(output) else f"added to {output}"
            again = "(resuming needs -o FILE)" if is_stdout(output) else "a rerun with the same -o resumes"
            status(f"batch interrupted: {plural(len(written), 'row')} done and {where}; {again}")
            raise typer.Exit(130) from None
        rate = summary.tokens / summary.seconds if summary.seconds else 0.0
        skipped = "0 skipped"
        if summary.malformed:
            lines = plural(len(summary.malformed), "line")
            skipped = f"{lines} skipped (listed above; exit status {SKIPPED_EXIT})"
        already = "" if is_stdout(output) else f", {summary.skipped} already in {output.name}"
        status(
            f"batch: {summary.done} done{already}, {skipped} | "
            f"{plural(summary.tokens, 'token')} in {summary.seconds:.1f} s ({rate:.1f} tok/s)"
        )
        if summary.malformed:  # every valid row ran; a script still learns that not every line did
            raise typer.Exit(SKIPPED_EXIT)
