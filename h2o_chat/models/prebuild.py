"""Compiled CPU steps built in a process of their own: at install for the embedded model's common kinds, and
while a chat, a piped run, a batch or the server decode eagerly until the step they need is ready.

    python -m h2o_chat.models.prebuild                     the embedded model's kinds a first start uses
    python -m h2o_chat.models.prebuild --job JOB.json      one model's kinds, as `builder_for` asks

A build loads the model as the asking process did (the same spec, dtype and weights: the same package key) and
writes the package under `compiled.cache_dir()`, whole or not at all; the asking process finds it there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from h2o_chat.files import BUILDING, claim_build, start_build

# what a first start of the embedded model decodes with: a chat's and a piped reply's default sampling (hot,
# penalized, top-p, filtered) under the default policy, and greedy rows (batch, eval, bench)
DEFAULT_KINDS = (
    {"quantized": False, "recalls": None, "uniform": True, "sampler": [True, True, True, True]},
    {"quantized": False, "recalls": None, "uniform": True, "sampler": None},
)


def default_kinds() -> list[dict]:
    """`DEFAULT_KINDS` with the default policy's store (a `recalls` of None means: as the default policy)."""
    from h2o_chat.engine.policies import DEFAULT_POLICY

    return [{**k, "recalls": DEFAULT_POLICY == "recall"} for k in DEFAULT_KINDS]


def builder_for(loaded, status: Callable[[str], None] | None = None) -> Callable | None:
    """A builder for `Engine.builder`: starts a build of the asked step kind in a process of its own (niced, its
    output in a log beside the packages), unless one is under way (three lanes of one server, or two servers,
    started three builds of one package) or this builder's own build of it failed (an evaluation's many
    engines would each start it again); None where the model is not on the CPU."""
    if loaded.device.type != "cpu":
        return None
    started: set = set()  # kinds this builder started a build of

    def start(kind) -> None:
        from h2o_chat.engine.step import compiled
        from h2o_chat.models import native

        folder = compiled.cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f"{BUILDING}{compiled.package_key(loaded.model, kind)}"
        if kind in started and not marker.exists():
            return  # its build ended without a package (it failed: build.log says why): not again for each engine
        if not claim_build(marker):
            return
        started.add(kind)
        job = {
            "marker": str(marker),
            "spec": dataclasses.asdict(loaded.spec),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "quantize": loaded.quantize,
            "native": native.products() != "pytorch",  # the 4-bit kernel this process's steps call
            "kinds": [dataclasses.asdict(kind)],
        }
        fd, path = tempfile.mkstemp(dir=folder, prefix=".job-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(job, f)
        start_build(["h2o_chat.models.prebuild", "--job", path], folder / "build.log")
        if status is not None:
            status(f"building the compiled decode step ({kind.describe()}) in the background; eager steps until then")

    return start


def run_job(job: dict) -> list[Path]:
    """Load the job's model on the CPU and build each of its kinds."""
    import torch

    from h2o_chat.engine.step import compiled
    from h2o_chat.models.loading import load
    from h2o_chat.models.registry import ModelSpec

    torch.set_num_threads(1)  # beside a process that decodes
    if not job.get("native", True):  # the asking process multiplies through PyTorch's kernel: so does its step
        os.environ["H2O_CHAT_NATIVE"] = "0"
    paths = []
    try:
        loaded = load(ModelSpec(**job["spec"]), device="cpu", dtype=job.get("dtype"), quantize=job.get("quantize"))
        for fields in job["kinds"]:
            sampler = fields.get("sampler")
            kind = compiled.StepKind(**{**fields, "sampler": None if sampler is None else tuple(sampler)})
            paths.append(_build_kind(loaded.model, kind))
    finally:
        if job.get("marker"):
            Path(job["marker"]).unlink(missing_ok=True)
    return paths


def _example_for(model, kind):
    """A small cache and sampler of `kind` for `model`, a prompt read: what a build traces (`_build_kind`)."""
    import torch

    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step import compiled
    from h2o_chat.engine.step.attention import cache_keyword
    from h2o_chat.engine.step.decode import Engine
    from h2o_chat.engine.step.sampling import Sampler

    policies = [make_policy("recall" if kind.recalls else "h2o", 32)]
    if not kind.uniform:  # rows that recall beside rows that do not
        policies.append(make_policy("h2o", 32))
    cache = H2OCache.for_model(model, policies, kv_quant="8bit" if kind.quantized else "none")
    engine = Engine(model, cache, "eager")
    if kind.sampler is not None:
        hot, penalized, nucleus, filtered = kind.sampler
        sampler = Sampler(
            temperature=0.7 if hot else 0.0,
            top_p=0.9 if nucleus else 1.0,
            repetition_penalty=1.1 if penalized else 1.0,
            min_p=0.05 if filtered and not nucleus else 0.0,
        )
        engine.set_sampler(sampler, len(policies))
    vocab = model.config.get_text_config().vocab_size
    ids = torch.arange(48, device=engine.device).remainder(vocab).repeat(len(policies), 1)
    engine.prefill(ids, chunk_size=16)
    if compiled.StepKind.of(cache, engine.sampler) != kind:
        raise RuntimeError(f"an example of {kind} came out as {compiled.StepKind.of(cache, engine.sampler)}")
    return cache, engine.sampler, cache_keyword(model)


def _build_kind(model, kind) -> Path:
    """The package of `kind` for `model`, built unless it is on disk already; its path."""
    from h2o_chat.engine.step import compiled

    path = compiled.cache_dir() / f"step-{compiled.package_key(model, kind)}.pt2"
    if not path.exists():
        cache, sampler, keyword = _example_for(model, kind)
        compiled.build(model, cache, sampler, keyword, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="a job file written by builder_for (deleted once read)")
    args = parser.parse_args(argv)
    if args.job:
        job = json.loads(Path(args.job).read_text())
        Path(args.job).unlink(missing_ok=True)
    else:
        from h2o_chat.models.registry import load_registry

        spec = load_registry().resolve(None)
        job = {"spec": dataclasses.asdict(spec), "dtype": None, "quantize": None, "kinds": default_kinds()}
        print(f"building the compiled decode steps of {spec.name} for this CPU (a few minutes, once)", file=sys.stderr)
    for path in run_job(job):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
