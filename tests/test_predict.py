"""``fastdist.evaluation.predict``: in one process here, and in real worlds through a worker.

tests/workers/predict_worker.py runs every case in one launch per world (2 ranks under
torchrun, one plain process) with its spill files in a shared directory of the test; a third
launch lets a rank raise uncaught. The one-process tests below need no launch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import Result, run_ranks, run_torchrun
from torch import nn
from torch.utils.data import Dataset

import fastdist.evaluation.spill as spill_module
from fastdist.evaluation.predict import predict, split_output

WORKER = Path(__file__).resolve().parent / "workers" / "predict_worker.py"
HAS_TORCHMETRICS = importlib.util.find_spec("torchmetrics") is not None
CASES = "order,output_path,sampler,failure" + (",metrics" if HAS_TORCHMETRICS else "")
WORLDS = {"torchrun-2": (True, 2), "python": (False, 1)}
N = 103


# ----- one process, no launch -----


class Numbers(Dataset):
    """``n`` samples ``{"x": [i, -i], "idx": i}``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([float(i), -float(i)]), "idx": i}


class Double(nn.Module):
    """``{"pred": 2x, "idx": idx, "loss": scalar}``; counts its forwards, may fail at one."""

    def __init__(self, fail_at: int = 0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.calls, self.fail_at = 0, fail_at
        self.modes: list[tuple[bool, bool]] = []  # (training, grad enabled) at each forward

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        self.modes.append((self.training, torch.is_grad_enabled()))
        if self.calls == self.fail_at:
            raise ValueError("boom")
        return {"pred": self.scale * x, "idx": idx, "loss": (self.scale * x).sum()}


def expected(n: int) -> list[dict[str, Any]]:
    return [{"pred": [2.0 * i, -2.0 * i], "idx": i} for i in range(n)]


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    path = tmp_path / "shared"
    path.mkdir()
    return path


@pytest.mark.usefixtures("no_dist_env")
def test_dict_outputs_in_order_eval_no_grad(shared: Path) -> None:
    """A dict per sample, the batch-level loss left out; eval + no_grad; mode restored."""
    model = Double()
    model.train()
    assert predict(model, Numbers(11), 4, shared_dir=shared) == expected(11)
    assert model.calls == 3 and set(model.modes) == {(False, False)}
    assert model.training, "the model's training mode must be restored"
    assert list(shared.iterdir()) == []


@pytest.mark.usefixtures("no_dist_env")
def test_to_output_and_tensor_outputs(shared: Path) -> None:
    model = Double()
    got = predict(model, Numbers(5), 2, shared_dir=shared, to_output=lambda o, b: o["idx"] * 10)
    assert got == [0, 10, 20, 30, 40]
    assert predict(nn.Identity(), [torch.tensor([i, i + 1]) for i in range(3)], 2) == [
        [0, 1],
        [1, 2],
        [2, 3],
    ]
    # Outputs that are not JSON keep their type when returned (pickle spill files).
    pairs = predict(model, Numbers(3), 2, to_output=lambda o, b: [(int(i), "x") for i in o["idx"]])
    assert pairs == [(i, "x") for i in range(3)]


@pytest.mark.usefixtures("no_dist_env")
def test_output_path_and_writer(shared: Path, tmp_path: Path) -> None:
    path = tmp_path / "pred.jsonl"
    assert predict(Double(), Numbers(9), 4, output_path=path, shared_dir=shared) is None
    assert [json.loads(line) for line in path.read_text().splitlines()] == expected(9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred.jsonl", "shared"]
    written: list[tuple[int, Any]] = []
    assert predict(Double(), Numbers(9), 4, writer=lambda i, o: written.append((i, o))) is None
    assert written == list(enumerate(expected(9)))
    assert list(shared.iterdir()) == []


@pytest.mark.usefixtures("no_dist_env")
def test_failure_removes_the_spill_dir(shared: Path, tmp_path: Path) -> None:
    model = Double(fail_at=2)
    model.train()
    with pytest.raises(ValueError, match="boom"):
        predict(model, Numbers(11), 4, output_path=tmp_path / "p.jsonl", shared_dir=shared)
    assert list(shared.iterdir()) == [] and not (tmp_path / "p.jsonl").exists()
    assert model.training
    with pytest.raises(ValueError, match="one per sample"):
        predict(Double(), Numbers(5), 2, shared_dir=shared, to_output=lambda o, b: [1])
    assert list(shared.iterdir()) == []


@pytest.mark.usefixtures("no_dist_env")
def test_default_spill_dir_is_private_and_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(**kwargs: Any) -> str:
        made.append(real(**kwargs))
        mode = stat.S_IMODE(os.stat(made[-1]).st_mode)
        assert mode == 0o700, oct(mode)
        return made[-1]

    monkeypatch.setattr(spill_module.tempfile, "mkdtemp", mkdtemp)
    assert predict(Double(), Numbers(3), 2) == expected(3)
    assert len(made) == 1 and not os.path.exists(made[0])


@pytest.mark.usefixtures("no_dist_env")
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"batch_size_per_gpu": 0}, ValueError, "batch_size_per_gpu"),
        ({"writer": print, "output_path": "x.jsonl"}, ValueError, "not both"),
        ({"output_path": "/nonexistent-dir/x.jsonl"}, RuntimeError, "does not exist"),
        ({"to_output": 3}, TypeError, "to_output"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type, words: str, shared: Path) -> None:
    with pytest.raises(error, match=words):
        predict(Double(), Numbers(3), **{"shared_dir": shared, **kwargs})
    assert list(shared.iterdir()) == []


def test_split_output() -> None:
    assert split_output(torch.tensor([1.5, 2.5]), 2) == [1.5, 2.5]
    both = {"a": torch.zeros(2, 1), "b": ["u", "v"], "n": 3, "loss": torch.tensor(1.0)}
    assert split_output(both, 2) == [{"a": [0.0], "b": "u"}, {"a": [0.0], "b": "v"}]
    assert split_output([torch.tensor([1, 2]), torch.tensor([3])], 2) == [[1, 2], [3]]
    # A tuple is several outputs, split like a dict's entries whatever the batch size (its
    # length equal to the batch's once made it one item per sample: another result at another
    # world size).
    pair = (torch.tensor([[0.5], [1.5]]), torch.tensor([10, 20]), torch.tensor(3.0))
    assert split_output(pair, 2) == [([0.5], 10), ([1.5], 20)]
    assert split_output(pair[:2], 2) == split_output(pair, 2)
    assert split_output((torch.tensor([7]), ["x"]), 1) == [(7, "x")]
    # A tuple of batch-first tensors in a dict (a ModelOutput's per-layer hidden_states) gives
    # each sample its rows at any batch size (an audit: at a batch size equal to its length,
    # sample i got layer i of the whole batch; at others it was left out).
    layers = tuple(torch.arange(6.0).view(3, 2) + 10 * k for k in range(3))
    rows = split_output({"hidden_states": layers}, 3)
    assert rows[1] == {"hidden_states": ([2.0, 3.0], [12.0, 13.0], [22.0, 23.0])}
    assert split_output({"hidden_states": tuple(t[:2] for t in layers)}, 2) == rows[:2]
    nested = {"kv": ((torch.zeros(2, 1), torch.ones(2)),)}  # nested alike
    assert split_output(nested, 2) == [{"kv": (([0.0], 1.0),)}] * 2
    # A list as long as the batch is an item per sample, whatever its items' shapes (a second
    # audit: per-sample tensors of 3 rows in batches of 3 were split as rows; one sample's list
    # came back as a tuple).
    own = [torch.full((3, 2), float(i)) for i in range(3)]
    assert split_output({"per": own}, 3)[1] == {"per": [[1.0, 1.0]] * 3}
    assert split_output({"per": own[:1]}, 1) == [{"per": [[0.0, 0.0]] * 3}]
    with pytest.raises(ValueError, match="to_output"):
        split_output(torch.zeros(3, 2), 2)
    with pytest.raises(ValueError, match="to_output"):
        split_output({"loss": torch.tensor(1.0)}, 2)
    with pytest.raises(ValueError, match="tuple output holds"):
        split_output((torch.tensor(1.0), 3), 2)
    with pytest.raises(ValueError, match=r"output\[1\] has shape \(3,\)"):
        split_output((torch.zeros(2), torch.zeros(3)), 2)
    with pytest.raises(TypeError, match="to_output"):
        split_output("text", 2)


# ----- real worlds -----


@dataclass
class World:
    name: str
    size: int
    out: Path
    shared: Path
    result: Result
    ranks: list[dict[str, Any]]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], World]:
    """Launch a world on first use and keep it for the module."""
    worlds: dict[str, World] = {}

    def get(name: str) -> World:
        if name not in worlds:
            torchrun, size = WORLDS[name]
            out, shared = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}-shared")
            args = [CASES, str(out), str(shared)]
            result, ranks = run_ranks(WORKER, size, args, out, torchrun, cwd=out)
            worlds[name] = World(name, size, out, shared, result, ranks)
        return worlds[name]

    return get


@pytest.fixture(params=list(WORLDS))
def world(request: pytest.FixtureRequest, launch: Callable[[str], World]) -> World:
    return launch(request.param)


@pytest.mark.slow
def test_two_ranks_return_the_one_process_outputs_in_order(
    launch: Callable[[str], World],
) -> None:
    """103 samples on 2 ranks (52 + 51): rank 0 gets the 1-process list, in the same order.

    The logits agree to float64 rounding, not bit for bit: a matrix product's kernel may
    round a row differently by where it sits in the batch (seen on one CPU: the last bit of
    one logit of 103), and the ranks' batches hold other rows than one process's.
    """
    one = launch("python").ranks[0]["order"]
    two = launch("torchrun-2").ranks
    assert [o["idx"] for o in one["batch8"]] == list(range(N))
    # Batch 5 leaves rank 1 a last batch of 1 (51 = 10 x 5 + 1), another matrix-product path.
    for batches in ("batch8", "batch5"):
        got = two[0]["order"][batches]
        assert [o["idx"] for o in got] == list(range(N)), batches
        for g, p in zip(got, one["batch8"], strict=True):
            assert g["pred"] == pytest.approx(p["pred"], rel=0, abs=1e-12), batches
    assert two[1]["order"]["batch8"] is None and two[1]["order"]["batch5"] is None
    for data in (one, two[0]["order"]):
        got, plain = data["batch8"], data["plain"]
        assert [o["idx"] for o in plain] == list(range(N))
        for g, p in zip(got, plain, strict=True):
            assert g["idx"] == p["idx"]
            assert g["pred"] == pytest.approx(p["pred"], rel=0, abs=1e-12)
    assert all(rank["order"]["training_after"] for rank in [*two, {"order": one}])


@pytest.mark.slow
def test_order_ignores_training_sampler_settings(world: World) -> None:
    """seed, drop_last, batch size, update_every, a timeout group: always dataset order."""
    sampler = world.ranks[0]["sampler"]
    assert set(sampler) == {"default", "seed7-droplast", "batch5-update3", "timeout-group", "left"}
    for name, got in sampler.items():
        if name == "left":
            continue
        assert got["idx"] == list(range(N)), name
        assert got["plain_loop_diff"] is not None and got["plain_loop_diff"] <= 1e-12, name
    for rank in world.ranks[1:]:
        assert all(v is None for k, v in rank["sampler"].items() if k != "left")


@pytest.mark.slow
def test_output_path_writes_every_sample_once_in_order(world: World) -> None:
    reference = world.ranks[0]["order"]["batch8"]
    data = world.ranks[0]["output_path"]
    lines = Path(data["path"]).read_text().splitlines()
    assert [json.loads(line) for line in lines] == reference
    assert data["written"] == [[i, o] for i, o in enumerate(reference)]
    assert data["tmp_files"] == []
    for rank in world.ranks:
        assert rank["output_path"]["returned"] == [None, None]


@pytest.mark.slow
def test_a_failing_rank_makes_every_rank_raise_and_leaves_nothing(world: World) -> None:
    """The last rank's model raises at its 2nd batch: every rank raises; the dir is removed."""
    failing = world.size - 1
    for rank, data in enumerate(world.ranks):
        case = data["failure"]
        error = case["error"]
        if rank == failing:
            assert error == {"type": "ValueError", "message": f"boom on rank {rank} at batch 2"}
        else:
            assert error["type"] == "RuntimeError"
            assert f"rank {failing}: ValueError: boom" in error["message"]
        assert case["left"] == [] and case["left_again"] == []
        assert case["again"] == (N if rank == 0 else None), "the ranks fell out of step"


@pytest.mark.slow
def test_nothing_left_in_the_shared_dir(world: World) -> None:
    assert list(world.shared.iterdir()) == []
    for rank in world.ranks:
        for case in ("order", "output_path", "sampler"):
            assert rank[case]["left"] == [], case


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHMETRICS, reason="torchmetrics is not installed")
def test_torchmetrics_and_fastdist_metrics_agree_on_any_world(
    launch: Callable[[str], World],
) -> None:
    """101 dev samples (51 + 50 on 2 ranks): same values on every rank and as one process."""
    one = launch("python").ranks[0]["metrics"]
    result = one["evaluator"]
    assert 0.1 < result["acc"] < 0.9
    assert math.isclose(result["tm_acc"], result["acc"], abs_tol=1e-6)  # float32 in torchmetrics
    assert math.isclose(result["tm_macro_f"], result["macro_f"], abs_tol=1e-6)
    assert result["f"] == result["pre"] == result["rec"] == result["acc"]  # micro, single-label
    correct = [p == t for p, t in zip(one["argmax"], one["targets"], strict=True)]
    assert result["acc"] == sum(correct) / 101
    for data in launch("torchrun-2").ranks:
        got = data["metrics"]
        for name in ("evaluator", "again", "trainer"):
            assert got[name].keys() == result.keys(), name
            for key, value in result.items():
                assert math.isclose(got[name][key], value, rel_tol=1e-12), (name, key)
        assert got["only_torchmetrics"] == {k: result[k] for k in ("tm_acc", "tm_macro_f")}
    assert one["again"] == one["trainer"] == result


@pytest.mark.slow
def test_uncaught_failure_ends_the_launch_and_removes_the_dir(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    result = run_torchrun(WORKER, 2, ["crash", str(tmp_path), str(shared)], timeout=90, check=False)
    assert result.returncode != 0, result.describe()
    assert "boom on rank 1 at batch 2" in result.output, result.describe()
    assert list(shared.iterdir()) == []
