"""Our one native kernel: 4-bit weight products of prompt chunks on CPUs with AMX (`int4_amx.cpp`).

PyTorch's CPU kernel for 4-bit weights costs time in proportion to the rows it multiplies (a 512-token chunk ~150x
one row). This one dequantizes each block of weights once per call and multiplies every row against it with AMX:
a chunk of 512 rows costs 7-9x less (docs/experiments.md, "An AMX kernel for 4-bit products"). It reads the
weights as PyTorch packed them (no second copy). Decode steps keep PyTorch's kernel (`cpu_quant.prompt_products`).

- Built with the system's C++ compiler against the installed torch: at install (`python -m h2o_chat.models.native`,
  which `scripts/install.sh` runs) or, when missing, by a process of its own started at first use, while the
  asking process keeps PyTorch's kernel. Kept beside this module (or under the cache folder when the package's
  folder cannot be written), named by its source and the torch version.
- Checked at its boundary before first use: the CPU's flags, the layout this build of PyTorch packs weights in,
  and one product against PyTorch's kernel. Any failure leaves PyTorch's kernel in place (`why_not` says why).
- On wherever it builds, loads and passes the check; `H2O_CHAT_NATIVE=0` turns it off (`off`), for a
  comparison or a doubt.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from h2o_chat.files import cxx as compiler  # the compiler inductor builds the compiled steps with
from h2o_chat.files import cxx_name

SOURCE = Path(__file__).with_name("int4_amx.cpp")
FLAGS = ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")  # what the kernel's instructions need
ARCH = ("-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")
BLOCK = 64  # output channels per packed block: a linear's outputs must be a multiple
GROUP = 32  # input channels per scale and zero (cpu_quant.GROUP: the only group the kernel takes)
BUILD_TIMEOUT = 600  # seconds
_state: dict = {}  # "op": the loaded kernel, or "why": why not (decided once per process)
_lock = threading.Lock()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def off() -> str | None:
    """Why prompt chunks do not ask for the kernel at all: `H2O_CHAT_NATIVE=0` turns it off."""
    if os.environ.get("H2O_CHAT_NATIVE", "1") == "0":
        return "turned off by H2O_CHAT_NATIVE=0"
    return None


def unsupported() -> str | None:
    """Why the kernel cannot run on this machine at all (nothing built or loaded), or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"it is built for Linux on x86-64, not {sys.platform} on {platform.machine()}"
    missing = [f for f in FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def library_name() -> str:
    """The built kernel's file name: by its source and the torch it is built against."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    return f"int4_amx-{key}.so"


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

    path = path or library_path()
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({cxx_name()}) was found")
    path.parent.mkdir(parents=True, exist_ok=True)
    lib = cpp_extension.library_paths()[0]
    includes = [arg for p in cpp_extension.include_paths() for arg in ("-isystem", p)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        command = [cxx, "-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w", abi, *ARCH, *includes]
        command += [str(SOURCE), "-o", str(out), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the compiler failed ({last[:200]})")
        os.replace(out, path)
    return path


def check(op: Callable) -> str | None:
    """Why the loaded kernel must not be used here, or None: the packed layout it reads is this build of
    PyTorch's, and its product agrees with PyTorch's kernel (to within bfloat16's rounding of the weights)."""
    N, K = 2 * BLOCK, 2 * GROUP
    q = ((torch.arange(N)[:, None] * 7 + torch.arange(K)[None, :] * 3) % 16).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    blocks = q.view(N // BLOCK, BLOCK, K)
    expect = (blocks[:, : BLOCK // 2] | (blocks[:, BLOCK // 2 :] << 4)).transpose(1, 2)
    if packed.shape != (N, K // 2) or not torch.equal(packed.view(N // BLOCK, K, BLOCK // 2).int(), expect):
        return "this build of PyTorch packs 4-bit weights in another layout than the kernel reads"
    generator = torch.Generator().manual_seed(0)
    uniform = torch.rand(K // GROUP, N, 2, generator=generator)  # (K / G, N, 2): scales in (0, 0.1), zeros +-0.5
    scales_zeros = (uniform * torch.tensor([0.1, 1.0]) - torch.tensor([0.0, 0.5])).to(torch.bfloat16).contiguous()
    x = torch.randn(21, K, generator=generator).to(torch.bfloat16)  # a full tile of 16 rows and a partial one
    ours = op(x, packed, GROUP, scales_zeros).float()
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros).float()
    if not torch.allclose(ours, theirs, rtol=0.02, atol=0.02 * theirs.abs().max().item()):
        return f"its product differs from PyTorch's (by {(ours - theirs).abs().max().item():.3g})"
    return None


def load(path: Path) -> Callable:
    """The kernel's operator, loading the library at `path` unless a library of the kernel is loaded already (a
    second one would register the operator twice, which aborts the process)."""
    try:
        return torch.ops.h2o_native.int4_mm
    except (AttributeError, RuntimeError):
        torch.ops.load_library(str(path))
        return torch.ops.h2o_native.int4_mm


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
                    op = load(path)
                    why = check(op)
                except Exception as e:  # a library that does not load or run here
                    why = f"it did not load ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]})"
                if why is None:
                    _state["op"] = op
                    return op
        _state["why"] = why
        return None


def why_not() -> str | None:
    """Why prompt chunks use PyTorch's kernel in this process (once `int4_mm` has been asked), or None."""
    return _state.get("why")


def main(argv: list[str] | None = None) -> int:
    """Build the kernel for this machine unless it is built (or cannot run here): exit 0, or 1 when the build failed."""
    args = sys.argv[1:] if argv is None else argv
    path = library_path()
    try:
        why = unsupported()
        if why is not None:
            print(f"the AMX kernel for prompt chunks is not built: {why}", file=sys.stderr)
            return 0
        if not path.exists():
            build(path)
        print(path)
        return 0
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        print(f"the AMX kernel for prompt chunks was not built: {e}", file=sys.stderr)
        return 1
    finally:
        if "--marker" in args:
            from h2o_chat.files import BUILDING

            (path.parent / (BUILDING + path.stem)).unlink(missing_ok=True)
