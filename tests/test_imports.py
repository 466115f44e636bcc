"""No import cycle in `kernels/`: every import counts, at module level or inside a function.

A cycle hidden behind an import inside a function still ties two modules into one idea (neither
can be read, tested or moved without the other) and breaks as soon as someone hoists the import.
"""

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "kernels"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, dotted name -> file (pkg/sub/__init__: "pkg.sub")."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(node, importer: str, is_package: bool, modules) -> set[str]:
    """The package's modules that one `import` or `from ... import` statement loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: level 1 is the importer's own package
            package = importer.split(".") if is_package else importer.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        # `from kernels import batch_invariant` names a module; `from kernels.norm import
        # rms_norm` names a function of one
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # `import a.b.c.func`-like names: the module part
            name = name.rpartition(".")[0]
        if name and name != importer:
            found.add(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its file (functions included)."""
    modules = module_names(root)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, name, path.name == "__init__.py", modules)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected group of modules (Tarjan's)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_within(graph, group) for group in groups]


def _cycle_within(graph, group) -> list[str]:
    """A closed path through `group`, from its first module back to it (breadth first)."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for succ in sorted(graph[path[-1]] & group):
            if succ == start:
                return path + [start]
            if succ not in seen:
                seen.add(succ)
                paths.append(path + [succ])
    raise AssertionError(f"no cycle through {sorted(group)}")


def test_kernels_has_no_import_cycle():
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph) > 20 and "kernels.grader.cli" in graph["kernels.__main__"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in kernels/:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "pkg"


def test_walker_finds_a_cycle_hidden_inside_a_function(tmp_path):
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/forward.py": "from pkg.backward import grad\n",
            "pkg/backward.py": """
                def grad():
                    from pkg import forward  # a module, named from its package
                    return forward
            """,
            "pkg/clean.py": "import pkg.forward\n",
        },
    )
    cycles = find_cycles(import_graph(pkg))
    assert cycles == [["pkg.backward", "pkg.forward", "pkg.backward"]]


def test_walker_resolves_relative_imports_and_names_from_modules(tmp_path):
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from .sub import leaf\n",  # a module of a subpackage
            "pkg/top.py": "from pkg.sub.leaf import value\n",  # a name: the edge is to leaf
            "pkg/sub/__init__.py": "from . import leaf\n",
            "pkg/sub/leaf.py": "import os\nvalue = 1\n",
            "pkg/sub/deep.py": "from ..top import value\nfrom .. import top\nimport pkg.sub\n",
        },
    )
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg.sub.leaf"},
        "pkg.top": {"pkg.sub.leaf"},
        "pkg.sub": {"pkg.sub.leaf"},
        "pkg.sub.leaf": set(),  # outside the package: no edge
        "pkg.sub.deep": {"pkg.top", "pkg.sub"},
    }
    assert find_cycles(graph) == []


@pytest.mark.parametrize(
    "leaf_imports",
    ["from pkg import value", "import pkg", "from . import value", "from .. import sub"],
)
def test_a_module_importing_its_own_package_face_is_a_cycle(tmp_path, leaf_imports):
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub.leaf import value\n",
            "pkg/sub/__init__.py": "from pkg.sub import leaf\n",
            "pkg/sub/leaf.py": f"def f():\n    {leaf_imports}\nvalue = 1\n",
        },
    )
    (cycle,) = find_cycles(import_graph(pkg))
    assert cycle[0] == cycle[-1] and "pkg.sub.leaf" in cycle
