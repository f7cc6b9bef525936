"""Find import cycles between the modules of a package (CI runs it on src/tokenmill).

Counts every import, lazy ones inside functions too (a lazy import that closes a cycle
still ties the two modules together); only imports under ``if TYPE_CHECKING:`` (type-only)
are exempt. Importing ``a.b.c`` also runs ``a/__init__``
and ``a/b/__init__``, so a package's ``__init__`` is an edge too.

    python tools/import_cycles.py src/tokenmill benchmarks   # exit 1 and the cycles if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """Dotted name of ``path``: under the package ``root``, or, for a folder of scripts
    that import each other by bare name (``benchmarks/``), relative to ``root``."""
    base = root.parent if (root / "__init__.py").exists() else root
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """Modules ``module`` imports, anywhere in it but under ``if TYPE_CHECKING:``."""
    found: list[str] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend([*node.body, *node.orelse, *node.finalbody])
            for handler in node.handlers:
                stack.extend(handler.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With)):
            stack.extend(node.body)
        elif isinstance(node, (ast.For, ast.While)):
            stack.extend([*node.body, *node.orelse])
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            found.append(base)
            found.extend(f"{base}.{alias.name}" for alias in node.names)  # submodules
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = {module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for target in _imports(tree, name, path.name == "__init__.py"):
            if target not in modules or target == name:
                continue
            graph[name].add(target)
            parent = target.rpartition(".")[0]
            while parent and parent in modules:  # importing a.b.c runs a.b's __init__
                if parent != name and not name.startswith(parent + "."):
                    graph[name].add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def main(argv: list[str]) -> int:
    status = 0
    for arg in argv or ["src/tokenmill"]:
        for component in cycles(import_graph(Path(arg))):
            print("import cycle:", " <-> ".join(component))
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
