"""The import contracts of layerwise, checked from the source: layers, the plugin boundary, no cycles.

Run it (``python tools/check_imports.py``; ``tox -e lint`` and the test suite do) to list every
import that breaks a contract; the exit status is 1 when there is one. Every import counts,
also one inside a function (a lazy import is still a dependency); only imports under
``if TYPE_CHECKING:`` are left out, as they never run.

The contracts:

1. **Layers**: a package may import the packages below it in :data:`LAYERS`, never one above.
   Packages on one line are independent of each other.
2. **The plugin boundary**: built-in plugins, the model zoo and the example plugin import only
   the public plugin API (:data:`PUBLIC`), plus their own package; and the rest of layerwise
   names no plugin: it reaches them through the registries.
3. **No cycles** between modules (the benchmark scripts' included).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> the package it installs as (setup.py's map)
SOURCES = {"core": "layerwise", "plugins": "layerwise.plugins", "model_zoo": "layerwise.model_zoo"}
#: top to bottom; a package imports only what is on a lower line (the root ``layerwise`` is the top)
LAYERS: list[tuple[str, ...]] = [
    ("layerwise.__main__",),
    ("layerwise.cli",),
    ("layerwise.scaffold",),
    ("layerwise.testing",),
    ("layerwise.plugins", "layerwise.model_zoo"),
    ("layerwise.plugin",),
    ("layerwise.verbs",),
    ("layerwise.planning",),
    ("layerwise.model_io",),
    ("layerwise.tracing",),
    ("layerwise.reports",),
    ("layerwise.host",),
    ("layerwise.runtime",),
    ("layerwise.algorithms",),
    ("layerwise.common",),
    ("layerwise.errors",),
]
#: the root package (``layerwise.compress`` & co., imported lazily) counts as this layer
ROOT_LAYER = "layerwise.verbs"
#: what a plugin may import from layerwise: the root package and the plugin API
PUBLIC = ("layerwise", "layerwise.plugin")
#: the built-in plugins: registered through entry points, imported by nothing else
PLUGIN_PACKAGES = ("layerwise.plugins", "layerwise.model_zoo")
#: importing these names from the root package is no dependency on the verbs
ROOT_CONSTANTS = {"__version__"}
#: plugin code outside the installed packages that keeps the boundary too
EXTERNAL_PLUGINS = {"examples/layerwise-starcoder2": "layerwise_starcoder2"}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    path: Path


def module_name(path: Path, folder: str, package: str) -> str:
    parts = path.relative_to(ROOT / folder).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((package, *parts))


def source_files() -> Iterator[tuple[Path, str, bool]]:
    """(file, module, is_package) for every installed module."""
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, module_name(path, folder, package), path.name == "__init__.py"


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports_of(path: Path, module: str, is_package: bool, known: set[str]) -> Iterator[Import]:
    """Every layerwise module ``path`` imports (``from X import name`` counts ``X.name`` when a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_lines(tree)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno, path)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [alias.name for alias in node.names]
            if base == "layerwise" and set(names) <= ROOT_CONSTANTS:
                continue
            submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in known]
            for target in submodules or [base]:
                yield Import(module, target, node.lineno, path)


def layer_of(module: str) -> int | None:
    for index, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return index
    return None


def package_of(module: str) -> str | None:
    for packages in LAYERS:
        for p in packages:
            if module == p or module.startswith(p + "."):
                return p
    return None


def check() -> list[str]:
    files = list(source_files())
    known = {module for _, module, _ in files}
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for path, module, is_package in files:
        for imp in imports_of(path, module, is_package, known):
            if not (imp.imported == "layerwise" or imp.imported.startswith("layerwise.")):
                continue
            where = f"{imp.path.relative_to(ROOT)}:{imp.line}"
            graph.setdefault(module, set()).add(imp.imported)
            mine, theirs = layer_of(module), layer_of(imp.imported)
            if imp.imported == "layerwise":
                theirs = layer_of(ROOT_LAYER)
            if mine is not None and theirs is not None and theirs <= mine and \
                    package_of(module) != package_of(imp.imported):
                problems.append(f"{where}: {module} imports {imp.imported}, a layer above or beside it")
            if package_of(imp.imported) in PLUGIN_PACKAGES and package_of(module) not in PLUGIN_PACKAGES:
                problems.append(f"{where}: {module} imports the plugin module {imp.imported}; reach plugins "
                                f"through the registries (layerwise.plugin.registry)")
            if package_of(module) in PLUGIN_PACKAGES:
                own = package_of(module)
                if not (imp.imported.startswith(f"{own}.") or imp.imported == own or _public(imp.imported)):
                    problems.append(f"{where}: plugin module {module} imports {imp.imported}; plugins import only "
                                    f"the public plugin API ({', '.join(PUBLIC)})")
    problems += _external_plugin_problems()
    graph.update(_bench_graph())
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return problems


def _public(module: str) -> bool:
    return module in PUBLIC or module.startswith("layerwise.plugin.")


def _external_plugin_problems() -> list[str]:
    problems = []
    for folder, package in EXTERNAL_PLUGINS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "tests" in path.relative_to(ROOT / folder).parts:
                continue
            for imp in imports_of(path, package, True, set()):
                if imp.imported.startswith("layerwise") and not imp.imported.startswith("layerwise_") \
                        and not _public(imp.imported):
                    problems.append(f"{path.relative_to(ROOT)}:{imp.line}: the example plugin imports "
                                    f"{imp.imported}; plugins import only the public plugin API")
    return problems


def _bench_graph() -> dict[str, set[str]]:
    """The benchmark scripts import each other by bare name (they run with bench/ on the path)."""
    scripts = {path.stem: path for path in sorted((ROOT / "bench").glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for stem, path in scripts.items():
        for imp in imports_of(path, f"bench.{stem}", False, set()):
            name = imp.imported.removeprefix("bench.").split(".")[0]
            if name in scripts and name != stem:
                graph.setdefault(f"bench.{stem}", set()).add(f"bench.{name}")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(_resolve(graph, node)):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(_a_cycle(graph, sorted(component)))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _resolve(graph: dict[str, set[str]], node: str) -> set[str]:
    """A package's ``__init__`` importing its own submodules is no cycle: only edges to other modules."""
    return {m for m in graph.get(node, ()) if m != node and not node.startswith(m + ".")}


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete path through the component that comes back to its start, for the message."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = next((m for m in sorted(_resolve(graph, path[-1])) if m in members), None)
        if nxt is None:
            return component
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} import contract violation(s)" if problems else "import contracts kept")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
