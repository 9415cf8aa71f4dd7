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


MAX_PARAMETERS = 12


def test_no_function_takes_more_than_twelve_parameters():
    """Host code passes typed objects (EngineConfig, PlanSpec, StepLengths), not flag lists. Exempt: the command
    entry points (their flags are their parameters) and Triton kernels (a pointer, stride or constant per argument,
    as a GPU launch takes them)."""
    from runner.cli import COMMANDS
    entry_points = {fn.__name__ for fn in COMMANDS.values()}
    wide = []
    for path in sorted((ROOT / "runner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in entry_points:
                continue
            if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            if len(names) > MAX_PARAMETERS:
                wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {len(names)} parameters")
    assert not wide, "\n".join(wide)


def test_no_flag_is_defined_twice():
    """A flag that several commands take is defined once (a Help type in runner.args, or an EngineConfig field):
    no two commands carry the same help text each in their own docstring, and a command's own flag of a shared
    name means something else (its help differs)."""
    from runner.args import flags_of
    from runner.cli import COMMANDS
    by_name: dict[str, list] = {}
    for command, fn in COMMANDS.items():
        for f in flags_of(fn):
            by_name.setdefault(f.name, []).append((command, f))
    copies = []
    for name, defs in by_name.items():
        own = [(c, f.help) for c, f in defs if not f.shared]
        shared = {f.help for _, f in defs if f.shared}
        helps = [h for _, h in own]
        if len(set(helps)) < len(helps) or shared & set(helps):
            copies.append(f"--{name}: {own}")
    assert not copies, "flags written out again instead of shared:\n" + "\n".join(copies)
