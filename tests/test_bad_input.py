"""Bad input to ``DistTrainer``: one table, run in one torchrun launch of 2 ranks.

Every row is a set of ``DistTrainer`` keywords (over the worker's working defaults) that must
raise the given exception, with a message holding the given words (the argument and the fix),
the same message on both ranks. Rows checked at construction (``"init"``) must raise before
the process group exists; rows that can only be seen at the first micro-batch
(``"first_batch"``: the loss, the batch fields; ``"log_step"``: the losses of the updates
before it) must raise there on every rank, and the world goes on to the next row. Then rank 0
calls every collective entry point of :data:`GUARDED_CALLS` (imported by name) inside the
callbacks_master guard, and last a callbacks_master hook calls ``barrier`` (imported by name
at the top of this module): rank 0 raises at once, and rank 1, which went on training, must
fail soon after, not after torch's 30-minute timeout. tests/workers/bad_input_worker.py runs
the table.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launch import Result, run_torchrun
from torch import nn
from torch.distributed import (
    all_gather_object,
    all_reduce,
    barrier,
    batch_isend_irecv,
    broadcast_object_list,
    irecv,
    isend,
    monitored_barrier,
    new_group,
    new_subgroups,
    reduce_scatter_tensor,
    send,
)
from torch.utils.data import Dataset, IterableDataset, RandomSampler
from workers.trainer_worker import ToyData, ToyNet

from fastdist import DDP, FSDP, AccuracyMetric, Callback, CrossEntropyLoss, Pipeline
from fastdist.callbacks import EarlyStopCallback, LRSchedulerCallback, WarmupCallback
from fastdist.data import TokenBatchSampler
from fastdist.distributed import get_rank

WORKER = Path(__file__).resolve().parent / "workers" / "bad_input_worker.py"
LAUNCH_BOUND = 40.0  # seconds for the whole launch (5 s here, torch's import included)
FAIL_BOUND = 15.0  # seconds from rank 0's error in a hook to rank 1's


@dataclass(frozen=True)
class Row:
    """One bad input: ``given`` (keywords, or a builder of them), the exception's type name,
    words its message must hold, and when it is raised (``"init"``, ``"first_batch"``, or
    ``"log_step"``: the first, with ``print_every=1``; ``"group"``: at construction, once the group
    formed, when the ranks were given different arguments)."""

    given: dict[str, Any] | Callable[[], dict[str, Any]]
    error: str
    words: tuple[str, ...]
    when: str = "init"


def row(given: Any, expected: str, when: str = "init") -> Row:
    """``expected``: ``"TypeError: words | more words"``."""
    error, words = expected.split(": ", 1)
    return Row(given, error, tuple(words.split(" | ")), when)


class Renamed(Dataset):
    """ToyData's samples with ``x`` renamed ``input``: no field feeds ``ToyNet.forward(x)``."""

    def __init__(self, n: int) -> None:
        self.data = ToyData(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = self.data[i]
        return {"input": sample["x"], "target": sample["target"], "idx": i}


class OptionalNet(ToyNet):
    """A forward whose parameters all have defaults, none named like a batch field."""

    def forward(self, tokens: torch.Tensor | None = None, mask: Any = None) -> torch.Tensor:
        assert tokens is not None
        return super().forward(tokens)


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(ToyData(16))


class Keyed(Callback):
    state_key = "same"  # type: ignore[assignment]


class FreezeAtStart(Callback):
    """Freezes the hidden layer in ``on_train_begin`` on every rank: after DDP wrapped it."""

    def on_train_begin(self) -> None:
        self.trainer.model.hidden.requires_grad_(False)


class BarrierAt(Callback):
    """Calls ``barrier`` (imported by name) after update ``step``: a hang on rank 0 alone."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == self.step:
            barrier()


def per_sample_loss(output: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    return F.cross_entropy(output, batch["target"], reduction="none")


def _foreign_optimizer() -> dict[str, Any]:
    return {"optimizer": torch.optim.SGD(ToyNet().parameters(), lr=0.1)}


def _learning_rate_per_rank() -> dict[str, Any]:
    model = ToyNet()
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1 * (1 + get_rank())),
    }


def _frozen_on_rank_one() -> dict[str, Any]:
    model = ToyNet()
    model.hidden.requires_grad_(get_rank() == 0)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def _same_callback_twice() -> dict[str, Any]:
    cb = EarlyStopCallback(patience=2)
    return {"callbacks_all": [cb], "callbacks_master": [cb]}


def _plateau(mode: str = "max", evaluates: bool = True, own: bool = True) -> dict[str, Any]:
    model = ToyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped = optimizer if own else torch.optim.SGD(ToyNet().parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(stepped, mode=mode)
    given = {"model": model, "optimizer": optimizer}
    if evaluates:
        given |= {"dev_data": ToyData(8), "metrics": AccuracyMetric()}
    return given | {"callbacks_all": [LRSchedulerCallback(plateau)]}


NOT_WRITABLE = "pass a directory it can create and write to, or fix the permissions"
DEVICES = "'auto' (or None), 'cpu', 'cuda', 'cuda:N'"
FIELDS = "the batch's fields are ['input', 'target', 'idx']"

# name -> the bad input and what it must raise.
ROWS: dict[str, Row] = {
    # data and model
    "train_data_not_a_dataset": row(
        {"train_data": 5},
        "TypeError: train_data must be a map-style dataset | IterableDataset | got 5",
    ),
    "empty_train_data": row(lambda: {"train_data": ToyData(0)}, "ValueError: train_data is empty"),
    "too_few_samples_for_drop_last": row(
        lambda: {"train_data": ToyData(8), "drop_last": True},
        "ValueError: batch_size_per_gpu=8 | drop_last=True | lower batch_size_per_gpu",
    ),
    "stream_with_sampler": row(
        lambda: {"train_data": Stream(), "sampler": [0, 1]},
        "ValueError: sampler= and batch_sampler= do not apply | leave both None",
    ),
    "model_not_a_module": row(
        {"model": "net"}, "TypeError: model must be a torch.nn.Module | got 'net' | model=MyNet()"
    ),
    "model_with_nothing_to_train": row(
        lambda: {"model": nn.Identity()},
        "ValueError: model (Identity) has no parameter that requires a gradient | requires_grad_",
    ),
    "dev_data_not_a_dataset": row(
        lambda: {"dev_data": 3, "metrics": AccuracyMetric()},
        "TypeError: dev_data must be a map-style dataset | got 3",
    ),
    # optimizer and loss
    "optimizer_class": row(
        {"optimizer": torch.optim.SGD}, "TypeError: optimizer=SGD is a class | pass an instance"
    ),
    "optimizer_not_an_optimizer": row(
        {"optimizer": "adam"},
        "TypeError: optimizer must be a torch.optim.Optimizer | got 'adam' | model.parameters()",
    ),
    "foreign_optimizer": row(
        _foreign_optimizer,
        "ValueError: optimizer holds | not parameters of model | model.parameters()",
    ),
    "loss_name": row(
        {"loss": "cross_entropy"},
        "TypeError: loss must be a fastdist Loss | callable(output, batch) | got str",
    ),
    "loss_class": row(
        {"loss": CrossEntropyLoss},
        "TypeError: loss=CrossEntropyLoss is a class | loss=CrossEntropyLoss()",
    ),
    "loss_of_one_argument": row(
        {"loss": lambda output: output.sum()},
        "TypeError: loss <lambda> cannot be called as loss(output, batch) | def loss(output,",
    ),
    # callbacks
    "callbacks_all_bare": row(
        lambda: {"callbacks_all": EarlyStopCallback()},
        "TypeError: callbacks_all must be a list | single EarlyStopCallback | pass a list, "
        "callbacks_all=[cb]",
    ),
    "callbacks_master_bare": row(
        lambda: {"callbacks_master": Callback()},
        "TypeError: callbacks_master must be a list | pass a list, callbacks_master=[cb]",
    ),
    "callbacks_all_a_name": row(
        {"callbacks_all": "EarlyStop"},
        "TypeError: callbacks_all must be a list of fastdist Callback objects | got 'EarlyStop'",
    ),
    "callback_class_in_list": row(
        {"callbacks_all": [EarlyStopCallback]},
        "TypeError: callbacks_all[0] is the class EarlyStopCallback | pass an instance",
    ),
    "callback_not_a_callback": row(
        {"callbacks_master": [print]},
        "TypeError: callbacks_master must hold fastdist Callback objects | "
        "callbacks_master[0] is <built-in function print>",
    ),
    "same_callback_twice": row(
        _same_callback_twice,
        "ValueError: EarlyStopCallback object is given twice | callbacks_all and "
        "callbacks_master | pass each callback once",
    ),
    "changes_training_on_rank_0_only": row(
        lambda: {"callbacks_master": [WarmupCallback(warmup=2)]},
        "ValueError: WarmupCallback in callbacks_master changes training on rank 0 only | "
        "put it in callbacks_all",
    ),
    "plateau_reads_the_score_the_wrong_way": row(
        lambda: _plateau(mode="min"),
        "ValueError: ReduceLROnPlateau(mode='min') would reduce the learning rate while acc "
        "improves (larger is better) | pass mode='max'",
    ),
    "plateau_without_evaluation": row(
        lambda: _plateau(evaluates=False),
        "ValueError: LRSchedulerCallback(interval='evaluation') | there is none | "
        "pass dev_data= and metrics=",
    ),
    "scheduler_of_another_optimizer": row(
        lambda: _plateau(own=False),
        "ValueError: ReduceLROnPlateau steps another optimizer than the trainer's | build it "
        "on the optimizer= you pass to DistTrainer",
    ),
    "two_callbacks_one_state_key": row(
        lambda: {"callbacks_all": [Keyed(), Keyed()]},
        "ValueError: callbacks_all holds two callbacks with state_key 'same' | its own state_key",
    ),
    # sizes and counts
    "batch_size_per_gpu_zero": row(
        {"batch_size_per_gpu": 0}, "ValueError: batch_size_per_gpu must be an integer >= 1 | got 0"
    ),
    "batch_size_per_gpu_str": row(
        {"batch_size_per_gpu": "8"},
        "ValueError: batch_size_per_gpu must be an integer >= 1 | got '8'",
    ),
    "n_epochs_zero": row({"n_epochs": 0}, "ValueError: n_epochs must be an integer >= 1"),
    "num_workers_negative": row(
        {"num_workers": -1}, "ValueError: num_workers must be an integer >= 0"
    ),
    "update_every_zero": row(
        {"update_every": 0}, "ValueError: update_every must be an integer >= 1"
    ),
    "print_every_float": row(
        {"print_every": 2.5}, "ValueError: print_every must be an integer >= 1 | got 2.5"
    ),
    "validate_every_zero": row(
        {"validate_every": 0}, "ValueError: validate_every=0 is not valid | use -1"
    ),
    "dev_batch_size_zero": row(
        {"dev_batch_size_per_gpu": 0}, "ValueError: dev_batch_size_per_gpu must be an integer >= 1"
    ),
    "seed_str": row({"seed": "0"}, "ValueError: seed must be an integer >= 0 | got '0'"),
    "check_sync_every_negative": row(
        {"check_sync_every": -1}, "ValueError: check_sync_every must be an integer >= 0"
    ),
    "keep_checkpoints_zero": row(
        {"keep_checkpoints": 0}, "ValueError: keep_checkpoints must be an integer >= 1"
    ),
    "slow_rank_threshold_negative": row(
        {"slow_rank_threshold": -0.5}, "ValueError: slow_rank_threshold must be a number >= 0"
    ),
    "stream_read_ahead_mb_zero": row(
        {"stream_read_ahead_mb": 0}, "ValueError: stream_read_ahead_mb must be a number > 0"
    ),
    "timeout_negative": row({"timeout": -1}, "ValueError: timeout must be a number > 0"),
    "timeout_infinite": row(
        {"timeout": float("inf")}, "ValueError: timeout must be at most 1e+08 seconds | got inf"
    ),
    "seed_too_large": row({"seed": 2**64}, "ValueError: seed must be below 2**63 | smaller seed"),
    "sampler_a_name": row(
        {"sampler": "random"}, "TypeError: sampler must be a sampler | got 'random'"
    ),
    "batch_sampler_of_indices": row(
        {"batch_sampler": [1, 2]},
        "TypeError: batch_sampler must give each batch as a list of sample indices | holds 1",
    ),
    "validate_every_without_dev_data": row(
        {"validate_every": 2},
        "ValueError: validate_every=2 evaluates dev_data, but none was given | pass dev_data=",
    ),
    "multiprocessing_context_without_workers": row(
        {"multiprocessing_context": "spawn"},
        "ValueError: multiprocessing_context='spawn' applies to DataLoader worker",
    ),
    "timeout_timedelta": row(
        lambda: {"timeout": __import__("datetime").timedelta(minutes=1)},
        "ValueError: timeout must be a number > 0 | timedelta",
    ),
    # switches and choices
    "drop_last_str": row(
        {"drop_last": "yes"}, "TypeError: drop_last must be True or False | got 'yes'"
    ),
    "use_tqdm_none": row({"use_tqdm": None}, "TypeError: use_tqdm must be True or False"),
    "load_best_model_str": row(
        {"load_best_model": "yes"}, "TypeError: load_best_model must be True or False"
    ),
    "pin_memory_str": row({"pin_memory": "yes"}, "TypeError: pin_memory must be True or False"),
    "checkpoint_async_str": row(
        {"checkpoint_async": "yes"}, "TypeError: checkpoint_async must be True or False | 'yes'"
    ),
    "compile_int": row({"compile": 1}, "TypeError: compile must be True or False | got 1"),
    "on_nonfinite_unknown": row(
        {"on_nonfinite": "ignore"},
        "ValueError: on_nonfinite must be one of 'raise', 'skip' | got 'ignore'",
    ),
    "multiprocessing_context_unknown": row(
        {"multiprocessing_context": "threads"},
        "ValueError: multiprocessing_context must be one of None, 'fork', 'forkserver', 'spawn'",
    ),
    "amp_unknown": row(
        {"amp": "fp32"}, "ValueError: amp must be one of None, 'bf16', 'fp16' | got 'fp32'"
    ),
    "amp_fp16_on_cpu": row(
        {"amp": "fp16"}, "ValueError: amp='fp16' needs a CUDA device | use amp='bf16' on CPU"
    ),
    "fp16_and_amp_bf16": row(
        {"fp16": True, "amp": "bf16"},
        "ValueError: fp16=True and amp='bf16' | pass only amp='bf16' or amp='fp16'",
    ),
    "fp16_str": row({"fp16": "O1"}, "TypeError: fp16 must be True or False"),
    "persistent_workers_without_workers": row(
        {"persistent_workers": True},
        "ValueError: persistent_workers=True applies to DataLoader worker | set num_workers > 0",
    ),
    "prefetch_factor_without_workers": row(
        {"prefetch_factor": 4},
        "ValueError: prefetch_factor=4 applies to DataLoader worker | set num_workers > 0",
    ),
    # metrics
    "dev_data_without_metrics": row(
        lambda: {"dev_data": ToyData(10)},
        "ValueError: dev_data needs metrics= | metrics=AccuracyMetric()",
    ),
    "metrics_a_name": row(
        lambda: {"dev_data": ToyData(10), "metrics": "acc"},
        "TypeError: metrics='acc' is a name | pass metric objects | AccuracyMetric()",
    ),
    "metrics_class": row(
        lambda: {"dev_data": ToyData(10), "metrics": AccuracyMetric},
        "TypeError: metrics holds the class AccuracyMetric | AccuracyMetric()",
    ),
    "metrics_wrong_item": row(
        lambda: {"dev_data": ToyData(10), "metrics": [3]},
        "TypeError: metrics must be fastdist Metric or torchmetrics.Metric objects | got int",
    ),
    "metric_key_not_reported": row(
        lambda: {"dev_data": ToyData(10), "metrics": AccuracyMetric(), "metric_key": "f1"},
        "ValueError: metric_key='f1' | ['acc']",
    ),
    "metric_key_without_metrics": row(
        {"metric_key": "acc"},
        "ValueError: metric_key='acc' | pass metrics | or leave metric_key out",
    ),
    "metric_key_int": row(
        lambda: {"dev_data": ToyData(10), "metrics": AccuracyMetric(), "metric_key": 3},
        "TypeError: metric_key must be a str | '-loss'",
    ),
    # samplers and collate_fn
    "sampler_class": row(
        {"sampler": RandomSampler}, "TypeError: sampler=RandomSampler is a class | pass an instance"
    ),
    "sampler_int": row({"sampler": 3}, "TypeError: sampler must be a sampler | __len__ | got 3"),
    "batch_sampler_int": row(
        {"batch_sampler": 3}, "TypeError: batch_sampler must be a sampler | batches of this rank"
    ),
    "sampler_and_batch_sampler": row(
        {"sampler": [0, 1], "batch_sampler": [[0, 1]]},
        "ValueError: pass sampler= or batch_sampler=, not both",
    ),
    "batch_sampler_with_drop_last": row(
        {"batch_sampler": [[0, 1], [2, 3]], "drop_last": True},
        "ValueError: drop_last=True does not apply with batch_sampler= | leave drop_last out",
    ),
    # lengths not one per sample of train_data (ToyData(32)): samples never trained, or an
    # IndexError on one rank
    "token_lengths_too_few": row(
        {"batch_sampler": TokenBatchSampler([3] * 31, 8)},
        "ValueError: TokenBatchSampler has 31 lengths for a train_data of 32 samples | never train"
        " | pass the length of every sample of train_data",
    ),
    "token_lengths_too_many": row(
        {"batch_sampler": TokenBatchSampler([3] * 35, 8)},
        "ValueError: TokenBatchSampler has 35 lengths for a train_data of 32 samples",
    ),
    "token_batches_in_a_pipeline": row(  # it failed at the first update, its fixes no help
        lambda: {
            "batch_sampler": TokenBatchSampler([3] * 32, 8),
            "strategy": Pipeline(stages=2, schedule="gpipe"),
        },
        "ValueError: batch_sampler=TokenBatchSampler makes batches of varying numbers of samples"
        " | a pipeline's stages take micro-batches of one shape | use batch_size_per_gpu=",
    ),
    "collate_fn_not_callable": row(
        {"collate_fn": "stack"}, "TypeError: collate_fn must be a function | or None | got 'stack'"
    ),
    # paths
    "save_path_int": row(
        {"save_path": 123}, "TypeError: save_path must be a directory path | got 123"
    ),
    "save_path_empty": row(
        {"save_path": ""}, "ValueError: save_path must be a non-empty directory path"
    ),
    "save_path_read_only_dir": row(
        {"save_path": "/sys"},
        f"ValueError: save_path='/sys' is not writable | {NOT_WRITABLE}",
    ),
    "save_path_uncreatable": row(
        {"save_path": "/sys/fastdist-run"},
        "ValueError: save_path='/sys/fastdist-run' cannot be created: '/sys' is not writable | "
        + NOT_WRITABLE,
    ),
    "save_path_a_file": row(
        {"save_path": __file__},
        "ValueError: is not a directory (" + repr(__file__) + " is a file) | pass a directory path",
    ),
    "checkpoint_dir_under_a_file": row(
        {"checkpoint_dir": f"{__file__}/checkpoints"},
        f"ValueError: checkpoint_dir={__file__ + '/checkpoints'!r} is not a directory "
        f"({__file__!r} is a file) | pass a directory path",
    ),
    "checkpoint_dir_int": row(
        {"checkpoint_dir": 5}, "TypeError: checkpoint_dir must be a directory path | got 5"
    ),
    "checkpoint_dir_read_only_dir": row(
        {"checkpoint_dir": "/sys"},
        f"ValueError: checkpoint_dir='/sys' is not writable | {NOT_WRITABLE}",
    ),
    "checkpoint_every_negative": row(
        {"checkpoint_every": -1}, "ValueError: checkpoint_every must be an integer >= 0"
    ),
    # device
    "device_gpu": row(
        {"device": "gpu"},
        f"ValueError: device='gpu' is not a device fastdist trains on | {DEVICES} | GPU is 'cuda'",
    ),
    "device_meta": row(
        {"device": "meta"},
        f"ValueError: device='meta' is not a device | {DEVICES}",
    ),
    "device_int": row(
        {"device": 0},
        f"TypeError: device must be | {DEVICES} | got 0",
    ),
    "device_cuda_without_gpu": row(
        {"device": "cuda"}, "ValueError: device='cuda' but CUDA is not available | use device='cpu'"
    ),
    # strategy, its options and unknown keywords
    "strategy_unknown": row(
        {"strategy": "deepspeed"}, "ValueError: strategy must be 'ddp' | 'fsdp' | got 'deepspeed'"
    ),
    "strategy_class": row(
        {"strategy": DDP}, "TypeError: strategy=DDP is a class | strategy=DDP(...)"
    ),
    "strategy_int": row(
        {"strategy": 1}, "TypeError: strategy must be 'ddp', 'fsdp' or a strategy object | got 1"
    ),
    "ddp_bucket_cap_negative": row(
        lambda: {"strategy": DDP(bucket_cap_mb=-1)},
        "ValueError: bucket_cap_mb must be a number > 0",
    ),
    "ddp_comm_hook_unknown": row(
        lambda: {"strategy": DDP(comm_hook="int8")},
        "ValueError: comm_hook must be one of None, 'fp16', 'bf16', 'powersgd'",
    ),
    "ddp_flag_str": row(
        lambda: {"strategy": DDP(static_graph="yes")},
        "TypeError: static_graph must be True or False",
    ),
    "comm_hook_with_average_every": row(
        lambda: {"strategy": DDP(comm_hook="fp16", average_every=4)},
        "ValueError: comm_hook | average_every | choose one",
    ),
    "comm_hook_bf16_on_cpu": row(
        lambda: {"strategy": DDP(comm_hook="bf16")},
        "ValueError: comm_hook='bf16' needs CUDA | comm_hook='fp16'",
    ),
    "skip_nonfinite_with_local_sgd": row(
        lambda: {"strategy": DDP(average_every=2), "on_nonfinite": "skip"},
        "ValueError: on_nonfinite='skip' needs the gradients all-reduced | on_nonfinite='raise'",
    ),
    "fsdp_wrap_bare_class": row(
        lambda: {"strategy": FSDP(wrap=nn.Linear)},
        "TypeError: wrap must be a list of nn.Module classes | wrap=[Linear]",
    ),
    "fsdp_wrap_instance": row(
        lambda: {"strategy": FSDP(wrap=[nn.Linear(2, 2)])},
        "TypeError: wrap must hold nn.Module classes | pass the class, Linear",
    ),
    "fsdp_wrap_absent": row(
        lambda: {"strategy": FSDP(wrap=[nn.Conv2d])},
        "ValueError: FSDP(wrap=...) names ['Conv2d'] | pass the classes of its repeated blocks",
    ),
    "fsdp_cpu_offload_on_cpu": row(
        lambda: {"strategy": FSDP(cpu_offload=True)}, "ValueError: cpu_offload | drop cpu_offload"
    ),
    "unknown_keyword": row(
        {"batch_size": 8},
        "TypeError: unexpected keyword argument 'batch_size' | did you mean batch_size_per_gpu?",
    ),
    "flat_ddp_keyword": row(
        {"bucket_cap_mb": 50},
        "TypeError: bucket_cap_mb= is an option of the strategy (fastdist.strategies.DDP) | "
        "pass strategy=DDP(bucket_cap_mb=50)",
    ),
    "flat_comm_hook": row(
        {"ddp_comm_hook": "fp16"}, "TypeError: ddp_comm_hook= | strategy=DDP(comm_hook='fp16')"
    ),
    "flat_fsdp_wrap": row(
        {"fsdp_wrap": [nn.Linear]},
        "TypeError: fsdp_wrap= | fastdist.strategies.FSDP | pass strategy=FSDP(wrap=[Linear])",
    ),
    # a strategy's own option names, given to DistTrainer
    "flat_tp": row(
        {"tp": 2},
        "TypeError: tp= is an option of the strategy (fastdist.strategies.FSDP), not of "
        "DistTrainer: pass strategy=FSDP(tp=2)",
    ),
    "flat_tp_plan": row(
        {"tp_plan": {"fc": "colwise"}},
        "TypeError: tp_plan= is an option of the strategy | strategy=FSDP(tp_plan={'fc': ",
    ),
    "flat_wrap": row(
        {"wrap": [nn.Linear]},
        "TypeError: wrap= is an option of the strategy | pass strategy=FSDP(wrap=[Linear])",
    ),
    "flat_ddp_comm_hook_name": row(
        {"comm_hook": "powersgd"},
        "TypeError: comm_hook= is an option of the strategy | strategy=DDP(comm_hook='powersgd')",
    ),
    # given differently on the ranks: seen once the group forms, before any other collective
    "ranks_given_another_update_every": row(
        lambda: {"update_every": 1 + get_rank()},
        "ValueError: DistTrainer was given different arguments on different ranks | "
        "update_every: 1 on ranks [0], 2 on ranks [1] | Give every rank the same arguments",
        when="group",
    ),
    "ranks_given_datasets_of_another_length": row(
        lambda: {"train_data": ToyData(32 - 4 * get_rank())},
        "ValueError: different arguments | len(train_data): 32 on ranks [0], 28 on ranks [1]",
        when="group",
    ),
    "ranks_given_another_learning_rate": row(
        _learning_rate_per_rank,
        "ValueError: different arguments | optimizer.param_groups[0]['lr']: 0.1 on ranks [0], "
        "0.2 on ranks [1]",
        when="group",
    ),
    "a_callback_on_rank_zero_only": row(
        lambda: {"callbacks_all": [EarlyStopCallback(patience=2)] if get_rank() == 0 else []},
        "ValueError: different arguments | callbacks_all: ['EarlyStopCallback'] on ranks [0], "
        "[] on ranks [1]",
        when="group",
    ),
    "a_callback_set_otherwise_on_one_rank": row(
        lambda: {"callbacks_all": [EarlyStopCallback(patience=2 + get_rank())]},
        "ValueError: different arguments | callbacks_all[0].patience: 2 on ranks [0], 3 on "
        "ranks [1]",
        when="group",
    ),
    "a_loss_set_otherwise_on_one_rank": row(
        lambda: {"loss": nn.CrossEntropyLoss(label_smoothing=0.1 * get_rank())},
        "ValueError: different arguments | loss.label_smoothing: 0.0 on ranks [0], 0.1 on "
        "ranks [1]",
        when="group",
    ),
    "a_layer_frozen_on_one_rank": row(
        _frozen_on_rank_one,
        "ValueError: different arguments | frozen parameters (requires_grad=False): none on "
        "ranks [0], 2 ['hidden.weight', 'hidden.bias'] #",
        when="group",
    ),
    "a_sampler_on_one_rank": row(
        lambda: {"sampler": RandomSampler(ToyData(32)) if get_rank() else None},
        "ValueError: different arguments | sampler: None on ranks [0], RandomSampler on ranks [1]",
        when="group",
    ),
    # seen at the first micro-batch, on every rank
    "a_layer_frozen_once_ddp_wrapped_the_model": row(
        {"callbacks_all": [FreezeAtStart()]},
        "ValueError: requires_grad changed after DistTrainer was built | frozen: ['hidden.bias', "
        "'hidden.weight'] | Set requires_grad before building DistTrainer",
        when="first_batch",
    ),
    "loss_not_a_scalar": row(
        {"loss": per_sample_loss, "update_every": 2},
        "ValueError: loss | scalar",
        when="first_batch",
    ),
    "batch_lacks_a_parameter": row(
        lambda: {"train_data": Renamed(32)},
        "TypeError: ToyNet.forward(x) needs 'x', which the batch lacks | "
        f"{FIELDS} | rename the dataset's fields | **kwargs",
        when="first_batch",
    ),
    "loss_a_tuple_of_three": row(
        {"loss": lambda output, batch: (F.cross_entropy(output, batch["target"]), 1, 2)},
        "ValueError: loss returned a tuple of 3 | a (sum, count) pair",
        when="first_batch",
    ),
    "loss_detached": row(
        {"loss": lambda output, batch: F.cross_entropy(output, batch["target"]).detach()},
        "ValueError: loss returned a tensor that does not require grad | torch.no_grad()",
        when="first_batch",
    ),
    "collate_returns_none": row(
        {"collate_fn": lambda samples: None},
        "TypeError: collate_fn returned NoneType, which cannot feed ToyNet.forward | a tensor, "
        "a tuple or list (x, ..., y), or a dict",
        when="first_batch",
    ),
    "loss_counts_nothing": row(
        {
            "loss": lambda output, batch: (F.cross_entropy(output, batch["target"]), 0),
            "print_every": 1,
        },
        "ValueError: loss returned (sum, count) pairs whose counts add up to 0 over the updates "
        "up to step 1 | count must be the number of items",
        when="log_step",
    ),
    "batch_shares_no_parameter": row(
        lambda: {"train_data": Renamed(32), "model": OptionalNet()},
        "TypeError: OptionalNet.forward(tokens=..., mask=...) shares no name with the batch | "
        f"{FIELDS} | **kwargs",
        when="first_batch",
    ),
}

# name -> (a call on rank 0 inside the callbacks_master guard, the function its error names).
GUARDED_CALLS: dict[str, tuple[Callable[[], Any], str]] = {
    "barrier": (lambda: barrier(), "barrier"),
    "all_reduce": (lambda: all_reduce(torch.ones(1)), "all_reduce"),
    "reduce_scatter_tensor": (
        lambda: reduce_scatter_tensor(torch.ones(1), torch.ones(2)),
        "reduce_scatter_tensor",
    ),
    "all_gather_object": (lambda: all_gather_object([None, None], 1), "all_gather_object"),
    "broadcast_object_list": (lambda: broadcast_object_list([1]), "broadcast_object_list"),
    "send": (lambda: send(torch.ones(1), dst=1), "send"),
    "isend": (lambda: isend(torch.ones(1), dst=1), "isend"),
    "irecv": (lambda: irecv(torch.ones(1), src=1), "irecv"),
    "batch_isend_irecv": (
        lambda: batch_isend_irecv([torch.distributed.P2POp(isend, torch.ones(1), 1)]),
        "batch_isend_irecv",
    ),
    "monitored_barrier": (lambda: monitored_barrier(), "monitored_barrier"),
    "new_group": (lambda: new_group(), "new_group"),
    "new_subgroups": (lambda: new_subgroups(group_size=1), "new_subgroups"),
}

HOOK_ROW = row(
    lambda: {"callbacks_master": [BarrierAt(1)], "n_epochs": 2},
    "CollectiveInMasterCallbackError: callbacks_master hook BarrierAt.on_step_end called "
    "torch.distributed.barrier() on rank 0 only | Move this callback to callbacks_all",
)

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Launch:
    result: Result
    seconds: float
    ranks: list[dict[str, Any]]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Every row in one launch (which fails: the hook row ends it); each rank's JSON."""
    out = tmp_path_factory.mktemp("bad-input")
    start = time.monotonic()
    result = run_torchrun(WORKER, 2, [str(out)], timeout=2 * LAUNCH_BOUND, cwd=out, check=False)
    seconds = time.monotonic() - start
    ranks = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results\n{result.describe()}"
        ranks.append(json.loads(path.read_text()))
    return Launch(result, seconds, ranks)


def _check_error(error: dict[str, Any], expected: Row, rank: int) -> None:
    assert error["type"] == expected.error, f"rank {rank}: {error}"
    for word in expected.words:
        assert word in error["message"], f"rank {rank}: {word!r} not in {error['message']!r}"


def test_the_table_is_large_and_ran_whole_within_the_bound(launch: Launch) -> None:
    assert len(ROWS) >= 45
    assert [set(rank["rows"]) for rank in launch.ranks] == [set(ROWS)] * 2
    assert launch.seconds < LAUNCH_BOUND, launch.result.describe()
    assert launch.result.returncode != 0  # the hook row ends the launch on purpose


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input_fails_alike_on_every_rank(name: str, launch: Launch) -> None:
    expected = ROWS[name]
    errors = [rank["rows"][name] for rank in launch.ranks]
    for rank, error in enumerate(errors):
        _check_error(error, expected, rank)
        if expected.when == "init":
            assert not error["group_after"], f"rank {rank}: process group formed before the error"
        elif expected.when == "group":  # the comparison is the trainer's first collective
            assert error["group_after"] and "global_step" not in error, error
        else:  # the first micro-batch of the first epoch (the first log step), and reported
            step = 1 if expected.when == "log_step" else 0
            assert (error["global_step"], error["batch_idx"]) == (step, 0), error
            assert (
                f"rank {rank} raised {expected.error}: {error['message']}" in launch.result.output
            )
    assert errors[0]["message"] == errors[1]["message"]


def test_every_collective_entry_point_is_refused_in_callbacks_master(launch: Launch) -> None:
    refused = launch.ranks[0]["guarded"]
    assert set(refused) == set(GUARDED_CALLS)
    for name, (_, function) in GUARDED_CALLS.items():
        error = refused[name]
        assert error["type"] == "CollectiveInMasterCallbackError", (name, error)
        assert (
            f"hook Probe.on_step_end called torch.distributed.{function}() on rank 0 only"
            in (error["message"])
        )
        assert "Move this callback to callbacks_all" in error["message"]
    # afterwards every gate is open again: a barrier and an all-reduce ran on both ranks
    assert [rank["after_guard"] for rank in launch.ranks] == [2.0, 2.0]


def test_a_collective_in_a_master_hook_ends_every_rank_quickly(launch: Launch) -> None:
    """Rank 0 raises inside the hook; rank 1, training on into the next all-reduce, fails as
    soon as rank 0 has exited, not after torch's 30-minute default timeout."""
    first, other = (rank["hook"] for rank in launch.ranks)
    _check_error(first, HOOK_ROW, 0)
    assert other["type"] is not None, other
    assert other["time"] - first["time"] < FAIL_BOUND, (first, other)
    output = launch.result.output
    assert "[rank 0] rank 0 raised CollectiveInMasterCallbackError" in output
    # rank 1's report says which rank failed where, and how
    assert "[rank 1] a collective failed on rank 1" in output
    assert "in BarrierAt.on_step_end, FAILED with CollectiveInMasterCallbackError" in output
