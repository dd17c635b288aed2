"""The tokstream package's imports form no cycle, and the kernels sit below everything else.

Function-local imports count as edges too: a local import whose target imports the importer
(directly or not) only hides a cycle, and the definition it reaches for belongs elsewhere.
`if TYPE_CHECKING:` imports never run and are left out, except where a test asks for the
type-level graph (a module function that takes its caller's whole object is such a cycle).
Lazy imports that break no cycle (torch, pynvml, a subcommand's body) are fine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"tokstream": "tokstream", "kernels": "tokstream.kernels",
                "chaos": "tokstream.chaos", "loadgen": "tokstream.loadgen"}
"""Folder -> the package it installs as (pyproject.toml's package-dir)."""


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the installed tokstream package."""
    out = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool):
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if not is_package:
            parts.pop()
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(root: Path, type_level: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported tokstream module: line of the first such import}; importing a.b.c
    runs a and a.b too, so those are edges as well. type_level: `if TYPE_CHECKING:` imports
    are edges too."""
    found = modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in found.items():
        edges = graph.setdefault(module, {})
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        todo = list(ast.iter_child_nodes(tree))
        while todo:
            node = todo.pop()
            if not type_level and _is_type_checking(node):
                todo.extend(node.orelse)
                continue
            todo.extend(ast.iter_child_nodes(node))
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(node, module, path.name == "__init__.py"):
                while name:
                    if name in found and name != module:
                        edges[name] = min(edges.get(name, node.lineno), node.lineno)
                    name = name.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
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
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _described(graph, component: list[str]) -> str:
    members = set(component)
    return "; ".join(f"{a}:{line} -> {b}" for a in component
                     for b, line in sorted(graph[a].items()) if b in members)


def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert len(graph) > 100  # the whole package was read
    found = cycles(graph)
    assert not found, "\n".join(_described(graph, component) for component in found)


BELOW_KERNELS = {"tokstream", "tokstream.envs"}
"""What the kernels may import outside their package: envs reads the environment switches and
imports no tokstream module itself (checked below), so it sits under the kernels."""


def test_kernels_import_nothing_above_them():
    """tokstream.kernels is the bottom layer (the worker's model builds on it): a kernel or its
    check that reached up into the worker would make the two packages one knot."""
    graph = import_graph(ROOT)
    upward = [f"{module}:{line} -> {target}" for module, edges in graph.items()
              if module.startswith("tokstream.kernels") or module in BELOW_KERNELS
              for target, line in edges.items()
              if target not in BELOW_KERNELS and not target.startswith("tokstream.kernels")]
    assert not upward, upward
    assert "tokstream.envs" in graph["tokstream.kernels.cpu_build"]  # the switches' one reader


def test_the_checker_sees_a_cycle_that_a_local_import_hides(tmp_path):
    """The mutation: two modules importing each other, one of them inside a function."""
    for folder in PACKAGE_DIRS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "tokstream" / "a.py").write_text("from tokstream.b import thing\n")
    (tmp_path / "tokstream" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokstream import c\n"
        "def thing():\n    from tokstream.a import thing as other\n    return other\n")
    (tmp_path / "tokstream" / "c.py").write_text("from . import b\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["tokstream.a", "tokstream.b"]]  # c's edge back is type-only
    assert graph["tokstream.c"] == {"tokstream": 1, "tokstream.b": 1}


TYPE_LEVEL_ACYCLIC = ("tokstream.engine.core", "tokstream.engine.recovery",
                      "tokstream.engine.scoring", "tokstream.engine.scheduler", "tokstream.server")
"""Modules (by prefix) in no import cycle even counting `if TYPE_CHECKING:` imports: the core
and its snapshot, the recovery objects of both sides, scoring, the scheduler package (its
helpers took the whole Scheduler: admission <-> preemption <-> scheduler), the gateway (issue
33)."""
TYPE_LEVEL_CYCLES_LEFT: list[set[str]] = []
"""The type-level cycles anywhere in the tree still to be removed, each to be deleted with its
cycle (the last, engine/messages' __init__ re-exporting modules that name each other's types,
went when the package stopped re-exporting)."""


def test_no_type_level_cycle_through_the_core_its_recovery_or_the_gateway():
    """Issue 33: recover(core, ...), snapshot(core), score(core, ...) took the whole EngineCore
    and GatewaySnapshot the whole Server, so each imported its caller back for the type."""
    graph = import_graph(ROOT, type_level=True)
    found = [component for component in cycles(graph)
             if any(module.startswith(TYPE_LEVEL_ACYCLIC) for module in component)]
    assert not found, "\n".join(_described(graph, component) for component in found)


def test_no_type_level_cycle_anywhere_but_those_left():
    """A new cycle, or one of those left grown, fails; one of those left shrunk or gone does
    not."""
    graph = import_graph(ROOT, type_level=True)
    found = [component for component in cycles(graph)
             if not any(set(component) <= left for left in TYPE_LEVEL_CYCLES_LEFT)]
    assert not found, "\n".join(_described(graph, component) for component in found)


def test_the_scheduler_imports_no_torch():
    """The scheduler and its helpers are pure Python (STYLE habit 8): tested without a model,
    and the engine core's loop pays no torch import for them."""
    code = ("import sys, tokstream.engine.scheduler.scheduler; "
            "sys.exit('torch' in sys.modules or 'numpy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_type_level_graph_counts_type_checking_imports(tmp_path):
    """The mutation: a module that imports its caller for a type only."""
    for folder in PACKAGE_DIRS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "tokstream" / "core.py").write_text("from tokstream.helper import run\n")
    (tmp_path / "tokstream" / "helper.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokstream.core import X\n")
    assert cycles(import_graph(tmp_path)) == []
    assert cycles(import_graph(tmp_path, type_level=True)) == [["tokstream.core",
                                                               "tokstream.helper"]]


def test_the_engine_imports_nothing_of_the_worker():
    """The engine core starts ranks by name (rank_start.RANK_PROGRAM) and speaks to them
    through engine/messages only; worker/ imports those messages, never the other way."""
    graph = import_graph(ROOT)
    crossing = {(module, target): line for module, edges in graph.items()
                if module.startswith("tokstream.engine")
                for target, line in edges.items() if target.startswith("tokstream.worker")}
    assert not crossing, crossing


MAX_MODULES_PER_FOLDER = 20
"""Issue 33: a folder past ~20 modules no longer reads as one idea."""
NAMES_BESIDE_THE_GATEWAY = ("tokstream", "tokstream.engine", "tokstream.worker")
"""The packages whose modules a gateway module is read beside (it imports them): a gateway file
named like one of theirs (admission.py, errors.py) said less than it seemed to."""


def gateway_layout_problems(root: Path) -> list[str]:
    """tokstream/server's folders hold at most MAX_MODULES_PER_FOLDER modules each, and no
    two of its modules, nor one of them and one of NAMES_BESIDE_THE_GATEWAY, share a name."""
    found = modules(root)
    gateway = [name for name in found if name.startswith("tokstream.server.")
               and found[name].name != "__init__.py"]
    problems = []
    folders: dict[str, list[str]] = {}
    for name in gateway:
        folders.setdefault(name.rpartition(".")[0], []).append(name)
    problems += [f"{folder}: {len(names)} modules" for folder, names in sorted(folders.items())
                 if len(names) > MAX_MODULES_PER_FOLDER]
    owners: dict[str, list[str]] = {}
    for name, path in found.items():
        if path.name != "__init__.py" and (name in gateway or
                                           name.rpartition(".")[0] in NAMES_BESIDE_THE_GATEWAY):
            owners.setdefault(path.stem, []).append(name)
    problems += [f"{stem}.py: {', '.join(sorted(names))}" for stem, names in sorted(owners.items())
                 if len(names) > 1 and any(name in gateway for name in names)]
    return problems


def test_the_gateway_folders_stay_small_and_their_file_names_distinct():
    server = (ROOT / "tokstream" / "server" / "server.py").read_text(encoding="utf-8")
    assert "\nclass Server:" in server  # the hub, in a file named for it
    assert not gateway_layout_problems(ROOT), gateway_layout_problems(ROOT)


def test_the_gateway_layout_check_sees_a_crowded_folder_and_a_repeated_name(tmp_path):
    for folder in PACKAGE_DIRS:
        (tmp_path / folder).mkdir()
    for folder in ("tokstream/engine", "tokstream/server", "tokstream/server/api"):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "tokstream" / "engine" / "admission.py").write_text("")
    (tmp_path / "tokstream" / "server" / "admission.py").write_text("")
    for i in range(MAX_MODULES_PER_FOLDER + 1):
        (tmp_path / "tokstream" / "server" / "api" / f"m{i}.py").write_text("")
    assert gateway_layout_problems(tmp_path) == [
        f"tokstream.server.api: {MAX_MODULES_PER_FOLDER + 1} modules",
        "admission.py: tokstream.engine.admission, tokstream.server.admission"]
