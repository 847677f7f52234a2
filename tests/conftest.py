"""Shared fixtures: one session-scoped embedded model, tiny random models built from configs (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

# keep test runs self-contained: converted weights go to a per-run folder unless the user points elsewhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# decode steps run eagerly unless a test asks for the compiled step (compiling costs seconds per model and batch)
os.environ.setdefault("H2O_CHAT_DECODE", "eager")

FAMILIES = ("llama", "mistral", "qwen2", "opt", "gpt_neox")


def pytest_collection_modifyitems(config, items) -> None:
    """`@pytest.mark.cuda` tests are skipped without a GPU, so that `pytest -m cuda` (scripts/gpu_check.sh) selects
    them by their mark where one is."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def cached(model, cache) -> dict:
    """The keyword arguments that hand `cache` to `model`'s forward or generate: `cache` in transformers >= 5.2x,
    `past_key_values` before (the old name is deprecated there and goes in 5.40), as the engine passes it."""
    from h2o_chat.engine.step.attention import cache_keyword

    return {cache_keyword(model): cache}


def tiny_config(family: str, layers: int = 2, max_positions: int = 8192):
    """A few small layers of a real architecture; random weights with peaked attention."""
    from transformers import GPTNeoXConfig, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
    )
    if family == "llama":
        return LlamaConfig(**common, intermediate_size=128, num_key_value_heads=2)  # GQA: 2 query heads per KV
    if family == "mistral":
        return MistralConfig(**common, intermediate_size=128, num_key_value_heads=2, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common, intermediate_size=128, num_key_value_heads=1, use_sliding_window=False)
    if family == "opt":
        common.pop("initializer_range")
        return OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64, init_std=0.2)
    if family == "gpt_neox":
        return GPTNeoXConfig(**common, intermediate_size=128, rotary_pct=0.5)
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, **kwargs):
    from transformers import AutoModelForCausalLM

    from h2o_chat.engine.step.attention import prepare_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), attn_implementation="sdpa").eval()
    return prepare_model(model)


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M, loaded once for the whole session."""
    from h2o_chat.models.loading import load
    from h2o_chat.models.registry import load_registry

    return load(load_registry().resolve(None), device="cpu")


@pytest.fixture
def prompt_ids(embedded):
    def make(text: str) -> list[int]:
        ids = embedded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return ids if isinstance(ids, list) else list(ids["input_ids"])

    return make


def tiny_tokenizer():
    """A word-level tokenizer over 256 ids with a chat template: enough to save and load a tiny model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, 256)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


@pytest.fixture
def tiny_folder(tmp_path):
    """A tiny LLaMA saved as safetensors with its tokenizer, like a downloaded model folder."""
    model = tiny_model("llama")
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def fast_load(monkeypatch, embedded):
    """Reuse the session's embedded model instead of loading it in every invocation."""
    calls = []

    def load_model(
        model, models_file, device, dtype, quantize, download, kv_tokens=None, kv_rows=1, kv_quant="none",
        store_tokens=0,
    ):  # fmt: skip
        from h2o_chat.models.loading import load, resolve_settings
        from h2o_chat.models.registry import load_registry

        calls.append(model)
        spec = load_registry(models_file).resolve(model)
        if model is not None:  # anything else goes through the real loading and its errors
            kv = {"kv_tokens": kv_tokens, "kv_rows": kv_rows, "kv_quant": kv_quant, "store_tokens": store_tokens}
            return load(spec, device, dtype, quantize, download=download, **kv)
        resolve_settings(spec, device, dtype, quantize)
        return embedded

    from h2o_chat.app import options

    monkeypatch.setattr(options, "load_model", load_model)  # every command loads through ModelOptions.load
    return calls


@pytest.fixture
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP barriers make each step
    ~50x slower; long tiny-model loops run on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the 4-bit products of AVX2's library, as it says it takes them ---------------------------------------------
def rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) bfloat16 as AVX2's steps' kernel rounds it, per group of 32 input channels, as float64: the largest
    magnitude (the first, if tied) kept as it is, the others d * round(x * (127 / m)) in float32 with ties to even,
    d = m / 127, m the next largest magnitude."""
    from h2o_chat.models.cpu_quant import GROUP

    xs = x.float().view(x.shape[0], -1, GROUP)
    first = xs.abs().argmax(-1, keepdim=True)  # torch's argmax: the first of ties
    largest = torch.zeros_like(xs, dtype=torch.bool).scatter_(-1, first, True)
    m = torch.where(largest, 0.0, xs.abs()).amax(-1, keepdim=True)
    inverse = torch.where(m > 0, torch.tensor(127.0) / m, torch.zeros_like(m))
    q = torch.round(xs * inverse).clamp(-127, 127)
    rounded = torch.where(largest, xs.double(), q.double() * (m / 127.0).double())
    return rounded.view_as(x)


def product_on_8_bits(x: torch.Tensor, lin) -> torch.Tensor:
    """x (M, K) bfloat16 times an `Int4Linear`'s weights as AVX2's library multiplies them, in float64: x rounded
    to 8 bits per group (`rounded_to_8_bits`), against the dequantized weights, and the zeros' term on the exact x
    (y += scale (d sum(xq q) + x_largest q_largest) + (zero - 8 scale) sum(x))."""
    from h2o_chat.models.cpu_quant import GROUP

    weights = lin.dequantize().double()
    rounded = rounded_to_8_bits(x)
    s, z = lin.scales_zeros[..., 0].double(), lin.scales_zeros[..., 1].double()  # (K / 32, N)
    lost = (x.double() - rounded).view(x.shape[0], -1, GROUP).sum(-1)  # what the rounding took from each group
    return rounded @ weights.t() + lost @ (z - 8 * s)
