"""models.toml -> frozen ModelSpec; alias lookup with a named error for unknown names.

No torch here: the CLI reads model specs before deciding whether to import anything heavy.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from h2o_chat.errors import ConfigError, ModelNotFoundError, UnknownModelError
from h2o_chat.files import read_user_text, user_config_dir

PACKAGE_MODELS = Path(__file__).with_name("models.toml")
FAMILIES = ("llama", "mistral", "qwen2", "opt", "gpt_neox")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZE = ("none", "4bit", "8bit")


@dataclass(frozen=True)
class ModelSpec:
    """One model: where its weights come from and how to load it by default."""

    name: str
    source: str
    family: str = "llama"
    dtype: str = "auto"
    quantize: str = "none"
    context: int | None = None
    note: str = ""

    def __post_init__(self) -> None:
        """Every field checked, each message naming the alias and the field (as models.toml spells them)."""
        where = f"models.{self.name}"
        for name in ("source", "family", "dtype", "quantize", "note"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"{where}.{name} must be a string, got {value!r}")
        if not self.source.strip():
            raise ConfigError(f"{where}.source is empty: give a Hugging Face repo id, a folder or a .gguf file")
        for name, allowed in (("family", FAMILIES), ("dtype", DTYPES), ("quantize", QUANTIZE)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{where}.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        context = self.context
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context <= 0):
            raise ConfigError(f"{where}.context must be a positive number of tokens, got {context!r}")

    @property
    def kind(self) -> str:
        """embedded | gguf | local | hub"""
        if self.source.startswith("embedded:"):
            return "embedded"
        if self.source.endswith(".gguf"):
            return "gguf"
        if self.source.startswith(("/", ".", "~")) or Path(self.source).expanduser().exists():
            return "local"
        return "hub"


@dataclass(frozen=True)
class Registry:
    default: str
    models: dict[str, ModelSpec] = field(default_factory=dict)

    def resolve(self, name: str | None) -> ModelSpec:
        """An alias, a local folder or .gguf file, or a Hugging Face repo id (owner/name); None: the default."""
        if name is None:
            name = self.default
        name = name.strip()
        if not name:
            raise UnknownModelError(
                "--model is empty: give an alias (h2o-chat models lists them), a folder or a .gguf file"
            )
        if name in self.models:
            return self.models[name]
        path = Path(name).expanduser()
        if path.exists():
            family = _guess_family(path)
            return ModelSpec(name=path.name, source=str(path.resolve()), family=family)
        if name.lower().endswith(".gguf"):
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        if name.startswith(("/", ".", "~")):
            raise ModelNotFoundError(f"model folder not found: {path}")
        if _looks_like_repo_id(name):
            return ModelSpec(name=name, source=name, family=_guess_family_from_name(name))
        close = difflib.get_close_matches(name, self.models, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownModelError(
            f"unknown model {name!r}: not an alias in models.toml, a local path or a repo id{hint} "
            "(h2o-chat models lists the aliases)"
        )


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and " " not in name


def _guess_family_from_name(name: str) -> str:
    low = name.lower()
    for key, family in (
        ("opt", "opt"),
        ("pythia", "gpt_neox"),
        ("neox", "gpt_neox"),
        ("mistral", "mistral"),
        ("qwen", "qwen2"),
    ):
        if key in low:
            return family
    return "llama"


def _guess_family(path: Path) -> str:
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.exists():
        import json

        try:
            model_type = json.loads(config.read_text()).get("model_type", "")
        except (OSError, ValueError):
            model_type = ""
        if model_type in FAMILIES:
            return model_type
    return _guess_family_from_name(path.name)


def _read_toml(path: Path) -> dict:
    text = read_user_text(path, "models file", ConfigError)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"models file {path} is not valid TOML: {e}") from None


def _specs(data: dict, path: Path) -> dict[str, ModelSpec]:
    unknown = set(data) - {"models", "default"}
    if unknown:  # `[foo]` for `[models.foo]`: an alias that would vanish without a word
        first = sorted(unknown)[0]
        raise ConfigError(
            f"{path}: unknown top-level key {first!r} (a file holds `default` and [models.ALIAS] tables: "
            f"[models.{first}]?)"
        )
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise ConfigError(f"{path}: [models] must be a table of aliases")
    specs = {}
    for alias, entry in models.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: models.{alias} must be a table")
        unknown = set(entry) - {"source", "family", "dtype", "quantize", "context", "note"}
        if unknown:
            raise ConfigError(f"{path}: models.{alias} has unknown keys: {', '.join(sorted(unknown))}")
        if "source" not in entry:
            raise ConfigError(f"{path}: models.{alias} has no source")
        try:
            specs[alias] = ModelSpec(name=alias, **entry)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    return specs


def load_registry(user_file: str | Path | None = None) -> Registry:
    """The packaged models.toml, overlaid by the user's file (explicit path, else the config folder's)."""
    data = _read_toml(PACKAGE_MODELS)
    models = _specs(data, PACKAGE_MODELS)
    default = data.get("default", "smollm2-135m")
    if user_file is not None:
        path = Path(user_file).expanduser()
    else:
        path = user_config_dir() / "models.toml"
        if not path.exists():
            path = None
    if path is not None:
        extra = _read_toml(path)
        models.update(_specs(extra, path))
        default = extra.get("default", default)
        if not isinstance(default, str):
            raise ConfigError(f"{path}: default must be the name of an alias, got {default!r}")
    if default not in models:
        raise ConfigError(f"default model {default!r} is not defined in models.toml")
    return Registry(default=default, models=models)
