"""Checks of DistTrainer's arguments, run on every rank before any collective."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Sampler

from fastdist.callbacks.callback import Callback, state_keys
from fastdist.callbacks.lr_scheduler import LRSchedulerCallback
from fastdist.callbacks.run_log import RunLogCallback
from fastdist.checkpoint.export import check_format
from fastdist.checks import check_instance, check_list, check_writable_dir, describe
from fastdist.distributed.env import get_local_rank, visible_gpu_count
from fastdist.evaluation.validator import as_metric_list, resolve_metric_key
from fastdist.loggers.backend import Logger, check_loggers
from fastdist.losses import Loss, as_loss_fn
from fastdist.metrics import LossMetric, Metric
from fastdist.strategies.registry import BY_NAME
from fastdist.trainer.check_resume import overridden
from fastdist.trainer.data_arguments import (
    check_collate,
    check_dataset,
    check_dev_data,
    check_enough_samples,
    check_samplers,
    epoch_batches,
    shard_data,
)
from fastdist.trainer.options import TrainerOptions

#: DistTrainer keywords that became options of a strategy object: name -> (class, option).
MOVED = {
    "ddp_comm_hook": ("DDP", "comm_hook"),
    "fsdp_wrap": ("FSDP", "wrap"),
}
# Every option of a strategy given to DistTrainer itself (tp=2): where it belongs.
MOVED |= {
    option: (cls.__name__, option)
    for cls in BY_NAME.values()
    for option in inspect.signature(cls).parameters
}


@dataclass(frozen=True)
class Arguments:
    """DistTrainer's arguments, checked: the options and the parts to assemble."""

    options: TrainerOptions
    train_data: Dataset
    dev_data: Dataset | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], Any]
    loss: Any  # as given (a torch loss module inside loss_fn's closure): the ranks compare it
    metrics: list[Metric]
    metric_key: str
    larger_better: bool
    callbacks_all: list[Callback]
    callbacks_master: list[Callback]
    loggers: list[Logger]
    sampler: Sampler | None
    batch_sampler: Sampler | None
    collate_fn: Callable | None
    device: torch.device
    #: How many parameters each of the optimizer's groups holds, as given (a checkpoint
    #: records them; a pipeline's stage keeps its own share of each later).
    optimizer_groups: list[int]

    @property
    def stream(self) -> bool:
        """Whether ``train_data`` is a stream (an ``IterableDataset``)."""
        return isinstance(self.train_data, IterableDataset)


def check_all(given: Mapping[str, Any], extra: Mapping[str, Any]) -> Arguments:
    """Check every argument of ``DistTrainer`` (``given`` by name, ``extra``: keywords it
    does not take); raise alike on every rank, before any collective. Last, every rank
    checks that it can write to ``save_path`` and ``checkpoint_dir`` (creating nothing)."""
    reject_extra(extra, given)
    options = TrainerOptions.of(overridden(given))  # the tool's, if it runs us
    model, train_data, dev_data = given["model"], given["train_data"], given["dev_data"]
    check_model(model)
    stream = isinstance(train_data, IterableDataset)
    check_dev_data(dev_data, options.validate_every)
    sampler, batch_sampler = given["sampler"], given["batch_sampler"]
    check_samplers(sampler, batch_sampler, stream, options.drop_last, options.strategy.one_shape)
    n_train = None if stream else check_dataset("train_data", train_data)
    shards = shard_data(train_data, n_train, batch_sampler, options.strategy)
    if n_train is not None and sampler is None and batch_sampler is None:
        check_enough_samples(n_train // shards, options.batch_size_per_gpu, options.drop_last)
        options.strategy.check_batches(
            epoch_batches(n_train, shards, options), options.update_every
        )
    metrics = check_metrics(given["metrics"], dev_data is not None, options.metric_key)
    metric_key, larger_better = resolve_metric_key(options.metric_key, metrics)
    optimizer = given["optimizer"]
    if optimizer is None:
        optimizer = torch.optim.Adam(model.parameters(), lr=4e-3)
    check_optimizer(optimizer, model)
    loss_fn = check_loss(given["loss"])
    callbacks = check_callbacks(given["callbacks_all"], given["callbacks_master"])
    tie_to_trainer(
        metrics, callbacks[0], optimizer, loss_fn, dev_data is not None, metric_key, larger_better
    )
    collate_fn = check_collate(given["collate_fn"])
    check_format("best_model_format", options.best_model_format, model)
    device = resolve_device(options.device)
    options.strategy.check(model, optimizer, device, options.amp)
    if options.checkpointing and not options.strategy.blocks(model):
        raise ValueError(
            f"activation_checkpointing={options.activation_checkpointing!r} checkpoints the "
            f"model's blocks, but {type(model).__name__} has none: hold its repeated layers in "
            "an nn.ModuleList, or name their class in FSDP(wrap=[...])"
        )
    for name in ("save_path", "checkpoint_dir"):
        if getattr(options, name) is not None:
            check_writable_dir(name, getattr(options, name))
    return Arguments(
        options=options,
        train_data=train_data,
        dev_data=dev_data,
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        loss=given["loss"],
        metrics=metrics,
        metric_key=metric_key,
        larger_better=larger_better,
        callbacks_all=callbacks[0],
        callbacks_master=callbacks[1],
        loggers=check_loggers(given["loggers"], options.save_path, _backends(callbacks)),
        sampler=sampler,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        device=device,
        optimizer_groups=[len(group["params"]) for group in optimizer.param_groups],
    )


def tie_to_trainer(
    metrics: list[Metric],
    callbacks_all: list[Callback],
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], Any],
    evaluates: bool,
    metric_key: str,
    larger_better: bool,
) -> None:
    """What metrics and callbacks take of the other arguments: a ``LossMetric()`` the trainer's
    loss; an ``LRSchedulerCallback`` checks its scheduler against the optimizer and the
    evaluation (:meth:`~fastdist.callbacks.LRSchedulerCallback.check`)."""
    for metric in metrics:
        if isinstance(metric, LossMetric):
            metric.use_trainer_loss(loss_fn)
    for cb in callbacks_all:
        if isinstance(cb, LRSchedulerCallback):
            cb.check(optimizer, evaluates, metric_key, larger_better)


def reject_extra(extra: Mapping[str, Any], known: Collection[str]) -> None:
    """Raise ``TypeError`` for a keyword ``DistTrainer`` does not take, naming where an option
    moved (``bucket_cap_mb`` -> ``DDP(bucket_cap_mb=...)``) or the name meant."""
    for name, value in extra.items():
        if name in MOVED:
            cls, option = MOVED[name]
            raise TypeError(
                f"{name}= is an option of the strategy (fastdist.strategies.{cls}), not of "
                f"DistTrainer: pass strategy={cls}({option}={_shown(value)})"
            )
    for name in extra:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise TypeError(f"DistTrainer got an unexpected keyword argument {name!r}{hint}")


def _shown(value: Any) -> str:
    """``value`` as it would be written in a script: classes by name (``[Block]``)."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, list | tuple) and all(isinstance(v, type) for v in value):
        return "[" + ", ".join(v.__name__ for v in value) + "]"
    return repr(value)


def check_model(model: Any) -> None:
    """An ``nn.Module`` with something to train."""
    check_instance("model", model, nn.Module, "a torch.nn.Module", "MyNet()")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model ({type(model).__name__}) has no parameter that requires a gradient, so there "
            "is nothing to train: pass the model to train, with its parameters unfrozen "
            "(model.requires_grad_(True))"
        )
    if any(getattr(p, "device_mesh", None) is not None for p in model.parameters()):
        raise ValueError(
            f"model ({type(model).__name__}) was sharded by an earlier trainer (its parameters "
            "are DTensors), and a model is wrapped once: build the model anew for this trainer, "
            "and load the weights the first one saved (trainer.save_model) if it goes on from them"
        )


def check_optimizer(optimizer: Any, model: nn.Module) -> None:
    """An optimizer instance stepping parameters of ``model`` only."""
    what = "a torch.optim.Optimizer built from model.parameters() (or None: Adam, lr=4e-3)"
    example = "torch.optim.AdamW(model.parameters(), lr=1e-3)"
    check_instance("optimizer", optimizer, torch.optim.Optimizer, what, example)
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(
            f"optimizer holds {foreign} tensor(s) that are not parameters of model: build it from "
            "this model after creating the model, e.g. torch.optim.AdamW(model.parameters())"
        )


def check_loss(loss: Any) -> Callable[[Any, Any], Any]:
    """The ``loss`` argument as ``fn(output, batch)``; a class, or a function that cannot be
    called with two arguments, is refused here rather than at the first batch."""
    if isinstance(loss, type):
        name = loss.__name__
        raise TypeError(f"loss={name} is a class: pass an instance, loss={name}()")
    if callable(loss) and not isinstance(loss, (Loss, nn.Module)):
        try:
            inspect.signature(loss).bind(None, None)
        except TypeError:
            name = getattr(loss, "__name__", type(loss).__name__)
            raise TypeError(
                f"loss {name} cannot be called as loss(output, batch), the model's output and "
                "the batch: give it those two parameters, e.g. def loss(output, batch): return "
                "F.cross_entropy(output, batch['target'])"
            ) from None
        except ValueError:
            pass  # no signature to read (a builtin): it is called as it is
    return as_loss_fn(loss)


def check_metrics(metrics: Any, has_dev_data: bool, metric_key: str | None) -> list[Metric]:
    """The ``metrics`` argument as a list; ``dev_data`` and ``metric_key`` need metrics."""
    example = "metrics=AccuracyMetric() or metrics=[AccuracyMetric(), LossMetric()]"
    if isinstance(metrics, (str, bytes)):
        raise TypeError(f"metrics={metrics!r} is a name: pass metric objects, e.g. {example}")
    if isinstance(metrics, Mapping):
        items = list(metrics.values())
    else:  # a list, or one metric (a generator is left to as_metric_list, unconsumed)
        items = list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
    for metric in items:
        if isinstance(metric, type):
            name = metric.__name__
            raise TypeError(f"metrics holds the class {name}: pass an instance, {name}()")
    checked = as_metric_list(metrics)
    if has_dev_data and not checked:
        raise ValueError(f"dev_data needs metrics=: pass e.g. {example}")
    if metric_key is not None and not checked:
        raise ValueError(
            f"metric_key={metric_key!r} picks a result of metrics=, but there are none: pass "
            f"metrics (e.g. {example}) with dev_data=, or leave metric_key out"
        )
    return checked


def _backends(callbacks: tuple[list[Any], list[Any]]) -> list[tuple[str, Logger]]:
    """The logging backends the callbacks hold (``JSONLogCallback``'s file...), each with
    where it is."""
    return [
        (f"a {type(cb).__name__} in {name}", b)
        for name, given in zip(("callbacks_all", "callbacks_master"), callbacks, strict=True)
        for cb in given
        if isinstance(cb, RunLogCallback)
        for b in cb.log.backends
    ]


def check_callbacks(callbacks_all: Any, callbacks_master: Any) -> tuple[list[Any], list[Any]]:
    """Both callback lists: lists of ``Callback`` objects, each object in one place only and
    each ``state_key`` once per list, none that changes training in ``callbacks_master`` (on
    every rank: ``callbacks_master`` are checked here too, though only rank 0 runs them)."""
    lists = {
        name: check_list(name, given, Callback, "fastdist Callback objects", "cb")
        for name, given in (
            ("callbacks_all", callbacks_all),
            ("callbacks_master", callbacks_master),
        )
    }
    seen: dict[int, str] = {}
    for name, items in lists.items():
        for cb in items:
            if id(cb) in seen:
                raise ValueError(
                    f"the same {type(cb).__name__} object is given twice ({seen[id(cb)]} and "
                    f"{name}): pass each callback once, or build a second one"
                )
            seen[id(cb)] = name
        state_keys(items, name)  # raises on two callbacks with one state_key
    for cb in lists["callbacks_master"]:
        if cb.changes_training:
            raise ValueError(
                f"{type(cb).__name__} in callbacks_master changes training on rank 0 only, so "
                "the ranks would train different models: put it in callbacks_all"
            )
    return lists["callbacks_all"], lists["callbacks_master"]


def resolve_device(device: str | torch.device | None, gpu_count: int | None = None) -> torch.device:
    """The trainer's device; ``"auto"``/``None``/``"cuda"``: ``cuda:LOCAL_RANK`` (modulo the
    visible GPUs: ``cuda:0`` where a scheduler shows each process its own GPU), else the CPU.
    Whether the processes really have a GPU each is agreed when the group forms
    (:func:`fastdist.distributed.env.agreed_backend`).

    Args:
        device: ``"auto"``, ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        gpu_count: the visible GPUs; default torch's count (0 without CUDA).

    Raises:
        ValueError: a CUDA device that is not there.
    """
    gpu_count = visible_gpu_count() if gpu_count is None else gpu_count
    if device is None or device == "auto":
        resolved = torch.device("cuda" if gpu_count else "cpu")
    else:
        resolved = parse_device(device)
    if resolved.type != "cuda":
        return resolved
    if not gpu_count:
        raise ValueError(f"device={device!r} but CUDA is not available here: use device='cpu'")
    if resolved.index is None:
        return torch.device("cuda", get_local_rank() % gpu_count)
    if resolved.index >= gpu_count:
        raise ValueError(
            f"device={device!r} but {gpu_count} GPU(s) are visible (cuda:0 to "
            f"cuda:{gpu_count - 1}): pick one of those or set CUDA_VISIBLE_DEVICES"
        )
    return resolved


def parse_device(device: Any) -> torch.device:
    """``device`` (not ``"auto"``) as a CPU or CUDA ``torch.device``; another spelling, type or
    kind of device raises an error naming the ones fastdist accepts."""
    accepted = "'auto' (or None), 'cpu', 'cuda', 'cuda:N' or a torch.device of those"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be {accepted}; got {describe(device)}")
    try:
        resolved = torch.device(device)
    except RuntimeError:  # torch's message lists every device type it knows
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device={describe(device)} is not a device fastdist trains on: pass {accepted} "
            "(a GPU is 'cuda')"
        )
    return resolved
