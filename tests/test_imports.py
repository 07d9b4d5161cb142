"""No import cycles between the modules of spinf_worker/ and api/.

Every ``import`` / ``from ... import`` of a module counts, at module level or inside a function
(a lazy import still ties the two modules together); those under ``if TYPE_CHECKING:`` do not.
``from pkg import name`` depends on ``pkg.name`` when that is a module, else on ``pkg``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spinf_worker", "api")
QUEUE = "spinf_worker.queue"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """What this file imports, relative imports resolved, TYPE_CHECKING blocks left out:
    ``a.b`` for ``import a.b``, ``"a.b\0c,d"`` for ``from a.b import c, d``."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            visit(child)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(f"{target}\0" + ",".join(alias.name for alias in node.names))
        walk(node)

    walk(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for entry in imported_names(tree, name, path.name == "__init__.py"):
            if "\0" not in entry:                    # import a.b.c
                deps.add(resolve(entry))
                continue
            target, _, aliases = entry.partition("\0")
            for alias in aliases.split(","):         # from a.b import c: a.b.c if a module
                sub = f"{target}.{alias}"
                deps.add(sub if sub in modules else resolve(target))
        deps.discard(None)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every
    module in one reaches every other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in component)
    return f"{' <-> '.join(component)}  ({edges})"


def _split() -> tuple[dict[str, set[str]], list[list[str]], list[list[str]]]:
    graph = import_graph()
    found = cycles(graph)

    def in_queue(component: list[str]) -> bool:
        return any(m == QUEUE or m.startswith(QUEUE + ".") for m in component)

    return (graph, [c for c in found if not in_queue(c)], [c for c in found if in_queue(c)])


def test_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "spinf_worker.engine.runner" in graph
    assert "spinf_worker.engine.layout" in graph["spinf_worker.engine.runner"]   # relative
    assert "spinf_worker.kernels.flex_tree" in graph["spinf_worker.kernels.attention"]  # lazy


def test_cycle_finder_finds_a_function_level_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph, outside_queue, _ = _split()
    assert not outside_queue, "import cycles:\n" + "\n".join(
        describe(c, graph) for c in outside_queue)


def test_no_import_cycles_in_queue():
    graph, _, in_queue = _split()
    assert not in_queue, "import cycles in spinf_worker/queue/:\n" + "\n".join(
        describe(c, graph) for c in in_queue)
