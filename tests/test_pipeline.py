"""``Pipeline`` (pipeline stages, each replicated with DDP, sharded with FSDP, or split with
tensor parallelism and sharded): bad input refused in process, and real worlds of 1, 2 and 4
ranks (8 in the long tier; tests/workers/pipeline_worker.py) that must reach one
process's parameters (float64, AdamW, gradient clipping, a ``(sum, count)`` token loss on
sequences of uneven lengths, update_every=4), evaluate and predict as it does, save a model
that loads strictly into the plain one, resume exactly after a rank dies, and write
checkpoints that DDP resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import Launch, free_port, run_ranks, run_together, torchrun_command
from torch import nn
from workers.pipeline_worker import (
    N_TRAIN,
    TP_PLAN,
    WIDTH,
    HeadFirst,
    OutsideResidual,
    Scaled,
    Sequences,
    SkipAll,
    Tagger,
    flat,
    token_loss,
)

from fastdist import DDP, FSDP, DistTrainer, Pipeline
from fastdist.cli import main
from fastdist.strategies.pipeline_checks import stage_plan, stage_tp_plans
from fastdist.strategies.stage_check import check_cut, check_gradients
from fastdist.strategies.stages import plan_stages

WORKER = Path(__file__).resolve().parent / "workers" / "pipeline_worker.py"


class Loose(Tagger):
    """A parameter of the model itself, which no FSDP stage would shard."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))


def checked(strategy: Pipeline, model: nn.Module) -> None:
    """``strategy.check`` of ``model`` on the CPU, with AdamW."""
    strategy.check(model, torch.optim.AdamW(model.parameters()), torch.device("cpu"), None)


class Flat(nn.Module):
    """No repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)


def three_blocks() -> Tagger:
    model = Tagger()
    del model.blocks[3]
    return model


class Mixed(Tagger):
    """Blocks of two classes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[3] = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)


@pytest.mark.parametrize(
    "make, words",
    [
        (
            lambda: Pipeline(schedule="zero-bubble"),
            "schedule must be one of 'gpipe', '1f1b', 'interleaved",
        ),
        (lambda: Pipeline(schedule="interleaved-1f1b", split=["blocks.2"]), "(2 per rank), got 1"),
        (lambda: Pipeline(stages=1), "got 1: a rank per stage; a model not cut: DDP() or FSDP()"),
        (
            lambda: Pipeline(stages=3, split=["blocks.2"]),
            "2 name(s) for stages=3 (1 per rank), got 1",
        ),
        (lambda: Pipeline(stage_strategy=FSDP(replicate=2)), "HSDP (replicate), CPU offload"),
        (lambda: Pipeline(stage_strategy=FSDP(tp=2, tp_plan=lambda m, mesh: None)), "function"),
        (
            lambda: stage_tp_plans(Tagger(), {"blocks": "colwise"}, plan_stages(Tagger(), 2, None)),
            "tp_plan names blocks, whose parameters lie in pipeline stages [0, 1]",
        ),
        (
            lambda: Pipeline(stage_strategy=FSDP(tp=2, tp_plan=TP_PLAN)).degrees(6),
            "not a multiple of 4: launch a multiple of 4 processes, or use "
            "Pipeline(stages=3, stage_strategy=FSDP(tp=2, ...)) or Pipeline(stages=2) or "
            "Pipeline(stages=3), which fit 6",
        ),
        (lambda: checked(Pipeline(stage_strategy=FSDP()), Loose()), "['scale'] belong to none"),
        (lambda: Pipeline(stage_strategy=FSDP(wrap=[nn.Linear])), "FSDP's wrap (a stage shards"),
        (lambda: Pipeline(stage_strategy=DDP(comm_hook="fp16")), "stage_strategy must be DDP()"),
        (
            lambda: Pipeline(stages=3).degrees(4),
            "not a multiple of 3: launch a multiple of 3 processes, or use Pipeline(stages=2) "
            "or Pipeline(stages=4), which fit 4",
        ),
        (lambda: Pipeline().check_window(1), "or use Pipeline(stages=2, schedule='gpipe')"),
        (lambda: Pipeline().check_batches([[4] * 7 + [2]], 4), "of [4, 4, 4, 2] samples"),
        (lambda: Pipeline().check_batches([[4, 4, 3], [4, 4]], 3), "batch_size_per_gpu dividing"),
        (lambda: plan_stages(Tagger(), 2, ["blocks.9"]), "names ['blocks.9'], which Tagger"),
        (lambda: plan_stages(Tagger(), 2, ["inp"]), "must name blocks of one nn.ModuleList"),
        (lambda: plan_stages(Tagger(), 2, ["blocks.0"]), "blocks: blocks: blocks.0 ... blocks.3"),
        (
            lambda: stage_plan(Tagger(), Pipeline(stages=5), None),
            "Pipeline(stages=5) cuts the model into 5 stages: it needs at least 5 blocks, but "
            "Tagger's blocks holds 4: use Pipeline(stages=2) or Pipeline(stages=3) or "
            "Pipeline(stages=4)",
        ),
        (  # only what fits the world size and the schedule in use
            lambda: stage_plan(Tagger(), Pipeline(stages=4, schedule="interleaved-1f1b"), 8),
            "into 8 stages (2 per rank under interleaved 1F1B): it needs at least 8 blocks, but "
            "Tagger's blocks holds 4: use Pipeline(stages=2, schedule='interleaved-1f1b')",
        ),
        (
            lambda: stage_plan(three_blocks(), Pipeline(stages=2, schedule="interleaved-1f1b"), 2),
            "holds 3: use Pipeline(stages=2)",  # one stage per rank fits where 2 do not
        ),
        (
            lambda: Pipeline(stages=2, stage_strategy=FSDP(tp=4, tp_plan=TP_PLAN)).degrees(4),
            "or use Pipeline(stages=2, stage_strategy=FSDP(tp=2, ...)) or Pipeline(stages=2) or "
            "Pipeline(stages=4), which fit 4",
        ),
        (  # no list of blocks: a fix that works, whether split is given or not
            lambda: plan_stages(Flat(), 2, None),
            "Pipeline(split=None) cuts a model between the blocks of one nn.ModuleList (or "
            "nn.ModuleDict) that its forward runs in order, but Flat holds none, so no split "
            "can cut it as it is: put its repeated layers in one",
        ),
        (  # it offered split= to a user who had passed one
            lambda: plan_stages(Flat(), 2, ["b"]),
            "Pipeline(split=['b']) cuts a model between the blocks of one nn.ModuleList (or "
            "nn.ModuleDict) that its forward runs in order, but Flat holds none, so no split "
            "can cut it as it is: put its repeated layers in one (self.blocks = "
            "nn.ModuleList([...])); then split=None cuts them evenly",
        ),
        (
            lambda: plan_stages(Mixed(), 2, None),
            "Mixed's blocks holds blocks of 2 classes (Block, Linear): pass split=['blocks.2']",
        ),
    ],
)
def test_bad_pipelines_are_refused(make: Any, words: str) -> None:
    with pytest.raises((ValueError, TypeError)) as caught:
        make()
    assert words in str(caught.value)


def test_trainer_refuses_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks DistTrainer runs alike on every rank: a world that the stages do not divide
    (here one process), before a window too short for 1F1B (whose fix would not help)."""
    model = Tagger()

    def trainer(**options: Any) -> None:
        DistTrainer(Sequences(N_TRAIN), model, loss=token_loss, device="cpu", **options)

    with pytest.raises(ValueError, match=r"Pipeline\(stages=3\) runs one stage per rank, but"):
        trainer(strategy=Pipeline(stages=3), update_every=2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun's, before any group: the layout fits
    with pytest.raises(ValueError, match="schedule='1f1b' needs at least as many micro-batch"):
        trainer(strategy=Pipeline(stages=2), update_every=1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(
        ValueError, match=r"Pipeline\(stages=2, schedule='gpipe'\) runs one stage per rank"
    ):
        trainer(strategy=Pipeline(stages=2, schedule="gpipe"))


class Nested(nn.Module):
    """nanoGPT's layout: ``transformer`` (a ModuleDict of wte, the blocks h, ln_f), lm_head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        parts = {"wte": nn.Embedding(8, 4), "h": blocks, "ln_f": nn.LayerNorm(4)}
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = nn.Linear(4, 8, bias=False)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight


def test_even_split_and_owners() -> None:
    plan = plan_stages(Tagger(), 3, None)
    assert plan.blocks == [["blocks.0", "blocks.1"], ["blocks.2"], ["blocks.3"]]
    owners = [plan.owner(n) for n in ("inp.weight", "blocks.2.fc.bias", "out.weight")]
    assert owners == [0, 1, 2]
    nested = plan_stages(Nested(), 2, None)  # the blocks are h, not the mixed ModuleDict
    assert nested.container == "transformer.h" and nested.starts() == ["transformer.h.2"]
    names = ("transformer.wte.weight", "transformer.h.1.bias", "transformer.ln_f.weight")
    assert [nested.owner(n) for n in (*names, "lm_head.weight")] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="held by two pipeline stages: tied weights"):
        plan_stages(Nested(tied=True), 2, None)
    mixed = plan_stages(Mixed(), 2, ["blocks.2"])  # named, blocks of several classes cut
    assert mixed.blocks == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]
    degrees = Pipeline(stage_strategy=FSDP(tp=2, tp_plan=TP_PLAN)).degrees(4)
    assert degrees == {"pp": 2, "dp_shard": 1, "tp": 2}
    plans = stage_tp_plans(Tagger(), TP_PLAN, plan_stages(Tagger(), 2, None))
    assert [sorted(p) for p in plans] == [
        ["blocks.0.fc", "blocks.1.fc", "inp"],
        ["blocks.2.fc", "blocks.3.fc"],
    ]


def test_a_model_is_cut_only_where_its_stages_compute_its_output() -> None:
    """check_cut, in process: the activations passed between the stages, every module's mode
    as it was; a model whose residual connections skip the blocks, whose head is registered
    before the blocks (so the first stage would hold it), or whose forward reads its own
    parameters, is refused naming the fix; an error of the model's own raises as itself."""
    batch = {"x": Sequences(4).x[:4]}

    def run(module: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        return module(batch["x"])

    model = Tagger()
    model.blocks[1].eval()  # modes as they were after the check (which runs in eval mode)
    modes = [m.training for m in model.modules()]
    hidden = check_cut(model, plan_stages(model, 2, None), batch, run)
    assert hidden[0].shape == (4, 9, WIDTH) and hidden[1][0].shape == (4, 9)
    assert [m.training for m in model.modules()] == modes and modes.count(False) == 2
    with pytest.raises(ValueError, match="cut so, it computes another output"):
        check_cut(OutsideResidual(), plan_stages(OutsideResidual(), 2, None), batch, run)
    with pytest.raises(ValueError, match="out runs on pipeline stage 1, but its parameters"):
        check_cut(HeadFirst(), plan_stages(HeadFirst(), 2, None), batch, run)

    class Penalized(Tagger):  # its forward reads every parameter: a stage holds fewer
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            weights = sum(p.square().sum() for p in self.parameters())
            return {"pred": super().forward(x)["pred"] + weights}

    with pytest.raises(ValueError, match=r"another output.*self\.parameters\(\)"):
        check_cut(Penalized(), plan_stages(Penalized(), 2, None), batch, run)

    def broken(module: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        raise KeyError("the user's own bug")

    with pytest.raises(KeyError, match="the user's own bug"):  # as itself, not "cannot be cut"
        check_cut(Tagger(), plan_stages(Tagger(), 2, None), batch, broken)


def test_a_model_is_cut_only_where_its_stages_compute_its_gradients() -> None:
    """check_gradients, in process: Tagger's stages give its gradients (and .grad is left
    untouched); a skip connection around all the blocks, or a parameter of the model itself
    used in the blocks, computes the right output (check_cut passes) but gradients a stage
    other than the one holding the parameter computes, which the pipeline would lose: both
    refused, naming the module and split=."""
    batch = {"x": Sequences(4).x[:4]}

    def run(module: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        return module(batch["x"])

    model = Tagger()
    check_gradients(model, plan_stages(model, 2, None), batch, run)
    assert all(p.grad is None for p in model.parameters())
    for cls, module in ((SkipAll, "inp.weight (inp)"), (Scaled, "scale (Scaled itself)")):
        model = cls()
        plan = plan_stages(model, 2, None)
        check_cut(model, plan, batch, run)  # the output is right
        with pytest.raises(ValueError) as caught:
            check_gradients(model, plan, batch, run)
        words = f"pipeline stage 1 computes a gradient for {module}, but stage 0 holds"
        assert words in str(caught.value) and "split=[...]" in str(caught.value)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def one(out: Path) -> dict[str, Any]:
    _, ranks = run_ranks(WORKER, 1, ["one", str(out)], out / "one", False, cwd=out)
    return ranks[0]


def assert_like_one_process(run: dict[str, Any], one: dict[str, Any], best: bool = False) -> None:
    """The parameters (with ``best``: those of the best model, loaded at the end), the saved
    and the best model, evaluation and prediction of one process (float64: the same sums in
    the same order, so equal to rounding)."""
    assert run["steps"] == one["steps"] == 9
    params = torch.tensor(run["params"])
    assert (params - torch.tensor(flat(Tagger()))).abs().max() > 1e-2  # it trained
    expected = torch.tensor(one["best" if best else "params"])
    torch.testing.assert_close(params, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.tensor(run["saved"]), params, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.tensor(run["best"]), torch.tensor(one["best"]), atol=1e-12, rtol=0
    )
    assert run["eval"]["loss"] == pytest.approx(one["eval"]["loss"], abs=1e-12)
    preds = [[sample["pred"] for sample in r["predict"]] for r in (run, one)]
    torch.testing.assert_close(torch.tensor(preds[0]), torch.tensor(preds[1]), rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def pp4(one: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """The 4-rank world (after the one-process run, whose results it is held against)."""
    _, ranks = run_ranks(WORKER, 4, ["pp4", str(out)], out / "pp4", True, cwd=out, timeout=240)
    return ranks


@pytest.fixture(scope="module")
def pp2(pp4: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """The 2-rank world, which resumes the 4-rank world's FSDP stages' checkpoint."""
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the resident memory
    args = (WORKER, 2, ["pp2", str(out)], out / "pp2", True)
    _, ranks = run_ranks(*args, cwd=out, timeout=180, env=env)
    return ranks


@pytest.mark.slow
def test_two_stages_train_one_process_model(one: dict[str, Any], pp2: list[dict[str, Any]]) -> None:
    """Pipeline(stages=2) with GPipe and 1F1B at 2 ranks (an epoch's last update, of one
    micro-batch, runs GPipe; 1F1B's model has rank 0's weights only: rank 1's are noise); DDP
    at 2 ranks resumes the GPipe run's checkpoint of update 3 (the whole model and optimizer
    state, gathered from the stages), and a pipeline one process's, ending with its best model
    loaded; a model whose residual connections skip its blocks, and one with a skip
    connection around all of them (whose gradients the stages would lose), are refused at
    their first update, alike on both ranks; a short last batch in an update of full ones is
    refused as the trainer is built; with no evaluation or checkpoint after the last update,
    train() leaves the whole model on both ranks; an exception in a stage's code is reported
    as itself; what a callback changes on the model's modules holds in every stage; bf16 FSDP
    stages evaluate and predict."""
    ranks = pp2
    for rank in ranks:  # the whole model on every rank when train() returns, as under DDP
        torch.testing.assert_close(
            torch.tensor(rank["left"]), torch.tensor(one["left"]), rtol=0, atol=1e-12
        )
    for schedule in ("gpipe", "1f1b", "interleaved"):
        assert_like_one_process(ranks[0][schedule], one["plain"])
        assert ranks[1][schedule]["eval"] == ranks[0][schedule]["eval"]
        assert ranks[1][schedule]["predict"] is None  # rank 0 gets the outputs
    # Modes, attributes and hooks a callback gives the model's modules, before each
    # micro-batch too, hold in every stage (interleaved: a stage's first block each).
    assert_like_one_process(ranks[0]["modes"], one["modes"])
    for rank in ranks:
        assert rank["modes"]["modes"] == one["modes"]["modes"]
        assert rank["modes"]["calls"] == one["modes"]["calls"]
    # Of 27 micro-batches: blocks 1 and 3 frozen throughout (the evaluations put each module
    # back in its own mode), block 0 training on 2 of 3, block 2 on every second.
    assert one["modes"]["calls"] == [18, 0, 13, 0]
    for resumed in ("ddp_resumed", "from_one"):
        assert ranks[0][resumed]["start_step"] == 3
        assert_like_one_process(ranks[0][resumed], one["plain"], best=resumed == "from_one")
    # The data shards, not the processes, say whether the rest of the epoch was sharded anew:
    # 2 stages (1 shard) -> DDP at 2 ranks (2 shards) was; 1 process -> 2 stages was not.
    assert (ranks[0]["ddp_resumed"]["rolled_back"], ranks[0]["from_one"]["rolled_back"]) == (
        True,
        False,
    )
    assert ranks[0]["uncut"] == ranks[1]["uncut"]
    assert "OutsideResidual cannot be cut into pipeline stages at ['blocks.2']" in ranks[0]["uncut"]
    assert "h = block(h), residual connections inside the blocks" in ranks[0]["uncut"]
    assert ranks[0]["skip"] == ranks[1]["skip"]  # right outputs, gradients lost: refused
    # Each stage's peak (its parameters, the rise of VmHWM over train()) against its estimate:
    # the wider set's bound (tests/test_estimate.py).
    ratios = [r["memory"]["measured"] / r["memory"]["peaks"][i] for i, r in enumerate(ranks)]
    assert all(0.7 <= ratio <= 1.6 for ratio in ratios), ratios
    assert ranks[0]["short"] == ranks[1]["short"]  # at build time, not at the epoch's end
    assert "[4, 4, 4, 2] samples (data shards of 30 samples" in ranks[0]["short"]
    assert "stage 1 computes a gradient for inp.weight (inp), but stage 0" in ranks[0]["skip"]
    # bf16 FSDP stages evaluate and predict under autocast: each rank's whole model, its own
    # stage in bf16, the other's not (an audit: rank 0 alone raised a dtype mismatch).
    bf16 = [rank["bf16_sharded"] for rank in ranks]
    assert bf16[0]["eval"] == bf16[1]["eval"] and bf16[1]["predict"] is None
    # ... and rank 0 warned that its callbacks_master's on_loss_begin never comes.
    never = "LossPeek.on_loss_begin in callbacks_master is never called: rank 0 runs the"
    warned = [[w for w in rank["warned"] if never in w] for rank in bf16]
    assert len(warned[0]) == 1 and not warned[1]
    assert bf16[0]["eval"]["loss"] == pytest.approx(bf16[0]["fp32"]["loss"], rel=0.05)
    predicted = torch.tensor([sample["pred"] for sample in bf16[0]["predict"]])
    torch.testing.assert_close(predicted, torch.tensor(bf16[0]["fp32_predict"]), rtol=0, atol=0.05)
    # An exception inside a stage is the user's, not torch's wrapper ("failed to run forward").
    assert ranks[0]["boom"] == "ValueError: user bug: a bad value in the first stage"
    assert ranks[1]["boom"] == "ValueError: rank 1 stops with rank 0"


@pytest.mark.slow
def test_two_stages_by_two_replicas(
    one: dict[str, Any], pp4: list[dict[str, Any]], pp2: list[dict[str, Any]], out: Path
) -> None:
    """4 ranks as 2 pipelines of 2 stages: split=["blocks.1"] (1 block, then 3) with DDP
    between the replicas of each stage, whose parameters check_sync_every compares, and
    interleaved 1F1B (2 stages per rank, each with its own DDP); FSDP
    stages (pp=2 x dp_shard=2), and a run resuming their checkpoint of update 3 that ends by
    loading its best model into the sharded stages; data shards of 17 and 16 sequences, the
    second's last micro-batch a filler (it weighs nothing); FSDP() at 2 ranks (the 2-rank
    world) resumes the FSDP stages' checkpoint of update 3, DCP resharding it."""
    ranks = pp4
    for run in ("pp_dp", "pp_inter", "pp_fsdp", "fsdp_resumed"):
        assert_like_one_process(ranks[0][run], one["plain"], best=run == "fsdp_resumed")
        assert {r[run]["eval"]["loss"] for r in ranks} == {ranks[0][run]["eval"]["loss"]}
    assert ranks[0]["fsdp_resumed"]["start_step"] == 3
    assert_like_one_process(ranks[0]["uneven"], one["uneven"])  # with a filler micro-batch
    # Their checkpoint of update 3 (DCP shards, as FSDP's) resumed by FSDP() at 2 ranks, and
    # exported offline: the whole model, every stage's shards, loading strictly.
    assert pp2[0]["fsdp_from_pp_fsdp"]["start_step"] == 3
    assert_like_one_process(pp2[0]["fsdp_from_pp_fsdp"], one["plain"])
    step3 = out / "pp4" / "pp_fsdp" / "save" / "checkpoints" / "step-00000003"
    assert main(["export", str(step3), str(out / "pp_fsdp.pt")]) == 0
    Tagger().load_state_dict(torch.load(out / "pp_fsdp.pt", weights_only=True))


@pytest.mark.slow
def test_killed_pipeline_resumes_exactly(one: dict[str, Any], out: Path) -> None:
    """Rank 1 (the last stage) dies after update 5; torchrun restarts both ranks, which resume
    from update 4's checkpoint (inside epoch 2), each stage taking its part of it."""
    options = ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    command = torchrun_command(WORKER, 2, ["resume", str(out)], [*options, "--max-restarts=1"])
    (result,) = run_together([Launch(command, cwd=out)], timeout=240)
    assert result.returncode == 0, result.describe()
    assert "resumed from" in result.output and "step-00000004" in result.output
    run = json.loads((out / "resume" / "rank0.json").read_text())["resumed"]
    assert run["start_step"] == 4
    assert_like_one_process(run, one["plain"])


@pytest.mark.slow
def test_tensor_parallel_stages(
    one: dict[str, Any], pp4: list[dict[str, Any]], pp2: list[dict[str, Any]]
) -> None:
    """Pipeline(stages=2, stage_strategy=FSDP(tp=2)) at 4 ranks (pp=2 x tp=2: each stage's
    planned layers split over its 2 ranks, FSDP over a dp_shard of one; one data shard, so
    4 micro-batches per update) reaches one process's parameters, and keeps its best model
    (loaded into the split stages at the end); FSDP() at 2 ranks resumes its checkpoint of
    update 3 (DCP shards of the tensor-parallel stages), as one process would."""
    run = pp4[0]["pp_tp"]
    assert_like_one_process(run, one["plain"], best=True)
    assert {r["pp_tp"]["eval"]["loss"] for r in pp4} == {run["eval"]["loss"]}
    assert pp2[0]["fsdp_from_pp_tp"]["start_step"] == 3
    assert_like_one_process(pp2[0]["fsdp_from_pp_tp"], one["plain"])
    # A column-split head would hand the loss half its outputs: refused alike at update 1.
    head = pp4[0]["colwise_head"]
    assert {r["colwise_head"] for r in pp4} == {head}
    assert (
        "stage 1 gives outputs of shapes [(4, 9)] where one process's model gives [(4, 9, 2)]"
        in head
    )
    assert "(out)" in head and "output_layouts=Replicate()" in head


@pytest.mark.slow
@pytest.mark.long
def test_tensor_parallel_stages_with_shards(one: dict[str, Any], out: Path) -> None:
    """pp=2 x dp_shard=2 x tp=2 at 8 ranks (the long tier: 29 s here under load) reaches one
    process's parameters."""
    _, ranks = run_ranks(WORKER, 8, ["pp8", str(out)], out / "pp8", True, cwd=out, timeout=900)
    assert_like_one_process(ranks[0]["pp_dp_tp"], one["plain"])
    assert {r["pp_dp_tp"]["eval"]["loss"] for r in ranks} == {ranks[0]["pp_dp_tp"]["eval"]["loss"]}
