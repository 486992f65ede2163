"""The guides' Python examples (``.. code-block:: python`` in README.rst and docs/*.rst) parse,
and every fastdist name they import or reach as ``fastdist.X`` exists. The docstrings' examples
run as doctests in ``.ci/run`` (``sphinx-build -b doctest``)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.rst", *sorted((ROOT / "docs").glob("*.rst"))]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, source)`` of each ``.. code-block:: python`` of ``page``."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not re.match(r"\s*\.\. code-block:: python\s*$", line):
            continue
        indent = len(line) - len(line.lstrip())
        body, j = [], i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
            body.append(lines[j])
            j += 1
        code = "\n".join(body)
        skip = min((_indent(b) for b in body if b.strip()), default=0)
        blocks.append((i + 1, "\n".join(b[skip:] for b in body)))
        assert code.strip(), f"{page.name}:{i + 1}: an empty code block"
    return blocks


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


EXAMPLES = [(p, n, code) for p in PAGES for n, code in python_blocks(p)]


def test_the_docs_have_python_examples() -> None:
    assert len(EXAMPLES) >= 5, [f"{p.name}:{n}" for p, n, _ in EXAMPLES]


@pytest.mark.parametrize(
    "page, line, code", EXAMPLES, ids=[f"{p.name}:{n}" for p, n, _ in EXAMPLES]
)
def test_example_parses_and_names_real_fastdist_names(page: Path, line: int, code: str) -> None:
    tree = ast.parse(code, filename=f"{page.name}:{line}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastdist"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), (
                    f"{page.name}:{line}: {node.module}.{alias.name}"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fastdist"):
                    importlib.import_module(alias.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "fastdist"
        ):
            assert hasattr(importlib.import_module("fastdist"), node.attr), (
                f"{page.name}:{line}: fastdist.{node.attr}"
            )


def test_the_arguments_table_lists_every_argument_of_dist_trainer() -> None:
    from fastdist import DistTrainer

    page = (ROOT / "docs" / "concepts.rst").read_text()
    table = page.split("DistTrainer arguments\n", 1)[1].split("\n\n", 2)[1]
    listed = set(re.findall(r"^``(\w+)``", table, flags=re.MULTILINE))
    wanted = set(inspect.signature(DistTrainer).parameters) - {"unknown"}
    assert not wanted - listed, f"missing from docs/concepts.rst's table: {wanted - listed}"
    assert not listed - wanted, f"not arguments of DistTrainer: {listed - wanted}"
