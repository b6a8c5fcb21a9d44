"""The package's imports point one way and never form a cycle.

Layers, lowest first: ``_primitives`` -> the features (``device``, ``samplers``, ``remote``, then
``streams``) -> ``_engine`` -> ``isolation`` -> ``loader`` -> ``compare`` and ``integrations`` ->
the package's public face (``threadloader``, ``__main__`` and the public module paths
``stats``, ``memory``, ``transfer``, ``lightning``). A module may import from its own package or
from a lower layer; every import counts, also one inside a function or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import threadloader

PACKAGE = pathlib.Path(threadloader.__file__).parent

LAYERS: dict[str, int] = {
    "_primitives": 0,
    "device": 1,
    "samplers": 1,
    "remote": 1,
    "streams": 2,
    "_engine": 3,
    "isolation": 4,
    "loader": 5,
    "compare": 6,
    "integrations": 6,
    "threadloader": 7,
    "__main__": 7,
    "stats": 7,
    "memory": 7,
    "transfer": 7,
    "lightning": 7,
}


def _module_name(path: pathlib.Path) -> str:
    parts = ["threadloader", *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The threadloader modules ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {m for m in found if m in modules and m != name}


def _layer(name: str) -> tuple[str, int]:
    parts = name.split(".")
    key = parts[1] if len(parts) > 1 else parts[0]
    assert key in LAYERS, f"{name} is in no layer: add its package to LAYERS"
    return key, LAYERS[key]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_points_down_or_stays_in_its_package(graph: dict[str, set[str]]) -> None:
    """No module imports from a higher layer, nor from another package of its own layer."""
    wrong = []
    for name, targets in graph.items():
        package, rank = _layer(name)
        for target in targets:
            target_package, target_rank = _layer(target)
            if target_package != package and target_rank >= rank:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    """No module imports itself through other modules (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_an_upward_import(tmp_path: pathlib.Path) -> None:
    """The walk finds imports inside functions and under TYPE_CHECKING, relative ones too."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from threadloader.loader import ThreadDataLoader\n"
        "def f():\n"
        "    from ..device import pinned\n"
    )
    modules = _modules()
    found = _imports("threadloader._engine.probe", source, modules)
    assert found == {"threadloader.loader", "threadloader.device.pinned"}
