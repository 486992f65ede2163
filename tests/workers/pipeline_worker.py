"""Worker for tests/test_pipeline.py: ``Pipeline`` against one process.

Usage::

    pipeline_worker.py one OUT_DIR   # one process: the plain model
    pipeline_worker.py pp2 OUT_DIR   # torchrun, 2 ranks: Pipeline(stages=2), gpipe and 1f1b;
                                     # DDP resuming the gpipe run's checkpoint, a
                                     # pipeline resuming one's, FSDP() resuming pp4's FSDP
                                     # stages' (run "one" and "pp4" first)
    pipeline_worker.py pp4 OUT_DIR   # torchrun, 4 ranks: 2 stages x 2 replicas (1f1b), DDP
                                     # and FSDP stages; FSDP(tp=2) stages (pp=2 x tp=2)
    pipeline_worker.py resume OUT_DIR  # torchrun --max-restarts=1, 2 ranks: rank 1 dies
                                       # after update 5 on the first attempt
    pipeline_worker.py pp8 OUT_DIR   # torchrun, 8 ranks: pp=2 x dp_shard=2 x tp=2 (long tier)

Every run trains :class:`Tagger` (float64, 4 residual blocks) on sequences of 1 to 9 real
tokens padded to 9, with a ``(sum, count)`` token loss, AdamW, gradient clipping and a global
batch of 16 sequences per update (4 in an epoch's last); then evaluates, predicts and saves
the model. Writes ``OUT_DIR/<mode>/rank<R>.json``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel
from workers import estimate_worker
from workers.ending import exit_now
from workers.token_loss_worker import Sequences
from workers.trainer_worker import refused, write_json

from fastdist import DDP, FSDP, Callback, DistTrainer, LossMetric, Pipeline, get_rank
from fastdist.callbacks import GradientClipCallback

WIDTH, N_TRAIN, N_DEV = 16, 36, 13  # 9 micro-batches of 4: updates of 4, 4 and 1
UNEVEN = 33  # at 4 ranks, data shards of 17 and 16 sequences
#: Tagger's layers split over 2 tensor-parallel ranks: output features, gathered again (its
#: blocks add their input to their layer's output).
TP_PLAN = {"inp": ColwiseParallel(output_layouts=Replicate())}
TP_PLAN["blocks.*.fc"] = ColwiseParallel(output_layouts=Replicate())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class Tagger(nn.Module):
    """An input projection, 4 residual blocks (an ``nn.ModuleList``), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, WIDTH, dtype=torch.float64)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.out = nn.Linear(WIDTH, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return {"pred": self.out(h).squeeze(-1)}


class OutsideResidual(Tagger):
    """Its residual connections skip the blocks: it cannot be cut into stages."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return {"pred": self.out(h).squeeze(-1)}


class SkipAll(Tagger):
    """A skip connection around all the blocks: every stage's output is right, but the last
    stage recomputes ``inp``, whose gradient through the skip the first stage never gets."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = e = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return {"pred": self.out(h + e).squeeze(-1)}


class Scaled(Tagger):
    """A parameter of the model itself used inside the blocks (of both stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) * self.scale
        return {"pred": self.out(h).squeeze(-1)}


class WideHead(Tagger):
    """A head of 2 outputs (what a column-split head would shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 2, dtype=torch.float64)


class Boom(Tagger):
    """Raises in training once armed (its stage check, in eval mode, passes)."""

    armed = False

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if Boom.armed and self.training:
            raise ValueError("user bug: a bad value in the first stage")
        return super().forward(x)


class ArmAtUpdate2(Callback):
    """At update 2 rank 0's stage raises (inside torch's schedule); rank 1 stops too (in this
    callback), so that neither waits for the other."""

    def on_batch_begin(self, batch: Any) -> None:
        if self.trainer.state.global_step == 1:
            Boom.armed = True
            if get_rank() == 1:
                raise ValueError("rank 1 stops with rank 0")


class Scale(nn.Module):
    """``factor`` times its input in training mode, counting those forwards (a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.5
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return h
        self.calls += 1
        return h * self.factor


class ScaledBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale(torch.tanh(self.fc(h)))


class Moded(Tagger):
    """Blocks whose output depends on their mode; block 1's frozen (eval) before the build."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock() for _ in range(4))
        self.blocks[1].scale.eval()


class ChangeModes(Callback):
    """What a callback changes on the model after the build: block 3 frozen, an attribute of
    block 2, a forward hook on block 1 (its stage's first under a pipeline); and before each
    micro-batch, the modes of blocks 0 and 2. The evaluation after each epoch puts each module
    back in its own mode (blocks 1 and 3 stay frozen)."""

    def on_train_begin(self) -> None:
        model, self.drawn = self.trainer.model, 0
        model.blocks[3].scale.eval()
        model.blocks[2].scale.factor = 3.0
        model.blocks[1].register_forward_hook(lambda module, args, output: output * 0.5)

    def on_batch_begin(self, batch: Any) -> None:
        self.drawn += 1
        self.trainer.model.blocks[0].scale.train(self.drawn % 3 != 0)
        self.trainer.model.blocks[2].scale.train(self.drawn % 2 == 0)


def with_modes(strategy: Any, out: Path) -> dict:
    """:func:`train` of :class:`Moded` changed by :class:`ChangeModes`; the modes and the
    counts of training forwards it ends with."""
    model = Moded()
    result = train(strategy, out, model=model, callbacks=[ChangeModes()])
    result["modes"] = [module.training for module in model.modules()]
    result["calls"] = [float(block.scale.calls) for block in model.blocks]
    return result


def failure(make: Any) -> str:
    """The exception a run raised, as the trainer's one-line error names it."""
    try:
        make()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


class DieOnce(Callback):
    """Rank 1 dies after update ``at`` on the first attempt (``None``: never); the step each
    attempt starts at is kept."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_train_begin(self) -> None:
        self.start_step = self.trainer.state.global_step

    def on_step_end(self) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and get_rank() == 1 and self.trainer.state.global_step == self.at:
            os._exit(1)


class HeadFirst(Tagger):
    """Registers its head before its blocks, so the first stage would hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = self._modules.pop("blocks")  # registered again: after out


def token_loss(output: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error summed over the real tokens, and their number."""
    mask = batch["mask"]
    return ((output["pred"] - batch["target"]) ** 2 * mask).sum(), mask.sum()


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def train(strategy: Any, out: Path, batch: int = 4, update_every: int = 4, **kw: Any) -> dict:
    """Train 3 epochs (9 updates); what rank 0 holds of the results."""
    model = kw.pop("model", None) or Tagger()
    die, resume = DieOnce(kw.pop("die_at", None)), kw.pop("resume", "auto")
    trainer = DistTrainer(
        Sequences(kw.pop("n_train", N_TRAIN), squash=True),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1),
        loss=token_loss,
        callbacks_all=[GradientClipCallback(clip_value=0.5), die, *kw.pop("callbacks", [])],
        batch_size_per_gpu=batch,
        update_every=update_every,
        n_epochs=3,
        dev_data=Sequences(N_DEV, seed=4, squash=True),
        metrics=[LossMetric(nn.MSELoss(), pred="pred", target="target")],
        metric_key="-loss",
        dev_batch_size_per_gpu=2,
        save_path=str(out / "save"),
        keep_checkpoints=9,  # update 3's is resumed by other layouts
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
        load_best_model=kw.pop("load_best_model", False),
        timeout=60,
        **kw,
    )
    summary = trainer.train(resume)
    result: dict[str, Any] = {
        "steps": summary["steps"],
        "start_step": die.start_step,
        "rolled_back": trainer.state.rolled_back,  # resumed on other data shards, among others
        "eval": trainer.evaluate(),
        "predict": trainer.predict(Sequences(N_DEV, seed=4, squash=True)),
    }
    saved = trainer.save_model(out / "model.pt")
    full = trainer.strategy.full_state_dict()
    if full is not None:
        plain = type(model)()
        plain.load_state_dict(full)  # strict: every key of the plain model, no other
        result["params"] = flat(plain)
        plain.load_state_dict(torch.load(saved, weights_only=True))
        result["saved"] = flat(plain)
        plain.load_state_dict(torch.load(trainer.best_model_path, weights_only=True))
        result["best"] = flat(plain)
    return result


class LossPeek(Callback):
    def on_loss_begin(self, batch: Any, output: Any) -> None:
        pass


def bf16_sharded(out: Path) -> dict[str, Any]:
    """A float32 Tagger trained with bf16 FSDP stages: its evaluation and prediction, rank 0's
    fp32 evaluation of the same weights by hand, and the warnings logged as it was built (a
    callbacks_master's ``on_loss_begin``, which rank 0, the first stage, never calls)."""
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fastdist").addHandler(handler)
    model, train, data = Tagger().float(), Sequences(N_TRAIN), Sequences(N_DEV, seed=4)
    train.x, data.x = train.x.float(), data.x.float()
    trainer = DistTrainer(
        train, model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.02), loss=token_loss,
        batch_size_per_gpu=4, update_every=4, n_epochs=1, dev_data=data,
        metrics=[LossMetric(nn.MSELoss(), pred="pred", target="target")], metric_key="-loss",
        save_path=str(out), use_tqdm=False, device="cpu", amp="bf16", timeout=60,
        strategy=Pipeline(stages=2, stage_strategy=FSDP()), callbacks_master=[LossPeek()],
    )  # fmt: skip
    logging.getLogger("fastdist").removeHandler(handler)
    trainer.train()
    result = {"eval": trainer.evaluate(), "predict": trainer.predict(data), "warned": warnings}
    full = trainer.strategy.full_state_dict()
    if full is not None:
        plain = Tagger().float()
        plain.load_state_dict(full)
        batch = {"x": data.x, "target": torch.stack([data[i]["target"] for i in range(N_DEV)])}
        with torch.no_grad():
            pred = plain(batch["x"])["pred"].float()
        result["fp32"] = {"loss": nn.MSELoss()(pred, batch["target"].float()).item()}
        result["fp32_predict"] = pred.tolist()
    return result


def left_by_train(strategy: Any) -> list[float]:
    """The model as ``train()`` leaves it on this rank, with no evaluation or checkpoint after
    the last update (those gather a pipeline's stages themselves)."""
    model = Tagger()
    DistTrainer(
        Sequences(N_TRAIN, squash=True),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.02),
        loss=token_loss,
        batch_size_per_gpu=4,
        update_every=4,
        n_epochs=1,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
        timeout=60,
    ).train()
    return flat(model)


def loaded_on_rank_zero() -> Tagger:
    """A Tagger whose weights rank 0 alone holds (a script loading pretrained weights on rank 0
    only, as DDP allows): the other ranks' are noise until the trainer starts them alike."""
    model = Tagger()
    if get_rank() != 0:
        with torch.no_grad():
            for param in model.parameters():
                param.normal_()
    return model


def main(argv: list[str]) -> int:
    mode, out = argv[1], Path(argv[2]) / argv[1]
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    if mode == "one":
        result["plain"] = train("ddp", out / "plain")
        result["uneven"] = train("ddp", out / "uneven", n_train=UNEVEN)
        result["left"] = left_by_train("ddp")
        result["modes"] = with_modes("ddp", out / "modes")
    elif mode == "pp2":
        result["left"] = left_by_train(Pipeline(stages=2))
        result["gpipe"] = train(Pipeline(stages=2, schedule="gpipe"), out / "gpipe")
        # 2 stages per rank (one block each), interleaved; the epoch's last update LoopedBFS.
        interleaved = Pipeline(stages=2, schedule="interleaved-1f1b")
        result["interleaved"] = train(interleaved, out / "interleaved")
        result["modes"] = with_modes(interleaved, out / "modes")
        one_f_one_b, model = Pipeline(stages=2, schedule="1f1b"), loaded_on_rank_zero()
        result["1f1b"] = train(one_f_one_b, out / "1f1b", model=model)
        # The pipeline's checkpoint of update 3 (the end of epoch 1) resumed by DDP at 2 ranks.
        step3 = out / "gpipe" / "save" / "checkpoints" / "step-00000003.pt"
        result["ddp_resumed"] = train(DDP(), out / "ddp", update_every=2, resume=str(step3))
        # And the one-process run's checkpoint of update 3 resumed by the pipeline.
        plain = out.parent / "one" / "plain" / "save" / "checkpoints" / "step-00000003.pt"
        best = {"resume": str(plain), "load_best_model": True}  # ends with the best model
        result["from_one"] = train(Pipeline(stages=2), out / "from_one", **best)
        result["uncut"] = refused(
            lambda: train(Pipeline(stages=2), out / "uncut", model=OutsideResidual())
        )
        result["skip"] = refused(lambda: train(Pipeline(stages=2), out / "skip", model=SkipAll()))
        # 30 sequences: 7 batches of 4 and one of 2, the last update mixing them.
        result["short"] = refused(lambda: train(Pipeline(stages=2), out / "short", n_train=30))
        # The 4-rank FSDP stages' checkpoint of update 3 (DCP shards) resumed by FSDP() here,
        # and the tensor-parallel stages' (pp=2 x tp=2).
        for run in ("pp_fsdp", "pp_tp"):
            sharded = out.parent / "pp4" / run / "save" / "checkpoints" / "step-00000003"
            resumed = train(FSDP(), out / f"from_{run}", update_every=2, resume=str(sharded))
            result[f"fsdp_from_{run}"] = resumed
        # Per-stage memory, estimated and measured (the launch sets MALLOC_MMAP_THRESHOLD_).
        result["memory"] = estimate_worker.compare(Pipeline(stages=2), 2, 1, size=8)
        result["bf16_sharded"] = bf16_sharded(out / "bf16_sharded")
        boom = {"model": Boom(), "callbacks": [ArmAtUpdate2()]}  # last: the group is left failed
        result["boom"] = failure(lambda: train(Pipeline(stages=2), out / "boom", **boom))
    elif mode == "resume":
        result["resumed"] = train(Pipeline(stages=2), out / "resumed", checkpoint_every=1, die_at=5)
    elif mode == "pp4":
        strategy = Pipeline(stages=2, schedule="1f1b", split=["blocks.1"])
        result["pp_dp"] = train(strategy, out / "pp_dp", update_every=2, check_sync_every=1)
        # Interleaved: 2 stages per rank, each replicated by its own DDP over 2 pipelines.
        looped = Pipeline(stages=2, schedule="interleaved-1f1b")
        result["pp_inter"] = train(looped, out / "pp_inter", update_every=2, check_sync_every=1)
        # 33 sequences: data shards of 17 and 16, so the second's last update is a filler.
        result["uneven"] = train(Pipeline(stages=2), out / "uneven", update_every=2, n_train=UNEVEN)
        sharded = Pipeline(stages=2, stage_strategy=FSDP())
        result["pp_fsdp"] = train(sharded, out / "pp_fsdp", update_every=2)
        # Its checkpoint of update 3 (sharded stages' parameters and AdamW state), resumed.
        step3 = out / "pp_fsdp" / "save" / "checkpoints" / "step-00000003"
        best = {"resume": str(step3), "load_best_model": True}  # ends with the best model
        resumed = train(sharded, out / "fsdp_resumed", update_every=2, **best)
        result["fsdp_resumed"] = resumed
        # pp=2 x tp=2: one data shard, so 4 micro-batches per update (16 sequences).
        tensor = Pipeline(stages=2, stage_strategy=FSDP(tp=2, tp_plan=TP_PLAN))
        result["pp_tp"] = train(tensor, out / "pp_tp", load_best_model=True)
        # The head split too ("colwise"): each rank's stage 1 would hand on half the outputs.
        plan = {**TP_PLAN, "out": "colwise"}
        sharded_head = Pipeline(stages=2, stage_strategy=FSDP(tp=2, tp_plan=plan))
        wide = WideHead()
        result["colwise_head"] = refused(lambda: train(sharded_head, out / "head", model=wide))
    elif mode == "pp8":
        tensor = Pipeline(stages=2, stage_strategy=FSDP(tp=2, tp_plan=TP_PLAN))
        result["pp_dp_tp"] = train(tensor, out / "pp_dp_tp", update_every=2)
    else:
        raise ValueError(f"unknown mode {mode!r}: one, pp2, pp4, pp8 or resume")
    write_json(out, result)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
