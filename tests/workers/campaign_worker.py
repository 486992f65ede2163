"""Worker for the fault campaign (tests/campaign.py): one ``torchrun --max-restarts=K`` launch
carries K kills.

Usage (under torchrun)::

    campaign_worker.py OUT_DIR PLAN_JSON

``PLAN_JSON`` holds ``{"configs": [...], "epochs": E, "kills": [kill, ...]}``. Attempt ``a``
(torchrun's ``TORCHELASTIC_RESTART_COUNT``) carries ``kills[a]``, if any: ``{"config", "kind",
"rank", "step", "at"}``; the chosen rank SIGKILLs itself at that point of training ``config``:

* ``update``: before micro-batch ``at`` (from 1) of update ``step``, once the checkpoint of
  update ``step - 1`` is in the manifest;
* ``evaluate``: in the ``at``-th forward of the evaluation after update ``step``;
* ``checkpoint``: while the checkpoint of update ``step`` is written: rank 0 after ``torch.save``
  wrote the ``.pt`` temp file, before its fsync and rename; any rank after DCP wrote its shards
  (``__R_0.distcp``), before ``.metadata`` and the publishing rename;
* ``rename``: rank 0, right after the checkpoint of ``step`` was renamed into place (file or
  directory), before the manifest names it (the next attempt resumes from it);
* ``predict``: in the ``at``-th batch of ``trainer.predict`` after training, its spill file
  part-written.

Every attempt trains each config of the plan twice from fixed seeds: ``OUT_DIR/straight/C``
(never killed) and ``OUT_DIR/faulty/C`` (killed), each with ``resume="auto"`` and then a
prediction; a run whose result files exist already is skipped. Files, per run directory:
``a<attempt>.rank<R>.ids.jsonl`` (resume_worker's IdLog: the ids and loss of every update),
``starts.rank<R>.jsonl`` (``{"attempt", "start_step"}`` as each attempt begins training),
``result.rank<R>.json`` (final parameters) and ``predict.jsonl`` (rank 0). The killing rank
appends ``{"attempt", "config", "kind", "rank", "step", "expect"}`` to ``OUT_DIR/kills.jsonl``
first, ``expect`` being the step the next attempt must resume from.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_files
from stream_worker import StatefulStream
from torch import nn
from workers.ending import exit_now
from workers.resume_worker import N_SAMPLES, IdLog, build_trainer, flat_params, write_json
from workers.trainer_worker import ToyData

from fastdist import AccuracyMetric, Callback, get_rank

predict_module = importlib.import_module(
    "fastdist.evaluation.predict"
)  # the package exports predict()

#: config name -> (resume_worker config, whether the training data is a stream)
RUNS = {"ddp": ("plain", False), "fsdp": ("fsdp", False), "stream": ("epoch-lr", True)}
VALIDATE_EVERY = 2
PREDICT_DATA = ToyData(40, seed=2)  # 20 samples a rank: 3 batches of 8


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def newest_checkpoint(checkpoints: Path) -> int:
    """The step of the newest checkpoint in the manifest (0: none)."""
    try:
        entries = json.loads((checkpoints / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # none yet, or being replaced
        return 0
    return entries[-1]["step"] if entries else 0


class Killer(Callback):
    """Carries out this attempt's kill (``None``: none) in one run; see the module's doc."""

    def __init__(self, kill: dict[str, Any] | None, out: Path, checkpoints: Path) -> None:
        self.kill, self.out, self.checkpoints = kill or {}, out, checkpoints
        self.mine = kill is not None and kill["rank"] == get_rank()
        self.micro = 0  # micro-batches of the current update
        self.forwards = 0  # evaluation forwards since the last update
        self.spills = 0  # predicted batches

    def due(self, kind: str, step: int, count: int) -> bool:
        """Whether this rank dies now: at the ``count``-th point of ``kind`` at ``step``."""
        kill = self.kill
        return self.mine and (kill["kind"], kill["step"], kill["at"]) == (kind, step, count)

    def die(self, expect: int) -> None:
        """Append the kill's record, then SIGKILL this process."""
        record = dict(self.kill, attempt=attempt(), expect=expect)
        with open(self.out / "kills.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_begin(self) -> None:
        record = {"attempt": attempt(), "start_step": self.trainer.state.global_step}
        with open(self.checkpoints.parent / f"starts.rank{get_rank()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_batch_begin(self, batch: Any) -> None:
        self.micro += 1
        step = self.trainer.state.global_step + 1
        if self.due("update", step, self.micro):
            deadline = time.monotonic() + 30  # rank 0 records step - 1 before it trains on
            while newest_checkpoint(self.checkpoints) < step - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            self.die(expect=newest_checkpoint(self.checkpoints))

    def on_step_end(self) -> None:
        self.micro = self.forwards = 0

    def on_eval_forward(self, module: nn.Module, args: Any) -> None:
        """A forward pre-hook of the model: evaluation and prediction forwards."""
        if module.training:
            return
        self.forwards += 1
        step = self.trainer.state.global_step
        if self.due("evaluate", step, self.forwards):
            self.die(expect=step - 1)  # the checkpoint of ``step`` follows the evaluation

    def on_spill(self) -> None:
        """Before each predicted batch's outputs are spilled."""
        self.spills += 1
        if self.due("predict", 0, self.spills):
            self.die(expect=self.trainer.state.global_step)

    def on_write(self, name: str, renamed: bool) -> None:
        """After ``name`` (a checkpoint's temp file, shard or final name) is written or renamed."""
        if not self.mine:
            return
        step = f"step-{self.kill['step']:08d}"
        written = self.kill["kind"] == "checkpoint" and not renamed and step in name
        moved = self.kill["kind"] == "rename" and renamed and name in (step, f"{step}.pt")
        if written:
            self.die(expect=self.kill["step"] - 1)
        if moved:  # whole, not yet in the manifest: resume="auto" continues from it
            self.die(expect=self.kill["step"])


KILLER: Killer | None = None  # the run's, for the patched writers below


def _patch(owner: Any, name: str, after: Any) -> None:
    """Make ``owner.name`` call ``after(*args)`` once the original returned."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if KILLER is not None:
            after(*args, **kwargs)
        return result

    setattr(owner, name, patched)


def _saved(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    if hasattr(f, "flush"):
        f.flush()
    assert KILLER is not None
    KILLER.on_write(os.path.basename(getattr(f, "name", str(f))), renamed=False)


def _shards_written(writer: Any, *args: Any, **kwargs: Any) -> None:
    assert KILLER is not None
    KILLER.on_write(os.path.basename(str(writer.path)), renamed=False)


def _renamed(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
    assert KILLER is not None
    KILLER.on_write(os.path.basename(os.fspath(dst)), renamed=True)


def _spilling(*args: Any, **kwargs: Any) -> None:
    assert KILLER is not None
    KILLER.on_spill()


def install_patches() -> None:
    """The campaign's kill points inside fastdist's and torch's writers (no behaviour change)."""
    _patch(torch, "save", _saved)
    _patch(dcp_files.FileSystemWriter, "write_data", _shards_written)
    _patch(os, "replace", _renamed)
    original_split = predict_module.split_output

    def split_output(*args: Any, **kwargs: Any) -> Any:
        if KILLER is not None:
            _spilling()
        return original_split(*args, **kwargs)

    predict_module.split_output = split_output


def done(directory: Path) -> bool:
    return all((directory / f"result.rank{r}.json").exists() for r in range(2))


def run(out: Path, tag: str, name: str, epochs: int, kill: dict[str, Any] | None) -> None:
    """Train (resuming) and predict with run ``tag``/``name``, killed as ``kill`` says."""
    global KILLER
    directory = out / tag / name
    if done(directory):
        return
    directory.mkdir(parents=True, exist_ok=True)
    rank = get_rank()
    ids = IdLog(directory / f"a{attempt()}.rank{rank}.ids.jsonl")
    killer = Killer(kill, out, directory / "checkpoints")
    config, stream = RUNS[name]
    trainer = build_trainer(
        config,
        directory,
        callbacks=[ids, killer],
        n_epochs=epochs,
        train_data=StatefulStream(N_SAMPLES) if stream else None,
        dev_data=ToyData(16, seed=1),
        metrics=AccuracyMetric(),
        metric_key="acc",
        validate_every=VALIDATE_EVERY,
    )
    trainer.model.register_forward_pre_hook(killer.on_eval_forward)
    KILLER = killer
    try:
        trainer.train()
    finally:
        ids.file.close()
    spill = out / "spill"
    spill.mkdir(exist_ok=True)
    trainer.predict(PREDICT_DATA, output_path=directory / "predict.jsonl", shared_dir=spill)
    KILLER = None
    write_json(
        directory / f"result.rank{rank}.json",
        {"final": flat_params(trainer.model), "steps": trainer.state.global_step},
    )


def main(argv: list[str]) -> int:
    out, plan = Path(argv[1]), json.loads(Path(argv[2]).read_text())
    install_patches()
    kills = plan["kills"]
    kill = kills[attempt()] if attempt() < len(kills) else None
    for name in plan["configs"]:
        run(out, "straight", name, plan["epochs"], None)
        run(out, "faulty", name, plan["epochs"], kill if kill and kill["config"] == name else None)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
