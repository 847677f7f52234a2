"""A cache's sequence as plain values and named tensors, and back: what a saved conversation, a prompt cache and
the server's idle conversations on disk hold (the app writes them to files: `app/statefile.py`).

What is carried is what a snapshot carries (`H2OCache.snapshot`), taken from the declarations, never listed here:
the plain values `sequence.SNAPSHOT`, each row's `RowState` fields (its group aside: a group is the cache's policy
and numbering, which `settings` names), every declared tensor of the slots and of recall's store
(`Table.tensors()`: per entry, per row, per head) and the store's host bookkeeping (`Store.HOST_FIELDS`, with what
each row recalls and may hold). A field added to any of them is saved and restored with the others; a state saved
before it was declared is refused (its names differ), never half restored.

`settings` is what a state is valid with: the model's weights (`compiled.model_fingerprint`), its layers, the
policy with every setting, how positions are numbered, how keys and values are stored, the model's dtype. Nothing
in a state depends on the device: `unpack` puts the tensors on the cache's.
"""

from __future__ import annotations

import dataclasses

import torch

from h2o_chat.engine.policies import POLICIES, Policy, Recall
from h2o_chat.engine.positions import RowState
from h2o_chat.engine.sequence import SNAPSHOT
from h2o_chat.engine.step import compiled
from h2o_chat.engine.storage.slots import Slots, fields
from h2o_chat.engine.storage.store import STORE_FIELDS, Store
from h2o_chat.errors import InputError

ROW_VALUES = tuple(f.name for f in dataclasses.fields(RowState) if f.name != "group")  # a row's saved bookkeeping
PARTS = ("slots", "store")  # the tables of a state; a tensor is named "<part>.<field>"


class StateError(InputError):
    """A saved state that cannot be restored here: the message says why, in one line."""


# -- what a state is valid with -----------------------------------------------------------------------------
def policy_values(policy: Policy) -> dict:
    """A policy as plain values: its name and every setting (`policy_of` builds it again)."""
    return {"name": policy.name, **dataclasses.asdict(policy)}


def policy_of(values: dict) -> Policy:
    """The policy `policy_values` gave, checked as any policy is (a setting it does not know: StateError)."""
    values = dict(values)
    cls = POLICIES.get(values.pop("name", None))
    if cls is None:
        raise StateError(f"it names no policy this h2o-chat knows ({', '.join(POLICIES)})")
    try:
        return cls(**values)
    except TypeError as e:
        raise StateError(f"its policy has settings this h2o-chat does not know ({e})") from None


def settings(cache, model) -> dict:
    """What a state of `cache` (a cache of `model`, one policy for its rows) is valid with: restored only where
    every value is the same."""
    if len(cache.groups) != 1:
        raise StateError("only a cache whose rows follow one policy can be saved")
    group = cache.groups[0]
    return {
        "model": compiled.model_fingerprint(model),
        "layers": len(cache.layers),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_quant": cache.kv_quant,
        "positions": group.positions,
        "policy": policy_values(group.policy),
    }


# -- a snapshot as values and tensors, and back -------------------------------------------------------------
def pack(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """A snapshot (`H2OCache.snapshot`: on the host) as plain values and tensors named "slots.keys", ...; a
    snapshot of a cache that has read nothing has no tensors."""
    values = {name: state[name] for name in SNAPSHOT}
    values["rows"] = [{name: getattr(r, name) for name in ROW_VALUES} for r in state["rows"]]
    tensors = {}
    for part in PARTS:
        table = state.get(part)
        if table is not None:
            tensors.update({f"{part}.{name}": t.contiguous() for name, t in table.tensors().items()})
    store = state.get("store")
    if store is not None:
        values["store"] = {
            **dict(zip(Store.HOST_FIELDS, store.host(), strict=True)),
            "recalled": store.recalled,
            "capacities": store.capacities,
        }
    return values, tensors


def capture(cache) -> tuple[dict, dict[str, torch.Tensor]]:
    """What `cache` holds now (a copy on the host), as `pack` gives it, with the notices it has given."""
    values, tensors = pack(cache.snapshot())
    values["warned"] = sorted(cache.seq.warned)
    return values, tensors


def unpack(values: dict, tensors: dict[str, torch.Tensor], cache, dtype: torch.dtype, device) -> dict:
    """A snapshot for `cache.restore` (or a row view's) from what `pack` gave, on `device`; `dtype` is the
    model's. Everything is checked against the declarations and `cache`'s policy first: StateError when a name,
    a shape or a dtype is not what this cache would hold."""
    missing = [name for name in (*SNAPSHOT, "rows") if name not in values]
    if missing:
        raise StateError(f"it has no {missing[0]!r} (saved by another version of h2o-chat)")
    for row in values["rows"]:
        if not isinstance(row, dict) or sorted(row) != sorted(ROW_VALUES):
            got = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise StateError(f"its rows hold {got}, this h2o-chat's hold {', '.join(sorted(ROW_VALUES))}")
    group = cache.groups[0]
    by_part = {part: {} for part in PARTS}
    for name, t in tensors.items():
        part, _, field = name.partition(".")
        if part not in by_part:
            raise StateError(f"it holds a tensor {name!r} that no table of the cache declares")
        by_part[part][field] = t
    rows = len(values["rows"])
    state = {name: values[name] for name in SNAPSHOT}
    state["rows"] = [RowState(group, **row) for row in values["rows"]]
    state["slots"] = _slots(by_part["slots"], cache, group.policy, dtype, rows, device) if by_part["slots"] else None
    state["store"] = None
    if by_part["store"]:
        state["store"] = _store(by_part["store"], values.get("store"), cache, group.policy, dtype, rows, device)
    elif state["slots"] is not None and isinstance(group.policy, Recall):
        raise StateError("it holds no store of evicted tokens, which recall keeps")
    if state["slots"] is None and rows:
        raise StateError("it has rows but no slots")
    return state


def restore(cache, values: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device) -> None:
    """Put a packed state into `cache` (checked whole first: nothing changes when it is refused); storage of
    the same shape is overwritten in place, so a captured or compiled step stays valid."""
    cache.restore(unpack(values, tensors, cache, dtype, device))
    cache.seq.warned = set(values.get("warned", ()))


def _names(part: str, got: dict, declared: list[str]) -> None:
    if sorted(got) != sorted(declared):
        raise StateError(
            f"its {part} hold {', '.join(sorted(got))}; this h2o-chat declares {', '.join(sorted(declared))}"
        )


def _check(part: str, name: str, t: torch.Tensor, lead: tuple, dtype: torch.dtype) -> None:
    if tuple(t.shape[: len(lead)]) != lead or t.dtype != dtype:
        shape = ", ".join(map(str, lead))
        raise StateError(f"its {part}' {name} is {tuple(t.shape)} {t.dtype}; this cache's is ({shape}, ...) {dtype}")


def _slots(got: dict, cache, policy: Policy, dtype: torch.dtype, rows: int, device) -> Slots:
    declared = fields(cache.kv_quant == "8bit")
    _names("slots", got, [f.name for f in declared] + list(Slots.ROW_FIELDS))
    stored = torch.int8 if cache.kv_quant == "8bit" else dtype
    lead = tuple(got[declared[0].name].shape[:4])  # (L, B, H, S)
    if lead[:2] != (len(cache.layers), rows) or (policy.capacity is not None and lead[3] != policy.capacity + 1):
        capacity = "a growing number of" if policy.capacity is None else f"{policy.capacity} +1"
        raise StateError(
            f"its slots are {lead[0]} layers x {lead[1]} rows x {lead[3]} slots, where this cache holds "
            f"{len(cache.layers)} x {rows} x {capacity}"
        )
    for f in declared:
        _check("slots", f.name, got[f.name], lead, f.dtype or stored)
    for name in Slots.ROW_FIELDS:
        _check("slots", name, got[name], (rows,), torch.long)
    return Slots({name: t.to(device) for name, t in got.items()}, dtype)


def _store(got: dict, host: dict | None, cache, policy: Policy, dtype: torch.dtype, rows: int, device) -> Store:
    _names("store", got, [f.name for f in STORE_FIELDS] + list(Store.ROW_FIELDS) + list(Store.HEAD_FIELDS))
    wanted = [*Store.HOST_FIELDS, "recalled", "capacities"]
    if not isinstance(host, dict) or sorted(host) != sorted(wanted):
        raise StateError(f"its store's bookkeeping is not {', '.join(wanted)}")
    if any(not isinstance(v, list) or len(v) != rows for v in host.values()):
        raise StateError("its store's bookkeeping does not have one value per row")
    lead = tuple(got[STORE_FIELDS[0].name].shape[:4])
    if lead[:2] != (len(cache.layers), rows):
        raise StateError(f"its store is {lead[0]} layers x {lead[1]} rows, where this cache holds {len(cache.layers)}")
    for f in STORE_FIELDS:
        _check("store", f.name, got[f.name], lead, f.dtype)
    for name in Store.HEAD_FIELDS:
        _check("store", name, got[name], lead[:3], got[name].dtype)
    store = Store(
        {name: t.to(device) for name, t in got.items()},
        dtype,
        host["recalled"],
        tuple(host[name] for name in Store.HOST_FIELDS),
        host["capacities"],
    )
    if isinstance(policy, Recall):
        store.drop = policy.drop
    return store
