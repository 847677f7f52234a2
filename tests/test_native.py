"""Our kernels for 4-bit products (models/native: AMX's two or AVX2's two, whichever this CPU builds): what they
compute where they run, that prompt chunks go through the chunks' kernel and decode steps (eager or compiled)
through the steps' one, a row alike alone and in a batch, and that every way the library can be missing leaves
PyTorch's kernel with the reason."""

from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import product_on_8_bits
from h2o_chat.engine.storage.quant import dequantize, quantize
from h2o_chat.models import cpu_quant, native
from h2o_chat.models.cpu_quant import GROUP, Int4Linear, quantize_model

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="this torch lacks the int4 CPU kernel"
)


@pytest.fixture
def decided(monkeypatch):
    """Set what `native.int4_mm` has decided for this test (the chunks' op and the steps' `mv`, or the reason for
    none); restored after."""
    saved = dict(native._state)

    def set_(op=None, why=None, mv=None, attention=None):
        native._state.clear()
        if op is not None:
            native._state.update(op=op, mv=mv, attention=attention, block=native.pytorch_block())
        else:
            native._state.update(why=why or "the test says so")

    yield set_
    native._state.clear()
    native._state.update(saved)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The kernels built here, loaded; skipped where they cannot run (the reason given)."""
    why = native.unsupported()
    if why is not None:
        pytest.skip(f"our kernels cannot run here: {why}")
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    path = native.library_path()
    if not path.exists():
        path = native.build(tmp_path_factory.mktemp("native") / native.library_name())
    ops = native.load(path)  # the ones the engine loaded, if it has: (chunks', steps')
    why = native.check(ops[0])
    assert why is None, why
    return ops


@pytest.fixture(scope="module")
def kernel(kernels):
    """The prompt chunks' kernel (`int4_mm`), checked as the engine checks it."""
    return kernels[0]


@pytest.fixture(scope="module")
def step_kernel(kernels):
    """The decode steps' kernel (`int4_mv`), checked as the engine checks it."""
    assert native.check(kernels[1]) is None
    return kernels[1]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 17, 40])
def test_the_step_kernel_computes_what_it_says_and_gives_each_row_what_it_gets_alone(step_kernel, rows):
    """AMX's: exact products per group of 32 (no weight rounded). AVX2's: each row of x rounded per group of 32 to
    8-bit integers and a scale but for its largest (llama.cpp's Q8 products, an outlier kept), its sums of x q
    exact in integers and the zeros' term on the exact x. Each against the float64 product it says it takes,
    within the rounding of its bfloat16 output; and every row's result is the one it gets alone, in one tile of
    rows or across several."""
    torch.manual_seed(2)
    lin = Int4Linear.from_float(torch.randn(576, 1536) * 0.05)
    x = torch.randn(rows, 1536)
    x[:, GROUP : 2 * GROUP] = 0  # a group of zeros (no scale to divide by)
    x[:, 2 * GROUP : 3 * GROUP] *= 100  # a group far larger than its neighbours: its scale is its own
    x[:, 4 * GROUP + 7] = 300  # one large x among small ones (as LLMs' activations have): kept, the rest not coarse
    x = x.to(torch.bfloat16)
    got = step_kernel(x, lin.packed, GROUP, lin.scales_zeros)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 576)
    exact = x.double() @ lin.dequantize().double().t()
    if native.kernels() is native.AMX:
        said = exact
    else:
        said = product_on_8_bits(x, lin)
        # rounding x costs a few parts in a thousand of the largest output: a broken rounding costs far more
        assert (said - exact).abs().max() < 0.02 * exact.abs().max()
    error = (got.double() - said).abs()
    assert (error <= said.abs() * 2**-8 + 1e-4).all()  # the output's bfloat16 rounding: 2^-9 of it
    theirs = cpu_quant._int4_mm(x, lin.packed, lin.scales_zeros).double()
    if native.kernels() is native.AMX:  # PyTorch's kernel rounds each weight to float32 first: the last bits differ
        assert error.max() <= 1.5 * (theirs - exact).abs().max()
        assert (got.double() - theirs).abs().max() <= 2**-7 * exact.abs().max()
    for r in range(rows):
        assert torch.equal(step_kernel(x[r : r + 1].contiguous(), lin.packed, GROUP, lin.scales_zeros), got[r : r + 1])


@pytest.mark.parametrize("rows", [1, 5, 16, 21, 300])
def test_the_kernel_computes_the_product_within_bfloat16s_rounding_of_the_weights_and_each_row_alone(
    kernel, step_kernel, rows
):
    """Against the float64 product the chunks' kernel says it takes (AMX's: the weights rounded to bfloat16; AVX2's:
    the steps' own, on x rounded to 8 bits), at a real shape; each row's result is the one it gets alone. AMX's
    is as close to the exact weights as PyTorch's kernel."""
    torch.manual_seed(1)
    lin = Int4Linear.from_float(torch.randn(576, 1536) * 0.05)
    x = torch.randn(rows, 1536).to(torch.bfloat16)
    got = kernel(x, lin.packed, GROUP, lin.scales_zeros)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 576)
    exact = x.double() @ lin.dequantize().double().t()
    if native.kernels() is native.AMX:
        want = x.double() @ lin.dequantize().to(torch.bfloat16).double().t()
        assert torch.allclose(got.double(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())
        theirs = cpu_quant._int4_mm(x, lin.packed, lin.scales_zeros).double()
        assert (got.double() - exact).abs().max() < 4 * (theirs - exact).abs().max() + 1e-3
    else:  # one product for chunks and steps: a token read in a chunk is multiplied as the step would
        said = product_on_8_bits(x, lin)
        assert ((got.double() - said).abs() <= said.abs() * 2**-8 + 1e-4).all()
        assert torch.equal(got, step_kernel(x, lin.packed, GROUP, lin.scales_zeros))
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(kernel(x[r : r + 1].contiguous(), lin.packed, GROUP, lin.scales_zeros), got[r : r + 1])


def test_the_kernel_refuses_what_it_cannot_compute(kernel):
    block = native.pytorch_block()
    lin = Int4Linear.from_float(torch.randn(block * 3 // 2, 64))  # not whole blocks of outputs
    with pytest.raises(RuntimeError, match="unsupported shape"):
        kernel(torch.randn(2, 64).to(torch.bfloat16), lin.packed, GROUP, lin.scales_zeros)
    lin = Int4Linear.from_float(torch.randn(128, 64))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(torch.randn(2, 64), lin.packed, GROUP, lin.scales_zeros)


def test_the_avx2_kernel_reads_either_layout_pytorch_packs_in_and_sums_alike(kernel):
    """AVX2's kernels (chunks' and steps') read weights packed in blocks of 32 output channels (PyTorch's AVX2
    layout) or 64 (its AVX-512 one, on CPUs with AVX-512 but no AMX): the same weights give the same products, bit
    for bit, since each output is summed in the same order whatever the layout, for one row, two (a run of 32
    channels multiplied whole) and more (half a run at a time, in tiles of rows); and a block they do not read is
    refused."""
    if native.kernels() is not native.AVX2:
        pytest.skip("the library built here is not AVX2's")
    torch.manual_seed(3)
    lin = Int4Linear.from_float(torch.randn(192, 576) * 0.05)
    weights = lin.dequantize()
    scales_zeros = lin.scales_zeros
    x = torch.randn(13, 576).to(torch.bfloat16)
    # the 4-bit values back from the scales: q = round((w - zero) / scale) + 8, exact for weights made from them
    s, z = scales_zeros[..., 0].float().t(), scales_zeros[..., 1].float().t()  # (N, K / 32)
    q = ((weights.view(192, -1, 32) - z[..., None]) / s[..., None] + 8).round().view(192, 576).to(torch.int32)
    assert q.min() >= 0 and q.max() <= 15
    ours = native.pytorch_block()
    for name in ("int4_mm", "int4_mv"):  # the chunks' kernel and the steps' one
        op, products = getattr(torch.ops.h2o_native, name), {}
        for rows in (1, 2, 13):
            for block in (32, 64):
                packed = native.packing(q, block).reshape(192, 288).to(torch.uint8).contiguous()
                products[block] = op(x[:rows], packed, GROUP, scales_zeros, block)
            assert torch.equal(products[32], products[64]), (name, rows)
            assert torch.equal(products[ours], op(x[:rows], lin.packed, GROUP, scales_zeros, ours))
            assert torch.equal(products[ours], op(x, lin.packed, GROUP, scales_zeros, ours)[:rows])
        with pytest.raises(RuntimeError, match="block: 32 or 64"):
            op(x, lin.packed, GROUP, scales_zeros, 16)
    assert torch.equal(
        kernel(x, lin.packed, GROUP, scales_zeros),
        torch.ops.h2o_native.int4_mm(x, lin.packed, GROUP, scales_zeros, ours),
    )


def test_a_wrong_kernel_is_refused_by_the_check():
    """The boundary check compares one product with PyTorch's kernel: a kernel off by a little is not used. Where
    this build of PyTorch packs weights in a layout the kernel does not read (an AVX2-only CPU), that comes first,
    whatever the products."""

    def off(x, packed, group, sz):
        return (cpu_quant._int4_mm(x, packed, sz).float() * 1.1).to(torch.bfloat16)

    def pytorchs(x, packed, group, sz):
        return cpu_quant._int4_mm(x, packed, sz)

    assert "differs from PyTorch's" in native.compare(off)
    assert native.compare(pytorchs) is None
    if native.packs_as_read():
        assert "differs from PyTorch's" in native.check(off)
        assert native.check(pytorchs) is None
    else:
        assert native.check(pytorchs) == native.check(off)
        assert "another layout" in native.check(pytorchs)


def _counting(calls: list):
    def op(x, packed, group, sz):
        calls.append(x.shape[0])
        return cpu_quant._int4_mm(x, packed, sz)

    return op


def test_prompt_chunks_go_through_the_chunks_kernel_and_decode_steps_through_the_steps_one(decided):
    """A 4-bit model's prompt chunks (the engine's prefill) multiply through the chunks' kernel, every 4-bit linear
    of every chunk; its decode steps through the steps' kernel, every linear of every step, whatever the rows.
    With no library, both give what they gave through PyTorch's kernel, bit for bit."""
    from conftest import tiny_model
    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step.decode import Engine

    model = tiny_model("llama", layers=2)
    with torch.inference_mode():
        quantize_model(model, "4bit")
    linears = sum(isinstance(m, Int4Linear) for m in model.modules())  # the head's 4-bit copy among them
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))

    def read_and_step(steps: int = 4):
        engine = Engine(model, H2OCache.for_model(model, [make_policy("h2o", 32)] * 2), "eager")
        logits = engine.prefill(ids, chunk_size=16)
        return logits, [t for t in engine.tokens(logits, steps)]

    chunk_calls: list[int] = []
    step_calls: list[int] = []
    decided(op=_counting(chunk_calls), mv=_counting(step_calls))
    logits, tokens = read_and_step()
    chunks = 3  # 40 tokens in chunks of 16: 8, 16, 16 (the first chunk takes the remainder)
    # snap-free h2o reads once; every 4-bit linear once per chunk (the head only for the last position's rows)
    assert len(chunk_calls) == chunks * linears and sorted(set(chunk_calls)) == [2, 16, 32]
    assert len(step_calls) >= 3 * linears and len(step_calls) % linears == 0 and set(step_calls) == {2}
    decided(why="off")
    plain_logits, plain_tokens = read_and_step()
    assert torch.equal(logits, plain_logits) and tokens == plain_tokens  # the counting ops are PyTorch's kernel


def test_a_row_decodes_through_the_step_kernel_bit_for_bit_as_it_does_alone(kernel, step_kernel, decided):
    """Where the library runs, a 4-bit model's rows decoded together get, at every step, the logits each gets
    decoded alone: the step kernel's time is flat in the rows without giving up batch = alone."""
    from conftest import tiny_model
    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step.decode import Engine

    decided(op=kernel, mv=step_kernel)
    model = tiny_model("llama", layers=2)
    with torch.inference_mode():
        quantize_model(model, "4bit")
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(5))

    def decode(rows: torch.Tensor) -> list[torch.Tensor]:
        engine = Engine(model, H2OCache.for_model(model, [make_policy("h2o", 16)] * rows.shape[0]), "eager")
        token = engine.first_tokens(engine.prefill(rows, chunk_size=8))
        out = []
        for i in range(12):  # past the budget: eviction on the way
            logits, _ = engine.decode(token if i == 0 else None)
            out.append(logits.clone())
        return out

    together = decode(ids)
    alone = [decode(ids[i : i + 1]) for i in range(3)]
    for step, logits in enumerate(together):
        assert torch.equal(logits, torch.cat([a[step] for a in alone])), step


def test_every_way_the_kernel_is_missing_leaves_pytorchs_with_one_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "library_path", lambda: tmp_path / native.library_name())
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("H2O_CHAT_NATIVE", "0")
    assert native.int4_mm() is None and native.why_not() == "turned off by H2O_CHAT_NATIVE=0"
    monkeypatch.delenv("H2O_CHAT_NATIVE")  # on by default

    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx512f", "avx2"})  # neither AMX's nor AVX2's whole
    monkeypatch.setattr(native, "_state", {})
    assert native.int4_mm() is None and native.why_not() == "this CPU lacks fma, f16c"
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert native.kernels() is native.AVX2 and native.library_name().startswith("int4_avx2-")
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c", *native.AMX.flags})
    assert native.kernels() is native.AMX and native.library_name().startswith("int4_amx-")
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native.sys, "platform", "linux")

    # not built, no compiler: said; not built, a compiler: one build starts, this process keeps PyTorch's kernel
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(native, "_state", {})
    assert native.int4_mm() is None and "no C++ compiler" in native.why_not()
    monkeypatch.setattr(native, "compiler", lambda: "c++")
    started = []
    monkeypatch.setattr(native.subprocess, "Popen", lambda *a, **k: started.append(a[0]))
    for _ in range(2):  # decided once per process; a second process finds the build's marker and starts none
        monkeypatch.setattr(native, "_state", {})
        assert native.int4_mm() is None and "being built" in native.why_not()
        assert native.int4_mm() is None  # asked again: the same decision, no second build
    assert len(started) == 1 and started[0][-2:] == ["h2o_chat.models.native", "--marker"]

    # a library that does not load: PyTorch's kernel, with the loader's reason
    path = native.library_path()
    path.write_bytes(b"not a library")
    monkeypatch.setattr(native, "load", lambda p: torch.ops.load_library(str(p)))  # as when none is loaded yet
    monkeypatch.setattr(native, "_state", {})
    assert native.int4_mm() is None and native.why_not().startswith("it did not load (")

    # a compiler that fails: one line, exit 1, nothing left behind
    path.unlink()

    def fails(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "int4_amx.cpp:1: error: no such instruction\n")

    monkeypatch.setattr(native.subprocess, "run", fails)
    assert native.main([]) == 1 and not path.exists()


def test_a_chunk_reads_the_same_through_the_kernel_whatever_its_neighbours(kernel, decided):
    """Where the kernel runs, a batch of prompts read together gives each row what it gets read alone (each row's
    product is that row's alone), eviction included."""
    from conftest import tiny_model
    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step.decode import Engine

    decided(op=kernel)
    model = tiny_model("llama", layers=2)
    with torch.inference_mode():
        quantize_model(model, "4bit")
    ids = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(4))

    def read(rows: torch.Tensor, chunk: int) -> torch.Tensor:
        engine = Engine(model, H2OCache.for_model(model, [make_policy("h2o", 32)] * rows.shape[0]), "eager")
        return engine.prefill(rows, chunk_size=chunk)

    together = read(ids, 16)
    alone = torch.cat([read(ids[i : i + 1], 16) for i in range(3)])
    assert torch.equal(together, alone)


def test_a_compiled_step_calls_the_step_kernel_and_decodes_as_the_eager_step(kernel, step_kernel, decided):
    """The compiled step of a 4-bit model calls the steps' kernel and the decode attention (through AOTInductor's
    proxy for an operator of ours) and keeps the eager step's tokens; its package is keyed by the kernels, so a
    process multiplying through PyTorch's kernel never loads a step that calls ours (or the other way round)."""
    import zipfile

    from conftest import tiny_model
    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step import compiled
    from h2o_chat.engine.step.decode import Engine

    if compiled.unavailable() is not None:
        pytest.skip(compiled.unavailable())
    model = tiny_model("llama", layers=2, seed=8)
    with torch.inference_mode():
        quantize_model(model, "4bit")
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(6))

    def run(mode: str):
        engine = Engine(model, H2OCache.for_model(model, [make_policy("h2o", 16)] * 2), mode)
        return [t for t in engine.tokens(engine.prefill(ids, chunk_size=8), 24)], engine

    decided(op=kernel, mv=step_kernel, attention=torch.ops.h2o_native.decode_attention)
    want, _ = run("eager")
    got, engine = run("compile")
    assert engine._compiled.program is not None and got == want
    with zipfile.ZipFile(engine._compiled.program.path) as z:
        wrapper = z.read(next(n for n in z.namelist() if n.endswith("wrapper.json")))
        assert b"h2o_native::int4_mv" in wrapper and b"h2o_native::decode_attention" in wrapper
    kind = compiled.StepKind.of(engine.cache, engine.sampler)
    ours = compiled.package_key(model, kind)
    decided(why="off")
    assert compiled.package_key(model, kind) != ours


def test_a_step_built_by_a_process_of_its_own_calls_the_kernel_the_asking_process_calls(decided, monkeypatch, tmp_path):
    """A compiled step built beside a chat (`builder_for`) must land under the key the chat looks for: the job
    says which kernel the asking process multiplies with, and a build for a process on PyTorch's kernel turns
    the library off for itself (else it would build a step calling ours, which the asker never loads)."""
    import json
    import os
    from pathlib import Path
    from types import SimpleNamespace

    from conftest import tiny_model
    from h2o_chat.engine.step import compiled
    from h2o_chat.models import loading, prebuild
    from h2o_chat.models.registry import ModelSpec

    started: list = []
    monkeypatch.setattr(compiled, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a[0]))
    model = tiny_model("llama", layers=1)
    with torch.inference_mode():
        quantize_model(model, "4bit")
    spec = ModelSpec(name="tiny", source="x")
    loaded = SimpleNamespace(model=model, device=torch.device("cpu"), spec=spec, dtype=torch.float32, quantize="4bit")
    keys = []
    for decision, ours in ((dict(why="off"), False), (dict(op=_counting([]), mv=_counting([])), True)):
        decided(**decision)
        prebuild.builder_for(loaded)(compiled.StepKind())
        job = json.loads(Path(started[-1][-1]).read_text())
        assert job["native"] is ours
        keys.append(compiled.package_key(model, compiled.StepKind()))
    assert len(started) == 2 and keys[0] != keys[1]  # two kernels, two packages

    seen = []

    def load(*args, **kwargs):
        seen.append(os.environ.get("H2O_CHAT_NATIVE"))
        raise RuntimeError("loaded")

    monkeypatch.setattr(loading, "load", load)
    monkeypatch.setenv("H2O_CHAT_NATIVE", "1")  # restored after the test, whatever the job set
    for native_flag in (True, False):
        with pytest.raises(RuntimeError, match="loaded"):
            prebuild.run_job({"spec": {"name": "tiny", "source": "x"}, "native": native_flag, "kinds": []})
    assert seen == ["1", "0"]


def test_chunks_only_keeps_pytorchs_kernel_for_the_steps(kernel, monkeypatch):
    """`H2O_CHAT_NATIVE=chunks`: prompt chunks through the library, decode steps through PyTorch's kernel (and a
    compiled step's package says so)."""
    if not native.library_path().exists():
        pytest.skip("the library is not built where the engine looks for it")
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("H2O_CHAT_NATIVE", "chunks")
    assert native.int4_mm() is not None and native.int4_mv() is None and native.products() == "pytorch"
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv("H2O_CHAT_NATIVE")
    assert native.int4_mv() is not None and native.products() == native.library_name()


def test_the_weights_description_says_when_the_products_go_through_our_kernels(decided):
    """The panel, the piped summary and the bench's header describe the weights; they say "AMX kernels" or "AVX2
    kernels" (or "... kernel for prompt chunks" under `H2O_CHAT_NATIVE=chunks`) where this process multiplies
    through the library, so that a figure says which kernel made it."""
    from conftest import tiny_model
    from h2o_chat.models.loading import Loaded
    from h2o_chat.models.registry import ModelSpec

    model = tiny_model("llama", layers=1)
    with torch.inference_mode():
        quantize_model(model, "4bit")
    loaded = Loaded(model, None, ModelSpec(name="tiny", source="x"), torch.device("cpu"), torch.float32, "4bit")
    name = native.kernels().name.upper()  # AMX, or AVX2: the library this CPU builds
    decided(op=_counting([]), mv=_counting([]))
    assert loaded.weights == f"int4 groups of 32 (LM head too, {name} kernels), int8 embedding"
    decided(op=_counting([]))  # chunks only (H2O_CHAT_NATIVE=chunks)
    assert loaded.weights == f"int4 groups of 32 (LM head too, {name} kernel for prompt chunks), int8 embedding"
    decided(why="off")
    assert loaded.weights == "int4 groups of 32 (LM head too), int8 embedding"


def _slots(B, Hq, H, S, D, Dv, quantized, seed=0):
    """A decode step's inputs over S slots, about a fifth of them empty: query, keys, values, valid, scales, new."""
    from h2o_chat.engine.storage.quant import quantize

    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, Hq, 1, D, generator=g)
    keys, values = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, Dv, generator=g)
    valid = torch.rand(B, 1, S, generator=g) > 0.2
    new = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, Dv, generator=g)
    scales = None
    if quantized:
        (keys, kscale), (values, vscale) = quantize(keys), quantize(values)
        scales = kscale, vscale
    return query, keys, values, valid, scales, new


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "8bit"])
@pytest.mark.parametrize(
    ("Hq", "H", "D", "Dv", "width"),
    [(9, 3, 64, 64, 96), (8, 2, 80, 80, 37), (4, 4, 128, 128, 64), (7, 1, 64, 32, 9), (4, 2, 64, 64, None)],
)
def test_the_decode_attention_kernel_gives_pytorchs_output_and_mass(
    kernels, monkeypatch, quantized, Hq, H, D, Dv, width
):
    """The library's decode attention (attention.cpp) against PyTorch's operations in `attention_over_slots`:
    grouped query heads (3, 4, 7 per KV head, and none), head sizes not a multiple of 32, a width short of the
    slots or every slot but the spare, empty slots, float32 and 8-bit slots. The engine calls it for its steps."""
    from h2o_chat.engine.step import attention

    assert attention._native == (native.decode_attention, native.products)  # handed over on import
    query, keys, values, valid, scales, new = _slots(3, Hq, H, 101, D, Dv, quantized)
    calls = []
    op = torch.ops.h2o_native.decode_attention
    monkeypatch.setattr(attention, "_native", (lambda: lambda *a: calls.append(1) or op(*a), native.products))
    ours = attention.attention_over_slots(query, keys, values, D**-0.5, valid, None, scales, new=new, width=width)
    assert calls
    monkeypatch.setattr(attention, "_native", None)  # PyTorch's operations
    theirs = attention.attention_over_slots(query, keys, values, D**-0.5, valid, None, scales, new=new, width=width)
    assert ours[0].shape == theirs[0].shape and ours[1].shape == theirs[1].shape
    torch.testing.assert_close(ours[0], theirs[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], atol=2e-6, rtol=1e-5)
    S = width or keys.shape[2] - 1
    empty = ~valid[:, :, :S].expand(-1, H, -1)
    assert torch.equal(ours[1][..., :S][empty], torch.zeros_like(ours[1][..., :S][empty]))  # no mass to empty slots


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "8bit"])
@pytest.mark.parametrize(("Hq", "H", "Dv", "width"), [(9, 3, 64, 96), (4, 2, 64, None), (7, 1, 32, 9)])
def test_recalls_tokens_are_attended_by_the_kernel_as_by_pytorch_and_given_no_mass(
    kernels, monkeypatch, quantized, Hq, H, Dv, width
):
    """A recall step's tokens brought back from the store (their logits, as the ranking computed them, and their
    values) join the slots' and the step's own token's softmax in the library's attention as in PyTorch's
    operations: one row recalls nothing (all -inf), one has a token fewer; the slots' and own token's mass is
    PyTorch's, the recalled tokens get none. A kernel that leaves them out is refused by the engine's check."""
    from h2o_chat.engine.policies.recall_rank import Recalled
    from h2o_chat.engine.step import attention

    B, D, R = 3, 64, 6
    query, keys, values, valid, scales, new = _slots(B, Hq, H, 101, D, Dv, quantized, seed=5)
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(B, H, Hq // H, R, generator=g) * 8  # unscaled, as large as the slots' (x D^-0.5)
    logits[0] = -torch.inf  # row 0 recalled nothing
    logits[1, :, :, 4] = -torch.inf  # row 1 a token fewer
    recalled = Recalled(None, torch.randn(B, H, R, Dv, generator=g), None, logits)
    calls = []
    op = torch.ops.h2o_native.decode_attention
    monkeypatch.setattr(attention, "_native", (lambda: lambda *a: calls.append(len(a)) or op(*a), native.products))
    args = (query, keys, values, D**-0.5, valid, recalled, scales)
    ours = attention.attention_over_slots(*args, new=new, width=width)
    assert calls == [10]  # the kernel, with the recalled tokens
    monkeypatch.setattr(attention, "_native", None)  # PyTorch's operations
    theirs = attention.attention_over_slots(*args, new=new, width=width)
    torch.testing.assert_close(ours[0], theirs[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], atol=2e-6, rtol=1e-5)
    without = attention.attention_over_slots(query, keys, values, D**-0.5, valid, None, scales, new=new, width=width)
    assert torch.equal(theirs[0][0], without[0][0])  # nothing recalled: as without
    assert (ours[1][1:].sum(-1) < without[1][1:].sum(-1) - 1e-3).all()  # recalled tokens took mass from the rest

    def forgetful(*a):
        return op(*a[:8])

    assert "differs" in native.check_attention(forgetful)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "8bit"])
def test_a_row_attends_bit_for_bit_alike_alone_in_a_batch_and_at_any_width(kernels, quantized):
    """A row's output and mass depend on its own slots only: the same in a batch as alone, and whatever width of
    at least its held slots the step reads (a batch reads as wide as its fullest row)."""
    op = torch.ops.h2o_native.decode_attention
    query, keys, values, valid, scales, new = _slots(4, 6, 2, 130, 64, 64, quantized, seed=3)
    valid[1, :, 45:] = False  # row 1 holds tokens in its first 45 slots only
    qg = (query * 0.125).view(4, 2, 3, 64)

    def run(rows, width):
        cut = [None if t is None else t[rows, :, :width] for t in (keys, values, valid, *(scales or (None, None)))]
        return op(qg[rows], *cut, new[0][rows], new[1][rows])

    out, mass = run(slice(None), 129)
    for width in (45, 48, 100, 129):
        alone, alone_mass = run(slice(1, 2), width)
        assert torch.equal(alone, out[1:2])
        assert torch.equal(alone_mass[..., :45], mass[1:2, :, :45]) and torch.equal(
            alone_mass[..., -1], mass[1:2, :, -1]
        )


def _filled_store(recalled, seed=0):
    """A store of 2 layers, 2 rows, 3 KV heads (64 channels) and 300 entries, 230 of them filled with keys and
    values (about a tenth of the rows' later entries emptied again), its basis fitted: each row recalls
    `recalled[row]`."""
    from h2o_chat.engine.storage.store import Store

    gen = torch.Generator().manual_seed(seed)
    L, B, H, D, N, n = 2, 2, 3, 64, 300, 230
    template = torch.zeros(B, H, 1, D)
    store = Store.allocate(L, template, template, [N, N], recalled)
    keys, values = torch.randn(L, B, H, n, D, generator=gen), torch.randn(L, B, H, n, D, generator=gen)
    pos = torch.arange(n).expand(L, B, H, n)
    store.append_chunk(keys, values, pos, pos, torch.rand(L, B, H, n, generator=gen))
    store.pos[..., 100:n][torch.rand(L, B, H, n - 100, generator=gen) < 0.1] = -1
    store.evicted, store.fitted = [n, n], [0, 0]
    store.basis.copy_(torch.linalg.qr(torch.randn(L, B, H, D, D, generator=gen)).Q[..., : store.low.shape[-1]])
    store.low[:], store.lscale[:] = quantize(dequantize(store.keys, store.kscale, torch.float32) @ store.basis)
    return store


@pytest.mark.parametrize("recalled", [[8, 8], [8, 3]], ids=["alike", "fewer"])
@pytest.mark.parametrize("width", [None, 256])
def test_the_recall_ranking_kernel_recalls_what_pytorchs_operations_recall(kernels, monkeypatch, recalled, width):
    """Recall's decode-step ranking through the library (one pass per row and KV head) against PyTorch's
    operations (`recall_rank.ranked`) on a filled store with empty entries, every entry or the first 256 ranked,
    rows recalling alike or one fewer: the same tokens in the same order, their logits and values; a row's are
    the same alone."""
    from h2o_chat.engine.policies import recall_rank

    store = _filled_store(recalled)
    calls = []
    op = torch.ops.h2o_native.recall_step
    for i in range(2):
        q = torch.randn(2, 9, 1, 64, generator=torch.Generator().manual_seed(i))
        monkeypatch.setattr(recall_rank, "_native", lambda: lambda *a: calls.append(1) or op(*a))
        ours = recall_rank.step(store, i, q, width)
        monkeypatch.setattr(recall_rank, "_native", None)
        theirs = recall_rank.step(store, i, q, width)
        assert torch.equal(ours.index, theirs.index)
        torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=0, rtol=0)  # int8 x a float16 scale: exact
        if recalled[1] < recalled[0]:  # past its own number the row gets nothing (and the spare)
            assert bool((ours.logits[1, :, :, recalled[1] :] == -torch.inf).all())
            assert bool((ours.index[1, :, recalled[1] :] == store.capacity).all())
        assert bool((ours.logits[0] > -torch.inf).all())  # the first row recalls its 8 in every head
    assert len(calls) == 2
    n = width or store.capacity
    layer = [store.basis[0], *(t[0, :, :, :n] for t in (store.low, store.lscale, store.pos))]
    layer += [t[0] for t in (store.keys, store.kscale, store.values, store.vscale)]
    q, per_row = torch.randn(2, 3, 3, 64), None if recalled[0] == recalled[1] else torch.tensor(recalled)
    sizes = (store.pick, recall_rank.CANDIDATES)
    both = op(q, *layer, *sizes, per_row)
    alone = op(q[1:], *(t[1:] for t in layer), *sizes, None if per_row is None else per_row[1:])
    assert all(torch.equal(a, b[1:]) for a, b in zip(alone, both, strict=True))


def test_a_wrong_recall_ranking_is_refused_by_the_check(kernels):
    """The check the engine runs before using the library catches a ranking that ignores what a row recalls, or
    that recalls the right tokens in another order, and passes the real one."""
    op = torch.ops.h2o_native.recall_step
    assert native.check_recall(op) is None

    def every_row_alike(*a):
        return op(*a[:-1], None)

    def reversed_order(*a):
        return tuple(t.flip(-1) if t.dim() == 3 else t for t in op(*a))

    assert "recalls other tokens" in native.check_recall(every_row_alike)
    assert "recalls other tokens" in native.check_recall(reversed_order)


@pytest.mark.parametrize("rule", ["first", "age", "recalls", "score"])
@pytest.mark.parametrize("capacities", [[40, 40], [40, 23]], ids=["one-capacity", "two"])
def test_the_store_placement_kernel_places_what_pytorchs_operations_place(kernels, rule, capacities):
    """Recall's store after each of 150 decode steps, placed by the library (one pass over every layer's store) and
    by PyTorch's operations: the same fields everywhere and the same drop counts, under every drop rule, rows of
    one capacity and of two (the smaller row never holds past its own), with tied positions, scores and recall
    counts, while the store fills and after (new tokens dropping others or themselves)."""
    op = torch.ops.h2o_native.store_place
    ours, theirs = native.twin_stores(capacities)
    gen = torch.Generator().manual_seed(1)
    lost_itself = 0
    for step in range(150):
        before = ours.pos.clone()
        pos = native.place_alike(ours, theirs, op, rule, gen, step)
        mine, other = ours.tensors(), theirs.tensors()
        for name in mine:
            assert torch.equal(mine[name], other[name]), (step, name)
        lost_itself += int((ours.pos[..., :-1] == before[..., :-1]).all(-1).logical_and(pos[..., 0] >= 0).sum())
    held = (ours.pos[..., :-1] >= 0).sum(-1)
    assert held[:, 0].eq(capacities[0]).all() and held[:, 1].eq(capacities[1]).all()  # full, each row its own
    assert bool((ours.pos[:, 1, :, capacities[1] : -1] == -1).all())
    assert int(ours.drops.sum()) > 0 and lost_itself > 0


def test_a_wrong_store_placement_is_refused_by_the_check(kernels):
    """The check the engine runs before using the library catches a placement that ignores the drop rule or a
    row's own capacity, and passes the real one."""
    op = torch.ops.h2o_native.store_place
    assert native.check_store_place(op) is None

    def by_score_always(fields, pos, score, marks, drops, limit, rule):
        op(fields, pos, score, marks, drops, limit, 3)

    def every_row_full_size(fields, pos, score, marks, drops, limit, rule):
        op(fields, pos, score, marks, drops, None, rule)

    assert "drop 'age'" in native.check_store_place(by_score_always)
    assert "differs from PyTorch's" in native.check_store_place(every_row_full_size)


@pytest.mark.parametrize("names", native.SETTLE_ROWS, ids=["+".join(n) for n in native.SETTLE_ROWS])
def test_the_slots_placement_kernel_evicts_what_pytorchs_operations_evict(kernels, names):
    """The slots after each of 120 decode steps, placed by the library (one pass over every layer's slots) and by
    PyTorch's operations (`evict.settle`): every buffer equal, snap's side buffer included, for rows ranked by
    score and by position, with sinks kept, rows of two budgets in one batch (the smaller never holds past its
    own), tied scores, and a NaN among them (slot 0 loses, as PyTorch's argmin has it), while the cache fills and
    after."""
    op = torch.ops.h2o_native.slots_place
    (ours, theirs), rules = native.twin_slots(names)
    gen = torch.Generator().manual_seed(1)
    evicted = 0
    for step in range(120):
        before = ours.pos[..., :-1].clone()
        native.settle_alike(ours, theirs, rules, op, gen, step)
        for a, b in zip(ours.buffers(), theirs.buffers(), strict=True):
            assert torch.equal(a, b), step
        evicted += int(((before >= 0) & (ours.pos[..., :-1] != before)).sum())
    held = (ours.pos[..., :-1] >= 0).sum(-1)  # (L, B, H): full, each row to its own budget
    assert held.eq(rules.limit[None, :, None]).all() and evicted > 0
    assert bool((ours.pos[..., -1] == -1).all())  # the spare emptied
    if "sink" in names:  # a sink row keeps its first positions whatever their scores
        row = names.index("sink")
        kept = (ours.pos[:, row] >= 0) & (ours.pos[:, row] < int(rules.sinks[row]))
        assert kept.sum(-1).eq(int(rules.sinks[row])).all()


def test_the_slots_placement_kernel_fills_a_cache_as_pytorchs_operations_do(kernels):
    """A cache with room in every row (`evict.fill`: no rule given): each step's token goes to its row's first empty
    slot, the same with the library as with PyTorch's scatter, rows of two budgets alike."""
    op = torch.ops.h2o_native.slots_place
    (ours, theirs), rules = native.twin_slots(("h2o", "sink"))
    gen = torch.Generator().manual_seed(2)
    for step in range(int(rules.limit.min())):
        native.settle_alike(ours, theirs, None, op, gen, step)
        for a, b in zip(ours.buffers(), theirs.buffers(), strict=True):
            assert torch.equal(a, b), step
        assert bool((ours.pos[..., : step + 1] == torch.arange(step + 1)).all())  # in order, from slot 0


def test_a_wrong_slots_placement_is_refused_by_the_check(kernels):
    """The check the engine runs before using the library catches a placement that ranks every row by score, or
    forgets the rows' own budgets or sinks, and passes the real one."""
    op = torch.ops.h2o_native.slots_place
    assert native.check_slots_place(op) is None

    def by_score_always(fields, pos, score, newest, by_score, recent, sinks, limit):
        op(fields, pos, score, newest, torch.ones_like(by_score), recent, sinks, limit)

    def every_row_full_size(fields, pos, score, newest, by_score, recent, sinks, limit):
        op(fields, pos, score, newest, by_score, recent, sinks, None)

    def no_sinks(fields, pos, score, newest, by_score, recent, sinks, limit):
        op(fields, pos, score, newest, by_score, recent, None, limit)

    def loses_what_a_filling_cache_reads(fields, pos, score, newest, by_score, recent, sinks, limit):
        if by_score is not None:  # a cache with room (no rule): the token is left in the spare, which is cleared
            op(fields, pos, score, newest, by_score, recent, sinks, limit)

    assert "(sink and sink rows)" in native.check_slots_place(by_score_always)
    assert "(a cache filling)" in native.check_slots_place(loses_what_a_filling_cache_reads)
    assert "differs from PyTorch's" in native.check_slots_place(every_row_full_size)
    assert "differs from PyTorch's" in native.check_slots_place(no_sinks)


def test_a_wrong_decode_attention_is_refused_by_the_check(kernels):
    """The check the engine runs before using the library catches an attention that is off (mass shifted by one
    slot, or the keys read with the values' scales), and passes the real one."""
    op = torch.ops.h2o_native.decode_attention
    assert native.check_attention(op) is None

    def shifted(*args):
        out, mass = op(*args)
        return out, mass.roll(1, dims=-1)

    def misscaled(q, keys, values, valid, kscale, vscale, new_k, new_v):
        return op(q, keys, values, valid, vscale, vscale, new_k, new_v)  # the values' scales for the keys

    assert "differs" in native.check_attention(shifted)
    assert "differs" in native.check_attention(misscaled)


def test_the_decode_attention_refuses_what_it_cannot_compute(kernels):
    op = torch.ops.h2o_native.decode_attention
    query, keys, values, valid, scales, new = _slots(1, 2, 2, 16, 64, 64, True)
    qg = query.view(1, 2, 1, 64)
    with pytest.raises(RuntimeError, match="with their scales"):
        op(qg, keys, values, valid, None, None, *new)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        op(qg[..., :60], keys[..., :60], values, valid, *scales, new[0][..., :60], new[1])
    with pytest.raises(RuntimeError, match="float32 or int8"):
        op(qg, keys.half(), values.half(), valid, None, None, *new)
