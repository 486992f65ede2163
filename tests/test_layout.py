"""The package's layout stays as docs/architecture.rst draws it: imports run one way, no cycle,
``import fastdist`` without torch's heavy packages, small files and functions, one formula for
the global batch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fastdist"

#: Bottom to top; a module may import its own layer (without a cycle) and the layers below.
LAYERS = [
    ["fastdist.distributed"],
    ["fastdist.logging"],
    [
        "fastdist.checks",
        "fastdist.fields",
        "fastdist.losses",
        "fastdist.metrics",
        "fastdist.metrics_torchmetrics",
        "fastdist.modes",
        "fastdist.seed",
        "fastdist.state",
    ],
    ["fastdist.data", "fastdist.checkpoint", "fastdist.callbacks", "fastdist.loggers"],
    ["fastdist.strategies"],
    ["fastdist.evaluation", "fastdist.estimate"],
    ["fastdist.trainer"],
    ["fastdist", "fastdist.cli", "fastdist.__main__"],
]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_INIT_LINES = 40


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(path: Path, name: str) -> Iterator[str]:
    """The fastdist modules ``path`` imports anywhere in it (functions and TYPE_CHECKING
    blocks included), as the module, or the package, each import names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("fastdist"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("fastdist"):
                yield base


def layer(name: str) -> int:
    """The index of ``name``'s layer: the longest prefix in :data:`LAYERS` that owns it."""
    best, index = "", -1
    for i, names in enumerate(LAYERS):
        for owner in names:
            owns = name == owner or name.startswith(owner + ".")
            if owns and len(owner) > len(best) and not (owner == "fastdist" and name != owner):
                best, index = owner, i
    assert index >= 0, f"{name} is in no layer of tests/test_layout.py: add it"
    return index


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (resolved to modules that exist)."""
    names = modules()
    edges: dict[str, set[str]] = {}
    for name, path in names.items():
        targets = set()
        for target in imported(path, name):
            while target not in names:  # `from fastdist.x import y`: y may be a name, not a module
                target = target.rpartition(".")[0]
            if target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def test_imports_run_bottom_to_top() -> None:
    upward = [
        f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
        for name, targets in graph().items()
        for target in sorted(targets)
        if layer(target) > layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*stack, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])


def test_no_cycle_between_packages() -> None:
    """Subpackages of one layer may use each other one way only."""

    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    uses = {
        (package(name), package(target))
        for name, targets in graph().items()
        for target in targets
        if package(name) != package(target) and name != "fastdist"
    }
    both = sorted({tuple(sorted(pair)) for pair in uses if pair[::-1] in uses})
    assert not both, f"packages that import each other: {both}"


#: torch's packages that only FSDP, tensor parallelism, pipelines, DCP checkpoints or
#: compiling need (~0.7 s to import): ``import fastdist`` leaves them to the code that uses them.
HEAVY = (
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch._dynamo",
)


def test_import_leaves_the_heavy_torch_packages() -> None:
    code = (
        "import torch, fastdist, sys; "
        f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PACKAGE.parent,  # this checkout's fastdist
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_files_and_functions_are_small() -> None:
    long_files, long_functions = [], []
    for name, path in modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = body_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {lines} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body from its first statement after the docstring."""
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:] or body
    return (node.end_lineno or node.lineno) - body[0].lineno + 1


def test_the_trainer_init_only_assembles() -> None:
    tree = ast.parse((PACKAGE / "trainer" / "dist_trainer.py").read_text())
    (init,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    ]
    assert body_lines(init) <= MAX_INIT_LINES


def test_one_formula_for_the_global_batch() -> None:
    """``batch_size_per_gpu * world_size * update_every`` is computed in one place."""
    places = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                operands = {
                    getattr(n, "attr", getattr(n, "id", None)) for n in (node.left, node.right)
                }
                if "batch_size_per_gpu" in operands:
                    places.append(f"{name}:{node.lineno}")
    assert len(places) == 1, places
