"""The project's own module graph: no import cycles, counting imports placed inside functions and classes."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runner", "model_zoo")


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the project's packages (a package is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `module` imports anywhere in its file. `from a.b import c` is a.b.c where that is
    a module, else a.b; a name that is not itself a module counts as its longest prefix that is one."""
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            found.update(known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else known(base)
                         for alias in node.names)
    return found - {None, module}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    modules = project_modules()
    graph = {m: imported(m, path, modules) for m, path in modules.items()}
    bad = cycles(graph)
    report = "\n\n".join(f"cycle of {len(c)} modules:\n" + "\n".join(
        f"  {a} -> {b}" for a in sorted(c) for b in sorted(graph[a] & c)) for c in bad)
    assert not bad, f"import cycles among the project's modules:\n{report}"
