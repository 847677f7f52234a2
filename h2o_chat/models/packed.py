"""A CPU model's packed weights, saved once beside the converted weights and mapped at every later start.

Packing from the float32 file costs what the weights promised to save: the file's 513 MB mapped and touched to
make 107 MB, a peak of 1.2 GB resident. So the first start packs as before and writes the packed model
(`quantize_model`'s modules as held: the int4 kernel's layout) to `packed-4bit.pt` in the converted folder;
later starts build the model's modules with their shapes only (no weights), assign the file's tensors to them and
never open the float file. The packed weights stay views into the file's mapping (a page is resident once a
product has read it, the int8 table's only as its rows are gathered); the float32 ones (norms) are copied out of
it. The file says what made it (this format, torch's version, the CPU's vector width: the kernel's layout depends
on them); another's is rebuilt.

`torch.save` places every tensor at a 64-byte boundary of the file, and `torch.load(mmap=True)` maps it: the int8
kernel reads its weights with aligned loads (from a safetensors file, whose tensors follow each other unpadded,
it crashed with 4 rows or more).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

FORMAT = "2"  # what `quantize_model` holds: a change makes older files be rebuilt


def packed_path(folder: Path, fmt: str) -> Path:
    return Path(folder) / f"packed-{fmt}.pt"


def stamp(fmt: str) -> dict[str, str]:
    """What a packed file must have been made by to be used here."""
    return {
        "h2o_chat_packed": FORMAT,
        "quantize": fmt,
        "torch": str(torch.__version__),
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def save_packed(model: nn.Module, path: Path, fmt: str) -> None:
    """The packed model's parameters and buffers (a tied table once: `torch.save` keeps shared storage shared),
    with `stamp`, written whole or not at all."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt")
    os.close(fd)
    try:
        torch.save({"stamp": stamp(fmt), "state": model.state_dict()}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_packed(folder: Path, fmt: str, dtype: torch.dtype) -> nn.Module | None:
    """The model of a converted folder with its packed weights assigned from `packed_path` (mapped; small float
    weights copied), or None when there is no such file made here (`stamp`) or it does not fit the model."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from h2o_chat.models.cpu_quant import quantize_model

    path = packed_path(folder, fmt)
    if not path.exists():
        return None
    try:
        saved = torch.load(path, mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 -- a torn or foreign file has many ways to fail: pack it again
        return None
    if not isinstance(saved, dict) or saved.get("stamp") != stamp(fmt):
        return None
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary tables) computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    with contextlib.suppress(OSError):  # from_pretrained reads it too (stop tokens)
        model.generation_config = GenerationConfig.from_pretrained(folder)
    quantize_model(model, fmt, empty=True)
    # the float32 weights (norms, biases) are copied out of the mapping: it keeps only what the products read
    state = {k: v.clone() if v.dtype == torch.float32 else v for k, v in saved["state"].items()}
    with contextlib.suppress(RuntimeError):  # shapes that do not fit
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
        if not missing and not unexpected and not left:  # every tensor from the file, and the file's every one used
            return model
    return None
