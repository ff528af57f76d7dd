"""House rule 16 (STYLE.md), checked over the library packages: no module reads another module's
private names, and no file-level import cycles.

- ruff's SLF001 (configured in pyproject.toml: the library packages, not tests/) catches
  `obj._name` outside obj's own class; the torch names it may read are listed
  there, with why.
- ast catches what SLF001 does not: `from ours import _name` across files (a kernel's launcher
  reading its own Triton kernels' file excepted, as the rule says), and the import graph's cycles.
  Every import of our modules counts, wherever it is: inside a function and under TYPE_CHECKING
  too (a type-only cycle is still two files that each need the other to be read).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("distill", "teacher_cache", "student", "kernels", "pipelines")


def _module_name(path: Path) -> str:
    """`student/offload/runtime.py` -> "student.offload.runtime"; a package's __init__ is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every module of the library packages, by dotted name."""
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


class _Import(NamedTuple):
    """One import of one of our modules: the module it names, and the private names it takes from it."""

    target: str
    line: int
    private: list[str]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[_Import]:
    """The imports of our modules in module `name` (every one: at the top, in functions, under
    TYPE_CHECKING). `import a.b.c`: a.b.c (or its longest prefix that is a module); `from a.b
    import c`: a.b.c where that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules),
                              None)
                if target is not None:
                    found.append(_Import(target, node.lineno, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, `level - 1` packages up
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            private = []
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.append(_Import(f"{source}.{alias.name}", node.lineno, []))
                elif source in modules and alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append(alias.name)
            if source in modules and (private or any(f"{source}.{a.name}" not in modules for a in node.names)):
                found.append(_Import(source, node.lineno, private))
    return [i for i in found if i.target != name]


@functools.cache
def _graph() -> tuple[dict[str, Path], dict[str, list[_Import]]]:
    modules = _modules()
    return modules, {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search meets (one per edge back to a module on its path; every
    strongly connected set of modules shows at least one), each starting at its least name."""
    found, state, path = set(), {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):]
                k = cycle.index(min(cycle))
                found.add(tuple(cycle[k:] + cycle[:k]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return sorted(list(cycle) for cycle in found)


def test_the_cycle_search_finds_a_cycle_and_only_cycles():
    """The search itself, on a graph of known cycles (a test of this file's own machinery)."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f2"}, "f2": {"f"}}
    assert _cycles(edges) == [["a", "b", "c"], ["f", "f2"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_import_graph_reads_every_kind_of_import(tmp_path):
    """`import a.b`, `from a import b` (b a module), `from a.b import name`, relative imports, and
    imports under TYPE_CHECKING and inside functions all count; private names taken are noted (a
    test of this file's own machinery, on a package made for it)."""
    source = """
from typing import TYPE_CHECKING

import os
import pkg.f.g
from pkg import b
from pkg.c import thing
from . import d
from .e import _private, public
if TYPE_CHECKING:
    from pkg.h import Hint

def later():
    import pkg.i
    from pkg import __version__
"""
    (tmp_path / "a.py").write_text(source)
    modules = {name: tmp_path / "x.py" for name in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f",
                                                    "pkg.h", "pkg.i")}
    found = _imports("pkg.a", tmp_path / "a.py", modules)
    assert {i.target for i in found} == {"pkg", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f", "pkg.h", "pkg.i"}
    assert {i.target: i.private for i in found if i.private} == {"pkg.e": ["_private"]}


def test_no_module_reads_another_modules_private_attributes():
    """ruff's SLF001 over the library packages (pyproject.toml's [tool.ruff]): `obj._name` outside
    obj's own class."""
    pytest.importorskip("ruff", reason="ruff comes with the dev extra: pip install -e '.[dev]'")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                             *PACKAGES], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, ("ruff check (SLF001) found private names read across modules:\n"
                                    f"{result.stdout}{result.stderr}")


def test_no_module_imports_another_modules_private_names():
    """`from ours import _name` reads a private name of another file. Excepted: a kernel's launcher
    `kernels/<name>.py` importing its Triton kernels from `kernels/<name>_triton.py` (STYLE rule 16)."""
    modules, graph = _graph()
    found = [f"{modules[name].relative_to(ROOT)}:{i.line}: {', '.join(i.private)} from {i.target}"
             for name, imports in sorted(graph.items()) for i in imports
             if i.private and not (name.startswith("kernels.") and i.target == f"{name}_triton")]
    assert not found, "private names imported across modules (make them public and documented):\n" + "\n".join(found)


def test_the_library_has_no_import_cycles():
    """No two modules import each other, directly or through others (type-only imports count)."""
    modules, graph = _graph()
    edges = {name: {i.target for i in imports} for name, imports in graph.items()}
    lines = {(name, i.target): i.line for name, imports in graph.items() for i in imports}
    cycles = _cycles(edges)
    where = lambda a, b: f"{modules[a].relative_to(ROOT)}:{lines[(a, b)]}"
    report = ["  " + " -> ".join(cycle + [cycle[0]]) + "\n    (" + ", ".join(
        where(a, b) for a, b in zip(cycle, cycle[1:] + cycle[:1])) + ")" for cycle in cycles]
    assert not cycles, f"{len(cycles)} import cycles (module -> the module it imports; where):\n" + "\n".join(report)
