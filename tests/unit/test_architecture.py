"""The shape of the house (docs/architecture.md), checked by reading the source with ``ast``:
no import cycle, no private name taken from another module, nothing but commands/ imports
commands/, click commands stay short, modules stay small, no cryptic module aliases.

Each rule names the offenders, so a failure says what to move where."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"cloudtrain": REPO / "cloudtrain",
         "cloudtrain_provisioners": REPO / "provisioners" / "cloudtrain_provisioners"}
MAX_LINES = 500
MAX_COMMAND_LINES = 40


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if "templates" in path.relative_to(root).parts:
                continue
            rel = path.relative_to(root).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, list[str], int, str | None]]:
    """(module imported, names taken from it, line, alias) for every import statement in the
    module, at any depth (a function-level import is an edge too). Relative imports are
    resolved; only our own modules are kept."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    base = name.split(".") if _is_package(name) else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append((a.name, [], node.lineno, a.asname))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [a.name for a in node.names]
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:   # `from pkg import submodule`
                    found.append((sub, [], node.lineno, a.asname))
            rest = [a for a in names if f"{mod}.{a}" not in MODULES]
            if rest:
                found.append((mod, rest, node.lineno, None))
    return [f for f in found if f[0] in MODULES]


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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
        for w in {e[0] for e in GRAPH[v]}:
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

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_source_is_where_the_test_looks() -> None:
    # A rule checked over nothing would pass for the wrong reason.
    assert "cloudtrain.commands.main" in MODULES and "cloudtrain_provisioners.aws.provider" in MODULES
    assert len(MODULES) > 60
    assert any(GRAPH[m] for m in MODULES)


def test_no_import_cycle() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles (function-level imports count): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_no_private_name_imported_from_another_module() -> None:
    bad = [f"{m}:{line} imports {', '.join(n for n in names if n.startswith('_'))} from {target}"
           for m in MODULES for target, names, line, _ in GRAPH[m]
           if target != m and any(n.startswith("_") and not n.startswith("__") for n in names)]
    assert not bad, "private names used across modules (make them public or move them): " \
        + "; ".join(bad)


def test_only_commands_import_commands() -> None:
    bad = [f"{m}:{line} imports {target}" for m in MODULES for target, _, line, _ in GRAPH[m]
           if target.startswith("cloudtrain.commands")
           and not m.startswith("cloudtrain.commands") and m not in ("cloudtrain.__main__",)]
    assert not bad, "only cloudtrain/commands may import cloudtrain.commands: " + "; ".join(bad)


def test_pipeline_does_not_reach_up_and_cluster_record_does_not_run_the_pipeline() -> None:
    bad = [f"{m}:{line} imports {target}" for m in MODULES for target, _, line, _ in GRAPH[m]
           if (m.startswith("cloudtrain.pipeline") and target.startswith("cloudtrain.commands"))
           or (m == "cloudtrain.cluster" and target.startswith("cloudtrain.pipeline"))
           or (m == "cloudtrain.spec" and target.startswith("cloudtrain.provider"))]
    assert not bad, "; ".join(bad)


def test_no_module_is_over_500_lines() -> None:
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them along a seam): {big}"


def _is_click_command(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr in ("command", "group"):
            return True
    return False


def test_click_commands_are_thin() -> None:
    long = []
    for m, path in MODULES.items():
        if not m.startswith("cloudtrain.commands"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and _is_click_command(node):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_COMMAND_LINES:
                    long.append(f"{m}.{node.name}: {n} lines")
    found = sum(1 for m, p in MODULES.items() if m.startswith("cloudtrain.commands")
                for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.FunctionDef) and _is_click_command(n))
    assert found >= 12, "the command finder found too few click commands"
    assert not long, "click commands over ~40 lines (move the work into pipeline/): " + "; ".join(long)


def test_no_cryptic_module_aliases() -> None:
    bad = [f"{m}:{line} imports {target} as {alias}" for m in MODULES
           for target, _, line, alias in GRAPH[m]
           if alias and len(alias) < 4 and target in MODULES]
    assert not bad, "import our modules by their names (grep must find the calls): " + "; ".join(bad)


def test_the_cli_module_is_gone() -> None:
    assert not (REPO / "cloudtrain" / "cli.py").exists()
    assert not list((REPO / "cloudtrain").glob("cmd_*.py"))


def test_click_commands_live_only_in_commands() -> None:
    elsewhere = [f"{m}.{node.name}" for m, path in MODULES.items()
                 if not m.startswith("cloudtrain.commands")
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.FunctionDef) and _is_click_command(node)]
    assert not elsewhere, "click commands outside cloudtrain/commands: " + ", ".join(elsewhere)


def test_one_guard_and_one_click_context() -> None:
    core = {m: p.read_text() for m, p in MODULES.items() if m.startswith("cloudtrain.")}
    assert [m for m, s in core.items() if "help_option_names" in s] == ["cloudtrain.commands.base"]
    assert [m for m, s in core.items() if "def _guard(" in s or "def guard(" in s] \
        == ["cloudtrain.commands.base"]


MAX_PARAMETERS = 8
MAX_FUNCTION_LINES = 80


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(path relative to the repo, function) for every function and method in cloudtrain/."""
    out = []
    for m, path in MODULES.items():
        if m == "cloudtrain" or m.startswith("cloudtrain."):
            rel = str(path.relative_to(REPO))
            out += [(rel, node) for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Its parameters, ``*args`` and ``**kwargs`` included, a method's self/cls not."""
    a = fn.args
    named = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    if named and named[0] in ("self", "cls"):
        named = named[1:]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_takes_over_8_parameters_or_runs_over_80_lines() -> None:
    """A long parameter list asks for a typed request record; a long body for a cut at its
    natural seams (docs/architecture.md)."""
    funcs = _functions()
    assert len(funcs) > 500, "the function finder found too few functions"
    many = [f"{rel}:{fn.lineno} {fn.name}: {n} parameters" for rel, fn in funcs
            if (n := _parameters(fn)) > MAX_PARAMETERS]
    long = [f"{rel}:{fn.lineno} {fn.name}: {n} lines" for rel, fn in funcs
            if (n := (fn.end_lineno or fn.lineno) - fn.lineno + 1) > MAX_FUNCTION_LINES]
    for line in many + long:
        print(line)
    assert not many and not long, (
        f"functions over {MAX_PARAMETERS} parameters: {'; '.join(many) or 'none'}. "
        f"Functions over {MAX_FUNCTION_LINES} lines: {'; '.join(long) or 'none'}")


def test_no_import_of_the_planner_from_provider() -> None:
    """Placement is decided once, in the plan (``pipeline/place.py``): the provider layer
    (``cloudtrain/provider/``, the contract and the cloud base) takes the ranked targets on
    the request and imports nothing from the planner, the ranking or the pipeline, not even
    inside a function."""
    above = ("cloudtrain.planner", "cloudtrain.ranking", "cloudtrain.pipeline")
    provider = [m for m in MODULES if m == "cloudtrain.provider"
                or m.startswith("cloudtrain.provider.")]
    assert "cloudtrain.provider.cloud" in provider, "the provider package was not found"
    bad = [f"{m}:{line} imports {target}" for m in provider for target, _, line, _ in GRAPH[m]
           if target in above or target.startswith(tuple(a + "." for a in above))]
    assert not bad, "provider/ reaches up to the planner: " + "; ".join(bad)


TEST_ONLY_ENV = ("ADDRESS_MAP", "CT_TEST_", "CT_MOTO_", "CT_STANDIN_")
"""What only tests set: a fake cloud's address map (``CLOUDTRAIN_<CLOUD>_ADDRESS_MAP``, gone
in issue 22: tests reach their stand-in nodes through ``resources.ssh_proxy``), the test
harness's own variables (``CT_TEST_*``: the connection guard's and the ssh recorder's logs)
and the fakes' settings (``CT_MOTO_*``, ``CT_STANDIN_*``). The other variables the product
reads are settings a user may set (endpoints, timeouts, polls), documented where they act."""


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_address_map_or_test_only_variable_in_the_product() -> None:
    """No module under cloudtrain/ or provisioners/ (nor a script the nodes run) names an
    address map or a variable only tests set: the tests reach their stand-in nodes through
    the mechanisms users have (ssh_proxy, the nodes' own PATH and environment)."""
    bad = [f"{m}:{line}: {text[:60]!r}" for m, p in MODULES.items()
           for line, text in _strings(ast.parse(p.read_text()))
           if any(k in text for k in TEST_ONLY_ENV)]
    bad += [f"{m}:{line} imports {target}" for m in MODULES
            for target, names, line, _ in GRAPH[m]
            if "addrmap" in target or "AddressMap" in names]
    scripts = list((REPO / "bootstrap").glob("*.sh"))
    assert scripts, "the node scripts moved: point this test at them"
    bad += [f"{p.name}: {k}" for p in scripts for k in TEST_ONLY_ENV if k in p.read_text()]
    assert not (REPO / "cloudtrain" / "provider" / "addrmap.py").exists()
    assert not bad, "test machinery in the product (move it to tests/): " + "; ".join(bad)


def test_one_import_path_per_name() -> None:
    """A name is imported from the module that defines it, never through a module that merely
    imported it too (``from cloudtrain.state import NodeRow`` when it lives in ``schema``).
    The provider door (``cloudtrain.provider``) is the one deliberate facade: plugins import
    from it."""
    defined: dict[str, set[str]] = {}
    imported: dict[str, dict[str, str]] = {}
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        defined[m] = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                      for tg in (n.targets if isinstance(n, ast.Assign) else [n.target])
                      for t in ast.walk(tg) if isinstance(t, ast.Name)}
        defined[m] |= {n.name for n in tree.body
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        imported[m] = {a.asname or a.name: f"{n.module}.{a.name}" for n in ast.walk(tree)
                       if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module
                       and n.module.startswith("cloudtrain") for a in n.names}
    bad = []
    for m, path in MODULES.items():
        for n in ast.walk(ast.parse(path.read_text())):
            if (isinstance(n, ast.ImportFrom) and n.module in defined
                    and n.module != "cloudtrain.provider"):
                bad += [f"{path.relative_to(REPO)}:{n.lineno} imports {a.name} from {n.module}; "
                        f"it is {imported[n.module][a.name]}" for a in n.names
                        if a.name not in defined[n.module] and a.name in imported[n.module]]
    assert not bad, "; ".join(bad)


NODE_THIRD_PARTY = {"sweep.py": {"optuna"}, "sweepstudy.py": {"optuna"}, "sweepwork.py": {"optuna"},
                    "preflight.py": {"torch"}}
"""The one exception to "node/*.py is standard library only": the sweep driver (sweep.py,
sweepstudy.py, sweepwork.py) imports optuna
(its samplers, pruners and storages; grpcio comes with its gRPC storage proxy), which
bootstrap installs on the nodes only when a sweep runs. It imports it inside the functions
that use it, never at module level, so the other node scripts never need it (docs/sweep.md).
The preflight's node program (preflight.py) imports torch the same way: it runs where a job
would, with the node's PyTorch (docs/preflight.md)."""


def test_node_scripts_are_standard_library_only_but_the_sweep_driver() -> None:
    import sys
    node = REPO / "cloudtrain" / "node"
    bad = []
    for path in sorted(node.glob("*.py")):
        tree = ast.parse(path.read_text())
        siblings = {p.stem for p in node.glob("*.py")}       # shipped side by side
        allowed = set(sys.stdlib_module_names) | siblings | {"__future__", "cloudtrain"}
        for n in ast.walk(tree):
            if not isinstance(n, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module] if isinstance(n, ast.ImportFrom) and n.module and not n.level else []
            for top in {m.split(".")[0] for m in names} - allowed:
                at_top = n in tree.body
                if top not in NODE_THIRD_PARTY.get(path.name, set()) or at_top:
                    bad.append(f"{path.name}:{n.lineno} imports {top}"
                               + (" at module level" if at_top else ""))
    assert not bad, "node scripts run with the node's bare python3: " + "; ".join(bad)
