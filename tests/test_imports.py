"""No import circle between the modules of ``lrmoe``: data flows one way (config → router →
planner → dispatch → experts → combine), so a lower module never imports a higher one.

The graph is read from the source with ``ast``, not by importing it, so every import counts: a
module's top level, one inside a function (a lazy import still ties the two modules) and one
under ``if TYPE_CHECKING:``. ``from pkg import name`` is an edge to ``pkg.name`` where that is a
module, else to ``pkg`` (its ``__init__``, which re-exports the name).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted((src / "lrmoe").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imported(node: ast.Import | ast.ImportFrom, package: str, known: dict) -> list[str]:
    """The package's modules one import statement names (``package``: the importing module's own)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if node.level:  # relative: ``from .x import y`` inside package ``a.b`` is ``from a.b.x import y``
        parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(parts + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        if f"{target}.{alias.name}" in known:  # a submodule
            out.append(f"{target}.{alias.name}")
        elif target in known:  # a name of the module (or re-exported by the package's __init__)
            out.append(target)
    return out


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, within the package."""
    known = modules(src)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, package, known):
                    if target != name:
                        edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_graph_sees_the_package():
    graph = import_graph()
    assert len(graph) > 50 and "lrmoe.layer" in graph
    assert "lrmoe.config" in graph["lrmoe.layer"], "the reader finds plain imports"


def test_graph_resolves_relative_and_package_imports(tmp_path):
    files = {
        "__init__.py": "",
        "a/__init__.py": "from lrmoe.a.x import X\n",
        "a/x.py": "from . import y\nX = 1\n",  # a submodule, relative
        "a/y.py": "from ..b import z\n",  # a name of lrmoe.b: its __init__
        "b/__init__.py": "def z():\n    from lrmoe.a import X\n",  # lazy, through lrmoe.a's __init__
    }
    for rel, text in files.items():
        (tmp_path / "lrmoe" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lrmoe" / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert {m: set(e) for m, e in graph.items()} == {
        "lrmoe": set(), "lrmoe.a": {"lrmoe.a.x"}, "lrmoe.a.x": {"lrmoe.a.y"}, "lrmoe.a.y": {"lrmoe.b"},
        "lrmoe.b": {"lrmoe.a"}}
    assert find_cycle(graph) == ["lrmoe.a", "lrmoe.a.x", "lrmoe.a.y", "lrmoe.b", "lrmoe.a"]


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}) is None


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle in lrmoe:\n  " + "\n  ".join(steps))
