"""The shape of the core, read from the source: commands are a thin click layer that nothing
below imports, dependencies point one way (commands -> pipeline -> cluster/context -> ...),
no import cycle (function-level imports counted), one guard and one click context, short
command functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "cloudtrain"


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def _known(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The cloudtrain modules ``module`` imports when it runs (at any level, not for typing)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        found.update(k for k in map(_known, names) if k and k != module)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def test_nothing_below_the_commands_imports_them() -> None:
    outside = {m: sorted(i for i in deps if i.startswith("cloudtrain.commands"))
               for m, deps in GRAPH.items()
               if not m.startswith("cloudtrain.commands") and m != "cloudtrain.__main__"}
    assert {m: d for m, d in outside.items() if d} == {}


def test_the_record_and_the_context_do_not_import_the_pipeline() -> None:
    for m in ("cloudtrain.cluster", "cloudtrain.context"):
        assert not [d for d in GRAPH[m] if d.startswith(("cloudtrain.pipeline",
                                                         "cloudtrain.commands"))], m


def test_no_import_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in GRAPH:
        if m not in index:
            visit(m)
    assert cycles == []


def _click_commands() -> list[tuple[str, str, int]]:
    out = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    "command" in ast.unparse(d) or "group" in ast.unparse(d)
                    for d in node.decorator_list):
                out.append((m, node.name, node.end_lineno - node.lineno + 1))  # type: ignore[operator]
    return out


def test_click_commands_live_in_commands_and_are_short() -> None:
    found = _click_commands()
    assert len(found) >= 14
    assert [(m, n) for m, n, _ in found if not m.startswith("cloudtrain.commands.")] == []
    assert [(m, n, lines) for m, n, lines in found if lines > 40] == []


def test_one_guard_and_one_click_context() -> None:
    settings = [m for m, p in MODULES.items() if "help_option_names" in p.read_text()]
    assert settings == ["cloudtrain.commands.base"]
    guards = [m for m, p in MODULES.items() if "def _guard" in p.read_text()
              or "def guard(" in p.read_text()]
    assert guards == ["cloudtrain.commands.base"]
