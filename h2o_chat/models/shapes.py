"""Random-weight models of real shapes (LLaMA-2-7B, OPT-6.7B, ...): speed needs no trained weights.

No weights can be downloaded on our GPU machines, so `random_model` builds a model of a real shape with random
weights once, saves it as safetensors in the user cache, and commands load it through the normal loading path
(so --quantize 4bit|8bit exercises bitsandbytes as users do).
"""

from __future__ import annotations

from pathlib import Path

import torch

from h2o_chat.files import user_cache_dir, writable_cache_dir

SHAPES: dict[str, dict] = {
    "llama-2-7b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama-2-13b": dict(
        model_type="llama",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "opt-6.7b": dict(
        model_type="opt",
        hidden_size=4096,
        ffn_dim=16384,
        num_hidden_layers=32,
        num_attention_heads=32,
        vocab_size=50272,
        max_position_embeddings=2048,
        word_embed_proj_dim=4096,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        sliding_window=None,
    ),
    # small enough for a CPU smoke test of the whole path
    "llama-tiny": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=8192,
    ),
}


def random_model(shape: str, dtype: torch.dtype = torch.float16, folder: Path | None = None, status=None) -> Path:
    """A model of a real shape with random weights, saved once (safetensors + a placeholder tokenizer)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    if shape not in SHAPES:
        from h2o_chat.errors import ConfigError

        raise ConfigError(f"unknown model shape {shape!r}; choose from {', '.join(SHAPES)}")
    dtype_name = str(dtype).removeprefix("torch.")
    name = f"{shape}-{dtype_name}"
    if folder is None:  # the user cache, or a temporary folder when it cannot be written
        folder = user_cache_dir() / "random" / name
        if not (folder / "config.json").exists():
            folder = writable_cache_dir(status) / "random" / name
    if (folder / "config.json").exists():
        return folder
    params = dict(SHAPES[shape])
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}  # ids only: the bench feeds random tokens
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")), eos_token="t1", pad_token="t0"
    )
    tok.save_pretrained(folder)
    return folder
