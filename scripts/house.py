#!/usr/bin/env python3
"""The package's shape measured from its source: sizes, import circles and the layers.

``python scripts/house.py`` prints the largest classes and modules of ``flowerdro/``, every
import circle between its modules and between its top-level rooms (a folder or a module
directly under ``flowerdro/``), and every import that runs from a lower layer of
:data:`LAYERS` up to a higher one. It reads the code with the standard library's
:mod:`ast` only (nothing is imported or run), so it measures any checkout.

What counts as an import: every ``import`` / ``from ... import`` statement of a module,
inside functions included, except those under ``if TYPE_CHECKING:`` (annotations only)
and those of a package's ``__init__.py`` (its re-exports). A name taken from a package
(``from flowerdro.strategies import build_strategy``) counts as an import of the module
that defines it, found through the package's re-exports. With ``--check`` the exit code
is 1 when anything is reported as wrong (a circle, an upward import, a room in no layer,
a class or module over the limits), else 0.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flowerdro"

#: The layers of the package, lowest first: a module may import its own layer and those below.
#: Each entry names top-level rooms (a folder or a module directly under ``flowerdro/``).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core", "settings", "buffers"),
    ("protocol", "client_errors", "data", "models"),
    ("runs", "validation", "wrappers", "privacy", "legacy_wire"),
    ("clients", "deploy"),
    ("strategies",),
    ("legacy", "trackers"),
    ("comparison",),
    ("apps",),
    ("experiments",),
    ("advise",),
)

#: Limits every module and class of the package keeps.
MAX_CLASS_LINES, MAX_MODULE_LINES = 300, 600


@dataclass
class Module:
    """One module of the package: its name, file, lines, classes and imports."""

    name: str
    path: Path
    lines: int
    classes: dict[str, int] = field(default_factory=dict)
    imports: set[str] = field(default_factory=set)
    #: name → module it comes from, for a package's ``__init__`` re-exports.
    exports: dict[str, str] = field(default_factory=dict)

    @property
    def is_package(self) -> bool:
        """Whether this is a package's ``__init__``."""
        return self.path.name == "__init__.py"

    @property
    def room(self) -> str:
        """The top-level room: ``flowerdro.strategies.base`` → ``strategies``."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterable[tuple[str, str | None]]:
    """(module imported, name taken or None) of every import outside ``if TYPE_CHECKING:``."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for alias in node.names:
                yield base, alias.name
        todo.extend(ast.iter_child_nodes(node))


def read_package(root: Path = ROOT) -> dict[str, Module]:
    """Every module of ``flowerdro/`` with its sizes and (unresolved) imports."""
    modules: dict[str, Module] = {}
    raw: dict[str, list[tuple[str, str | None]]] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        name = _module_name(path, root)
        mod = Module(name, path, len(text.splitlines()))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
        modules[name] = mod
        raw[name] = list(_imports(tree, name, path.name == "__init__.py"))
    for name, imports in raw.items():
        mod = modules[name]
        for target, alias in imports:
            if not target.startswith(PACKAGE):
                continue
            if alias is not None and f"{target}.{alias}" in modules:
                target = f"{target}.{alias}"
            if mod.is_package and alias is not None:
                mod.exports[alias] = target
            mod.imports.add(target if alias is None else f"{target}:{alias}")
    for mod in modules.values():
        mod.imports = {_resolve(t, modules) for t in mod.imports} - {mod.name, None}  # type: ignore[arg-type]
    return modules


def _resolve(target: str, modules: dict[str, Module]) -> str | None:
    """The module an import reaches: a name re-exported by a package resolves to where it is defined."""
    name, _, alias = target.partition(":")
    seen = set()
    while alias and name in modules and modules[name].is_package and alias in modules[name].exports \
            and (name, alias) not in seen:
        seen.add((name, alias))
        name = modules[name].exports[alias]
    return name if name in modules else None


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module → modules it imports (a package's ``__init__`` re-exports left out)."""
    return {m.name: set() if m.is_package else set(m.imports) for m in modules.values()}


def room_edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Top-level room → rooms it imports."""
    out: dict[str, set[str]] = {}
    for src, targets in edges(modules).items():
        room = modules[src].room
        out.setdefault(room, set())
        out[room] |= {modules[t].room for t in targets if modules[t].room != room}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(room: str) -> int | None:
    """The index of ``room`` in :data:`LAYERS` (None when it is in none)."""
    for i, rooms in enumerate(LAYERS):
        if room in rooms:
            return i
    return None


def upward(modules: dict[str, Module]) -> list[tuple[str, str]]:
    """(importer, imported) of every import from a lower layer up to a higher one."""
    out = []
    for src, targets in edges(modules).items():
        a = layer_of(modules[src].room)
        for t in sorted(targets):
            b = layer_of(modules[t].room)
            if a is not None and b is not None and b > a:
                out.append((src, t))
    return out


def unlayered(modules: dict[str, Module]) -> list[str]:
    """Top-level rooms that :data:`LAYERS` does not place."""
    return sorted({m.room for m in modules.values() if m.room != "__init__" and layer_of(m.room) is None})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=8, help="how many of the largest classes and modules to list")
    ap.add_argument("--check", action="store_true", help="exit 1 when a circle, an upward import, a room in no "
                                                         "layer or a size over the limits is reported")
    args = ap.parse_args()
    modules = read_package()
    classes = sorted(((n, f"{m.name}.{c}") for m in modules.values() for c, n in m.classes.items()), reverse=True)
    mods = sorted(((m.lines, m.name) for m in modules.values()), reverse=True)
    print(f"{len(modules)} modules, {sum(len(m.classes) for m in modules.values())} classes")
    print("largest classes: " + ", ".join(f"{name} {n}" for n, name in classes[: args.top]))
    print("largest modules: " + ", ".join(f"{name} {n}" for n, name in mods[: args.top]))
    module_circles, room_circles = circles(edges(modules)), circles(room_edges(modules))
    print(f"import circles between modules: {len(module_circles)}")
    for c in module_circles:
        print("  " + " <-> ".join(c))
    print(f"import circles between top-level rooms: {len(room_circles)}")
    for c in room_circles:
        print("  " + " <-> ".join(c))
    up = upward(modules)
    print(f"imports from a lower layer up to a higher one: {len(up)}")
    for src, dst in up:
        print(f"  {src} -> {dst}")
    if missing := unlayered(modules):
        print("rooms in no layer: " + ", ".join(missing))
    over = [f"class {name} {n}" for n, name in classes if n > MAX_CLASS_LINES] + \
        [f"module {name} {n}" for n, name in mods if n > MAX_MODULE_LINES]
    print(f"over the limits ({MAX_CLASS_LINES} lines a class, {MAX_MODULE_LINES} a module): {len(over)}")
    for line in over:
        print("  " + line)
    broken = bool(module_circles or room_circles or up or missing or over)
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
