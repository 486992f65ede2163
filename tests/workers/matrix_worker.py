"""Worker for tests/test_matrix.py: the combination matrix's runs, several per launched world.

Usage::

    matrix_worker.py WORLD OUT_DIR          # WORLD: "two" (torchrun, 2 ranks) or "one"

Every case of :func:`cases` (a pairwise covering of the options, and three plain runs) trains
the same float64 bag-of-tokens model under its options in ``OUT_DIR/<case>``. The two-rank
world runs each case, and the straight twin (``<case>~straight``: the same options without the
kill or SIGTERM) of each case that is interrupted and resumed; torchrun restarts the world after
a kill or a pre-emption, and the restarted world skips the runs it finished and resumes the
interrupted one. The one-process world continues the cases that move to another world size,
and runs the one-process references (``<case>~one``: twice ``update_every``, the same global
batch). Each run writes per rank ``ids.rank<R>.jsonl`` (every completed update's sample ids,
by attempt) and ``result.<WORLD>.rank<R>.json`` (the final weights gathered, the result, the
dev loss of the final model, the WARNING and ERROR lines of the attempt that finished).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pairwise import pairwise
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Sampler
from workers.ending import exit_from
from workers.trainer_worker import warnings_logged

from fastdist import DDP, FSDP, CrossEntropyLoss, DistTrainer, LossMetric, Metric
from fastdist.callbacks import Callback, EarlyStopCallback
from fastdist.data import TokenBatchSampler
from fastdist.distributed import get_rank, get_world_size

N, DEV, BATCH, EPOCHS, VOCAB = 61, 12, 2, 3, 20
# The updates at which each interruption strikes (rank 1 dies before the micro-batch that
# would start update KILL_AT + 1). A stop request comes in the last epoch's first update;
# early stopping after the second evaluation (at every epoch end: see DevSize).
KILL_AT, SIGTERM_AT, RESIZE_AT = 4, 5, 7
OPTIONS: dict[str, list[Any]] = {
    "data": ["map", "tokens", "stream", "sampler", "drop_last"],
    "stop": ["none", "early", "request", "sigterm"],
    "comm": ["none", "powersgd", "local_sgd"],
    "resume": ["none", "kill", "resize"],
    "strategy": ["ddp", "fsdp"],
    "update_every": [1, 3],
    "amp": ["none", "bf16"],
    "check_sync": [0, 2],
    "save": ["save_path", "checkpoint_dir"],
}


def allowed(case: dict[str, Any]) -> bool:
    """FSDP has no communication hook and no local SGD: DDP's options (refused, see the test)."""
    return not (case.get("strategy") == "fsdp" and case.get("comm", "none") != "none")


#: Plain runs besides the covering, whose one-process reference the arithmetic makes equal.
PLAIN = {"data": "map", "stop": "none", "comm": "none", "resume": "none", "amp": "none"}
EXTRA = [
    dict(PLAIN, strategy="ddp", update_every=3, check_sync=2, save="save_path"),
    dict(PLAIN, data="tokens", strategy="fsdp", update_every=1, check_sync=0, save="save_path"),
    dict(PLAIN, data="stream", strategy="ddp", update_every=3, check_sync=0, save="checkpoint_dir"),
]


def cases() -> dict[str, dict[str, Any]]:
    """The pairwise covering (``c00``, ``c01``...) and the plain runs (``p0``...), by name."""
    covering = {f"c{i:02d}": case for i, case in enumerate(pairwise(OPTIONS, allowed))}
    return {**covering, **{f"p{i}": case for i, case in enumerate(EXTRA)}}


def twin(case: dict[str, Any]) -> dict[str, Any]:
    """The uninterrupted twin of a case: no kill, no SIGTERM, no move to another world."""
    stop = "none" if case["stop"] == "sigterm" else case["stop"]
    return dict(case, resume="none", stop=stop)


def interrupted(case: dict[str, Any]) -> bool:
    """Whether the case is killed or pre-empted and resumed on the same world."""
    return case["resume"] == "kill" or case["stop"] == "sigterm"


def one_process_equal(case: dict[str, Any]) -> bool:
    """Whether one process with twice ``update_every`` reaches the same weights: the same
    samples in every update, sums of gradients in another order only (float64)."""
    plain = case["comm"] == "none" and case["amp"] == "none" and case["stop"] == "none"
    return plain and case["resume"] == "none" and case["data"] in ("map", "tokens", "stream")


class Sequences(Dataset):
    """``n`` token sequences of length 2-8; the target is the parity of their sum."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(2, 9, (n,), generator=gen).tolist()
        self.tokens = [torch.randint(1, VOCAB, (k,), generator=gen) for k in self.lengths]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        tokens = self.tokens[i]
        return {"tokens": tokens, "target": int(tokens.sum()) % 2, "idx": i}


def pad(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(s["tokens"]) for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens[row, : len(s["tokens"])] = s["tokens"]
    return {
        "tokens": tokens,
        "target": torch.tensor([s["target"] for s in samples]),
        "idx": torch.tensor([s["idx"] for s in samples]),
    }


class Stream(IterableDataset):
    """The sequences in order, as a stream that saves its position (resumes exactly)."""

    def __init__(self) -> None:
        self.data, self.position = Sequences(N), 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start, self.position = self.position, 0
        for i in range(start, N):
            self.position = i + 1
            yield self.data[i]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class EveryOther(Sampler[int]):
    """A user's sampler: this rank's positions of a fixed order, equal shards (60 samples)."""

    def __init__(self, rank: int, world: int) -> None:
        self.indices = list(range(rank, N - 1, world))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Bag(nn.Module):
    """The mean of the tokens' embeddings, two blocks, logits (float64, no randomness)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8, padding_idx=0, dtype=torch.float64)
        self.blocks = nn.ModuleList([nn.Linear(8, 8, dtype=torch.float64) for _ in range(2)])
        self.out = nn.Linear(8, 2, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = (tokens > 0).to(self.embed.weight.dtype).unsqueeze(-1)
        h = (self.embed(tokens) * mask).sum(1) / mask.sum(1)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return {"pred": self.out(h)}


class DevSize(Metric):
    """The number of dev samples scored: the same at every evaluation, so that early
    stopping on it (``patience=1``) stops at the second, whatever the training does."""

    keys = ("dev_size",)

    def reset(self) -> None:
        self.n = 0

    def update(self, output: Any, batch: Any) -> None:
        self.n += len(batch["idx"])

    def state(self) -> torch.Tensor:
        return torch.tensor([float(self.n)], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        return {"dev_size": float(state[0])}


class Faults(Callback):
    """The case's interruptions, each on its attempt: a kill, a SIGTERM, a stop (the move to
    another world size, a stop request); ``ids`` of every completed update to a file."""

    def __init__(self, case: dict[str, Any], folder: Path, world: str) -> None:
        self.case, self.folder, self.world = case, folder, world
        self.file = open(folder / f"ids.rank{get_rank()}.jsonl", "a")  # noqa: SIM115
        self.ids: list[int] = []

    def once(self, what: str) -> bool:
        """True the first time ``what`` happens in this case (a marker file remembers)."""
        marker = self.folder / what
        if marker.exists():
            return False
        marker.touch()
        return True

    def on_train_begin(self) -> None:
        self.start = self.trainer.state.global_step

    def on_batch_begin(self, batch: Any) -> None:
        state = self.trainer.state
        killing = self.case["resume"] == "kill" and state.global_step == KILL_AT
        if killing and get_rank() == 1 and self.world == "two" and self.once("killed"):
            os._exit(1)
        if not state.is_filler:
            self.ids += batch["idx"].tolist()

    def on_step_end(self) -> None:
        state, case = self.trainer.state, self.case
        record = {"attempt": self.attempt(), "start": self.start, "step": state.global_step}
        self.file.write(json.dumps(dict(record, epoch=state.epoch, ids=self.ids)) + "\n")
        self.file.flush()
        self.ids = []
        step = state.global_step
        sigterm = case["stop"] == "sigterm" and step == SIGTERM_AT and self.world == "two"
        if sigterm and get_rank() == 1 and self.once("sigtermed"):
            os.kill(os.getpid(), signal.SIGTERM)
        if case["resume"] == "resize" and step == RESIZE_AT and self.world == "two":
            self.trainer.request_stop()  # continued by one process
        if case["stop"] == "request" and state.epoch == EPOCHS and get_rank() == 0:
            self.trainer.request_stop()

    def attempt(self) -> str:
        return f"{self.world}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def build(case: dict[str, Any], folder: Path, world: str, update_every: int) -> DistTrainer:
    """The trainer of ``case`` (one process: ``update_every`` as given)."""
    rank, size = get_rank(), get_world_size()
    model = Bag()
    options: dict[str, Any] = {
        "loss": CrossEntropyLoss(),
        "collate_fn": pad,
        "batch_size_per_gpu": BATCH,
        "n_epochs": EPOCHS,
        "update_every": update_every,
        "print_every": 2,
        "use_tqdm": False,
        "device": "cpu",
        "checkpoint_every": 3,
        "timeout": 60,
        "dev_data": Sequences(DEV, seed=1),
        "metrics": [LossMetric(CrossEntropyLoss()), DevSize()],
        "metric_key": "-loss",
        "check_sync_every": case["check_sync"],
        "amp": None if case["amp"] == "none" else case["amp"],
        "callbacks_all": [Faults(case, folder, world)],
        "strategy": _strategy(case),
    }
    if case["save"] == "save_path":
        options["save_path"] = str(folder)
    else:
        options["checkpoint_dir"] = str(folder / "checkpoints")
    if case["stop"] == "early":  # never better than the first: the second evaluation stops
        options["metric_key"] = "dev_size"
        options["callbacks_all"].append(EarlyStopCallback(patience=1))
    data: Any = Sequences(N)
    if case["data"] == "tokens":
        options["batch_sampler"] = TokenBatchSampler(data.lengths, max_tokens=16, seed=3)
    elif case["data"] == "stream":
        data = Stream()
    elif case["data"] == "sampler":
        options["sampler"] = EveryOther(rank, size)
    elif case["data"] == "drop_last":
        options["drop_last"] = True
    return DistTrainer(
        data, model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), **options
    )


def _strategy(case: dict[str, Any]) -> Any:
    if case["comm"] == "powersgd":
        return DDP(comm_hook="powersgd")
    if case["comm"] == "local_sgd":
        return DDP(average_every=2)
    return FSDP() if case["strategy"] == "fsdp" else DDP()


def run(name: str, case: dict[str, Any], out: Path, world: str, update_every: int) -> None:
    """Train one run to its end (or its stop) and write this rank's result."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    result_path = folder / f"result.{world}.rank{get_rank()}.json"
    if result_path.exists():  # finished before a restart of this world
        return
    trainer = build(case, folder, world, update_every)
    with warnings_logged() as lines:
        result = trainer.train()
        dev_loss = trainer.evaluate()["loss"]  # the final model: the best, loaded
    full = trainer.strategy.full_state_dict()
    weights = None if full is None else torch.cat([t.flatten() for t in full.values()]).tolist()
    record = {
        "result": result,
        "complete_epochs": trainer.state.epoch - (not trainer.state.epoch_complete),
        "dev_loss": dev_loss,
        "weights": weights,
        "world_size": get_world_size(),
        "logged": lines,
    }
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(result_path)


def main(world: str, out: Path) -> None:
    for name, case in cases().items():
        ue = case["update_every"]
        if world == "two":
            if interrupted(case):
                run(f"{name}~straight", twin(case), out, world, ue)
            run(name, case, out, world, ue)
        elif case["resume"] == "resize":
            run(name, case, out, world, ue)  # the same folder: resumes the 2-rank checkpoint
        elif one_process_equal(case):
            run(f"{name}~one", case, out, world, 2 * ue)


if __name__ == "__main__":
    exit_from(lambda: main(sys.argv[1], Path(sys.argv[2])))
