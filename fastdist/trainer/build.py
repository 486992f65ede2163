"""Assembling a trainer from its arguments, top to bottom: check everything, form the process
group, let the strategy wrap the model, then build the batches, evaluation, callbacks and
checkpoints, and register every stateful part with the checkpointer.
"""

from __future__ import annotations

import datetime
import itertools
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastdist.callbacks.callback import CallbackList, answers
from fastdist.callbacks.run_log import RunLogCallback
from fastdist.checkpoint import PER_RANK, Checkpointer, RandomState
from fastdist.checkpoint.background import Background
from fastdist.checkpoint.identity import identity
from fastdist.data import StreamBatches, TrainBatches
from fastdist.data.feed import make_forward
from fastdist.data.protocol import Batches
from fastdist.data.workers import warn_if_fork_may_hang, worker_context
from fastdist.distributed import (
    destroy_groups,
    get_rank,
    get_world_size,
    hang,
    init_distributed,
    is_distributed,
    is_multi_node,
    new_gloo_group,
)
from fastdist.distributed.position import PositionBoard
from fastdist.distributed.ray_train import in_ray_train
from fastdist.distributed.storage import check_shared_dirs
from fastdist.evaluation.best_model import BestModel
from fastdist.evaluation.evaluator import Evaluator
from fastdist.evaluation.validator import Validator
from fastdist.loggers import JsonLogger
from fastdist.loggers.json_lines import writes_run_log
from fastdist.logging import logger
from fastdist.state import TrainerState
from fastdist.strategies import DataShard, Strategy, Topology
from fastdist.trainer.arguments import Arguments, check_all
from fastdist.trainer.check_resume import callbacks as check_resume_callbacks
from fastdist.trainer.failure import install_excepthook
from fastdist.trainer.loss_tracker import LossTracker
from fastdist.trainer.options import TrainerOptions
from fastdist.trainer.precision import Precision
from fastdist.trainer.preemption import SigtermFlag
from fastdist.trainer.ray_report import RayReport
from fastdist.trainer.safety import check_even_shards
from fastdist.trainer.same_arguments import check_same_arguments
from fastdist.trainer.sync import Sync
from fastdist.trainer.timing import RankTimer, SlowRankReport


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    device: torch.device
    rank: int
    size: int
    group: Any  # the trainer's process group (None: the default one)
    board: PositionBoard  # where every rank is, for failure reports
    topology: Topology  # the layout of the ranks, which the strategy asked for
    replica_group: tuple[int, int] = (0, 1)  # (index, count) among the job's replica groups

    @property
    def data(self) -> DataShard:
        """The shard of the data this rank evaluates on (and trains on, in one group)."""
        return self.topology.data_shard

    @property
    def train_data(self) -> DataShard:
        """The shard of the data this rank trains on: its group's shard of the epoch, each
        replica group training its own."""
        return self.data.across_groups(self.replica_group)


@dataclass
class Run:
    """Every part of one trainer, assembled."""

    options: TrainerOptions
    world: World
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    forward: Callable[[nn.Module, Any], Any]
    loss_fn: Callable[[Any, Any], Any]
    precision: Precision
    data: Batches
    validator: Validator
    callbacks: CallbackList
    checkpointer: Checkpointer
    rng: RandomState
    state: TrainerState
    losses: LossTracker
    timer: RankTimer
    slow_ranks: SlowRankReport
    sigterm: SigtermFlag
    sync: Sync


def build(given: Mapping[str, Any], extra: Mapping[str, Any]) -> Run:
    """A trainer's parts from ``DistTrainer``'s arguments (``given`` by name; ``extra``:
    keywords it does not take, refused)."""
    args = check_all(given, extra)  # alike on every rank, before any collective
    options, device = args.options, args.device
    precision = Precision(options.amp, device)  # refuses fp16 without CUDA
    sigterm = SigtermFlag()  # refuses a bad FASTDIST_REQUEUE_SIGNAL
    world = _form_world(args)  # the topology too: the strategy's layout
    model = args.model.to(device)
    forward = make_forward(model)  # from the signature, before compiling
    evaluate = make_forward(model, evaluation=True)  # the model's predict() if it has one
    strategy = options.strategy  # checkpoints blocks and compiles, each strategy its way
    optimizer = strategy.setup(
        model,
        args.optimizer,
        device,
        world.group,
        options.amp,
        compile=options.compile,
        checkpointing=options.checkpointing,
        timeout=options.timeout,
        topology=world.topology,
    )
    timer = RankTimer(device, world.rank, world.size)
    stream_group = new_gloo_group(options.timeout) if args.stream else None
    write_group = new_gloo_group(options.timeout) if options.checkpoint_async else None
    data = _batches(args, world, timer, stream_group)
    if not data.plans_uneven:  # a user's sampler: its shards must be equal
        check_even_shards(len(data.loader), world.group)
    if is_multi_node():
        shared = [("save_path", options.save_path), ("checkpoint_dir", options.checkpoint_dir)]
        check_shared_dirs([(name, path) for name, path in shared if path], world.group)
    losses, state = LossTracker(device), TrainerState(n_epochs=options.n_epochs)
    sync_args = (losses, timer, model, options.on_nonfinite == "raise", sigterm, world.board)
    run = Run(
        options=options,
        world=world,
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        forward=forward,
        loss_fn=args.loss_fn,
        precision=precision,
        data=data,
        validator=_validator(args, strategy, evaluate, world),
        callbacks=_callbacks(args, world.rank == 0, world.topology.holds_loss),
        checkpointer=_checkpointer(args, world, state, write_group, strategy),
        rng=RandomState(world.rank),
        state=state,
        losses=losses,
        timer=timer,
        slow_ranks=SlowRankReport(
            options.slow_rank_threshold, world.rank == 0, not strategy.waits_in_compute
        ),
        sigterm=sigterm,
        sync=Sync(*sync_args, device, world.group, strategy.average_over_groups),
    )
    _register_parts(run)
    strategy.bind(state, partial(_group_samples, run))  # e.g. counts lost samples
    # The groups this trainer created go with it (each holds sockets and threads).
    owned = [world.group, stream_group, write_group, *strategy.own_groups]
    weakref.finalize(run, destroy_groups, owned)
    return run


def _form_world(args: Arguments) -> World:
    """Form the process group (several processes) and the trainer's own group; check that
    every rank was given the same arguments, before the strategy's first collective."""
    options, device = args.options, args.device
    if get_world_size() > 1:
        spec = options.device  # "auto" and "cuda" ask for a GPU of each process's own
        exclusive = spec in (None, "auto") or torch.device(spec).index is None
        init_distributed(timeout=options.timeout, device=device, exclusive=exclusive)
        if device.type == "cuda" and dist.get_backend() == "gloo":
            logger.info(
                "%s is shared by this node's processes: gradients go over gloo; "
                "device='auto' gives each process a GPU and nccl",
                device,
            )
    rank, size = get_rank(), get_world_size()
    install_excepthook()
    group = None  # a group of our own bounds every wait of the trainer by the timeout
    if is_distributed() and options.timeout is not None:
        group = dist.new_group(timeout=datetime.timedelta(seconds=options.timeout))
    check_same_arguments(args, group)
    topology = Topology.of(options.strategy, device.type, options.timeout)
    board = PositionBoard(rank, size)
    hang.watch(rank, hang.dump_dir(options.save_path), lambda: board.describe(board.fields))
    return World(device, rank, size, group, board, topology, options.strategy.replica_group)


def _group_samples(run: Run) -> list[int]:
    """Each replica group's samples (its ranks' real ones) in the update ``run`` is at."""
    index, count = run.world.replica_group
    size, every = run.world.data.size, run.options.update_every
    sizes = getattr(run.data, "sizes", None)  # every rank's micro-batch sizes of the pass
    if sizes is None:  # a stream (one group only): the nominal figure
        return [run.options.global_batch(size)] * count
    start = run.state.batch_idx // every * every
    ranks = [sum(rank[start : start + every]) for rank in sizes]
    return [sum(ranks[g * size : (g + 1) * size]) for g in range(count)]


def _batches(args: Arguments, world: World, timer: RankTimer, stream_group: Any) -> Batches:
    """This rank's training batches: a stream's (agreeing on ``stream_group``), or a
    map-style dataset's."""
    options = args.options
    workers = options.num_workers
    warn_if_fork_may_hang(options.multiprocessing_context, workers, world.size)
    loader_options: dict[str, Any] = dict(
        num_workers=workers,
        collate_fn=args.collate_fn,
        pin_memory=world.device.type == "cuda"
        if options.pin_memory is None
        else options.pin_memory,
        persistent_workers=options.persistent_workers and workers > 0,
        prefetch_factor=options.prefetch_factor if workers > 0 else None,
        multiprocessing_context=worker_context(options.multiprocessing_context)
        if workers
        else None,
    )
    if args.stream:
        return StreamBatches(
            args.train_data,
            options.batch_size_per_gpu,
            options.drop_last,
            world.train_data.rank,
            world.train_data.size,
            options.update_every,
            options.stream_read_ahead_mb,
            stream_group,
            timer.collective_in_next,
            **loader_options,
        )
    return TrainBatches(
        args.train_data,
        options.batch_size_per_gpu,
        args.sampler,
        args.batch_sampler,
        options.drop_last,
        options.seed,
        world.train_data.rank,
        world.train_data.size,
        options.update_every,
        **loader_options,
    )


def _validator(args: Arguments, strategy: Strategy, forward: Any, world: World) -> Validator:
    options = args.options
    evaluator = Evaluator(
        strategy.eval_module,
        strategy.equal_forwards,
        forward,
        args.metrics,
        strategy.device,
        options.eval_batch_size,
        options.num_workers,
        args.collate_fn,
        world.group,
        worker_context(options.multiprocessing_context) if options.num_workers else None,
        world.topology,
    )
    best = BestModel(
        strategy,
        options.save_path,
        options.load_best_model,
        args.metric_key,
        options.best_model_format,
        world.group,
    )
    return Validator(
        args.dev_data, evaluator, args.metric_key, args.larger_better, options.validate_every, best
    )


def _callbacks(args: Arguments, is_master: bool, holds_loss: bool) -> CallbackList:
    """The callback lists, the loggers' component last; with a ``save_path``, a JSON log of the
    run (``log.jsonl``) unless a given logger writes it. Rank 0 warns of a callbacks_master's
    loss hooks that never come (a pipeline computes the loss on its last stage only)."""
    master, loggers = list(args.callbacks_master), list(args.loggers)
    unreached = master if is_master and not holds_loss else []
    for cb, hook in itertools.product(unreached, ("on_loss_begin", "on_backward_begin")):
        if answers(cb, hook):
            logger.warning(
                "%s.%s in callbacks_master is never called: rank 0 runs the pipeline's first "
                "stage, the loss is computed on the last; put it in callbacks_all",
                type(cb).__name__,
                hook,
            )
    save_path = args.options.save_path
    given = args.callbacks_all + master
    held = [b for cb in given if isinstance(cb, RunLogCallback) for b in cb.log.backends]
    if save_path and not writes_run_log([*loggers, *held], save_path):
        loggers.append(JsonLogger())  # the run's record: save_path/log.jsonl
    if loggers:
        master.append(RunLogCallback(loggers, state_key="loggers"))
    every = [*args.callbacks_all, *check_resume_callbacks()]
    return CallbackList(every, master, is_master, guard_master=is_distributed())


def _checkpointer(
    args: Arguments, world: World, state: TrainerState, write_group: Any, strategy: Strategy
) -> Checkpointer:
    """Checkpoints in ``checkpoint_dir``, else ``<save_path>/checkpoints``, else none; in a
    Ray Train worker also reported to Ray (:mod:`~fastdist.trainer.ray_report`); with
    ``checkpoint_async`` written in the background, on ``write_group``; healed from a live
    peer where the strategy has one (torchft's replica groups); only from checkpoints of the
    trainer's model and optimizer (:mod:`~fastdist.checkpoint.identity`)."""
    options = args.options
    directory = options.checkpoint_dir
    if directory is None and options.save_path is not None:
        directory = os.path.join(options.save_path, "checkpoints")
    mirror = RayReport(state) if in_ray_train() else None
    if mirror is not None and directory is None:
        logger.warning(
            "running under Ray Train without save_path or checkpoint_dir: no checkpoint is "
            "written, so none reaches Ray (result.checkpoint and result.metrics stay None) and "
            "a restarted worker starts from the beginning; pass save_path= to resume"
        )
    every, keep = options.checkpoint_every, options.keep_checkpoints
    background = Background(write_group) if options.checkpoint_async else None
    return Checkpointer(
        directory,
        every,
        keep,
        world.group,
        mirror,
        background,
        strategy.peer,
        world.data.size,
        # the model's own names and (global) shapes
        {**identity(args.model, args.optimizer), "groups": args.optimizer_groups},
    )


def _register_parts(run: Run) -> None:
    """Every stateful part, under the stable name a checkpoint holds it by."""
    register = run.checkpointer.register
    for name, part, scope in run.strategy.checkpoint_parts():  # model, optimizer, strategy
        register(name, part, scope)
    register("trainer", run.state)
    register("precision", run.precision)
    register("callbacks", run.callbacks)
    register("best_model", run.validator.best)
    register("data", run.data, PER_RANK)
    register("rng", run.rng, PER_RANK)
