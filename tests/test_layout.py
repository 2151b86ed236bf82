"""The package reads top-down: no import cycles, and the write side never loads the relay.

A cycle, even one only a type annotation needs, means two modules each hold
part of the other's job; a reader can no longer start at a package's face and
read down. Imports inside functions and under ``TYPE_CHECKING`` count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Checkout folder -> installed package name (pyproject's package-dir).
PACKAGES = {"outbox": "outbox", "relay": "outbox.relay", "integrations": "outbox.integrations"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "migrations" in path.relative_to(ROOT / folder).parts:
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of ours that ``name`` imports, wherever the import statement stands."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                module = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                if submodule in modules:
                    targets.add(submodule)
                elif module in modules:
                    targets.add(module)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name in modules)
    targets.discard(name)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_the_write_side_never_imports_the_relay_or_the_handlers():
    """An application that only emits never loads them; the two exceptions are named."""
    allowed = {"outbox.testing", "outbox.dashboard._live"}  # drains with a relay; LISTENs like one
    reaching = {
        name: sorted(t for t in targets if t.startswith(("outbox.relay", "outbox.integrations")))
        for name, targets in _graph().items()
        if not name.startswith(("outbox.relay", "outbox.integrations")) and name not in allowed
    }
    assert {name: targets for name, targets in reaching.items() if targets} == {}


def test_the_relay_and_the_handlers_never_import_each_other():
    graph = _graph()
    crossing = [
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if (name.startswith("outbox.relay") and target.startswith("outbox.integrations"))
        or (name.startswith("outbox.integrations") and target.startswith("outbox.relay"))
    ]
    assert crossing == []


def test_the_check_sees_a_cycle_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_package_in_the_checkout_is_in_the_wheel():
    """pyproject lists the packages by hand: a new subpackage left off imports here and fails installed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join([package, *init.parent.relative_to(ROOT / folder).parts])
        for folder, package in PACKAGES.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
