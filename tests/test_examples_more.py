"""The language-model, world-size comparison and streaming examples run end to end, with tiny
settings."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from launch import REPO_ROOT, run_python, run_torchrun

LANGUAGE_MODEL = REPO_ROOT / "examples" / "language_model.py"
COMPARE = REPO_ROOT / "examples" / "compare_world_sizes.py"
STREAM = REPO_ROOT / "examples" / "stream_jsonl.py"
# An odd number of prompts: rank 0 decodes 3 of them, rank 1 decodes 2.
PROMPTS = ["alpha ", "Return the ", "If ", "class Foo", "z"]
TINY_LM = ["--max-bytes", "20000", "--epochs", "1", "--block-size", "32", "--d-model", "32"]
TINY_LM += ["--layers", "1", "--heads", "2", "--max-new-tokens", "16"]


@pytest.mark.slow
def test_language_model_decodes_in_prompt_order(tmp_path: Path) -> None:
    args = [*TINY_LM]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    result = run_torchrun(LANGUAGE_MODEL, nproc=2, args=args, cwd=tmp_path, timeout=120)
    out = result.output
    assert "global batch 32 = 16 per process x 2" in out
    best = re.search(r"best dev loss (\d+\.\d+) \(perplexity (\d+\.\d+)", out)
    assert best, result.describe()
    loss, ppl = float(best.group(1)), float(best.group(2))
    assert 0 < loss < math.log(256) + 0.5  # near or below a uniform guess over bytes
    assert ppl == pytest.approx(math.exp(loss), rel=1e-3)
    assert list((tmp_path / "cache").glob("stdlib_docs_py*.json")), "rank 0 cached the text"
    # Rank 0 alone prints every prompt's sample once, in prompt order, below its header.
    lines = result.stdout.splitlines()
    headers = [(i, line) for i, line in enumerate(lines) if line.startswith("--- sample ")]
    assert [line for _, line in headers] == [
        f"--- sample {i}: {prompt!r}" for i, prompt in enumerate(PROMPTS)
    ], result.describe()
    for (at, _), prompt in zip(headers, PROMPTS, strict=True):
        assert lines[at + 1].startswith(prompt)
    evals = [
        json.loads(line)
        for line in (tmp_path / "save_lm" / "log.jsonl").read_text().splitlines()
        if '"kind": "eval"' in line
    ]
    assert len(evals) == 1 and evals[0]["loss"] == pytest.approx(loss, abs=1e-4)
    assert "ppl" in evals[0]


@pytest.mark.long  # three launches of the example; CI time
def test_compare_world_sizes_plots_and_tabulates(tmp_path: Path) -> None:
    args = ["--quick", "--out-dir", "runs", "-o", "curves.png"]
    result = run_python(COMPARE, args=args, cwd=tmp_path, timeout=150)
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", result.describe()
    for n in (1, 2):
        assert (tmp_path / "runs" / f"{n}proc" / "save" / "log.jsonl").is_file()
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["run", "procs"])
    assert "best dev acc" in lines[header] and "samples/s" in lines[header]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 3]}
    assert rows["1proc"][1:3] == ["1", "64"] and rows["2proc"][1:3] == ["2", "64"]
    assert rows["1proc"][3] == rows["2proc"][3] == "24"  # the same updates: 1497 / 64
    for row in rows.values():
        loss, acc = float(row[4]), float(row[5])
        assert 0 < loss < math.log(10) and 0.1 < acc <= 1  # better than chance after 1 epoch
    assert "largest training-loss gap at one update step" in result.stdout


@pytest.mark.slow
@pytest.mark.long  # stream resume: test_stream, bit-exact, in the default run
def test_stream_example_trains_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """2 ranks stream the JSON-lines digits; a second run with more epochs resumes."""
    first = run_torchrun(STREAM, nproc=2, args=["--epochs", "2"], cwd=tmp_path, timeout=120)
    acc = re.search(r"best dev accuracy (\d\.\d+) at epoch (\d+) \((\d+) updates", first.output)
    assert acc, first.describe()
    # 1497 lines over 2 readers (2 ranks x 1 worker): 749 and 748, 24 batches of 32 per epoch.
    assert float(acc.group(1)) > 0.8 and int(acc.group(3)) == 2 * 24
    lines = (tmp_path / "cache" / "digits-train.jsonl").read_text().splitlines()
    assert len(lines) == 1497 and set(json.loads(lines[0])) == {"x", "target"}
    second = run_torchrun(STREAM, nproc=2, args=["--epochs", "3"], cwd=tmp_path, timeout=120)
    resumed = "resumed from" in second.output and "the end of epoch 2, step 48" in second.output
    assert resumed, second.describe()
    assert re.search(r"\(72 updates", second.output), second.describe()
