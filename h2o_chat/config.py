"""models.toml -> frozen ModelSpec; alias lookup with a named error for unknown names.

No torch here: the CLI reads model specs before deciding whether to import anything heavy.
"""

from __future__ import annotations

import difflib
import os
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from h2o_chat.errors import ConfigError, H2OChatError, InputError, UnknownModelError

PACKAGE_MODELS = Path(__file__).with_name("models.toml")
FAMILIES = ("llama", "mistral", "qwen2", "opt", "gpt_neox")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZE = ("none", "4bit", "8bit")


def user_config_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "h2o-chat"


def user_data_dir() -> Path:
    """Where the input history lives."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "h2o-chat"


def user_cache_dir() -> Path:
    """Where converted weights live; H2O_CHAT_CACHE overrides."""
    if os.environ.get("H2O_CHAT_CACHE"):
        return Path(os.environ["H2O_CHAT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "h2o-chat"


def unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (made if missing), or None when they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


_fallback: dict[Path, Path] = {}


def writable_cache_dir(note: Callable[[str], None] | None = None) -> Path:
    """The user cache folder, or, when it cannot be written (a read-only home), a private temporary folder for
    this user; `note` is told once which, and why. A tool that cannot cache should still run."""
    wanted = user_cache_dir()
    if wanted in _fallback:
        return _fallback[wanted]
    why = unwritable(wanted)
    if why is None:
        return wanted
    folder = Path(tempfile.gettempdir()) / f"h2o-chat-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        private = folder.is_dir() and not folder.is_symlink() and st.st_mode & 0o077 == 0
        if not private or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise PermissionError  # someone else's folder in a shared /tmp: use a fresh one
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="h2o-chat-"))
    _fallback[wanted] = folder
    if note:
        note(
            f"note: cannot write {wanted} ({why}); converted weights are cached in {folder} instead "
            "(set H2O_CHAT_CACHE to a writable folder to keep them)"
        )
    return folder


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
        if not self.source:
            raise ConfigError(f"model {self.name!r} has no source")
        if self.family not in FAMILIES:
            raise ConfigError(f"model {self.name!r}: unknown family {self.family!r} (one of {', '.join(FAMILIES)})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model {self.name!r}: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantize not in QUANTIZE:
            raise ConfigError(f"model {self.name!r}: quantize must be one of {', '.join(QUANTIZE)}")

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
        """An alias, a local folder or .gguf file, or a Hugging Face repo id (owner/name)."""
        name = (name or self.default).strip()
        if name in self.models:
            return self.models[name]
        path = Path(name).expanduser()
        if path.exists():
            family = _guess_family(path)
            return ModelSpec(name=path.name, source=str(path.resolve()), family=family)
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


def read_user_text(path: Path, what: str = "file", error: type[H2OChatError] = InputError) -> str:
    """A user's UTF-8 file, or one clear error saying what is wrong with it."""
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except UnicodeDecodeError as e:
        raise error(f"cannot read {what} {path}: not UTF-8 text (byte offset {e.start})") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None


def _read_toml(path: Path) -> dict:
    text = read_user_text(path, "models file", ConfigError)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"models file {path} is not valid TOML: {e}") from None


def _specs(data: dict, path: Path) -> dict[str, ModelSpec]:
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
        specs[alias] = ModelSpec(name=alias, **entry)
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
    if default not in models:
        raise ConfigError(f"default model {default!r} is not defined in models.toml")
    return Registry(default=default, models=models)
