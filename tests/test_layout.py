"""The package's layering: engine < models < measure < app, each importing only the layers below it, no circle.

Read from the source (every import statement, inside functions too), so a lazy import cannot hide a
dependency that runs back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "h2o_chat"
LAYERS = ["engine", "models", "measure", "app"]  # bottom to top
SHARED = {"errors", "files"}  # beneath every layer
UI_LIBRARIES = ("typer", "rich", "prompt_toolkit")


def modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (annotations only: no dependency at run time)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(path: Path, name: str, annotations: bool = False) -> set[str]:
    """Every module this file imports at run time, fully qualified (relative imports resolved); with
    `annotations`, those under `if TYPE_CHECKING:` too."""
    out = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if annotations else _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: -node.level] if path.name != "__init__.py" else name.split(".")
                base = ".".join([*parent, base]) if base else ".".join(parent)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from h2o_chat.engine import cache`
    return out


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "h2o_chat" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS or parts[1] in SHARED else None


def runs_up(mine: str, theirs: str) -> bool:
    """Whether a module of layer `mine` importing one of layer `theirs` goes against the layering."""
    if mine in SHARED:
        return theirs not in SHARED
    return theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine)


def test_each_layer_imports_only_the_layers_below_it():
    mods = modules()
    wrong = []
    for name, path in mods.items():
        mine = layer_of(name)
        for target in imports(path, name):
            theirs = layer_of(target)
            if target in mods and mine is not None and theirs is not None and runs_up(mine, theirs):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_the_library_imports_no_command_line_or_rendering_library():
    found = [
        f"{name} -> {target}"
        for name, path in modules().items()
        if layer_of(name) in ("engine", "models", "measure") or name in ("h2o_chat.errors", "h2o_chat.files")
        for target in imports(path, name)
        if target.split(".")[0] in UI_LIBRARIES
    ]
    assert found == []


def test_the_ui_renders_what_it_is_given():
    """Rendering imports no measurement: tables and panels are handed records and figures."""
    mods = modules()
    ui = imports(mods["h2o_chat.app.ui"], "h2o_chat.app.ui")
    assert not [t for t in ui if layer_of(t) in ("measure", "models")]


def test_no_import_circle_even_for_annotations():
    mods = modules()
    graph = {
        # an import for annotations only still makes two modules name each other: counted
        name: {
            t for t in imports(path, name, annotations=True) if t in mods and t != name and not name.startswith(t + ".")
        }
        for name, path in mods.items()
    }
    # a package's own __init__ imported by its submodules is not a circle of code
    graph = {n: {t for t in ts if not n.startswith(t)} for n, ts in graph.items()}
    seen, stack, circles = set(), [], []

    def visit(node: str) -> None:
        if node in stack:
            circles.append(" -> ".join(stack[stack.index(node) :] + [node]))
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()

    for node in sorted(graph):
        visit(node)
    assert circles == []
