"""fastdist.estimate_memory and ``python -m fastdist estimate`` in this process (one forward on
the CPU, the optimizer stepped on the meta device); the estimates are held to measured peaks
in tests/test_tensor_parallel.py's worlds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run_ranks
from workers.estimate_worker import MoENet, setup

from fastdist import CrossEntropyLoss, estimate_memory
from fastdist.cli import main
from fastdist.estimate import parse_bytes
from fastdist.strategies import FSDP, Pipeline
from fastdist.strategies.blocks import find_blocks
from fastdist.strategies.pipeline_checks import kept_micro_batches

WORKER = Path(__file__).resolve().parent / "workers" / "estimate_worker.py"
SETUP = f"{WORKER}:setup"


def test_sharding_divides_the_states() -> None:
    given = setup()
    parts = (given["model"], given["optimizer"], given["batch"])
    ddp = estimate_memory(*parts, "ddp", 4, loss=given["loss"])
    fsdp = estimate_memory(*parts, "fsdp", 4, loss=given["loss"])
    mesh = estimate_memory(*parts, FSDP(tp=2, tp_plan=given["tp_plan"]), 4, loss=given["loss"])
    params = sum(p.numel() * 4 for p in given["model"].parameters())
    assert ddp.parameters == params
    assert ddp.optimizer == pytest.approx(2 * params, rel=1e-4)  # AdamW: two moments, steps
    assert fsdp.parameters == pytest.approx(params / 4, rel=0.01)
    assert mesh.parameters == pytest.approx(params / 4, rel=0.01)
    assert mesh.activations < fsdp.activations  # the split layers' outputs are halved
    assert mesh.peak < fsdp.peak < ddp.peak
    assert next(given["model"].parameters()).device.type == "cpu"  # the model is left as it was
    assert not given["optimizer"].state  # the real optimizer never stepped


def test_pipeline_stages_split_the_trained_states() -> None:
    """Pipeline(stages=2) at 2 ranks: each stage holds the whole model but trains (gradients,
    AdamW state) its half; 1F1B keeps 2 micro-batches' activations on the first stage, GPipe
    an update's on both; the estimate is the taller stage's."""
    given = setup()
    x, y = given["batch"]
    parts = (given["model"], given["optimizer"], (x[:8], y[:8]))
    plain = estimate_memory(*parts, "ddp", 1, loss=given["loss"], update_every=4)
    pipe = estimate_memory(*parts, Pipeline(stages=2), 2, loss=given["loss"], update_every=4)
    gpipe = Pipeline(stages=2, schedule="gpipe")
    flat = estimate_memory(*parts, gpipe, 2, loss=given["loss"], update_every=4)
    first, last = pipe.stages
    assert (first.strategy, last.strategy) == ("Pipeline() stage 0", "Pipeline() stage 1")
    assert first.parameters == last.parameters == plain.parameters
    assert first.gradients + last.gradients == plain.gradients
    assert first.optimizer + last.optimizer == pytest.approx(plain.optimizer, rel=1e-4)
    assert first.activations > last.activations  # 2 micro-batches' against 1 (and the loss)
    assert flat.stages[1].activations > 3 * last.activations  # 4 micro-batches
    assert pipe.peak == max(first.peak, last.peak) < plain.peak
    budget = parse_bytes("1GB")
    assert pipe.max_batch_size(budget) == min(s.max_batch_size(budget) for s in pipe.stages)
    # Interleaved 1F1B (4 stages, 2 per rank): rank 0 runs 4 warm-up forwards of half its
    # blocks before its first backward, then one more (2.5 micro-batches against 1F1B's 2);
    # rank 1 1.5 against 1.
    inter = Pipeline(stages=2, schedule="interleaved-1f1b")
    assert [kept_micro_batches(inter.schedule, 4, 2, 4, rank) for rank in (0, 1)] == [2.5, 1.5]
    looped = estimate_memory(*parts, inter, 2, loss=given["loss"], update_every=4)
    assert [s.strategy for s in looped.stages] == [f"{inter!r} pp rank {r}" for r in (0, 1)]
    assert all(
        a.activations > b.activations for a, b in zip(looped.stages, pipe.stages, strict=True)
    )
    # Tensor-parallel stages (pp=2 x tp=2 at 4 ranks): each stage's planned layers split in 2.
    tensor = Pipeline(stages=2, stage_strategy=FSDP(tp=2, tp_plan=given["tp_plan"]))
    split = estimate_memory(*parts, tensor, 4, loss=given["loss"], update_every=4)
    assert [s.strategy for s in split.stages] == [f"Pipeline(tp=2) stage {r}" for r in (0, 1)]
    assert all(
        a.activations < b.activations for a, b in zip(split.stages, pipe.stages, strict=True)
    )
    assert split.stages[0].gradients == pytest.approx(first.gradients / 2, rel=0.01)
    assert split.parameters > plain.parameters / 2  # the other stage's layers held whole
    with pytest.raises(ValueError, match="update_every=1 < stages=2: raise update_every to 2"):
        estimate_memory(*parts, Pipeline(stages=2), 2, loss=given["loss"])  # as the trainer


def test_checkpointing_lowers_the_activations() -> None:
    given = setup()
    parts = (given["model"], given["optimizer"], given["batch"])
    plain = estimate_memory(*parts, "ddp", 2, loss=given["loss"])
    every = estimate_memory(*parts, "ddp", 2, loss=given["loss"], activation_checkpointing=True)
    assert every.activations < plain.activations


def test_experts_are_part_of_their_block() -> None:
    # The experts' nn.ModuleList inside each layer are not blocks of their own: checkpointing
    # every second block keeps more than checkpointing every block.
    model = MoENet()
    assert find_blocks(model, None) == [f"layers.{i}" for i in range(4)]
    x = torch.randn(2048, 16)
    parts = (model, torch.optim.AdamW(model.parameters()), (x, (x[:, 0] > 0).long()))
    found = {
        setting: estimate_memory(
            *parts, "ddp", 2, loss=CrossEntropyLoss(), activation_checkpointing=setting
        ).activations
        for setting in (False, True, "every-2")
    }
    assert found[True] < found["every-2"] < found[False], found


def test_command_prints_the_table_and_the_largest_batch(capsys: pytest.CaptureFixture) -> None:
    args = ["estimate", SETUP, "--world-size", "4", "--tp", "2", "--update-every", "2"]
    assert main([*args, "--pp", "2", "--memory", "1GB"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0] == "world size 4, batch_size_per_gpu 64, update_every 2"
    columns = [c.strip() for c in lines[1].split("  ") if c.strip()]  # one per pipeline stage
    stages = ["Pipeline() stage 0", "Pipeline() stage 1"]
    assert columns == ["per rank", "DDP()", "FSDP()", "FSDP(tp=2)", *stages]
    for label in ("parameters", "gradients", "optimizer state", "activations", "peak"):
        assert any(line.startswith(label) for line in lines), printed
    fits = [int(n) for n in lines[-1].split()[-5:-2]]
    assert lines[-1].startswith("max batch in 1 GB")
    given = setup()
    parts = (given["model"], given["optimizer"], given["batch"])
    budget = parse_bytes("1GB")
    for strategy, batch in zip(("ddp", "fsdp"), fits, strict=False):
        found = estimate_memory(*parts, strategy, 4, loss=given["loss"], update_every=2)
        assert found.peak_at(batch) <= budget < found.peak_at(batch + 1)
    assert fits[0] < fits[1] < fits[2]


def test_command_reports_bad_input(capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", SETUP, "--memory", "lots"]) == 1
    assert "memory must be a size such as 80GB" in capsys.readouterr().err
    assert main(["estimate", "no_colon"]) == 1
    assert "module:function" in capsys.readouterr().err
    assert main(["estimate", SETUP, "--world-size", "3", "--tp", "2"]) == 1
    assert "not a multiple of tp=2" in capsys.readouterr().err
    assert main(["estimate", SETUP, "--world-size", "3", "--pp", "2"]) == 1
    assert "not a multiple of 2" in capsys.readouterr().err
    # The layouts the trainer refuses: 1F1B with fewer micro-batches than stages; one stage.
    assert main(["estimate", SETUP, "--world-size", "2", "--pp", "2"]) == 1
    assert "or use Pipeline(stages=2, schedule='gpipe')" in capsys.readouterr().err
    assert main(["estimate", SETUP, "--pp", "1"]) == 1
    assert "--pp 1 is no pipeline (Pipeline needs 2 or more stages)" in capsys.readouterr().err
    # What the trainer refuses under a pipeline, with the trainer's words: not figures.
    pp = [SETUP, "--world-size", "2", "--pp", "2", "--update-every", "2"]
    assert main(["estimate", *pp, "--activation-checkpointing", "true"]) == 1
    assert "activation_checkpointing under Pipeline is not supported" in capsys.readouterr().err
    assert main(["estimate", *pp, "--amp", "fp16"]) == 1
    assert "amp='fp16' under Pipeline: the gradient scaler" in capsys.readouterr().err


def test_command_names_a_setup_that_raises_or_returns_no_dict(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    script = tmp_path / "setups.py"
    script.write_text(
        "def boom():\n    raise RuntimeError('no data here')\n\ndef none():\n    pass\n"
    )
    assert main(["estimate", f"{script}:boom"]) == 1
    err = capsys.readouterr().err
    assert f"SETUP {script}:boom raised RuntimeError: no data here ({script}, line 2)" in err
    assert "Traceback" not in err
    assert main(["estimate", f"{script}:none"]) == 1
    err = capsys.readouterr().err
    assert "returned NoneType: return a dict with model, optimizer and batch" in err
    script.write_text(
        "import torch\ndef one():\n    return {'model': 1, 'optimizer': 2, 'batch': 3}\n"
    )
    assert main(["estimate", f"{script}:one"]) == 1
    assert "returned model=int: return a torch.nn.Module" in capsys.readouterr().err


class ResidualOutside(torch.nn.Module):
    """Its residual connections skip the blocks (``h = h + block(h)``): no cut computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def test_a_model_the_trainer_cannot_cut_is_refused() -> None:
    """Refused by the estimate as at the trainer's first update (the same check), not
    given figures."""
    model, x = ResidualOutside(), torch.randn(8, 16)
    parts = (model, torch.optim.AdamW(model.parameters()), (x, (x[:, 0] > 0).long()))
    with pytest.raises(ValueError, match=r"ResidualOutside cannot be cut into pipeline stages"):
        estimate_memory(*parts, Pipeline(stages=2), 2, loss=CrossEntropyLoss(), update_every=2)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ([SETUP.replace(":setup", ":missing")], "estimate_worker.py has no function missing"),
        ([SETUP, "--tp", "0"], "--tp must be an integer >= 1, got 0"),
        ([SETUP, "--world-size", "0"], "--world-size must be an integer >= 1, got 0"),
        ([SETUP, "--memory", "-5GB"], "memory must be a positive size such as 80GB"),
        ([SETUP, "--memory", "0"], "--memory must be more than 0 bytes"),
    ],
)
def test_command_names_the_bad_argument(
    capsys: pytest.CaptureFixture, args: list[str], error: str
) -> None:
    assert main(["estimate", *args]) == 1
    printed = capsys.readouterr().err
    assert printed.startswith("error: ") and error in printed, printed
    assert printed.count("\n") == 1, printed  # one line, no traceback


def test_unknown_amp_is_refused() -> None:
    given = setup()
    parts = (given["model"], given["optimizer"], given["batch"])
    with pytest.raises(ValueError, match="amp must be one of None, 'bf16', 'fp16'; got 'fp32'"):
        estimate_memory(*parts, amp="fp32")


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("eighty")


@pytest.mark.long  # a memory measurement of 6 trainings: python -m pytest -m long
@pytest.mark.slow
def test_estimate_on_wider_models(tmp_path: Path) -> None:
    # A GRU language model, a conv net under activation checkpointing and an MoE net, under
    # DDP and FSDP at 2 ranks: the estimate against the parameters held plus the rise of
    # VmHWM over train() (MALLOC_MMAP_THRESHOLD_: freed tensors leave the resident memory).
    # Measured/estimated, 2026-11-25/26: GRU 0.76-1.20 (FSDP the lowest, on a loaded machine),
    # conv 1.28-1.55 (the intermediates a block holds only while it runs, and backward's
    # gradients, are not counted; 1.52-1.55 in .ci/run's fresh venv, 1.35 in the dev venv,
    # cause not found), MoE 0.83-0.87; the bound docs/parallelism.rst states. The
    # margin is the documented one, wider than the 15% the MLP tests hold (test_tensor_parallel).
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    _, ranks = run_ranks(WORKER, 2, [str(tmp_path)], tmp_path, torchrun=True, timeout=400, env=env)
    ratios = {
        f"{case} rank {r}": found["measured"] / found["estimate"]
        for r, rank in enumerate(ranks)
        for case, found in rank.items()
    }
    assert len(ratios) == 12
    assert all(0.7 <= ratio <= 1.6 for ratio in ratios.values()), ratios
