"""C kernels for the CPU's hot paths, built on first use with the machine's C compiler and called through ctypes.

On a CPU every PyTorch operator costs microseconds whatever its size, and a decode step of the `recall` policy ran
about 17 of them per layer to rank its store (`store.Store._recall_step`), with two top-k sorts where selections
suffice. `csrc/recall_step.c` does that ranking in one call per layer. It is plain C (no PyTorch headers: it builds
in about a second) and is built once per source and processor into the cache folder (`H2O_CHAT_CACHE`), keyed by a
hash of the source, the flags and the processor's features, so a shared home never runs a build for another
processor.

Nothing depends on it: without a compiler, when the build fails, or with `H2O_CHAT_NATIVE=0`, the store ranks with
PyTorch operators as before (the tests compare both). `available()` says which, and `why()` why not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "recall_step.c"
FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fassociative-math",  # vectorized sums of products (infinities stay: no -ffast-math)
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
]
OPTIONAL = [
    # the processor's vector units, and OpenMP for the heads of a layer (PyTorch's CPU builds load libgomp.so.1,
    # whose runtime and threads the kernel then shares); each dropped when the compiler refuses it
    ["-march=native", "-fopenmp"],
    ["-march=native"],
    [],
]

_why: list[str] = []


def enabled() -> bool:
    return os.environ.get("H2O_CHAT_NATIVE", "1") != "0"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str, out: Path) -> None:
    """Compile SOURCE into `out`, atomically (several processes may build at once)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        for extra in OPTIONAL:
            cmd = [cc, *FLAGS, *extra, "-o", str(part), str(SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(part, out)
                return
        raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not enabled():
        _why.append("H2O_CHAT_NATIVE=0")
        return None
    cc = os.environ.get("CC") or "cc"
    cc = shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        _why.append("no C compiler (cc, gcc or clang) on PATH")
        return None
    from h2o_chat.files import writable_cache_dir

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr((FLAGS, OPTIONAL)).encode(), _cpu_features().encode(), cc.encode()):
        key.update(part)
    path = writable_cache_dir() / "native" / f"recall_step-{platform.machine()}-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why.append(f"the build failed ({e})")
        return None
    i, i64, p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.recall_step.argtypes = [i, i, i, i, i, i64, i, i, i, p, p, p, p, p, p, p, p, p, p, p, i, i]
    lib.recall_step.restype = i
    return lib


def available() -> bool:
    """Whether the C kernels are built and loaded (building them the first time)."""
    return _library() is not None


def why() -> str:
    """Why they are not used ('' when they are)."""
    return "" if available() else "; ".join(_why)


def recall_step(*args) -> int:
    """`csrc/recall_step.c`'s `recall_step` (arguments as there; tensors by their data pointers): how many (row,
    head)s took their candidates from the entries their last step's threshold listed."""
    listed = _library().recall_step(*args)
    if listed < 0:
        raise ValueError("recall_step: arguments it cannot take")
    return listed
