"""The shape of the code, read from its source: no import cycle between its modules, no function longer than
a screen and a half.

An import cycle ties modules so that none can be read, tested or changed without the others; here every import
counts, at module level or inside a function (an import moved into a function to dodge a cycle keeps the
cycle), and so does a lazy import that names its module in a string (the package's ``_LAZY`` table). Imports
under ``if TYPE_CHECKING:`` do not: they never run, and name a type for annotations only.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# package → its folder (pyproject.toml maps ``autorecompute.passes`` to the top-level ``passes/``)
PACKAGES = {"autorecompute": ROOT / "autorecompute", "autorecompute.passes": ROOT / "passes"}
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, pathlib.Path]:
    """Every module of the two packages, by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _resolve(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The module ``name`` is, or is in (``a.b.C`` → ``a.b``); None outside the packages."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imported(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of the packages that ``module`` imports anywhere in its source, or names in a string."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(_resolve(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b``: the submodule a.b when there is one, else a itself
            targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _resolve(base, known)
                           for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in known:      # a dotted module name (a bare "autorecompute" is a logger's, a key's)
            targets.add(node.value)
    return {t for t in targets if t is not None and t != module}


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield node.test
            for child in node.orelse:
                yield child
                yield from _runtime_nodes(child)
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    for module, path in known.items():
        graph.add_node(module)
        graph.add_edges_from((module, target) for target in imported(module, path, known))
    return graph


def _cycles() -> list[list[str]]:
    return sorted(nx.simple_cycles(import_graph()), key=lambda cycle: (len(cycle), cycle))


def _show(cycles: list[list[str]]) -> str:
    return "\n".join(" → ".join([*cycle, cycle[0]]) for cycle in cycles)


def test_the_import_graph_reads_function_level_and_lazy_imports():
    graph = import_graph()
    assert graph.has_edge("autorecompute.passes.build_problem", "autorecompute.passes.graph_facts")
    assert graph.has_edge("autorecompute", "autorecompute.api")               # the _LAZY table
    assert graph.has_edge("autorecompute.solvers.greedy", "autorecompute.solvers.segment_plans")  # in a function


def test_no_import_cycle():
    cycles = _cycles()
    assert not cycles, f"import cycles:\n{_show(cycles)}"


def long_functions() -> dict[tuple[str, str], int]:
    """(file, function) → lines, for every function over ``MAX_FUNCTION_LINES`` (its ``def`` to its last line,
    docstring included); methods and nested functions are named by what they are in (``Class.method``)."""
    found = {}
    for path in modules().values():
        file = path.relative_to(ROOT).as_posix()

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    lines = child.end_lineno - child.lineno + 1
                    if not isinstance(child, ast.ClassDef) and lines > MAX_FUNCTION_LINES:
                        found[(file, name)] = lines
                    visit(child, name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_no_function_is_over_80_lines():
    over = long_functions()
    assert not over, "functions over 80 lines (split them):\n" + "\n".join(
        f"  {file}: {name} ({lines} lines)" for (file, name), lines in sorted(over.items()))
