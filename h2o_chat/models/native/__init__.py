"""Our native library: 4-bit weight products on x86 CPUs, built for the CPU it runs on from one of two sources.

PyTorch's CPU kernel for 4-bit weights costs time in proportion to the rows it multiplies (8 rows ~3.5x one, a
512-token chunk ~150x). Ours dequantize each block of output channels once per call and multiply every row against
it; they read the weights as PyTorch packed them (no second copy). Each row's result is the one it gets alone,
whatever the rows beside it.

With AMX (Intel Xeon 4th generation and later), `int4_amx.cpp`, two kernels (docs/experiments.md, "An AMX kernel
for 4-bit products"):
- `int4_mm`, prompt chunks: the weights rounded to bfloat16 in a panel, then exact products: 7-9x faster than
  PyTorch's for a chunk of 512.
- `int4_mv`, decode steps: the products exact per group of 32 input channels (no weight rounded; the nibbles become
  bfloat16 by a table lookup), as fast as PyTorch's kernel for one row and flat in the rows up to 16 (8 rows 3x
  faster). Every decode step's product goes through it, so a row decodes bit for bit the same alone and in a batch.

With AVX2 and FMA but no AMX (AMD EPYC, Intel before Sapphire Rapids), `int4_avx2.cpp`: one product, registered
as both `int4_mm` (prompt chunks) and `int4_mv` (decode steps), as llama.cpp's Q4 x Q8 products: each row of x
rounded per group of 32 input channels to 8-bit integers and a scale (the group's largest x kept as it is), and
each group's products summed in integers over the nibbles themselves (vpmaddubsw; no weight dequantized), scaled
once per group. For steps 1.3-2x faster than its float32 predecessor, for chunks of 16-512 rows as fast as the
float32 panel kernel it replaced (~2x PyTorch's for 37 rows or more); perplexity unchanged (experiments.md, "8-bit
activations in the decode steps' products, then in prompt chunks too"). One product for both, so a token read in
a chunk is multiplied as a step would multiply it: with the float32 chunks beside 8-bit steps, a streamed
perplexity was 2.5% off the same text's one-pass perplexity.

Both builds also carry `decode_attention` (`attention.cpp`, AVX2 with FMA and F16C): a decode step's attention
over the held slots and the step's own token, with each key's mass for H2O, one pass per row and KV head over its
float32 or 8-bit slots, where PyTorch's operations read them in two products and a softmax with a barrier between
each (the 8-row step of the embedded model ~15% faster, its attention ~2x). It goes with the steps' kernel.

- Built with the system's C++ compiler against the installed torch: at install (`python -m h2o_chat.models.native`,
  which `scripts/install.sh` runs) or, when missing, by a process of its own started at first use, while the
  asking process keeps PyTorch's kernel throughout (its prompts and its steps). Kept beside this module (or under
  the cache folder when the package's folder cannot be written), named by its source and the torch version.
- Checked at its boundary before first use: the CPU's flags, the layout this build of PyTorch packs weights in,
  and one product of each kernel against PyTorch's, a row alone against the same row in a batch. Any failure
  leaves PyTorch's kernel in place (`why_not` says why).
- On wherever it builds, loads and passes the check; `H2O_CHAT_NATIVE=0` turns it off (`off`), for a
  comparison or a doubt; `H2O_CHAT_NATIVE=chunks` keeps it for prompt chunks only, steps (their products and
  attention) through PyTorch's operations (one row's decode step is
  ~5% faster through PyTorch's kernel with AMX, a batch's much slower).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_chat.files import cpu_info, cxx_name
from h2o_chat.files import cxx as compiler  # the compiler inductor builds the compiled steps with


@dataclass(frozen=True)
class Kernels:
    """One source of the library: the CPU flags its instructions need and the compiler's flags for them, the blocks
    of output channels it reads weights packed in (PyTorch packs in blocks of 64 where its kernel uses AVX-512, of
    32 with AVX2; a linear's outputs must be a multiple) and whether its kernels are told the block (their last
    argument). Each has a prompt chunks' kernel (`int4_mm`) and a decode steps' one (`int4_mv`)."""

    name: str
    source: Path
    flags: tuple[str, ...]
    arch: tuple[str, ...]
    blocks: tuple[int, ...]
    told_block: bool


AMX = Kernels(
    "amx",
    Path(__file__).with_name("int4_amx.cpp"),
    ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16", "f16c"),
    ("-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mf16c"),
    blocks=(64,),
    told_block=False,
)
AVX2 = Kernels(
    "avx2",
    Path(__file__).with_name("int4_avx2.cpp"),
    ("avx2", "fma", "f16c"),
    ("-mavx2", "-mfma", "-mf16c"),
    blocks=(32, 64),
    told_block=True,
)
SOURCES = (AMX, AVX2)  # the first whose flags the CPU has is built
ATTENTION = Path(__file__).with_name("attention.cpp")  # a decode step's attention (AVX2, FMA, F16C), built into both
GROUP = 32  # input channels per scale and zero (cpu_quant.GROUP: the only group the kernel takes)
BUILD_TIMEOUT = 600  # seconds
# "op", "mv", "attention", "recall", "place": the loaded kernels, or "why": why not (decided once per process)
_state: dict = {}
_fakes: set = set()  # the operators whose output shape is registered (once per process)
_lock = threading.Lock()


@functools.cache
def cpu_flags() -> set[str]:
    return set((cpu_info("flags") or "").split())


def off() -> str | None:
    """Why 4-bit products do not ask for the library at all: `H2O_CHAT_NATIVE=0` turns it off."""
    if os.environ.get("H2O_CHAT_NATIVE", "1") == "0":
        return "turned off by H2O_CHAT_NATIVE=0"
    return None


def kernels() -> Kernels:
    """The source built for this CPU: the first of `SOURCES` whose instructions it has (AVX2's, the least, when
    it has none: `unsupported` then says what it lacks)."""
    flags = cpu_flags()
    return next((k for k in SOURCES if set(k.flags) <= flags), SOURCES[-1])


def block() -> int:
    """The packed block of output channels the library used in this process reads (a linear's outputs must be a
    multiple of it to go through the library)."""
    return _state.get("block", 64)


@functools.cache
def pytorch_block() -> int | None:
    """The block of output channels this build of PyTorch packs 4-bit weights in on this CPU (byte j of a block's
    row k holding channel j in its low nibble and channel j + block / 2 in its high one): 64 (its AVX-512 kernel),
    32 (AVX2), or None (another layout)."""
    for BLOCK in (64, 32):
        N, K = 2 * BLOCK, 2 * GROUP
        q = _pattern(N, K)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        if packed.shape == (N, K // 2) and torch.equal(packed.view(N // BLOCK, K, BLOCK // 2).int(), packing(q, BLOCK)):
            return BLOCK
    return None


def _pattern(N: int, K: int) -> torch.Tensor:
    """4-bit values (N, K) int32 that tell every output and input channel apart (the checks' test weights)."""
    return ((torch.arange(N)[:, None] * 7 + torch.arange(K)[None, :] * 3) % 16).to(torch.int32).contiguous()


def packing(q: torch.Tensor, block: int) -> torch.Tensor:
    """4-bit values q (N, K) packed as PyTorch packs them in blocks of `block` output channels: (N / block, K,
    block / 2) bytes."""
    N, K = q.shape
    blocks = q.view(N // block, block, K)
    return (blocks[:, : block // 2] | (blocks[:, block // 2 :] << 4)).transpose(1, 2)


def unsupported() -> str | None:
    """Why the kernel cannot run on this machine at all (nothing built or loaded), or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"it is built for Linux on x86-64, not {sys.platform} on {platform.machine()}"
    missing = [f for f in kernels().flags if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def library_name() -> str:
    """The built kernel's file name: by its source and the torch it is built against."""
    return _library_name(kernels())


@functools.cache
def _library_name(source: Kernels) -> str:
    text = b"".join(path.read_bytes() for path in _sources(source))
    key = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:16]
    return f"int4_{source.name}-{key}.so"


def _sources(source: Kernels) -> tuple[Path, Path]:
    """What the library is built from (and named by): the CPU's products' source and the decode attention."""
    return source.source, ATTENTION


def library_path() -> Path:
    """Where the built kernel is: beside this module (where the install builds it) or, when the package's folder
    could not be written, under the cache folder (where a build at first use puts it). Where a build would go
    when it is in neither."""
    from h2o_chat.files import unwritable, user_cache_dir

    here = Path(__file__).with_name("_build") / library_name()
    cached = user_cache_dir() / "native" / library_name()
    if here.exists() or (not cached.exists() and unwritable(here.parent) is None):
        return here
    return cached


def build(path: Path | None = None) -> Path:
    """Compile the kernel into `path` (default `library_path()`), whole or not at all. Raises RuntimeError with
    the compiler's last line when it fails."""
    from torch.utils import cpp_extension

    path, source = path or library_path(), kernels()
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({cxx_name()}) was found")
    path.parent.mkdir(parents=True, exist_ok=True)
    lib = cpp_extension.library_paths()[0]
    includes = [arg for p in cpp_extension.include_paths() for arg in ("-isystem", p)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        command = [cxx, "-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w", abi, *source.arch, *includes]
        command += [
            *map(str, _sources(source)),
            "-o",
            str(out),
            f"-L{lib}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{lib}",
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the compiler failed ({last[:200]})")
        os.replace(out, path)
    return path


def check(op: Callable) -> str | None:
    """Why the loaded kernel `op` must not be used here, or None: the packed layout it reads is this build of
    PyTorch's (`packs_as_read`) and its products agree with PyTorch's kernel's (`compare`)."""
    if not packs_as_read():
        return "this build of PyTorch packs 4-bit weights in another layout than the kernel reads"
    return compare(op)


def packs_as_read() -> bool:
    """Whether this build of PyTorch packs 4-bit weights in a layout the kernel built for this CPU reads."""
    return pytorch_block() in kernels().blocks


def compare(op: Callable) -> str | None:
    """Why `op`'s products must not be used, or None: they agree with PyTorch's kernel (to within bfloat16's
    rounding of the weights) on weights PyTorch packed, and a row's result is the same alone as in a batch."""
    N, K = 128, 2 * GROUP
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_pattern(N, K), 1)
    generator = torch.Generator().manual_seed(0)
    uniform = torch.rand(K // GROUP, N, 2, generator=generator)  # (K / G, N, 2): scales in (0, 0.1), zeros +-0.5
    scales_zeros = (uniform * torch.tensor([0.1, 1.0]) - torch.tensor([0.0, 0.5])).to(torch.bfloat16).contiguous()
    x = torch.randn(21, K, generator=generator).to(torch.bfloat16)  # a full tile of 16 rows and a partial one
    ours = op(x, packed, GROUP, scales_zeros).float()
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros).float()
    if not torch.allclose(ours, theirs, rtol=0.02, atol=0.02 * theirs.abs().max().item()):
        return f"its product differs from PyTorch's (by {(ours - theirs).abs().max().item():.3g})"
    if not torch.equal(op(x[-1:].contiguous(), packed, GROUP, scales_zeros).float(), ours[-1:]):
        return "a row's product differs alone and in a batch"
    return None


def load(path: Path) -> tuple[Callable, Callable]:
    """The chunks' kernel and the steps' one, each `op(x, packed, group, scales_zeros)`, loading the library at
    `path` unless a library of the kernels is loaded already (a second one would register the operators twice,
    which aborts the process); told PyTorch's block where the source takes it (AVX2's). Their output's shape is
    registered, for a compiled step (torch.export), which records the block as a constant."""
    try:
        torch.ops.h2o_native.int4_mm  # noqa: B018 (loaded already?)
    except (AttributeError, RuntimeError):
        torch.ops.load_library(str(path))
    fakes = {
        "int4_mm": _fake_product,
        "int4_mv": _fake_product,
        "decode_attention": _fake_attention,
        "recall_step": _fake_recall,
    }
    for name in fakes.keys() - _fakes:
        torch.library.register_fake(f"h2o_native::{name}", fakes[name])
        _fakes.add(name)
    chunks, steps = torch.ops.h2o_native.int4_mm, torch.ops.h2o_native.int4_mv
    if kernels().told_block:
        block = pytorch_block() or kernels().blocks[0]
        return functools.partial(chunks, block=block), functools.partial(steps, block=block)
    return chunks, steps


def _fake_product(
    x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor, block: int | None = None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def _fake_attention(
    q, keys, values, valid, kscale, vscale, new_k, new_v, more=None, more_v=None
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, G, _ = q.shape
    return q.new_empty(B, H, G, values.shape[3]), q.new_empty(B, H, keys.shape[2] + 1)


def _fake_recall(q, basis, low, lscale, pos, keys, kscale, values, vscale, pick, candidates, per_row=None):
    B, H, G, _ = q.shape
    k = pick.shape[0]
    return q.new_empty(B, H, G, k), q.new_empty(B, H, k, values.shape[3]), q.new_empty(B, H, k, dtype=torch.long)


def check_recall(op: Callable) -> str | None:
    """Why the library's recall ranking must not be used, or None: over a store with empty entries, for rows
    that recall alike and rows that recall fewer, it recalls the tokens PyTorch's operations recall
    (`recall_rank.ranked`), with their logits and values, and a row ranks alike alone and in a batch."""
    from h2o_chat.engine.policies import recall_rank
    from h2o_chat.engine.storage.quant import quantize

    generator = torch.Generator().manual_seed(0)
    B, H, G, D, r, E, k, width = 3, 2, 3, 64, 16, 97, 4, 80  # 96 entries and the spare, 80 of them ranked
    q = torch.randn(B, H, G, D, generator=generator)
    basis = torch.randn(B, H, D, r, generator=generator) / 8  # any directions will do for the check
    (keys, kscale), (values, vscale) = (quantize(torch.randn(B, H, E, D, generator=generator)) for _ in range(2))
    low, lscale = quantize(keys.float() * kscale.float() @ basis)
    pos = torch.arange(E, dtype=torch.int32).expand(B, H, E).clone()
    pos[torch.rand(B, H, E, generator=generator) < 0.3] = -1
    tables = (basis, low[:, :, :width], lscale[:, :, :width], pos[:, :, :width], keys, kscale, values, vscale)
    for per_row in (None, torch.tensor([4, 2, 0])):
        ours = op(q, *tables, torch.arange(k), recall_rank.CANDIDATES, per_row)
        theirs = recall_rank.ranked(q, *tables, torch.arange(k), E - 1, per_row, torch.float32)
        if not torch.equal(ours[2], theirs[2]):
            return "its recall ranking recalls other tokens than PyTorch's"
        if not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ours[:2], theirs[:2], strict=True)):
            return "its recall ranking's logits or values differ from PyTorch's"
        last = None if per_row is None else per_row[-1:]
        alone = op(q[-1:], *(t[-1:] for t in tables), torch.arange(k), recall_rank.CANDIDATES, last)
        if not all(torch.equal(a, b[-1:]) for a, b in zip(alone, ours, strict=True)):
            return "a row's recall ranking differs alone and in a batch"
    return None


def twin_stores(capacities: list[int]) -> list:
    """Two empty recall stores alike (`Store`): 2 layers, 2 rows of `capacities` entries, 3 KV heads of 8
    channels, 2 recalled."""
    from h2o_chat.engine.storage.store import Store

    template = torch.zeros(2, 3, 1, 8)
    return [Store.allocate(2, template, template, capacities, [2, 2]) for _ in range(2)]


def place_alike(ours, theirs, op: Callable, rule: str, generator: torch.Generator, step: int) -> torch.Tensor:
    """One decode step's evicted tokens, random, into two stores alike (`Store`s of one shape): `ours` placed by
    `op` (the library's `store_place`), `theirs` by PyTorch's operations, under drop `rule`. Positions, scores and
    recall counts tie often, and every 7th `step` one head evicts nothing. -> the tokens' positions (L, B, H, 1)."""
    L, B, H, _, D = ours.keys.shape
    N = ours.capacity
    keys, values = (torch.randn(L, B, H, 1, D, generator=generator) for _ in range(2))
    pos = torch.randint(0, 3 * N, (L, B, H, 1), generator=generator)
    if step % 7 == 0:
        pos[0, 0, 0] = -1
    score = torch.randint(0, 5, (L, B, H, 1), generator=generator).float() / 4
    picked = torch.randint(0, N, (L, B, H, 2), generator=generator)
    for store, place in ((ours, op), (theirs, None)):
        store.drop = rule
        store.mark(picked)
        store.write_spare(keys, values, pos, pos, score)
        store.place_spare(place)
    return pos


def check_store_place(op: Callable) -> str | None:
    """Why the library's placement of recall's store must not be used, or None: under every drop rule, in a store
    that fills and then drops (a new token sometimes losing itself), its rows of one capacity or of two, with
    tied scores and recall counts, it moves and counts exactly what PyTorch's operations do
    (`Store.place_spare`)."""
    from h2o_chat.engine.storage.store import RULES

    generator = torch.Generator().manual_seed(0)
    N = 12
    for capacities in ([N, N], [N, 7]):
        for rule in RULES:
            ours, theirs = twin_stores(capacities)
            for step in range(3 * N):
                place_alike(ours, theirs, op, rule, generator, step)
                mine, other = ours.tensors(), theirs.tensors()
                if any(not torch.equal(mine[name], other[name]) for name in mine):
                    return f"its placement of recall's store (drop {rule!r}) differs from PyTorch's"
    return None


# policy sets whose rows `check_slots_place` and its test evict under: one policy, by score and by position; rows
# of their own budgets, sinks and rules in one batch (`Rules.within_limits`'s limits)
SETTLE_ROWS = (("h2o", "h2o"), ("sink", "sink"), ("snap", "recent"), ("h2o", "sink"))


def twin_slots(names: tuple[str, ...], capacity: int = 12) -> tuple[list, object]:
    """Two empty `Slots` alike, (2 layers, one row per policy name, 3 KV heads of 8 channels, `capacity` slots and
    the spare) with a side buffer moved with them (as snap's), and the rows' `Rules`: the rows' budgets differ (the
    last row's is smaller) unless every row has the same policy."""
    from h2o_chat.engine.policies import Rules, make_policy
    from h2o_chat.engine.storage.slots import Slots

    uniform = len(set(names)) == 1
    budgets = [capacity if uniform or r < len(names) - 1 else capacity - 4 for r in range(len(names))]
    policies = [make_policy(n, b) for n, b in zip(names, budgets, strict=True)]
    template = torch.zeros(len(names), 3, 1, 8)
    twins = [Slots.allocate(2, template, template, capacity) for _ in range(2)]
    for slots in twins:
        slots.extra = [torch.zeros(*slots.score.shape, 2)]
    return twins, Rules.of(policies, capacity, "cpu")


def settle_alike(ours, theirs, rules, op: Callable, generator: torch.Generator, step: int) -> None:
    """One decode step's token, random, into two `Slots` alike, then placed: `ours` by `op` (the library's
    `slots_place`), `theirs` by PyTorch's operations (`evict.settle`; `rules` None: `evict.fill`, a cache with room
    in every row). The slots' masses are quarters (they tie often) and at every 9th `step` one head's scores hold
    a NaN."""
    from h2o_chat.engine.policies import evict

    keys, values = (torch.randn(*ours.keys.shape[:3], ours.keys.shape[-1], generator=generator) for _ in range(2))
    mass = torch.randint(0, 4, ours.score.shape, generator=generator).float() / 4
    side = torch.randn(*ours.score.shape[:3], 2, generator=generator)
    for slots, place in ((ours, op), (theirs, None)):
        spare = slots.capacity
        slots.write((slice(None), slice(None), slice(None), spare), keys, values)
        slots.pos[..., spare] = slots.seen[None, :, None]
        slots.rot[..., spare] = slots.seen[None, :, None]
        slots.extra[0][:, :, :, spare] = side
        slots.score += mass
        if step % 9 == 0:
            slots.score[1, 0, 2, 3] = float("nan")
        if rules is None:
            evict.fill(slots, place)
        else:
            evict.settle(slots, rules, place)
        slots.score.nan_to_num_(0.0)
        slots.seen += 1


def check_slots_place(op: Callable) -> str | None:
    """Why the library's placement of the slots after a decode step must not be used, or None: for rows ranked by
    score and by position, with sinks, rows of several budgets and rules, a cache that fills and then evicts,
    tied scores and a NaN among them, it moves exactly what PyTorch's operations do (`evict.settle`)."""
    generator = torch.Generator().manual_seed(0)
    for names in (*SETTLE_ROWS, None):  # None: a cache filling (`evict.fill`), 12 steps
        (ours, theirs), rules = twin_slots(names or ("h2o", "h2o"))
        for step in range(30 if names else ours.capacity):
            settle_alike(ours, theirs, names and rules, op, generator, step)
            if not all(torch.equal(a, b) for a, b in zip(ours.buffers(), theirs.buffers(), strict=True)):
                what = f"{' and '.join(names)} rows" if names else "a cache filling"
                return f"its placement of the slots ({what}) differs from PyTorch's"
    return None


def check_attention(op: Callable) -> str | None:
    """Why the library's decode attention must not be used, or None: its output and mass agree with a plain
    softmax over the held slots and the new token (and recall's tokens brought back, some of them none), over
    float32 and 8-bit slots with empty ones among them, and a row's are the same alone as in a batch."""
    from h2o_chat.engine.storage.quant import quantize

    generator = torch.Generator().manual_seed(0)
    B, H, G, S, D, W = 3, 2, 3, 41, 64, 33  # 3 query heads per KV head, a width short of the slots
    q, k0, v0 = (torch.randn(B, H, n, D, generator=generator) for n in (G, S, S))
    new_k, new_v = (torch.randn(B, H, 1, D, generator=generator) for _ in range(2))
    valid = torch.rand(B, 1, S, generator=generator) > 0.25
    R = 5  # recalled tokens: their logits (one none) and values
    more = torch.randn(B, H, G, R, generator=generator).index_fill_(3, torch.tensor([2]), -torch.inf)
    more_v = torch.randn(B, H, R, D, generator=generator)
    for quantized, recalled in ((False, False), (True, False), (False, True)):
        k, v, kscale, vscale = k0, v0, None, None
        if quantized:
            (k, kscale), (v, vscale) = quantize(k0), quantize(v0)
        keys = k.float() * (1 if kscale is None else kscale.float())
        values = v.float() * (1 if vscale is None else vscale.float())
        logits = (q @ keys[:, :, :W].transpose(-1, -2)).masked_fill(~valid[:, :, None, :W], -torch.inf)
        logits = torch.cat((logits, q @ new_k.transpose(-1, -2), *((more,) if recalled else ())), dim=-1)
        probs = logits.softmax(-1)  # (B, H, G, W + 1 (+ R))
        out = probs @ torch.cat((values[:, :, :W], new_v, *((more_v,) if recalled else ())), dim=2)
        args = tuple(None if a is None else a[:, :, :W] for a in (k, v, valid, kscale, vscale))
        extra = (more, more_v) if recalled else ()
        ours, mass = op(q, *args, new_k, new_v, *extra)
        if not (torch.allclose(ours, out, atol=1e-5) and torch.allclose(mass, probs[..., : W + 1].sum(2), atol=1e-5)):
            return f"its decode attention differs from PyTorch's (by {(ours - out).abs().max().item():.3g})"
        last = (a[-1:] for a in (new_k, new_v, *extra))
        alone = op(q[-1:], *(None if a is None else a[-1:] for a in args), *last)
        if not (torch.equal(alone[0], ours[-1:]) and torch.equal(alone[1], mass[-1:])):
            return "a row's decode attention differs alone and in a batch"
    return None


def _build_in_background(path: Path) -> None:
    """Start `python -m h2o_chat.models.native` in a process of its own (niced; one at a time, by a marker)."""
    from h2o_chat.files import BUILDING, claim_build, start_build

    path.parent.mkdir(parents=True, exist_ok=True)
    if claim_build(path.parent / (BUILDING + path.stem)):
        start_build(["h2o_chat.models.native", "--marker"], path.with_suffix(".log"))


def int4_mm(background: bool = True) -> Callable | None:
    """The kernel, `op(x (M, K) bfloat16, packed, group, scales_zeros) -> (M, N) bfloat16`, or None where it is
    not used (`why_not()` says why). Decided once per process. Not built yet: None, and (`background`) its build
    starts in a process of its own."""
    if "op" in _state or "why" in _state:
        return _state.get("op")
    with _lock:
        if "op" in _state or "why" in _state:
            return _state.get("op")
        why = off() or unsupported()
        if why is None:
            path = library_path()
            if not path.exists():
                if compiler() is None:
                    why = f"no C++ compiler ({cxx_name()}) was found to build it"
                else:  # this process keeps PyTorch's kernel throughout: one kernel for all its prompts
                    if background:
                        _build_in_background(path)
                    why = "it is being built for this machine (the next start uses it)"
            else:
                try:
                    op, steps = load(path)
                    attention = torch.ops.h2o_native.decode_attention
                    recall = torch.ops.h2o_native.recall_step
                    place = torch.ops.h2o_native.store_place
                    settle = torch.ops.h2o_native.slots_place
                    why = check(op) or check(steps) or check_attention(attention) or check_recall(recall)
                    why = why or check_store_place(place) or check_slots_place(settle)
                except Exception as e:  # a library that does not load or run here
                    why = f"it did not load ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]})"
                if why is None:
                    if os.environ.get("H2O_CHAT_NATIVE") == "chunks":  # chunks only: steps keep PyTorch's
                        steps = None
                    attention = None if steps is None else attention
                    recall = None if steps is None else recall
                    _state.update(op=op, mv=steps, attention=attention, recall=recall, place=place, settle=settle)
                    _state["block"] = pytorch_block()
                    return op
        _state["why"] = why
        return None


def int4_mv(background: bool = True) -> Callable | None:
    """The decode steps' kernel, with `int4_mm`'s signature, or None where the library is not used (`int4_mm`
    decides, once per process)."""
    int4_mm(background)
    return _state.get("mv")


def decode_attention() -> Callable | None:
    """The library's decode-step attention, `op(q (B, H, G, D) float32, keys, values (B, H, W, D), valid (B, 1,
    W), kscale, vscale, new_k, new_v) -> (output (B, H, G, Dv), mass (B, H, W + 1))`, where the library is used
    for decode steps (`int4_mv`: a compiled step's package names the library it calls), else None."""
    int4_mm()
    return _state.get("attention")


def recall_step() -> Callable | None:
    """The library's ranking of recall's store in a decode step (`recall_rank.step`'s signature, tables first), where
    the library is used for decode steps, else None."""
    int4_mm()
    return _state.get("recall")


def store_place() -> Callable | None:
    """The library's placement of recall's store after a decode step (`Store.place_spare`'s `op`), where it loaded
    (eager, after the step: it does not depend on how steps multiply), else None."""
    int4_mm()
    return _state.get("place")


def slots_place() -> Callable | None:
    """The library's placement of the slots after a decode step (`evict.settle`'s `op`), where it loaded (eager,
    after the step, as `store_place`), else None."""
    int4_mm()
    return _state.get("settle")


def products() -> str:
    """Which kernel this process's decode steps multiply 4-bit weights with: the library's file name, or "pytorch"
    (a compiled step's package is keyed by it: the step calls that kernel)."""
    return library_name() if int4_mv() is not None else "pytorch"


def label() -> str | None:
    """What the weights' description says of the kernels this process's 4-bit products go through: "AMX kernels" or
    "AVX2 kernels" (chunks and steps), "AMX kernel for prompt chunks" (`H2O_CHAT_NATIVE=chunks`: steps through
    PyTorch's), or None (PyTorch's only)."""
    if int4_mm() is None:
        return None
    name = kernels().name.upper()
    return f"{name} kernels" if int4_mv() is not None else f"{name} kernel for prompt chunks"


def why_not() -> str | None:
    """Why 4-bit products use PyTorch's kernel in this process (once `int4_mm` has been asked), or None."""
    return _state.get("why")


def main(argv: list[str] | None = None) -> int:
    """Build the kernel for this machine unless it is built (or cannot run here): exit 0, or 1 when the build failed."""
    args = sys.argv[1:] if argv is None else argv
    path = library_path()
    try:
        why = unsupported()
        if why is not None:
            print(f"h2o-chat's kernels for 4-bit products are not built: {why}", file=sys.stderr)
            return 0
        if not path.exists():
            build(path)
        print(path)
        return 0
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        print(f"h2o-chat's kernels for 4-bit products were not built: {e}", file=sys.stderr)
        return 1
    finally:
        if "--marker" in args:
            from h2o_chat.files import BUILDING

            (path.parent / (BUILDING + path.stem)).unlink(missing_ok=True)


def _hand_over() -> None:
    """Give the engine (a layer below, which does not import this one) the decode attention and the name of what
    its steps call of the library."""
    from h2o_chat.engine.policies import evict, recall_rank
    from h2o_chat.engine.step import attention
    from h2o_chat.engine.storage import store

    attention.use_native(decode_attention, products)
    recall_rank.use_native(recall_step)
    store.use_native(store_place)
    evict.use_native(slots_place)


_hand_over()
