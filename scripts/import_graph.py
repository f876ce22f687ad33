"""The import graph of python/sglang_minima and kernels/minima_kernels, read with ast (nothing is imported).

Every import counts: module level, inside functions, under ``TYPE_CHECKING``. Prints each module
with its line count and the project modules it imports, the import cycles, and the imports that go
up the layer order below (test/unit/test_import_graph.py asserts there are none of either).

    python scripts/import_graph.py            # modules, lines, edges; then cycles and upward imports
    python scripts/import_graph.py --packages # the same collapsed to packages (sglang_minima.mem_cache, ...)
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "python", ROOT / "kernels")
PROJECT = ("sglang_minima", "minima_kernels")

# Lowest first; a module may import only from its own layer or a lower one. The longest matching
# prefix places a module (a bare package name only itself). Entry points (the plugin, the launcher) sit on top: nothing below imports them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("sglang_minima", "sglang_minima.config", "sglang_minima.selection", "sglang_minima.cpu_engine",
     "sglang_minima.models", "sglang_minima._cpu"),
    ("sglang_minima.codec",),
    ("sglang_minima.ops", "minima_kernels.common"),
    ("minima_kernels.heuristics", "minima_kernels.device_source"),
    ("minima_kernels.split_decode",),
    ("minima_kernels.tq3_decode", "minima_kernels.mixed_decode", "minima_kernels.fp8_decode",
     "minima_kernels.rotation_merge", "minima_kernels.convert"),
    ("minima_kernels.decode_paths",),
    ("minima_kernels.decode", "minima_kernels.prefill"),
    ("minima_kernels",),
    ("sglang_minima.mem_cache",),
    ("sglang_minima.reporting",),
    ("sglang_minima.layers",),
    ("sglang_minima.hooks",),
    ("sglang_minima.plugin", "sglang_minima.launch_server"),
)


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    local: bool
    """Inside a function (or under TYPE_CHECKING): not run when the module is imported."""


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            name = module_name(path, base)
            if name.split(".")[0] in PROJECT:
                found[name] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an import names: itself, or the nearest enclosing package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def add(target: str | None, node: ast.AST, local: bool) -> None:
        resolved = _resolve(target, modules) if target else None
        if resolved and resolved != name:
            found.append(Import(name, resolved, node.lineno, local))

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and _is_type_checking(child):
                inner = True
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child, local)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    stem = ".".join(base + ([child.module] if child.module else []))
                else:
                    stem = child.module or ""
                for alias in child.names:
                    sub = f"{stem}.{alias.name}"
                    add(sub if sub in modules else stem, child, local)
            visit(child, inner)

    visit(tree, False)
    return found


def external_imports(path: Path) -> set[str]:
    """Top-level names of the non-project packages a file imports anywhere (``sglang``, ``torch``, ...)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - set(PROJECT)


def layer_of(name: str) -> int | None:
    """The module's place in LAYERS, or None when no entry places it."""
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            nested = prefix not in PROJECT and name.startswith(prefix + ".")
            if (name == prefix or nested) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def graph() -> tuple[dict[str, Path], list[Import]]:
    modules = project_modules()
    edges = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return modules, edges


def cycles(nodes, edges: list[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    for e in edges:
        succ[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            strong(v)
    return out


def upward(edges: list[Import]) -> list[Import]:
    """Imports of a higher layer (an unplaced module counts as the highest)."""
    top = len(LAYERS)

    def rank(name: str) -> int:
        found = layer_of(name)
        return top if found is None else found

    return [e for e in edges if rank(e.target) > rank(e.source)]


def package_of(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "sglang_minima" and len(parts) > 2 and parts[1] in ("layers",):
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packages", action="store_true", help="collapse modules to packages")
    args = ap.parse_args()
    modules, edges = graph()
    if args.packages:
        lines: dict[str, int] = {}
        for name, path in modules.items():
            lines[package_of(name)] = lines.get(package_of(name), 0) + len(path.read_text().splitlines())
        pedges = sorted({(package_of(e.source), package_of(e.target)) for e in edges} - {(p, p) for p in lines})
        for pkg in sorted(lines):
            targets = [t for s, t in pedges if s == pkg]
            print(f"{pkg} ({lines[pkg]} lines) -> {', '.join(targets) or '-'}")
        loops = cycles(lines, [Import(s, t, 0, False) for s, t in pedges])
        print("package cycles:", "; ".join(" <-> ".join(c) for c in loops) or "none")
        return
    for name, path in modules.items():
        mine = sorted({(e.target, e.local) for e in edges if e.source == name})
        shown = ", ".join(t + (" (in a function)" if local else "") for t, local in mine) or "-"
        print(f"{name} ({len(path.read_text().splitlines())} lines) -> {shown}")
    loops = cycles(modules, edges)
    print("\nmodule cycles:", "; ".join(" -> ".join(c) for c in loops) or "none")
    print("modules with no layer:", ", ".join(n for n in modules if layer_of(n) is None) or "none")
    bad = upward(edges)
    print("upward imports:", "; ".join(f"{e.source}:{e.line} -> {e.target}" for e in bad) or "none")


if __name__ == "__main__":
    main()
