"""The CPU's decode step compiled ahead of time (`--decode compile`; what `auto` runs on a CPU).

What is compiled: the model's forward over the cache's storage, which a decode step only reads (each layer
attends to the new token in the spare slot's place, `attention_over_slots(new=...)`), recall's ranking of its
store, the stacking of every layer's new key, value, mass and recalled entries, and sampling. What is not:
writing the new tokens into the storage and eviction (`cache.end()`: a write into the stacked storage inside a
compiled graph is functionalized into a copy of the whole buffer, 15.5 ms against 2.1 in a 30-layer
reproduction: docs/experiments.md), which runs eagerly after it, in place.

How: the step is exported once as a function of its inputs (`torch.export`, the cache's and the sampler's tensors
passed in, never captured) with the batch, the slots, the store, the tokens recalled and the sampler's candidates
as symbolic sizes, and AOTInductor compiles it into a package of C++ kernels kept on disk (`cache_dir()`), keyed
by what decides its code (`StepKind` and the model: torch's and h2o-chat's versions, the config, the weights'
format and a fingerprint of their values). A later start loads the package in a fraction of a second and runs it
with the model's own weights as its constants (shared, not copied). Nothing is traced or checked per call (a
`torch.compile`d step checked ~10,000 guards a call), one program serves any budget, batch or store size, and a
program belongs to no engine: engines of one model share it, and it dies with the model.

Building a package takes one to four minutes for the embedded model on two cores (tracing, then C++ compilation;
recall's kinds the longest: 241-260 s on the 2-core Xeon on 2026-11-27);
`python -m h2o_chat.models.prebuild` builds the embedded model's common kinds at install (`scripts/install.sh`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
import weakref
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_chat.engine.step import attention
from h2o_chat.engine.step.sampling import draw
from h2o_chat.files import cxx, cxx_name

# the package's own version: a change to how packages are built or called makes the old ones stale
FORMAT = 3  # 2: a step reads the first len(span) slots; 3: and ranks the first len(ranked) store entries
# inductor's options: no size and stride check of every input per call (~20 per layer)
INDUCTOR_OPTIONS: dict = {"size_asserts": False}


def cache_dir() -> Path:
    """Where compiled steps are kept between runs."""
    from h2o_chat.files import user_cache_dir

    return user_cache_dir() / "steps"


_building = [float("-inf"), False]  # when the folder was last looked at, and whether a build was under way


def building() -> bool:
    """Whether a compiled step is being built on this machine now (a fresh marker beside the packages: this
    process's build in a process of its own, or another's). Looked at once a second at most."""
    from h2o_chat.files import BUILDING, BUILDING_STALE

    now = time.monotonic()
    if now - _building[0] >= 1.0:
        found = False
        with contextlib.suppress(OSError):
            for entry in os.scandir(cache_dir()):
                if entry.name.startswith(BUILDING):
                    with contextlib.suppress(OSError):
                        found = found or time.time() - entry.stat().st_mtime < BUILDING_STALE
        _building[:] = [now, found]
    return _building[1]


def unavailable() -> str | None:
    """Why a compiled CPU step cannot be built here, or None (a package already built needs no compiler)."""
    if cxx() is None:
        return f"no C++ compiler ({cxx_name()}) for the compiled step"
    return None


@dataclass(frozen=True)
class StepKind:
    """What decides a compiled step's code beyond the model: how the slots store keys and values, whether a
    store is ranked (and whether its rows recall alike), and how tokens are drawn (None: greedy argmax; else
    whether it samples, penalizes repetition, cuts by top-p and filters candidates)."""

    quantized: bool = False
    recalls: bool = False
    uniform: bool = True
    sampler: tuple[bool, bool, bool, bool] | None = None

    @classmethod
    def of(cls, cache, sampler) -> StepKind:
        store = cache.store
        drawn = None if sampler is None else (sampler.hot, sampler.penalized, sampler.nucleus, sampler.filtered)
        return cls(cache.slots.quantized, store is not None, store is None or store.uniform, drawn)

    def describe(self) -> str:
        parts = ["8-bit slots" if self.quantized else "slots"]
        if self.recalls:
            parts.append("recall")
        parts.append("greedy" if self.sampler is None else "sampled")
        return ", ".join(parts)


# -- the step as a function of its inputs ----------------------------------------------------------------------
def state_names(cache, sampler) -> tuple[list[str], list[str], list[str]]:
    """The inputs a step reads besides tokens and positions, in order: the slots' declared tensors, the store's
    (and the tokens each row recalls, the places recalled, and as many entries as a step ranks), the sampler's."""
    slots = list(cache.slots.tensors())
    store = [] if cache.store is None else [*cache.store.tensors(), "per_row", "pick", "ranked"]
    drawn = [] if sampler is None else list(sampler.tensors())
    return slots, store, drawn


def state_of(cache, sampler) -> list[torch.Tensor]:
    """The step's inputs besides tokens and positions, in `state_names` order."""
    out = list(cache.slots.tensors().values())
    if cache.store is not None:
        store = cache.store
        width = (cache.forward.store_width if cache.forward is not None else None) or store.capacity
        out += [*store.tensors().values(), store.per_row, store.pick, _span(width, store.pick.device)]
    if sampler is not None:
        out += list(sampler.tensors().values())
    return out


def inputs(cache, sampler) -> list[torch.Tensor]:
    """A compiled step's inputs after tokens and positions: the span of slots it reads (`_span`), then `state_of`."""
    span = _span(cache.forward.width or cache.slots.capacity, cache.slots.keys.device)
    return [span, *state_of(cache, sampler)]


_spans: dict[torch.device, torch.Tensor] = {}


def _span(width: int, device: torch.device | None = None) -> torch.Tensor:
    """A tensor of `width` entries: what tells a program how many slots or store entries a step reads (a size,
    not a value: one program serves every width). Views of one buffer per device, grown when a wider one is
    asked for."""
    device = torch.device("cpu") if device is None else device
    held = _spans.get(device)
    if held is None or held.shape[0] < width:
        held = _spans[device] = torch.zeros(width, dtype=torch.long, device=device)
    return held[:width]


class StepModule(torch.nn.Module):
    """`forward(tokens, positions, span, *state)` runs one decode step of `model` over a twin of `cache` whose
    slots, store and sampler read the given tensors, reading the first `len(span)` slots (`forward.read_width`:
    a size, not a value, so that one program serves every width): what is exported."""

    def __init__(self, model, cache, sampler, cache_keyword: str):
        super().__init__()
        self.model = model
        self._cache, self._sampler, self._kw = cache, sampler, cache_keyword
        self._names = state_names(cache, sampler)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, span: torch.Tensor, *state: torch.Tensor):
        from h2o_chat.engine import forward as fw

        slot_names, store_names, drawn_names = self._names
        it = iter(state)
        twin_cache = self._cache.twin(self._cache.slots.with_tensors({n: next(it) for n in slot_names}))
        ranked = None
        if store_names:
            store = self._cache.store.with_tensors({n: next(it) for n in store_names[:-3]})
            store.per_row, store.pick, ranked = next(it), next(it), next(it).shape[0]
            twin_cache.storage.store = store
        sampler = None
        if drawn_names:
            sampler = self._sampler.with_tensors({n: next(it) for n in drawn_names})
        twin_cache.forward = fw.Step(layers=len(twin_cache.layers), width=span.shape[0], store_width=ranked)
        out = self.model(input_ids=tokens[:, None], position_ids=positions, use_cache=True, logits_to_keep=1,
                         **{self._kw: twin_cache})  # fmt: skip
        logits = out.logits[:, -1]
        return logits, draw(sampler, logits), *twin_cache.forward.take()


def _dims(cache, sampler) -> tuple[list, list]:
    """Example inputs with every symbolic size at least 2 (export specializes sizes 0 and 1) and their dynamic
    shapes: the batch B, the slots S, the slots read W, the store's entries N, ranked R and recalled k, the
    sampler's candidates."""
    Dim = torch.export.Dim
    B, S, W = Dim("B", min=1, max=4096), Dim("S", min=3), Dim("W", min=2)
    # the store's entries, those ranked and its tokens recalled (it ranks 4 x K of R <= N - 1), the sampler's
    # candidates (of the vocabulary): sizes bound to others, which named dimensions cannot say
    N = R = K = CUT = Dim.AUTO

    def example(t: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
        shape = list(t.shape)
        for d, n in sizes.items():
            shape[d] = n
        return torch.zeros(shape, dtype=t.dtype, device=t.device)

    tokens = torch.zeros(2, dtype=torch.long, device=cache.slots.keys.device)
    slots = max(5, cache.slots.keys.shape[3])
    span = torch.zeros(slots - 2, dtype=torch.long, device=tokens.device)  # fewer than the slots before the spare
    examples, dynamic = [tokens, tokens[:, None].clone(), span], [{0: B}, {0: B}, {0: W}]
    for t in cache.slots.tensors().values():
        big = t.dim() >= 4
        examples.append(example(t, {1: 2, 3: slots} if big else {0: 2}))
        dynamic.append({1: B, 3: S} if big else {0: B})
    if cache.store is not None:
        store = cache.store
        k = max(2, store.k)
        entries = max(4 * k + 3, store.capacity + 1)
        for name, t in store.tensors().items():
            per_entry = name not in store.HEAD_FIELDS
            examples.append(example(t, {1: 2, 3: entries} if per_entry else {1: 2}))
            dynamic.append({1: B, 3: N} if per_entry else {1: B})
        examples += [
            torch.ones(2, dtype=torch.long, device=store.pick.device),
            torch.arange(k, device=store.pick.device),
            torch.zeros(entries - 2, dtype=torch.long, device=store.pick.device),  # fewer than the entries
        ]
        dynamic += [{0: B}, {0: K}, {0: R}]
    if sampler is not None:
        for name, t in sampler.tensors().items():
            if name == "ids":  # the vocabulary: fixed
                examples.append(t.clone())
                dynamic.append(None)
            elif name == "rank":
                examples.append(torch.arange(max(2, t.shape[0]), device=t.device))
                dynamic.append({0: CUT})
            else:
                examples.append(example(t, {0: 2}))
                dynamic.append({0: B})
    return examples, dynamic


# -- packages on disk --------------------------------------------------------------------------------------------
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_fingerprint(model) -> str:
    """What decides a package's constants besides the code: the model's config, its weights' names, shapes and
    dtypes, and a sample of their values (a folded constant carries a weight's values). Once per model."""
    if model in _fingerprints:
        return _fingerprints[model]
    h = hashlib.sha256()
    h.update(model.config.to_json_string(use_diff=False).encode())
    for name, t in _constants(model).items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64]
        h.update(sample.float().cpu().numpy().tobytes())
    _fingerprints[model] = h.hexdigest()[:16]
    return _fingerprints[model]


def _constants(model) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by every name they go by (tied and shared ones under each), as the
    exported step's constants are named (under `model.`)."""
    named = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    return {f"model.{k}": v for k, v in named.items() if v is not None}


def package_key(model, kind: StepKind) -> str:
    from h2o_chat import __version__

    parts = {
        "format": FORMAT,
        "torch": torch.__version__,
        "h2o_chat": __version__,
        "source": _source_hash(),
        "model": model_fingerprint(model),
        "kind": dataclasses.asdict(kind),
        "products": _products(model),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _products(model) -> str | None:
    """What a compiled step on CPU calls of our native library in this process (`attention.native_products`);
    None on a GPU."""
    if next(model.parameters()).device.type != "cpu":
        return None
    return attention.native_products()


@functools.cache
def _source_hash() -> str:
    """The engine's and the CPU kernels' source: a change to what the step runs makes old packages stale."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]  # the engine, every room
    for path in sorted([*root.rglob("*.py"), root.parent / "models" / "cpu_quant.py"]):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def export(model, cache, sampler, cache_keyword: str) -> torch.export.ExportedProgram:
    """The step for `cache` and `sampler` traced once as a function of its inputs, with its symbolic sizes."""
    module = StepModule(model, cache, sampler, cache_keyword)
    examples, dynamic = _dims(cache, sampler)
    with torch.inference_mode(), _quiet():
        shapes = (*dynamic[:3], tuple(dynamic[3:]))  # as the signature: tokens, positions, span, *state
        return torch.export.export(module, tuple(examples), dynamic_shapes=shapes, strict=False)


def build(model, cache, sampler, cache_keyword: str, path: Path) -> None:
    """Export the step for `cache` and `sampler` and compile it into the package `path` (written whole or not at
    all): the kernels without the model's weights (they are given at load), and beside them the few constants
    that are not weights (inductor's scalars, folded constants)."""
    exported = export(model, cache, sampler, cache_keyword)
    with torch.inference_mode(), _quiet():
        options = {
            **INDUCTOR_OPTIONS,
            "aot_inductor.package_constants_in_so": False,
            "aot_inductor.package_constants_on_disk_format": "pickle_weights",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".build-"))
        try:
            built = torch._inductor.aoti_compile_and_package(
                exported, package_path=str(tmp / "step.pt2"), inductor_configs=options
            )
            _strip_weights(Path(built), set(_constants(model)), tmp / "extras.pt", path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _strip_weights(built: Path, weights: set[str], extras: Path, target: Path) -> None:
    """The package without the model's weights (given at load from the model itself); the other constants into
    one small file saved inside it."""
    with zipfile.ZipFile(built) as z:
        config_name = next(n for n in z.namelist() if n.endswith("weights_config.json"))
        root = config_name.split("/")[0]
        config = json.loads(z.read(config_name))
        kept = {}
        for name, (file, *_rest) in config.items():
            if name not in weights:
                kept[name] = torch.load(io.BytesIO(z.read(f"{root}/data/weights/{file}")), weights_only=True)
        buf = io.BytesIO()
        torch.save(kept, buf)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".pt2")
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as out:
                for item in z.infolist():
                    if "/data/weights/" in item.filename or item.filename.endswith("weights_config.json"):
                        continue
                    out.writestr(item, z.read(item.filename))
                out.writestr(f"{root}/h2o_extras.pt", buf.getvalue())
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


@contextlib.contextmanager
def _quiet():
    """Export and inductor warn about what is expected here (static attributes, a deprecated constructor)."""
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("torch._export", "torch.export", "torch._inductor", "torch.fx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# -- loaded programs ---------------------------------------------------------------------------------------------
class Program:
    """A loaded package: `program(tokens, positions, cache, sampler)` runs one decode step and returns (logits,
    tokens, keys, values, masses[, recalled entries]). Holds the constants it was given (the model's own
    tensors: the package reads them in place)."""

    def __init__(self, path: Path, model):
        self.path = path
        with _quiet():
            self._runner = torch._inductor.aoti_load_package(str(path))
        with zipfile.ZipFile(path) as z:
            extras = next(n for n in z.namelist() if n.endswith("h2o_extras.pt"))
            constants = torch.load(io.BytesIO(z.read(extras)), weights_only=True)
        model_constants = _constants(model)
        names = self._runner.get_constant_fqns()
        missing = [n for n in names if n not in model_constants and n not in constants]
        if missing:
            raise RuntimeError(f"the compiled step wants constants the model lacks: {', '.join(missing[:3])}")
        self._constants = {n: model_constants[n] if n in model_constants else constants[n] for n in names}
        self._runner.load_constants(self._constants, check_full_update=True, user_managed=True)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, sampler) -> list[torch.Tensor]:
        return self._runner(tokens, positions, *inputs(cache, sampler))

    def take_seconds(self) -> float:
        """Seconds spent compiling at a call (`Fused`'s): a loaded package compiles nothing."""
        return 0.0


# -- on a GPU: the same step compiled in process --------------------------------------------------------------
class Fused:
    """The step on a GPU (`--decode compile` there): the same `StepModule`, exported as for a package, compiled in
    this process by inductor (`torch.compile`: Triton kernels, a layer's pointwise work and reductions fused into
    a few) when it is first called, and meant to be captured, with the eviction after it, in the step's CUDA
    graph (`runners.Captured`), so no guard or Python runs per step. Called like a `Program`. No package on disk:
    a package loaded for CUDA crashed inside torch's loader (docs/experiments.md); inductor's own caches make a
    later start's compilation quicker. A new batch size compiles again (once, then for every size)."""

    def __init__(self, model, cache, sampler, cache_keyword: str):
        self._module = export(model, cache, sampler, cache_keyword).module()
        self._fn = torch.compile(self._module, backend=FUSED_BACKEND, fullgraph=True)
        self.seconds = 0.0  # spent compiling at a call, not yet reported (`take_seconds`)
        self._shapes: set = set()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, sampler) -> list[torch.Tensor]:
        given = inputs(cache, sampler)
        shapes = (tokens.shape[0], *(tuple(t.shape) for t in given))
        if shapes in self._shapes:
            return self._fn(tokens, positions, *given)
        t = time.perf_counter()  # a first call at these shapes: compiles (or finds the compiled code) first
        out = self._fn(tokens, positions, *given)
        self._shapes.add(shapes)
        self.seconds += time.perf_counter() - t
        return out

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


# model -> {StepKind: Fused, or the error that making or first calling it raised: not tried again in this process}
_fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
FUSED_BACKEND = "inductor"  # the tests check the rest of the way on a CPU with "aot_eager"


def in_process(device: torch.device) -> bool:
    """Whether a compiled step on `device` is compiled in process (`Fused`), not loaded from a package."""
    return device.type == "cuda"


def fused(model, cache, sampler, cache_keyword: str, status=None) -> Fused:
    """The GPU's compiled step for this model and step kind, made once per process (`status` is told first). A
    kind that failed once (`fused_failed`) raises its error again at once: a new engine (a chat's /reset, a
    server's lane) does not export and compile for a minute to fail the same way."""
    kind = StepKind.of(cache, sampler)
    mine = _fused.setdefault(model, {})
    if isinstance(mine.get(kind), Exception):
        raise mine[kind]
    if kind not in mine:
        if status is not None:
            status(f"compiling the decode step for this GPU ({kind.describe()}; once per run, about a minute)")
        try:
            mine[kind] = Fused(model, cache, sampler, cache_keyword)
        except Exception as e:
            mine[kind] = e
            raise
    return mine[kind]


def fused_failed(model, cache, sampler, error: Exception) -> None:
    """The compiled step of this kind failed at its first call: `fused` raises `error` from now on."""
    _fused.setdefault(model, {})[StepKind.of(cache, sampler)] = error


_loaded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {package key: Program}


def program(model, cache, sampler, cache_keyword: str, status=None) -> Program:
    """The compiled step for this model and step kind: already loaded, on disk, or built now (`status` is told
    first: it takes minutes). A package that cannot be loaded (damaged, or from another build of torch)
    is built again, once."""
    kind = StepKind.of(cache, sampler)
    key = package_key(model, kind)
    mine = _loaded.setdefault(model, {})
    if key in mine:
        return mine[key]
    path = cache_dir() / f"step-{key}.pt2"
    if path.exists():
        try:
            mine[key] = Program(path, model)
            return mine[key]
        except Exception as e:  # noqa: BLE001 -- a damaged zip, a missing member, a library that will not load
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            if status is not None:
                status(f"the compiled decode step in {path.name} could not be loaded ({reason}): building it again")
            path.unlink(missing_ok=True)
    if status is not None:
        status(f"compiling the decode step for this CPU ({kind.describe()}; once per machine, a few minutes)")
    build(model, cache, sampler, cache_keyword, path)
    mine[key] = Program(path, model)
    return mine[key]


def ready(model, cache, sampler) -> bool:
    """Whether the compiled step for this model and step kind is loaded or on disk (no build needed)."""
    key = package_key(model, StepKind.of(cache, sampler))
    return key in _loaded.get(model, {}) or (cache_dir() / f"step-{key}.pt2").exists()
