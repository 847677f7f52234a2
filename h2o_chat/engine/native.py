"""C kernels for the CPU's hot paths, built on first use with the machine's C compiler and called through ctypes.

On a CPU every PyTorch operator costs microseconds whatever its size, and a decode step of the `recall` policy ran
about 17 of them per layer to rank its store (`recall_rank.Ranking.step`), with two top-k sorts where selections
suffice. `csrc/recall_step.c` does that ranking in one call per layer. It is plain C (no PyTorch headers: it builds
in about a second) and is built once per source and processor into the cache folder (`H2O_CHAT_CACHE`), keyed by a
hash of the source, the flags and the processor's features, so a shared home never runs a build for another
processor. It is built at install time (`python -m h2o_chat.engine.native --build`, which scripts/install.sh runs)
or, where that did not happen, when a model loads (`prepare`, with a status line): never in the middle of a reply.

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
import sys
import tempfile
from collections.abc import Callable
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


def _optional() -> list[list[str]]:
    """The processor's vector units (`-march`: this machine's, or H2O_CHAT_NATIVE_MARCH: x86-64-v3 = AVX2,
    x86-64 = none, which the tests build to run the portable paths), and OpenMP for the heads of a layer
    (PyTorch's CPU builds load libgomp.so.1, whose runtime and threads the kernel then shares); each dropped
    when the compiler refuses it."""
    march = f"-march={os.environ.get('H2O_CHAT_NATIVE_MARCH', 'native')}"
    return [[march, "-fopenmp"], [march], []]


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
        for extra in _optional():
            cmd = [cc, *FLAGS, *extra, "-o", str(part), str(SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(part, out)
                return
        raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


def _location(cc: str) -> Path:
    """Where this source, built with these flags by `cc` for this processor, lives in the cache folder."""
    from h2o_chat.files import writable_cache_dir

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr((FLAGS, _optional())).encode(), _cpu_features().encode(), cc.encode()):
        key.update(part)
    return writable_cache_dir() / "native" / f"recall_step-{platform.machine()}-{key.hexdigest()[:16]}.so"


_loaded: list[Path] = []  # the library's path, once loaded


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not enabled():
        _why.append("H2O_CHAT_NATIVE=0")
        return None
    cc = _compiler()
    if cc is None:
        _why.append("no C compiler (cc, gcc or clang) on PATH")
        return None
    path = _location(cc)
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
    _loaded[:] = [path]
    return lib


def available() -> bool:
    """Whether the C kernels are built and loaded (building them the first time)."""
    return _library() is not None


def why() -> str:
    """Why they are not used ('' when they are)."""
    return "" if available() else "; ".join(_why)


def prepare(status: Callable[[str], None] | None = None) -> Path | None:
    """Build the kernels now if this machine has no build yet (telling `status` first: it takes a few seconds),
    and load them: where the library is, or None when they cannot be used (`why`). The install script and the
    model loader call this, so that no reply waits for a compiler."""
    if status is not None and _library.cache_info().currsize == 0 and enabled():
        cc = _compiler()
        if cc is not None and not (path := _location(cc)).exists():
            status(f"building recall's C ranking for this processor into {path.parent} (once, a few seconds)")
    return _loaded[0] if available() else None


def main(argv: list[str] | None = None) -> int:
    """`python -m h2o_chat.engine.native --build`: build the kernels (scripts/install.sh runs it) and print
    where they are; exit 1, saying why, when they cannot be built (recall then ranks with PyTorch operators)."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["--build"]:
        print("usage: python -m h2o_chat.engine.native --build", file=sys.stderr)
        return 2
    path = prepare(lambda message: print(message, file=sys.stderr))
    if path is None:
        print(f"recall's C ranking is not built ({why()}): recall ranks with PyTorch operators", file=sys.stderr)
        return 1
    print(path)
    return 0


KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}  # the store dtypes the kernel reads (its `kind`)


def _checked(name: str, t, dtype, numel: int, at_least: bool = False):
    """A tensor the kernel reads or writes through a raw pointer: on the CPU, contiguous, of `dtype` and of the
    size the kernel assumes. Anything else would be read or written out of bounds, silently."""
    import torch

    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"recall_step: {name} must be a contiguous CPU tensor")
    if t.dtype != dtype:
        raise ValueError(f"recall_step: {name} must be {dtype}, got {t.dtype}")
    if t.numel() < numel if at_least else t.numel() != numel:
        raise ValueError(f"recall_step: {name} holds {t.numel()} elements where the kernel reads {numel}")
    return t


class RecallStep:
    """One layer's call of `csrc/recall_step.c` for one query shape: its buffers (layer views of the store's,
    the outputs, the shared scratch) checked once at this boundary and kept alive while it exists; each call
    checks the query and the counts. `low`/`basis` None: exact ranking (no first pass)."""

    def __init__(self, *, G, k, basis, low, keys, values, marks, thresholds, out_logits, out_values, scratch):
        import torch

        B, H, N, D = keys.shape
        BH, Dv = B * H, values.shape[-1]
        kind = KINDS.get(str(keys.dtype).removeprefix("torch."))
        if kind is None:
            raise ValueError(f"recall_step: a {keys.dtype} store is not one the kernel reads")
        f32, i32 = torch.float32, torch.int32
        r = 0 if basis is None else basis.shape[-1]
        checked = [
            _checked("keys", keys, keys.dtype, BH * N * D),
            _checked("values", values, keys.dtype, BH * N * Dv),
            None if basis is None else _checked("basis", basis, f32, BH * D * r),
            None if low is None else _checked("low", low, low.dtype, BH * r * N),
            _checked("marks", marks, i32, BH * N),
            _checked("thresholds", thresholds, f32, BH),
            _checked("out_logits", out_logits, f32, BH * G * k),
            _checked("out_values", out_values, f32, BH * k * Dv),
            _checked("fscratch", scratch[0], f32, BH * (G + 2) * N, at_least=True),
            _checked("iscratch", scratch[1], i32, BH * 3 * N, at_least=True),
        ]
        if low is not None and low.element_size() != 2:
            raise ValueError("recall_step: low must hold 16-bit coordinates")
        self._keep = checked  # the pointers below stay valid while this object lives
        self.BH, self.G, self.D, self.N, self.k, self.kind = BH, G, D, N, k, kind
        self._head = (BH, G, D, Dv, r, N)
        self._tail = tuple(None if t is None else t.data_ptr() for t in checked[2:4]) + tuple(
            t.data_ptr() for t in (*checked[:2], *checked[4:])
        )

    def __call__(self, query, n: int, many: int, threads: int) -> int:
        """Rank the first `n` entries for `query` (BH x G x D float32); how many (row, head)s took their candidates
        from the entries their last step's threshold listed."""
        import torch

        query = _checked("query", query, torch.float32, self.BH * self.G * self.D)
        if not 0 <= self.k <= n <= self.N or many > n or threads < 1:
            raise ValueError(f"recall_step: counts it cannot take (k {self.k}, n {n}, many {many}, N {self.N})")
        basis, low, keys, values, *rest = self._tail
        listed = _library().recall_step(
            *self._head, n, many, self.k, query.data_ptr(), basis, low, keys, values, *rest, threads, self.kind
        )
        if listed < 0:
            raise ValueError("recall_step: arguments it cannot take")
        return listed


if __name__ == "__main__":
    sys.exit(main())
