"""Worker for tests/test_tensor_parallel.py: FSDP with tensor parallelism (``FSDP(tp=2)``).

Usage::

    tp_worker.py four OUT_DIR   # torchrun, 4 ranks: bad input, then a 2x2 mesh killed and resumed
    tp_worker.py two OUT_DIR    # torchrun, 2 ranks: DDP, tp=2 alone, the 2x2 checkpoint on FSDP
    tp_worker.py one OUT_DIR    # one process: the 2x2 checkpoint on the plain model
    tp_worker.py compiled OUT_DIR  # torchrun, 4 ranks: the 2x2 mesh, plain and compiled

Writes ``OUT_DIR/<mode>/rank<R>.json``; on 4 and 2 ranks also a memory estimate against the
measured peak (tests/workers/estimate_worker.py) for the 2x2 mesh, DDP and FSDP. The other
runs train tests/workers/fsdp_worker.py's BlockNet with AdamW, update_every=2 and gradient
clipping over 40 samples (global batch 16).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from workers import estimate_worker
from workers.ending import exit_now
from workers.fsdp_worker import BlockNet
from workers.trainer_worker import ToyData, write_json

from fastdist import AccuracyMetric, Callback, CrossEntropyLoss, DistTrainer, LossMetric, get_rank
from fastdist.callbacks import GradientClipCallback
from fastdist.strategies import FSDP
from fastdist.strategies.topology import _MESHES

PLAN = {"blocks.0": "colwise", "blocks.1": "rowwise"}  # hidden features split, then summed
KILL_AT = 3  # the 2x2 run's rank 1 dies before this update's first micro-batch, once
N_TRAIN, N_DEV = 40, 13


class LossLog(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_backward_begin(self, loss: Any) -> None:
        self.losses.append(float(loss))


class KillOnce(Callback):
    def on_batch_begin(self, batch: Any) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and get_rank() == 1 and self.trainer.state.global_step == KILL_AT:
            os._exit(1)


def trainer(strategy: Any, batch: int, **options: Any) -> DistTrainer:
    model = options.pop("model", None) or BlockNet()
    return DistTrainer(
        ToyData(N_TRAIN),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
        loss=options.pop("loss", CrossEntropyLoss()),
        callbacks_all=[GradientClipCallback(clip_value=0.05), *options.pop("callbacks", [])],
        batch_size_per_gpu=batch,
        update_every=2,
        n_epochs=2,
        dev_data=ToyData(N_DEV, seed=1),
        dev_batch_size_per_gpu=2,
        metrics=[AccuracyMetric(), LossMetric(CrossEntropyLoss())],
        metric_key="-loss",
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
        timeout=options.pop("timeout", 60),
        load_best_model=False,  # the final parameters are compared
        **options,
    )


def flat(state: dict[str, torch.Tensor] | None) -> list[float] | None:
    if state is None:
        return None
    model = BlockNet()
    model.load_state_dict(state)  # strict: every key of the plain model
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def train(strategy: Any, batch: int, **options: Any) -> dict[str, Any]:
    """Train; the final parameters (rank 0), evaluate() and predict() of the dev set."""
    run = trainer(strategy, batch, **options)
    summary = run.train()
    dev = ToyData(N_DEV, seed=1)
    modules = run.strategy.module.named_modules()
    return {
        "compiled": [name for name, m in modules if m._compiled_call_impl is not None],
        "steps": summary["steps"],
        "params": flat(run.strategy.full_state_dict()),
        "eval": run.evaluate(dev),
        "predict": run.predict(dev),
        "best": flat(torch.load(run.best_model_path, weights_only=True))
        if run.best_model_path
        else None,
    }


class Tokens(torch.utils.data.Dataset):
    """32 sequences of 16 token ids, their own labels (a causal language model's data)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 100, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> torch.nn.Module:
    """A 2-layer transformers Llama, randomly initialised (ImportError without transformers)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(config)


def hugging_face(strategy: Any, batch: int) -> list[float] | None:
    """Train a tiny Llama (its own loss; under tp its own config.base_model_tp_plan); its
    final parameters on rank 0, in state-dict order (``None``: no transformers here)."""
    torch.manual_seed(0)
    try:
        model = tiny_llama()
    except ImportError:
        return None
    run = DistTrainer(
        Tokens(),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss=None,
        batch_size_per_gpu=batch,
        update_every=2,
        n_epochs=1,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
    )
    run.train()
    full = run.strategy.full_state_dict()
    return None if full is None else torch.cat([v.flatten() for v in full.values()]).tolist()


def bad_input() -> dict[str, str]:
    """The error of each bad tensor-parallel setup (on 4 ranks), and whether a mesh was made."""
    cases = {
        "tp_not_dividing": FSDP(tp=3, tp_plan=PLAN),
        "missing_module": FSDP(tp=2, tp_plan={"blocks.9": "colwise"}),
        "indivisible": FSDP(tp=2, tp_plan={"out": "colwise"}),  # 3 classes over 2 ranks
    }
    errors = {}
    for name, strategy in cases.items():
        try:
            trainer(strategy, 4)
        except ValueError as exc:
            errors[name] = str(exc)
    errors["meshes_made"] = str(len(_MESHES))
    return errors


def colwise_head() -> str:
    """The refusal of a plan splitting the output layer's features ("colwise", 2 outputs),
    whose shard a squared error would broadcast against the target without a word."""
    model = BlockNet()
    model.out = torch.nn.Linear(model.out.in_features, 2)

    def squared(output: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        target = torch.nn.functional.one_hot(batch["target"] % 2, 2).to(output.dtype)
        return ((output - target) ** 2).mean()

    strategy = FSDP(tp=2, tp_plan={**PLAN, "out": "colwise"})
    run = trainer(strategy, 8, model=model, loss=squared)
    try:
        run.train()
    except Exception as exc:  # before the check: the wrong model failed only in evaluation
        return f"{type(exc).__name__}: {exc}"
    return ""


def resume_copy(out: Path, batch: int, strategy: Any) -> dict[str, Any]:
    """Resume the 2x2 run's last checkpoint (a copy: nothing is left to train) on this world."""
    copy = out / f"ckpt-{get_rank()}"
    shutil.copytree(out.parent / "four" / "ckpt", copy)
    run = trainer(strategy, batch, checkpoint_dir=str(copy))
    summary = run.train()
    return {"steps": summary["steps"], "params": flat(run.strategy.full_state_dict())}


# Several trainers in one process (not what a training script does) trip over torch's caches,
# which tell device meshes apart by shape, not by process group: after a compiled trainer, or
# after an FSDP trainer with a timeout (its own process group, destroyed with it), a later
# trainer's DTensor op can look up the earlier trainer's group. Hence the order of the runs,
# and the compiled FSDP run without a timeout (on the default group, never destroyed).


def main(argv: list[str]) -> int:
    mode, out = argv[1], Path(argv[2]) / argv[1]
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    if mode == "four":
        result["bad_input"] = bad_input()
        # The killed run first: torchrun's restart runs main() again, and retrains only this.
        result["killed"] = train(
            FSDP(tp=2, tp_plan=PLAN),
            4,
            save_path=str(out / "save"),
            checkpoint_dir=str(out / "ckpt"),
            checkpoint_every=1,
            callbacks=[KillOnce()],
        )
        result["mesh"] = train(FSDP(tp=2, tp_plan=PLAN), 4)
        result["checkpointed"] = train(FSDP(tp=2, tp_plan=PLAN), 4, activation_checkpointing=True)
        log = LossLog()
        result["bf16"] = train(FSDP(tp=2, tp_plan=PLAN), 4, amp="bf16", callbacks=[log])
        result["bf16"]["losses"] = log.losses
        plan = estimate_worker.PLAN
        result["estimate"] = {"2d": estimate_worker.compare(FSDP(tp=2, tp_plan=plan), 4, 2)}
    elif mode == "two":
        result["ddp"] = train("ddp", 4)
        result["tp"] = train(FSDP(tp=2, tp_plan=PLAN), 8)  # one data shard: twice the batch
        result["hf"] = {"ddp": hugging_face("ddp", 2), "tp": hugging_face(FSDP(tp=2), 4)}
        result["compiled"] = train("fsdp", 4, compile=True, timeout=None)  # see above
        result["resharded"] = resume_copy(out, 4, "fsdp")
        result["estimate"] = {s: estimate_worker.compare(s, 2, 2) for s in ("ddp", "fsdp")}
        result["colwise_head"] = colwise_head()
    elif mode == "compiled":  # the long tier: 4 ranks compiling cost CI 34 s
        result["mesh"] = train(FSDP(tp=2, tp_plan=PLAN), 4)
        result["compiled"] = train(FSDP(tp=2, tp_plan=PLAN), 4, compile=True)  # last: see above
    else:
        result["resharded"] = resume_copy(out, 8, "fsdp")
    write_json(out, result)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
