"""The C ranking of a decode step's recall (`engine/native.py`, `csrc/recall_step.c`): it recalls exactly what
the PyTorch operators recall, marks the same entries, and a machine that cannot build it still runs."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from h2o_chat.engine import native
from h2o_chat.engine.recall_rank import CANDIDATES, TWO_PASS_FROM
from h2o_chat.engine.store import Store

needs_native = pytest.mark.skipif(not native.available(), reason=f"C kernels not built: {native.why()}")


def _store(B, H, D, recalled, n, gen, ties=False, dtype=torch.float32, keys=None, values=None):
    L = 2
    template = torch.zeros(B, H, 1, D, dtype=dtype)
    store = Store(L, template, template, [recalled] * B, 1)
    keys = torch.randn(L, B, H, n, D, generator=gen) if keys is None else keys
    if ties:  # groups of 8 identical keys: every logit is shared by 8 entries
        keys = keys[:, :, :, : n // 8].repeat_interleave(8, 3)
        n = keys.shape[3]
    values = torch.randn(L, B, H, n, D, generator=gen) if values is None else values  # unique: they name the entry
    with torch.inference_mode():
        store.append(keys.to(dtype), values.to(dtype), torch.arange(n).expand(L, B, H, n))
    return store


def _recalled(store, i, q, use_native):
    """(B, H, k) entries recalled by layer i (identified by their values), their logits and the marks added."""
    store.ranking.use_c = use_native
    before = store.marks.clone()
    with torch.inference_mode():
        got = store.ranking.step(i, q)
    values = store.values[i, :, :, None, : store.count]
    entry = (got.values[..., None, :] == values).all(-1).int().argmax(-1)
    order = entry.sort(-1)
    logits = got.logits.gather(3, order.indices[:, :, None, :].expand_as(got.logits))
    return order.values, logits, store.marks - before


@needs_native
@pytest.mark.parametrize(
    ("B", "H", "D", "G", "recalled", "n", "threads"),
    [
        (1, 3, 64, 3, 128, 900, 1),  # exact ranking (a store below the two-pass threshold), the embedded shape
        (1, 3, 64, 3, 128, 6000, 2),  # two passes, OpenMP over the heads
        (2, 2, 32, 2, 8, 300, 2),  # two rows, small heads: two passes from 64 entries
        (1, 1, 128, 4, 16, 80, 1),  # Llama-sized heads, exact
    ],
)
def test_the_c_ranking_recalls_what_the_operators_recall(B, H, D, G, recalled, n, threads):
    """Same entries (every row and head: a wrong offset, stride or index would not be), same logits, same marks,
    for exact and two-pass stores, one or two threads. The kernel's sums run in another order, so logits agree to
    rounding."""
    gen = torch.Generator().manual_seed(n)
    store = _store(B, H, D, recalled, n, gen)
    assert store.ranking.two is (True if n > TWO_PASS_FROM * CANDIDATES * recalled else None)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i in range(2):
            q = torch.randn(B, H * G, 1, D, generator=gen)
            ent_c, log_c, marks_c = _recalled(store, i, q, True)
            ent_t, log_t, marks_t = _recalled(store, i, q, False)
            assert torch.equal(ent_c, ent_t)
            torch.testing.assert_close(log_c, log_t, rtol=1e-5, atol=1e-4)
            assert torch.equal(marks_c, marks_t) and int(marks_c.sum()) == B * H * recalled
    finally:
        torch.set_num_threads(old)
    scratch = {step._tail[-2:] for _, step, *_ in store.ranking.calls.values()}  # its pointers, the last two arguments
    assert len(store.ranking.calls) == 2 and len(scratch) == 1  # one scratch for every layer, not one each


@needs_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("D", "G", "n"), [(64, 3, 900), (64, 3, 6000), (128, 4, 3000)])
def test_a_16_bit_store_is_ranked_as_a_float32_store_holding_the_same_numbers(dtype, D, G, n):
    """A GPU model's store holds its keys and values in float16 or bfloat16; the C ranking widens them as it reads
    them and ranks in float32: the same entries, logits and marks as the operators ranking a float32 store of the
    same numbers (exact and two-pass), and the values come back in the store's dtype, unchanged. A kernel that
    read 16-bit entries as float32, at a float32 stride, or narrowed the values, would not."""
    gen = torch.Generator().manual_seed(n + D)
    H, recalled = 2, 64
    keys = torch.randn(2, 1, H, n, D, generator=gen).to(dtype).float()
    values = torch.randn(2, 1, H, n, D, generator=gen).to(dtype).float()
    half = _store(1, H, D, recalled, n, gen, dtype=dtype, keys=keys, values=values)
    wide = _store(1, H, D, recalled, n, gen, keys=keys, values=values)
    assert half.ranking.two is wide.ranking.two is (True if n > TWO_PASS_FROM * CANDIDATES * recalled else None)
    for i in range(2):
        q = torch.randn(1, H * G, 1, D, generator=gen).to(dtype)
        with torch.inference_mode():
            half.ranking.use_c = True
            got = half.ranking.step(i, q)
        assert got.values.dtype == dtype
        ent_h, log_h, marks_h = _recalled(half, i, q, True)
        ent_w, log_w, marks_w = _recalled(wide, i, q.float(), False)
        assert torch.equal(ent_h, ent_w)
        torch.testing.assert_close(log_h, log_w, rtol=1e-5, atol=1e-4)
        assert torch.equal(marks_h, marks_w)
    assert half.ranking.calls  # it ranked in C


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_steps_that_start_from_the_last_steps_threshold_recall_what_the_operators_recall(threads):
    """A layer's next step lists the entries its first pass scores above a threshold the last step left, and
    takes its candidates from that list when it holds enough (most steps: queries drift), else ranks every entry
    (a query that jumps). Either way, what the operators recall, step after step, while the store grows."""
    gen = torch.Generator().manual_seed(11)
    B, H, G, D, recalled = 1, 3, 3, 64, 128
    store = _store(B, H, D, recalled, 6000, gen)
    assert store.ranking.two is True
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = torch.randn(B, H * G, 1, D, generator=gen)
        for step in range(12):
            if step % 4 == 3:  # a query unlike the last: its list may hold too few or too many
                q = torch.randn(B, H * G, 1, D, generator=gen)
            else:
                q = q + 0.1 * torch.randn(q.shape, generator=gen)
            ent_c, log_c, marks_c = _recalled(store, 0, q, True)
            ent_t, log_t, marks_t = _recalled(store, 0, q, False)
            assert torch.equal(ent_c, ent_t), step
            torch.testing.assert_close(log_c, log_t, rtol=1e-5, atol=1e-4)
            assert torch.equal(marks_c, marks_t)
            n = store.count
            with torch.inference_mode():  # a token evicted per step
                store.append(
                    torch.randn(2, B, H, 1, D, generator=gen),
                    torch.randn(2, B, H, 1, D, generator=gen),
                    torch.full((2, B, H, 1), n),
                )
    finally:
        torch.set_num_threads(old)
    assert 8 * H <= store.ranking.listed < 12 * H  # the drifting steps listed; the first could not (no threshold yet)


@needs_native
def test_ties_fill_the_recalled_tokens_with_entries_that_rank_as_high():
    """Keys repeated 8 times: the k-th best logit is shared by entries inside and outside the k recalled. The
    selection must take every entry above it and fill the rest with entries equal to it: k distinct entries,
    none below the k-th best (a fill with any entry not above it would take a lower one)."""
    gen = torch.Generator().manual_seed(3)
    store = _store(1, 3, 64, 132, 1000, gen, ties=True)  # exact ranking of 1,000 entries, 132 recalled
    assert store.ranking.two is None
    q = torch.randn(1, 9, 1, 64, generator=gen)
    entries, logits, marks = _recalled(store, 0, q, True)
    assert all(len(set(row.tolist())) == 132 for row in entries[0])
    true = (q.view(3, 3, 64) @ store.keys[0, 0, :, : store.count].mT).amax(1)  # (H, n)
    kth = true.topk(132, -1).values[:, -1:]
    assert bool(((true == kth).sum(-1) == 8).all())  # the k-th best is shared by 8 entries, 4 of them recalled
    got = true.gather(1, entries[0])
    assert bool((got >= kth - 1e-4).all())
    assert int(marks.sum()) == 3 * 132


def test_without_the_c_kernels_the_store_ranks_with_operators(monkeypatch, tmp_path):
    """H2O_CHAT_NATIVE=0, or a compiler that fails: not available, a reason, and recall still works."""
    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    for env, reason in ((("H2O_CHAT_NATIVE", "0"),), "H2O_CHAT_NATIVE=0"), ((("CC", "false"),), "the build failed"):
        native._library.cache_clear()
        native._why.clear()
        with monkeypatch.context() as m:
            for key, value in env:
                m.setenv(key, value)
            assert not native.available()
            assert reason in native.why()
            gen = torch.Generator().manual_seed(0)
            store = _store(1, 2, 32, 8, 100, gen)
            with torch.inference_mode():
                got = store.recall(0, torch.randn(1, 4, 1, 32, generator=gen))
            assert store.ranking.use_c is False and got.values.shape == (1, 2, 8, 32)
    native._library.cache_clear()
    native._why.clear()
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind


@pytest.mark.skipif(not native.available() or platform.machine() != "x86_64", reason="x86-64 builds of the kernel")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 and F16C only; no vector extensions at all
def test_the_portable_builds_recall_what_the_operators_recall(march, monkeypatch):
    """Our machines build with -march=native (AVX-512 here): the kernel's AVX2 and scalar paths run only on
    other CPUs unless built for them. Built so, they rank float32 and 16-bit stores as the operators do."""
    monkeypatch.setenv("H2O_CHAT_NATIVE_MARCH", march)
    native._library.cache_clear()
    try:
        assert native.available(), native.why()
        for dtype, n in ((torch.float32, 6000), (torch.float16, 900), (torch.bfloat16, 6000)):
            gen = torch.Generator().manual_seed(n)
            keys = torch.randn(2, 1, 3, n, 64, generator=gen).to(dtype)
            values = torch.randn(2, 1, 3, n, 64, generator=gen).to(dtype)
            store = _store(1, 3, 64, 128, n, gen, dtype=dtype, keys=keys, values=values)
            wide = _store(1, 3, 64, 128, n, gen, keys=keys.float(), values=values.float())  # the same numbers
            q = torch.randn(1, 9, 1, 64, generator=gen).to(dtype)  # the store widens a query from its dtype
            ent_c, log_c, marks_c = _recalled(store, 0, q, True)
            ent_t, log_t, marks_t = _recalled(wide, 0, q.float(), False)  # as the 16-bit tests above compare
            assert torch.equal(ent_c, ent_t), dtype
            torch.testing.assert_close(log_c, log_t, rtol=1e-4, atol=1e-3)
            assert torch.equal(marks_c, marks_t)
    finally:
        monkeypatch.delenv("H2O_CHAT_NATIVE_MARCH")
        native._library.cache_clear()


@needs_native
def test_the_kernels_boundary_refuses_what_it_would_read_out_of_bounds():
    """Raw pointers cross into C: a buffer of another dtype, not contiguous, too small, or a query of another
    shape is refused with a clear error before the call, never read."""
    B, H, N, D, G, k = 1, 2, 64, 32, 2, 8
    scratch = (torch.zeros(B * H * (G + 2) * N), torch.zeros(B * H * 3 * N, dtype=torch.int32))
    ok = dict(
        G=G, k=k, basis=None, low=None, keys=torch.zeros(B, H, N, D), values=torch.zeros(B, H, N, D),
        marks=torch.zeros(B, H, N, dtype=torch.int32), thresholds=torch.zeros(B * H),
        out_logits=torch.zeros(B, H, G, k), out_values=torch.zeros(B, H, k, D), scratch=scratch,
    )  # fmt: skip
    step = native.RecallStep(**ok)
    assert step(torch.zeros(B, H * G, 1, D), n=N, many=N, threads=1) >= 0  # a good call runs
    bad = {
        "values": torch.zeros(B, H, N, D, dtype=torch.float64),  # another dtype
        "keys": torch.zeros(B, H, D, N).transpose(2, 3),  # not contiguous
        "marks": torch.zeros(B, H, N - 1, dtype=torch.int32),  # too small
        "out_values": torch.zeros(B, H, k, D - 1),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match="recall_step"):
            native.RecallStep(**{**ok, name: value})
    for query in (torch.zeros(B, H * G, 1, D, dtype=torch.float16), torch.zeros(B, H * G, 2, D).transpose(2, 3)):
        with pytest.raises(ValueError, match="query"):
            step(query, n=N, many=N, threads=1)
    with pytest.raises(ValueError, match="counts"):
        step(torch.zeros(B, H * G, 1, D), n=N + 1, many=N, threads=1)  # more entries than the store holds


def test_the_install_builds_the_kernel_and_says_where(monkeypatch, tmp_path):
    """scripts/install.sh runs `python -m h2o_chat.engine.native --build`: it builds into the cache folder and
    prints the library's path; a model's load (`prepare`) then builds nothing and says nothing, and where no build
    was made it says so in one status line before building (never in the middle of a reply)."""
    if not native.available():
        pytest.skip(f"C kernels not built: {native.why()}")
    env = {**os.environ, "H2O_CHAT_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "h2o_chat.engine.native", "--build"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    built = done.stdout.strip()
    assert built.endswith(".so") and built.startswith(str(tmp_path)) and "building" in done.stderr
    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    said = []
    native._library.cache_clear()
    try:
        assert str(native.prepare(said.append)) == built and said == []  # built at install: nothing to say
        native._library.cache_clear()
        monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path / "fresh"))
        path = native.prepare(said.append)
        assert path.exists() and len(said) == 1 and "building" in said[0]
        assert native.main(["--bogus"]) == 2
    finally:
        native._library.cache_clear()
