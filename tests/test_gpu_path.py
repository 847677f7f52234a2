"""The GPU path: memory estimates and equal-memory throughput (on CPU), and CUDA checks that skip without one."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from conftest import cached, tiny_model
from h2o_chat.app import cli
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.decode import Engine
from h2o_chat.errors import DeviceError
from h2o_chat.measure.throughput import run_throughput
from h2o_chat.models.memory import check_fits, footprint
from h2o_chat.models.registry import ModelSpec
from h2o_chat.models.shapes import SHAPES, random_model

GB = 2**30


def shape_config(name: str):
    from transformers import AutoConfig

    params = dict(SHAPES[name])
    return AutoConfig.for_model(params.pop("model_type"), **params)


def test_footprint_of_real_shapes():
    llama = footprint(shape_config("llama-2-7b"))
    assert 6.7e9 < llama.linear_params + llama.other_params < 6.8e9  # LLaMA-2-7B: 6.74B parameters
    assert 12.4 * GB < llama.weight_bytes(torch.float16) < 12.7 * GB
    assert 3.6 * GB < llama.weight_bytes(torch.float16, "4bit") < 4.1 * GB  # NF4 + fp16 embeddings/head
    # 32 layers x 32 heads x (4,096 slots + the spare) x (128 x 2 x fp16 + position, rotation, score), + counters
    assert llama.kv_bytes(4096, torch.float16) == 32 * 32 * 4097 * (128 * 2 * 2 + 20) + 16
    gqa = footprint(shape_config("llama-3-8b"))
    assert gqa.kv_heads == 8 and gqa.kv_bytes(4096, torch.float16) == 32 * 8 * 4097 * (128 * 2 * 2 + 20) + 16
    opt = footprint(shape_config("opt-6.7b"))
    assert 6.6e9 < opt.linear_params + opt.other_params < 6.7e9


def test_does_not_fit_says_what_would():
    llama = footprint(shape_config("llama-2-7b"))
    # 17.0 GB: weights 12.6 GB, a cache of 2.1 GB, a decode step's transients (0.2 GB: its eviction keys), x1.15
    with pytest.raises(DeviceError, match=r"needs ~17\.0 GB.*8\.0 GB free.*--quantize 4bit needs ~\d\.\d GB"):
        check_fits("llama-2-7b", llama, torch.float16, "none", 4096, 8 * GB)
    with pytest.raises(DeviceError, match=r"--budget \d+ fits"):  # the weights fit, a smaller cache would
        check_fits("llama-2-7b", llama, torch.float16, "4bit", 200_000, 6 * GB)
    with pytest.raises(DeviceError, match="no setting fits"):
        check_fits("llama-2-7b", llama, torch.float16, "4bit", 512, GB)
    check_fits("llama-2-7b", llama, torch.float16, "4bit", 512, 8 * GB)  # fits: no error
    # recall's store too large: the store that fits is named, and the weights as they are held (said
    # "float16 weights (quantize 4bit)" and "no setting fits ...: try a smaller model")
    huge = dataclasses.replace(llama, store_tokens=10**7)
    with pytest.raises(DeviceError) as raised:
        check_fits("llama-2-7b", huge, torch.float16, "4bit", 512, 8 * GB)
    said = str(raised.value)
    assert "with 4-bit weights (float16 compute) and a 512-token KV cache and a store of 10,000,000" in said
    fitting = int(re.search(r"--recall-memory (\d+) fits$", said).group(1))
    for store, fits in ((fitting, True), (fitting + 1, False)):  # the largest that fits
        with contextlib.nullcontext() if fits else pytest.raises(DeviceError):
            check_fits("llama-2-7b", dataclasses.replace(llama, store_tokens=store), torch.float16, "4bit", 512, 8 * GB)


def test_throughput_at_equal_memory_on_cpu(tmp_path, monkeypatch):
    from h2o_chat.engine.step import compiled
    from h2o_chat.models.loading import load

    folder = random_model("llama-tiny", torch.float32, tmp_path / "tiny")
    loaded = load(ModelSpec(name="llama-tiny", source=str(folder)), device="cpu")
    calls = []
    records = run_throughput(
        loaded,
        memory_limit=64 * 2**20,
        prompt_tokens=256,
        generated_tokens=16,
        budget=32,
        chunk=32,
        progress=lambda d, t: calls.append((d, t)),
    )
    assert calls[-1] == (2 * 272, 2 * 272) and calls == sorted(calls)  # both configurations, prompt + steps
    full, h2o = records
    assert full.config == "full" and h2o.config == "h2o" and h2o.budget == 32
    assert h2o.batch > full.batch > 0  # a small cache per row fits more rows in the same memory
    # exactly the slots each allocated (+1 spare): 2 layers x 2 KV heads x ((K, V) of head dim 32 in fp32 +
    # position, rotation, score), and each row's two counters
    per_slot = 2 * 2 * (2 * 32 * 4 + 20)
    assert h2o.kv_bytes == h2o.batch * ((32 + 1) * per_slot + 16)
    assert full.kv_bytes == full.batch * ((256 + 16 + 1) * per_slot + 16)  # a full cache: the whole sequence, once
    assert full.decode == h2o.decode == "eager"  # both through the same engine
    # a compiled step not built yet (auto, no package, nothing building it here): its steps ran eagerly, and the
    # records say so (they said "compile")
    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    monkeypatch.setattr(compiled, "unavailable", lambda: None)
    monkeypatch.setattr(compiled, "ready", lambda *a: False)
    again = run_throughput(loaded, memory_limit=64 * 2**20, prompt_tokens=64, generated_tokens=8, budget=32, chunk=32)
    assert [r.decode for r in again] == ["eager", "eager"]


def test_bench_command_with_a_random_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    result = CliRunner().invoke(
        cli.app,
        [
            "bench",
            "--shape",
            "llama-tiny",
            "--lengths",
            "40,80",
            "--budget",
            "32",
            "--steps",
            "2",
            "--configs",
            "dynamic,h2o",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    # on CPU configurations are interleaved, with an h2o twin parked at the first length; CUDA runs them in turn
    twin = {"h2o@first"} if not torch.cuda.is_available() else set()
    assert {r["config"] for r in records} == {"dynamic", "h2o"} | twin
    assert {(r["config"], r["measured_at"]) for r in records if r["config"] != "h2o@first"} == {
        (c, n) for c in ("dynamic", "h2o") for n in (40, 80)
    }
    h2o = [r for r in records if r["config"] == "h2o"]
    assert all(r["kv_bytes"] == h2o[0]["kv_bytes"] for r in h2o)  # a fixed budget: the same bytes at 40 and 80
    bad = CliRunner().invoke(cli.app, ["bench", "--shape", "gpt-9"])
    assert bad.exit_code == 2 and "unknown --shape" in bad.stderr


# -- CUDA only ------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_fp16_parity_and_eviction_on_device():
    from transformers import DynamicCache

    model = tiny_model("llama", seed=31).to("cuda", torch.float16)
    ids = torch.randint(0, 256, (2, 40), device="cuda")
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        expected = model(ids, **cached(model, DynamicCache(config=model.config))).logits[:, -1]
    model.set_attn_implementation("h2o")
    cache = H2OCache.for_model(model, make_policy("h2o", 64))
    got = Engine(model, cache).prefill(ids)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    layer = cache.layers[0]
    assert layer.keys.device.type == "cuda" and layer.keys.dtype == torch.float16 and layer.score.dtype == torch.float32


@pytest.mark.cuda
def test_cuda_eager_decode_steps_never_sync_with_the_host():
    model = tiny_model("llama", seed=32).to("cuda", torch.float16)
    cache = H2OCache.for_model(model, make_policy("h2o", 32))
    engine = Engine(model, cache, "eager")
    engine.prefill(torch.randint(0, 256, (2, 48), device="cuda"))
    token = torch.tensor([1, 2], device="cuda")
    engine.decode(token)  # warm-up (allocations, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):  # a full cache: every step evicts, all on the device
            logits, _ = engine.decode()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (2, 256) and cache.stats().kept == 32


@pytest.mark.cuda
def test_cuda_4bit_loading_and_panel_memory(tiny_folder):
    """A 4-bit model: the captured step decides as the eager one (same tokens, same held positions), a budget
    that holds everything gives the full cache's tokens, and the panel's memory figures are the device's."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'h2o-chat[cuda]')")
    from h2o_chat.models.loading import load
    from h2o_chat.models.memory import process_memory

    loaded = load(ModelSpec(name="tiny", source=str(tiny_folder)), device="cuda", quantize="4bit")
    assert loaded.quantize == "4bit" and loaded.dtype in (torch.bfloat16, torch.float16)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0)).cuda()

    def run(policy, decode):
        cache = H2OCache.for_model(loaded.model, policy)
        engine = Engine(loaded.model, cache, decode)
        tokens = [t[0] for t in engine.tokens(engine.prefill(ids, chunk_size=8), 24)]
        return tokens, cache, engine

    captured, cache, engine = run(make_policy("h2o", 16), "graph")
    eager, eager_cache, _ = run(make_policy("h2o", 16), "eager")
    assert engine.captures == 1 and captured == eager
    assert torch.equal(cache.slots.pos.sort(-1).values, eager_cache.slots.pos.sort(-1).values)
    assert cache.stats().kept == 16 and cache.stats().seen == 30 + 23
    roomy, _, _ = run(make_policy("h2o", 64), "graph")
    full, _, _ = run(make_policy("full"), "graph")
    assert roomy == full  # nothing evicted: the full cache's tokens
    allocated = torch.cuda.memory_allocated()
    mem = process_memory()
    assert mem["gpu_allocated"] == allocated > cache.storage_bytes() > 0 and mem["gpu_reserved"] >= allocated


@pytest.mark.cuda
def test_cuda_load_refuses_what_cannot_fit(monkeypatch, tiny_folder):
    from h2o_chat.models import memory
    from h2o_chat.models.loading import load

    monkeypatch.setattr(memory, "free_gpu_bytes", lambda device=None: 1024)
    with pytest.raises(DeviceError, match="free"):
        load(ModelSpec(name="tiny", source=str(tiny_folder)), device="cuda")
