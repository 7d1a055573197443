"""The package layers, checked from the source: no import cycles, no import against the layer order.

Layers, bottom to top (a module may import its own layer and the layers below it):

    proto  ←  common  ←  server | worker  ←  sim | bench

`server` and `worker` never import each other. Inside `common/`, the root helpers (logs, metrics,
TLS channels, atomic files, subprocesses) import no subpackage; `wire/` (what both ends decode
identically) imports nothing from `config/` or `deploy/`; `config/` nothing from `deploy/`. Inside
`worker/`, the exchange side never imports the trainer side (`models/`, `data/`, `train/`): the round
loop and the aggregator client stay model-agnostic, like the shards; and models/data never import the
trainers or the exchange.

Every `import` and `from … import` statement counts, at module level and inside functions (a lazy
import is still a dependency). `common/cli.py` names the subcommands' modules as strings and imports
the chosen one at run time: that table is the one sanctioned upward reference, checked here to name
real modules.
"""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("proto", "common", "server", "worker", "sim", "bench")  # the folders installed as dilocox.<name>
LAYER = {"proto": 0, "common": 1, "server": 2, "worker": 2, "sim": 3, "bench": 3}
COMMON_ROOT_HELPERS_MAX = 9  # signing_keys sits beside security: the shard and the site use it at run time

# (importer prefix, imported prefix, why it is refused), checked after the layer order.
FORBIDDEN = [
    ("dilocox.server", "dilocox.worker", "server and worker never import each other"),
    ("dilocox.worker", "dilocox.server", "server and worker never import each other"),
    ("dilocox.sim", "dilocox.bench", "the simulation does not depend on the benchmarks"),
    ("dilocox.common.wire", "dilocox.common.config", "the wire code imports no configuration"),
    ("dilocox.common.wire", "dilocox.common.deploy", "the wire code imports no deployment code"),
    ("dilocox.common.wire", "dilocox.common.cli", "the wire code imports no command line"),
    ("dilocox.common.config", "dilocox.common.deploy", "configuration imports no deployment code"),
    ("dilocox.worker.exchange", "dilocox.worker.models", "the exchange side is model-agnostic"),
    ("dilocox.worker.exchange", "dilocox.worker.data", "the exchange side is model-agnostic"),
    ("dilocox.worker.exchange", "dilocox.worker.train", "the exchange side is model-agnostic"),
    ("dilocox.worker.exchange", "dilocox.worker.site", "the exchange side is model-agnostic"),
    ("dilocox.worker.models", "dilocox.worker.train", "models do not know their trainers"),
    ("dilocox.worker.models", "dilocox.worker.exchange", "models do not know the exchange"),
    ("dilocox.worker.data", "dilocox.worker.train", "data does not know its trainers"),
    ("dilocox.worker.data", "dilocox.worker.exchange", "data does not know the exchange"),
]


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """{dotted module name: file} for every module of the installed `dilocox` namespace."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(["dilocox", *parts])] = path
    return found


def _is_common_root_helper(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 3 and parts[1] == "common" and name != "dilocox.common.cli"


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The dilocox modules `path` imports anywhere in its body (a `from pkg import name` counts as the
    submodule `pkg.name` where that is a module, else as `pkg`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def top_package(name: str) -> str:
    return name.split(".")[1]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            low, high = LAYER[top_package(target)], LAYER[top_package(importer)]
            if low > high:
                problems.append(
                    f"{importer} imports {target}: against the layer order proto ← common ← server|worker ← sim|bench"
                )
                continue
            for source, forbidden, why in FORBIDDEN:
                if _within(importer, source) and _within(target, forbidden):
                    problems.append(f"{importer} imports {target}: {why}")
            if (
                _is_common_root_helper(importer)
                and target.startswith("dilocox.common.")
                and not _is_common_root_helper(target)
            ):
                problems.append(f"{importer} imports {target}: common's root helpers import no common subpackage")
    return problems


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph(ROOT))
    assert cycles == [], "import cycles:\n" + "\n".join(" ↔ ".join(cycle) for cycle in cycles)


def test_no_import_against_the_layer_order():
    problems = layer_violations(import_graph(ROOT))
    assert problems == [], "imports against the layers:\n" + "\n".join(problems)


def test_the_graph_sees_imports_inside_functions():
    """The checker reads lazy imports too (the shard's main imports its metrics inside `run`, the
    worker's inside a branch), and `from package import module` as the module; otherwise the checks
    above would pass on an empty graph."""
    graph = import_graph(ROOT)
    assert "dilocox.server.metrics" in graph["dilocox.server.main"]  # inside a function
    assert "dilocox.worker.metrics" in graph["dilocox.worker.main"]  # inside a function
    assert "dilocox.common.wire.codecs" in graph["dilocox.common.wire.bundle"]  # from package import module
    assert "dilocox.server.shard" in graph["dilocox.sim.inprocess"]
    assert len(graph) > 80


def test_common_root_holds_only_a_few_helpers():
    root_modules = [p.name for p in (ROOT / "common").glob("*.py") if p.name != "__init__.py"]
    assert len(root_modules) <= COMMON_ROOT_HELPERS_MAX, root_modules


def test_cli_dispatch_table_names_real_modules():
    from dilocox.common.cli import SUBCOMMANDS

    modules = module_files(ROOT)
    missing = [module for module, _help in SUBCOMMANDS.values() if module not in modules]
    assert missing == []


def _planted_tree(tmp_path: pathlib.Path, relative: str, line: str) -> pathlib.Path:
    copy = tmp_path / "tree"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "*.txt"))
    target = copy / relative
    target.write_text(target.read_text() + "\n\n" + line + "\n")
    return copy


@pytest.mark.parametrize(
    "relative, line, expected",
    [
        (
            "common/wire/codecs.py",
            "def _planted():\n    from dilocox.worker.exchange.cluster import DilocoCluster",
            "dilocox.common.wire.codecs imports dilocox.worker.exchange.cluster: against the layer order",
        ),
        (
            "server/shard.py",
            "from dilocox.worker.models import gpt",
            "dilocox.server.shard imports dilocox.worker.models.gpt: server and worker never import each other",
        ),
        (
            "common/wire/framing.py",
            "from dilocox.common.config.run import WireConfig",
            "the wire code imports no configuration",
        ),
        (
            "worker/exchange/cluster.py",
            "import dilocox.worker.train.inner_trainer",
            "the exchange side is model-agnostic",
        ),
        (
            "common/logs.py",
            "from dilocox.common.wire import errors",
            "common's root helpers import no common subpackage",
        ),
    ],
)
def test_a_planted_upward_import_is_caught(tmp_path, relative, line, expected):
    problems = layer_violations(import_graph(_planted_tree(tmp_path, relative, line)))
    assert any(expected in problem for problem in problems), problems


def test_a_planted_cycle_is_caught(tmp_path):
    tree = _planted_tree(
        tmp_path, "common/wire/quantize.py", "def _planted():\n    from dilocox.common.wire import codecs"
    )
    cycles = import_cycles(import_graph(tree))
    assert any({"dilocox.common.wire.codecs", "dilocox.common.wire.quantize"} <= set(cycle) for cycle in cycles), cycles


def test_every_package_folder_is_installed():
    """pyproject.toml names its packages one by one; a sub-package left off is missing from a built wheel
    (the Docker image installs one) while an editable install still finds it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        name for name, path in module_files(ROOT).items() if path.name == "__init__.py" and name != "dilocox.worker.api"
    }  # installed as `dilocox`
    assert folders - listed == set()


MODULE_LINES_MAX = 400  # a module longer than this holds more than one concern: split it along them


def test_no_module_is_over_the_line_budget():
    generated = {"dilocox.proto.dilocox_pb2", "dilocox.proto.dilocox_pb2_grpc"}  # protoc's output
    long = {
        name: lines
        for name, path in module_files(ROOT).items()
        if name not in generated and (lines := len(path.read_text().splitlines())) > MODULE_LINES_MAX
    }
    assert long == {}, long
