"""h2o-chat's state files: a sequence (`engine/storage/persist`) with what it belongs to -- a saved conversation,
a prompt cache, an idle server conversation -- as one safetensors file.

The tensors are the state's (`persist.pack`: "slots.keys", ..., "store.basis"), as stored, whatever the device
they came from. The safetensors metadata holds three strings: "format" (`FORMAT`), "header" (JSON: the format
`version`, the `kind`, `settings` -- what the state is valid with: the model's name, weights format and
fingerprint, the tokenizer's fingerprint, the policy with every setting, positions, KV storage, dtype --, `state`,
the sequence's plain values, or null when the cache had read nothing, and the kind's own part) and "sha256", a
digest of the header and of every tensor's name, dtype, shape and bytes, which safetensors does not check.

So: nothing is unpickled (safetensors and JSON only); a truncated or damaged file is refused in one line before
anything changes; a file of another model, policy or format version is refused naming the difference; a file
is written under a temporary name in its folder and renamed, so a crash never leaves half a file under its
name. A state's size is its storage's -- the budget's slots, recall's store -- whatever the sequence's length
(the header adds a conversation's messages).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h2o_chat.engine.storage import persist
from h2o_chat.engine.storage.persist import StateError

FORMAT = "h2o-chat-state"
VERSION = 1
KINDS = {"conversation": "a saved conversation", "prompt": "a prompt cache", "session": "a server conversation"}
MAX_HEADER = 256 * 2**20  # bytes of a safetensors header we read: a conversation's messages fit many times


@dataclass
class StateFile:
    """A file's header and tensors, read whole and checked (`read`)."""

    path: Path
    header: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def settings(self) -> dict:
        return self.header["settings"]

    @property
    def state(self) -> dict | None:
        """The sequence's plain values (None: the cache had read nothing)."""
        return self.header.get("state")

    def check(self, current: dict, here: str) -> None:
        """Refuse (StateError, one line) a state saved with other settings than `current` (`identity`); `here`
        names what would take it ("this chat")."""
        refuse_other(self.path, self.settings, current, here)

    def unpack(self, cache, loaded) -> dict:
        """The state as a snapshot for `cache` (a cache of `loaded`'s model), on its device, checked whole
        (`persist.unpack`): after this, nothing refuses it."""
        device = next(loaded.model.parameters()).device
        return persist.unpack(self.state, self.tensors, cache, getattr(torch, self.settings["dtype"]), device)

    def apply(self, cache, state: dict) -> None:
        """`unpack`'s snapshot into `cache`, in place where its storage has the same shapes."""
        cache.restore(state)
        cache.seq.warned = set(self.state.get("warned", ()))


# -- identity ------------------------------------------------------------------------------------------------
_tokenizer_prints: dict[int, tuple[object, str]] = {}


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what maps text to ids: the fast tokenizer's whole definition (vocabulary, merges, normalizer,
    added tokens), else its vocabulary. Once per tokenizer object."""
    held = _tokenizer_prints.get(id(tokenizer))
    if held is not None and held[0] is tokenizer:
        return held[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    _tokenizer_prints[id(tokenizer)] = (tokenizer, digest)
    return digest


def identity(loaded, cache) -> dict:
    """What a state of `cache` (a cache of `loaded`) is valid with: the engine's `settings`, and the model's name
    and weights format and the tokenizer, which say a difference in the user's words."""
    return {
        "model_name": loaded.spec.name,
        "model_source": loaded.spec.source,
        "weights": loaded.weights,
        "tokenizer": tokenizer_fingerprint(loaded.tokenizer),
        **persist.settings(cache, loaded.model),
    }


def difference(saved: dict, current: dict) -> tuple[str, str] | None:
    """The first setting in which `saved` differs from `current`, as (what was saved, what is here), or None."""

    def policy(values: dict) -> str:
        budget = values.get("budget")
        return f"{values.get('name')}" + (f" {budget}" if budget is not None else "")

    if saved.get("model") != current["model"]:
        name = saved.get("model_name", "?")
        if name == current["model_name"]:
            return (
                f"other weights of {name} ({saved.get('weights')}, fingerprint {saved.get('model')})",
                f"{current['weights']} (fingerprint {current['model']})",
            )
        return f"model {name} ({saved.get('weights')})", f"{current['model_name']} ({current['weights']})"
    if saved.get("tokenizer") != current["tokenizer"]:
        return f"another tokenizer (fingerprint {saved.get('tokenizer')})", f"fingerprint {current['tokenizer']}"
    if saved.get("dtype") != current["dtype"]:
        return f"keys and values in {saved.get('dtype')} (--dtype)", f"{current['dtype']}"
    if saved.get("kv_quant") != current["kv_quant"]:
        words = {"8bit": "8-bit keys and values (--kv-quant 8bit)", "none": "keys and values in the model's dtype"}
        return words.get(saved.get("kv_quant"), str(saved.get("kv_quant"))), words.get(current["kv_quant"], "")
    if saved.get("positions") != current["positions"]:
        return f"--positions {saved.get('positions')}", f"--positions {current['positions']}"
    if saved.get("policy") != current["policy"]:
        mine, theirs = saved.get("policy") or {}, current["policy"]
        a, b = policy(mine), policy(theirs)
        if a == b:  # the same name and budget: name the settings that differ
            keys = [k for k in sorted({*mine, *theirs}) if mine.get(k) != theirs.get(k)]
            a += " with " + ", ".join(f"{k} {mine.get(k)}" for k in keys)
            b += " with " + ", ".join(f"{k} {theirs.get(k)}" for k in keys)
        return f"policy {a}", b
    for key in sorted({*saved, *current} - {"model_name", "model_source", "weights"}):
        if saved.get(key) != current.get(key):
            return f"{key} {saved.get(key)}", f"{current.get(key)}"
    return None


def refuse_other(path, saved: dict, current: dict, here: str) -> None:
    diff = difference(saved, current)
    if diff is not None:
        raise StateError(f"{path} was saved with {diff[0]}; {here} runs {diff[1]}: refused, nothing was changed")


# -- writing -------------------------------------------------------------------------------------------------
def digest(header: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the header and of every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256(header.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


def write(path, kind: str, settings: dict, state: dict | None, tensors: dict[str, torch.Tensor], **parts) -> int:
    """Write a state file (under a temporary name in the same folder, then renamed over `path`): `settings` as
    `identity` gives them, the state's values and tensors (`persist.capture`; None and {} for a cache that has read
    nothing), and the kind's own parts. Returns its size in bytes."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = Path(path).expanduser()
    if path.is_dir():
        raise StateError(f"cannot write {path}: it is a folder")
    if not path.parent.is_dir():
        raise StateError(f"cannot write {path}: the folder {path.parent} does not exist")
    header = json.dumps(
        {"version": VERSION, "kind": kind, "settings": settings, "state": state, **parts}, ensure_ascii=False
    )
    metadata = {"format": FORMAT, "header": header, "sha256": digest(header, tensors)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp), metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # on disk before it takes the name: a crash leaves the old file or the new one
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise StateError(f"cannot write {path}: {e.strerror or e}") from None
    except SafetensorError as e:  # its own writes fail with its own error (a full disk, a folder gone)
        tmp.unlink(missing_ok=True)
        raise StateError(f"cannot write {path}: {str(e).splitlines()[0]}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# -- reading -------------------------------------------------------------------------------------------------
def _open(path) -> tuple[Path, object]:
    path = Path(path).expanduser()
    try:
        f = open(path, "rb")  # noqa: SIM115 -- closed by the caller
    except OSError as e:
        raise StateError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise StateError(f"cannot read {path}: not a regular file")
    return path, f


def _metadata(path: Path, head: bytes, size: int) -> tuple[dict, int, int]:
    """The safetensors header of a file of `size` bytes beginning with `head` (its header, or all of it): its
    metadata, the header's length and the file's expected size. StateError when it is no state file."""
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    if len(head) < 9 or head[8:9] != b"{" or n > MAX_HEADER:
        raise StateError(f"{path} is not an h2o-chat state file")
    if 8 + n > size:
        raise StateError(f"{path} is truncated ({size:,} bytes, its header alone takes {8 + n:,}); nothing was changed")
    try:
        table = json.loads(head[8 : 8 + n])
        meta = table.pop("__metadata__", None) or {}
        end = max((int(t["data_offsets"][1]) for t in table.values()), default=0)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise StateError(f"{path} is damaged (its header is not valid); nothing was changed") from None
    if meta.get("format") != FORMAT:
        raise StateError(f"{path} is a safetensors file, not an h2o-chat state file")
    return meta, n, 8 + n + end


def _header(path: Path, meta: dict) -> dict:
    try:
        header = json.loads(meta["header"])
        version, kind = header["version"], header["kind"]
    except (ValueError, TypeError, KeyError):
        raise StateError(f"{path} is damaged (its header is not valid); nothing was changed") from None
    if version != VERSION:
        from h2o_chat import __version__

        raise StateError(
            f"{path} is an h2o-chat state file of format version {version}; this h2o-chat ({__version__}) reads "
            f"version {VERSION}: refused"
        )
    if kind not in KINDS or not isinstance(header.get("settings"), dict):
        raise StateError(f"{path} is damaged (its header is not valid); nothing was changed")
    return header


def is_state_file(path) -> bool:
    """Whether `path` begins as a state file does (a safetensors header): what /load and --resume tell from a
    saved conversation's JSON."""
    try:
        with open(Path(path).expanduser(), "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= MAX_HEADER


def read_header(path, kind: str | None = None) -> dict:
    """A state file's header only (its tensors and digest unread: `read` checks the whole), e.g. to know the
    model and cache a --resume needs before anything loads."""
    path, f = _open(path)
    with f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        n = int.from_bytes(first, "little") if len(first) == 8 else 0
        head = first + f.read(n if n <= MAX_HEADER else 1)
    header = _header(path, _metadata(path, head, size)[0])
    _kind(path, header, kind)
    return header


def read(path, kind: str | None = None) -> StateFile:
    """A state file read whole and checked: its format and version, its size, its digest (a truncated or damaged
    file is one line, and nothing has changed); `kind`: the kind it must be."""
    from safetensors.torch import load

    path, f = _open(path)
    with f:
        data = f.read()
    meta, _, expected = _metadata(path, data, len(data))
    if len(data) < expected:
        raise StateError(f"{path} is truncated ({len(data):,} of {expected:,} bytes); nothing was changed")
    if len(data) > expected:
        raise StateError(f"{path} is damaged ({len(data) - expected:,} bytes after its end); nothing was changed")
    header = _header(path, meta)
    try:
        tensors = load(data)
    except Exception as e:  # noqa: BLE001 -- safetensors' own error type for any malformed file
        raise StateError(f"{path} is damaged ({str(e).splitlines()[0]}); nothing was changed") from None
    if digest(meta["header"], tensors) != meta.get("sha256"):
        raise StateError(f"{path} is damaged (its contents do not match their checksum); nothing was changed")
    _kind(path, header, kind)
    return StateFile(path, header, tensors)


def _kind(path: Path, header: dict, kind: str | None) -> None:
    if kind is not None and header["kind"] != kind:
        raise StateError(f"{path} is {KINDS[header['kind']]}, not {KINDS[kind]}")
