"""``DistTrainer``: set-up (validate, process group, DDP, loaders) and the training loop."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Sampler

from fastdist.callbacks.callback import Callback, CallbackList
from fastdist.callbacks.json_log import JSONLogCallback
from fastdist.data import StreamBatches, TrainBatches
from fastdist.distributed import (
    all_reduce_sum,
    backend_for,
    broadcast_object,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    is_multi_node,
    new_gloo_group,
)
from fastdist.distributed.position import PositionBoard
from fastdist.distributed.storage import check_shared_dirs
from fastdist.logging import logger
from fastdist.losses import as_loss_fn
from fastdist.strategies import check_strategy_inputs, make_strategy
from fastdist.trainer import validation
from fastdist.trainer.batch import eval_mode, make_forward
from fastdist.trainer.best_model import BestModel
from fastdist.trainer.checkpoint import set_rng_state
from fastdist.trainer.checkpointer import (
    Checkpointer,
    load_trainer_state_dict,
    trainer_state_dict,
)
from fastdist.trainer.config import TrainerConfig
from fastdist.trainer.evaluator import Evaluator
from fastdist.trainer.failure import install_excepthook, report_failure
from fastdist.trainer.loss_tracker import LossTracker
from fastdist.trainer.precision import Precision
from fastdist.trainer.predict import predict as run_predict
from fastdist.trainer.preemption import SigtermFlag
from fastdist.trainer.progress import Progress
from fastdist.trainer.safety import all_finite, check_even_shards, check_in_sync, failing_ranks
from fastdist.trainer.state import TrainerState
from fastdist.trainer.timing import RankTimer, SlowRankReport


class DistTrainer:
    """Data-parallel training over every process of a torchrun job (or one plain process).

    Args:
        train_data: map-style dataset of dict or ``(input, target)`` samples, or a stream (an
            ``IterableDataset``, sharded over ranks and DataLoader workers; see
            :mod:`fastdist.data.stream`).
        model: the ``nn.Module``; wrapped in ``DistributedDataParallel`` when world size > 1.
        optimizer: built from ``model.parameters()``; default ``Adam(lr=4e-3)``.
        loss: a fastdist loss, a torch loss module, ``callable(output, batch)`` or ``None`` (the
            model returns ``{"loss": ...}``). It returns the mean loss of the micro-batch, or a
            ``(sum, count)`` pair (e.g. summed token losses and the token count): then every
            update is normalised by its count over all ranks and micro-batches.
        callbacks_all: callbacks run on every rank (learning rate, clipping, early stop).
        callbacks_master: callbacks run on rank 0 only (logging, saving); no collectives.
        batch_size_per_gpu: micro-batch size of each process; the global batch of one update
            is ``batch_size_per_gpu * world_size * update_every``.
        n_epochs: passes over ``train_data``.
        num_workers: DataLoader worker processes per rank.
        drop_last: drop the last incomplete batch of every epoch instead of a short one.
        dev_data: evaluated with ``metrics`` every epoch or every ``validate_every`` updates.
        metrics: a :class:`~fastdist.metrics.Metric`, a ``torchmetrics.Metric``, or a list
            or ``{key: metric}`` dict of them.
        metric_key: the result key that picks the best model; ``"-loss"`` means lower is
            better; default: the first key of the first metric.
        update_every: micro-batches per optimizer update (gradient accumulation).
        print_every: updates between logged losses (also when stop requests are agreed and
            the losses are checked for NaN/Inf).
        validate_every: evaluate every N updates; ``-1`` at the end of every epoch.
        save_path: directory for the best model's ``state_dict``, the checkpoints and the
            run's JSON log (``log.jsonl``); ``None`` saves nothing.
        device: ``"auto"``/``None`` (``cuda:LOCAL_RANK`` if CUDA is available, else CPU),
            ``"cpu"``, ``"cuda"`` or a ``torch.device``.
        use_tqdm: progress bar on rank 0 when it writes to a terminal.
        sampler: a distributed-aware training sampler giving every rank equally many batches;
            default: :class:`~fastdist.data.ResumableSampler` (every sample once per epoch,
            no padding, shards differing by at most one sample).
        batch_sampler: a distributed-aware batch sampler instead of ``batch_size_per_gpu``
            batches, e.g. :class:`~fastdist.data.TokenBatchSampler` (exact weights, uneven
            ends, resumable); another one must give every rank equally many batches, which
            then weigh equally.
        collate_fn: turns a list of samples into a batch; default torch's.
        dev_batch_size_per_gpu: evaluation batch size; default ``batch_size_per_gpu``.
        seed: seed of the shuffled order of the training data (the same on every rank).
        load_best_model: load the best evaluated weights into ``model`` when training ends.
        find_unused_parameters: passed to ``DistributedDataParallel``.
        timeout: seconds any collective of the trainer may wait before every rank reports
            where each rank is and exits; default torch's (30 minutes).
        on_nonfinite: ``"raise"``: the losses are checked where they are read (every log step,
            evaluation, checkpoint and at the end), the model before it is evaluated or saved,
            and every rank raises, naming the ranks and the first update with a NaN/Inf loss.
            ``"skip"``: every update's all-reduced gradients are checked (one host read per
            update) and a non-finite update is skipped on every rank.
        check_sync_every: every N updates (and at the end) compare a checksum of the
            parameters across ranks and raise on the first that differs; 0 turns it off.
        checkpoint_every: write a checkpoint every N optimizer updates as well as at every
            epoch end (0: epoch ends only).
        checkpoint_dir: where checkpoints go; default ``<save_path>/checkpoints``; with
            neither, no checkpoints are written.
        keep_checkpoints: how many of the newest checkpoints to keep.
        amp: mixed precision: ``"bf16"`` (autocast; CPU or GPU) or ``"fp16"`` (autocast and a
            gradient scaler; CUDA only); ``None``: fp32.
        fp16: fastNLP's switch, the same as ``amp="fp16"``.
        ddp_comm_hook: ``"fp16"``/``"bf16"`` (gradients all-reduced in half precision) or
            ``"powersgd"`` (low-rank compression), torch's DDP communication hooks.
        average_every: post-local SGD: after that many warm-up updates, ranks step on their own
            gradients and average parameters every ``average_every`` updates (0: off).
        static_graph, gradient_as_bucket_view, bucket_cap_mb: passed to DDP.
        pin_memory: page-locked batches for faster copies to the GPU; default: on CUDA.
        persistent_workers, prefetch_factor: passed to the DataLoader (with ``num_workers``).
        compile: ``torch.compile`` the model (in place) before wrapping it.
        strategy: ``"ddp"`` (every rank holds the whole model) or ``"fsdp"`` (torch's
            ``fully_shard``: parameters, gradients and optimizer state sharded over the ranks;
            the optimizer is pointed at the sharded parameters, same class and groups).
        fsdp_wrap: module classes sharded one by one under ``"fsdp"``; default the children
            of the model's ``nn.ModuleList``s.
        reshard_after_forward, cpu_offload: ``"fsdp"`` options: free gathered parameters
            after each block's forward; keep shards and optimizer state in host memory (CUDA).
        slow_rank_threshold: rank 0 warns when a rank's time per update (data loading +
            compute, see :mod:`fastdist.trainer.timing`) exceeds the median over ranks by more
            than this fraction; 0 turns the warning off (the per-rank figures are still
            recorded in ``state.rank_times``, ``log.jsonl`` and TensorBoard).

    Example:
        >>> trainer = DistTrainer(train_data, model, optimizer, loss=CrossEntropyLoss(),
        ...                       dev_data=dev_data, metrics=AccuracyMetric(), n_epochs=3)
        >>> result = trainer.train()  # same dict on every rank
    """

    #: Exit code after a pre-emption (SIGTERM): 128 + 15, as if killed by the signal.
    PREEMPTED_EXIT_CODE = 143

    def __init__(
        self,
        train_data: Dataset,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loss: Any = None,
        callbacks_all: Sequence[Callback] | None = None,
        callbacks_master: Sequence[Callback] | None = None,
        batch_size_per_gpu: int = 8,
        n_epochs: int = 1,
        num_workers: int = 0,
        drop_last: bool = False,
        dev_data: Dataset | None = None,
        metrics: Any = None,
        metric_key: str | None = None,
        update_every: int = 1,
        print_every: int = 10,
        validate_every: int = -1,
        save_path: str | None = None,
        device: str | torch.device | None = "auto",
        use_tqdm: bool = True,
        sampler: Sampler | None = None,
        batch_sampler: Sampler | None = None,
        collate_fn: Callable | None = None,
        dev_batch_size_per_gpu: int | None = None,
        seed: int = 0,
        load_best_model: bool = True,
        find_unused_parameters: bool = False,
        timeout: float | None = None,
        on_nonfinite: str = "raise",
        check_sync_every: int = 0,
        checkpoint_every: int = 0,
        checkpoint_dir: str | None = None,
        keep_checkpoints: int = 2,
        amp: str | None = None,
        fp16: bool = False,
        ddp_comm_hook: str | None = None,
        average_every: int = 0,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        compile: bool = False,
        strategy: str = "ddp",
        fsdp_wrap: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        slow_rank_threshold: float = 0.1,
    ) -> None:
        # 1. Validate everything, identically on every rank, before any collective.
        self.config = cfg = TrainerConfig(
            batch_size_per_gpu=batch_size_per_gpu,
            dev_batch_size_per_gpu=dev_batch_size_per_gpu,
            n_epochs=n_epochs,
            update_every=update_every,
            print_every=print_every,
            validate_every=validate_every,
            num_workers=num_workers,
            drop_last=drop_last,
            metric_key=metric_key,
            save_path=None if save_path is None else os.fspath(save_path),
            use_tqdm=use_tqdm,
            seed=seed,
            load_best_model=load_best_model,
            find_unused_parameters=find_unused_parameters,
            timeout=timeout,
            on_nonfinite=on_nonfinite,
            check_sync_every=check_sync_every,
            checkpoint_every=checkpoint_every,
            checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
            keep_checkpoints=keep_checkpoints,
            amp="fp16" if fp16 and amp is None else amp,
            ddp_comm_hook=ddp_comm_hook,
            average_every=average_every,
            bucket_cap_mb=bucket_cap_mb,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            strategy=strategy,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            prefetch_factor=prefetch_factor,
            slow_rank_threshold=slow_rank_threshold,
        )
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        stream = isinstance(train_data, IterableDataset)
        if dev_data is not None:
            validation.check_dataset("dev_data", dev_data)
        validation.check_samplers(sampler, batch_sampler, stream)
        if not stream:
            n_train = validation.check_dataset("train_data", train_data)
            if sampler is None and batch_sampler is None:
                validation.check_enough_samples(
                    n_train // get_world_size(), batch_size_per_gpu, drop_last
                )
        self.metrics = validation.as_metric_list(metrics)
        if dev_data is not None and not self.metrics:
            raise ValueError("dev_data needs metrics=: pass e.g. metrics=AccuracyMetric()")
        self.metric_key, self.larger_better = validation.resolve_metric_key(
            metric_key, self.metrics
        )
        if optimizer is None:
            optimizer = torch.optim.Adam(model.parameters(), lr=4e-3)
        validation.check_optimizer(optimizer, model)
        self.callbacks_all = validation.check_callbacks("callbacks_all", callbacks_all)
        self.callbacks_master = validation.check_callbacks("callbacks_master", callbacks_master)
        callbacks = self.callbacks_all + self.callbacks_master
        if cfg.save_path and not any(isinstance(cb, JSONLogCallback) for cb in callbacks):
            self.callbacks_master.append(JSONLogCallback())  # the run's record: save_path/log.jsonl
        self.loss_fn = as_loss_fn(loss)
        self.device = validation.resolve_device(device)
        self.precision = Precision(cfg.amp, self.device)
        check_strategy_inputs(cfg, model, fsdp_wrap, self.device)
        if ddp_comm_hook == "bf16" and self.device.type != "cuda":
            raise ValueError("ddp_comm_hook='bf16' needs CUDA and NCCL; use 'fp16' with gloo")

        # 2. Process group, model placement and the strategy's wrapping.
        if get_world_size() > 1:
            pinned = device not in (None, "auto") and torch.device(device).index is not None
            backend = backend_for(self.device, pinned)
            if backend == "gloo" and self.device.type == "cuda":
                logger.info(
                    "%s is shared by this node's processes: gradients go over gloo; "
                    "device='auto' gives each process a GPU and nccl",
                    self.device,
                )
            init_distributed(backend=backend, timeout=timeout)
        self.rank, self.world_size = get_rank(), get_world_size()
        self.is_master = self.rank == 0
        install_excepthook()
        self.board = PositionBoard(self.rank, self.world_size)
        # A group of our own bounds every wait of the trainer by ``timeout``.
        self.group = None
        if is_distributed() and timeout is not None:
            self.group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
        self.model = model.to(self.device)
        self.forward = make_forward(self.model)  # from the signature, before compiling
        if compile:
            self.model.compile()
        self.strategy = make_strategy(cfg, self.device, self.group, fsdp_wrap)
        self.optimizer = self.strategy.wrap(self.model, optimizer)

        # 3. Data, evaluation, callbacks, checkpoints and state.
        self.train_data, self.dev_data = train_data, dev_data
        self.timer = RankTimer(self.device, self.rank, self.world_size)
        loader_options: dict[str, Any] = dict(
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
        )
        self.data: TrainBatches | StreamBatches
        if stream:
            self.data = StreamBatches(
                train_data,
                batch_size_per_gpu,
                drop_last,
                self.rank,
                self.world_size,
                update_every,
                new_gloo_group(timeout),
                self.timer.collective_in_next,
                **loader_options,
            )
        else:
            self.data = TrainBatches(
                train_data,
                batch_size_per_gpu,
                sampler,
                batch_sampler,
                drop_last,
                seed,
                self.rank,
                self.world_size,
                update_every,
                **loader_options,
            )
        if not self.data.plans_uneven:  # a user's sampler: its shards must be equal
            check_even_shards(len(self.data.loader), self.group)
        if is_multi_node():
            shared = [("save_path", cfg.save_path), ("checkpoint_dir", cfg.checkpoint_dir)]
            check_shared_dirs([(name, path) for name, path in shared if path], self.group)
        self.evaluator = Evaluator(
            self.model,
            self.forward,
            self.metrics,
            self.device,
            cfg.eval_batch_size,
            num_workers,
            collate_fn,
            self.group,
        )
        self.callbacks = CallbackList(
            self.callbacks_all, self.callbacks_master, self.is_master, guard_master=is_distributed()
        )
        self.callbacks.set_trainer(self)
        self.best = BestModel(
            self.model, self.strategy, cfg.save_path, keep_in_memory=load_best_model
        )
        default_dir = None if cfg.save_path is None else os.path.join(cfg.save_path, "checkpoints")
        self.checkpointer = Checkpointer(
            cfg.checkpoint_dir or default_dir,
            checkpoint_every,
            keep_checkpoints,
            sharded=cfg.strategy == "fsdp",
        )
        self.state = TrainerState(n_epochs=n_epochs)
        self._resume_rng: dict[str, Any] | None = None
        self.losses = LossTracker(self.device)
        self.slow_ranks = SlowRankReport(cfg.slow_rank_threshold, show=self.is_master)
        self.progress = Progress(show=False, use_tqdm=False, total=0, initial=0, global_batch=0)
        self.sigterm = SigtermFlag()  # watched during train(); agreed at sync points
        self.preempted = False  # a SIGTERM agreed by all ranks
        self.stop_agreed = False  # a stop (request or SIGTERM) agreed by all ranks

    @property
    def best_model_path(self) -> str | None:
        """The file rank 0 keeps the best model in (``None`` before the first, or on others)."""
        return self.best.path

    def train(self, resume: bool | str | os.PathLike = "auto") -> dict[str, Any]:
        """Train for ``n_epochs``; return the same result dict on every rank.

        Args:
            resume: ``"auto"`` continues from the newest valid checkpoint in the checkpoint
                directory if there is one (so a restarted job resumes with the same command);
                a path continues from that checkpoint; ``False`` starts afresh.

        Returns:
            ``best_eval`` (dict or None), ``best_epoch``, ``best_step``, ``steps`` (optimizer
            updates), ``seconds`` (rank 0's wall time).

        On SIGTERM every rank finishes its current update, the ranks agree at the next log
        step, rank 0 writes a checkpoint and every rank exits with code 143.
        """
        start = time.time()
        found = self.checkpointer.find(resume)
        if found is not None:
            self.load_state_dict(found[0])
        left = self._updates_left()
        self.state.total_steps = None if left is None else self.state.global_step + left
        if found is not None:
            state = self.state
            logger.info(
                "resumed from %s: epoch %d, %d samples into it, step %d%s",
                found[1],
                state.epoch,
                0 if state.epoch_complete else state.samples_in_epoch,
                state.global_step,
                ""
                if left != 0
                else " (nothing left to train: resume=False or another save_path starts afresh)",
            )
        cfg = self.config
        logger.info(
            "training on %d process(es), %s; global batch %d = %d per process x %d x "
            "update_every %d; %s updates",
            self.world_size,
            self.device,
            cfg.batch_size_per_gpu * self.world_size * cfg.update_every,
            cfg.batch_size_per_gpu,
            self.world_size,
            cfg.update_every,
            "unknown (a stream)" if left is None else self.state.total_steps,
        )
        global_batch = cfg.batch_size_per_gpu * self.world_size * cfg.update_every
        self.progress = Progress(
            self.is_master,
            cfg.use_tqdm,
            self.state.total_steps,
            self.state.global_step,
            global_batch,
        )
        self.losses.reset(self.state.global_step)
        try:
            with self.sigterm.watching(), self.timer.hooked(self.model):
                self._loop()
            if self.preempted:
                self._save_checkpoint()
                logger.warning("pre-empted: checkpoint written at step %d", self.state.global_step)
                raise SystemExit(self.PREEMPTED_EXIT_CODE)
            self._sync(check_model=True)  # the last updates' losses and the final weights
            self.slow_ranks.summary()
            if cfg.check_sync_every:
                check_in_sync(self.model, self.state.global_step, self.group)
            if cfg.load_best_model and self.state.best_eval is not None:
                self.best.load(self.is_master)
                state = self.state
                logger.info(
                    "loaded the best model of epoch %d step %d", state.best_epoch, state.best_step
                )
        except Exception as exc:
            report_failure(exc, self._where(), cfg.timeout)
            self.callbacks.on_exception(exc)
            raise
        finally:
            self.progress.close()
        result = {
            "best_eval": self.state.best_eval,
            "best_epoch": self.state.best_epoch,
            "best_step": self.state.best_step,
            "steps": self.state.global_step,
            "seconds": round(time.time() - start, 3),
        }
        self.board.publish(phase="finished")
        return broadcast_object(result, group=self.group)

    def _loop(self) -> None:
        state, cfg, callbacks = self.state, self.config, self.callbacks
        callbacks.on_train_begin()
        first_epoch = state.epoch + 1 if state.epoch_complete else state.epoch
        for epoch in range(max(first_epoch, 1), cfg.n_epochs + 1):
            state.epoch = epoch
            self.board.publish(epoch=epoch, step=state.global_step, phase="train")
            callbacks.on_epoch_begin()
            # The timer times next() and the copy to the device as the data wait.
            batches = self.timer.batches(self._epoch_batches(epoch), self.device)
            for batch_idx, batch in enumerate(batches):
                state.batch_idx = batch_idx
                state.is_update = self._ends_window(batch_idx)
                share = self.data.weights[batch_idx]
                state.is_filler = share == 0.0  # keeps a shorter shard in step; trains nothing
                callbacks.on_batch_begin(batch)
                # Only the last micro-batch of a window all-reduces gradients.
                with contextlib.nullcontext() if state.is_update else self.strategy.no_sync():
                    with self.precision.autocast(), eval_mode(self.model, state.is_filler):
                        output = self.forward(self.strategy.module, batch)
                        callbacks.on_loss_begin(batch, output)
                        loss = self.losses.add(self.loss_fn(output, batch), share)
                    callbacks.on_backward_begin(loss)
                    weight = self.losses.weight(share)
                    self.precision.backward(loss if weight == 1.0 else loss * weight)
                if state.is_update:  # (sum, count) losses: divide by the update's global count
                    self.losses.normalize(self.model, self.world_size, self.group)
                self.timer.backward_done(state.is_update)  # splits off the all-reduce wait
                callbacks.on_backward_end()
                if state.is_update and self._optimizer_step():
                    if state.global_step % cfg.print_every == 0:
                        self._sync(log_loss=True)  # on_step_end sees the fresh loss
                    callbacks.on_step_end()
                    if cfg.validate_every > 0 and state.global_step % cfg.validate_every == 0:
                        self._validate()
                    ends_epoch = self.data.ends_pass(batch_idx + 1)  # saved just below
                    if self.checkpointer.due(state.global_step) and not ends_epoch:
                        self._save_checkpoint()
                callbacks.on_batch_end()
                if self.stop_agreed:
                    break
            if not self.stop_agreed:  # the epoch ran to its end
                state.epoch_complete = True
                if cfg.validate_every < 0:
                    self._validate()
            if not self.preempted:  # a pre-empted epoch has not ended: it resumes later
                callbacks.on_epoch_end()
            if state.epoch_complete:
                self._save_checkpoint()
            if self.stop_agreed:
                break
        if not self.preempted:
            callbacks.on_train_end()

    def _epoch_batches(self, epoch: int) -> Iterator[Any]:
        """This epoch's batches from where training stands in it (mid-epoch after a resume)."""
        state = self.state
        if state.epoch_complete:
            state.samples_in_epoch = state.batches_in_epoch = 0
        state.epoch_complete = False
        self.data.begin(epoch, state.samples_in_epoch, state.batches_in_epoch)
        # iter() draws from the torch RNG. A checkpoint at an epoch end was taken before that
        # draw, one inside an epoch after it: restore the saved state on the matching side.
        resume_rng, self._resume_rng = self._resume_rng, None
        mid_epoch = state.samples_in_epoch > 0 or state.batches_in_epoch > 0
        if resume_rng is not None and not mid_epoch:
            set_rng_state(resume_rng)
        batches = self.data.iterate()
        if resume_rng is not None and mid_epoch:
            set_rng_state(resume_rng)
        return batches

    def _updates_left(self) -> int | None:
        """Optimizer updates from the current position to the end of the last epoch (``None``:
        unknown, a stream)."""
        state, every = self.state, self.config.update_every
        first = state.epoch + 1 if state.epoch_complete else max(state.epoch, 1)
        left = 0
        for epoch in range(first, self.config.n_epochs + 1):
            mid = epoch == state.epoch and not state.epoch_complete
            position = (state.samples_in_epoch, state.batches_in_epoch) if mid else (0, 0)
            n = self.data.n_micro_batches(epoch, *position)
            if n is None:
                return None
            left += -(-n // every)
        return left

    def _ends_window(self, batch_idx: int) -> bool:
        n = batch_idx + 1
        return n % self.config.update_every == 0 or n == len(self.data.weights)

    def _optimizer_step(self) -> bool:
        """Step, unless the gradients are non-finite or fp16 overflowed; say whether it did."""
        state, cfg = self.state, self.config
        # With fp16 the gradient scaler handles overflow itself, skipping such steps.
        skip = cfg.on_nonfinite == "skip" and self.precision.scaler is None
        if skip and not all_finite(p.grad for p in self.model.parameters()):
            self._skip_nonfinite_update()
            applied = False
        else:
            applied = self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.end_window(applied)
        if not applied:
            state.skipped_steps += 1
            return False
        state.global_step += 1
        state.samples_in_epoch, state.batches_in_epoch = self.data.position(state.batch_idx + 1)
        self.strategy.after_step(self.model, state.global_step)  # e.g. local SGD's averaging
        self.progress.update()
        if cfg.check_sync_every and state.global_step % cfg.check_sync_every == 0:
            check_in_sync(self.model, state.global_step, self.group)
        return True

    def _skip_nonfinite_update(self) -> None:
        """Warn that this update is skipped on every rank, naming the ranks with a NaN/Inf loss."""
        finite = bool(torch.isfinite(self.losses.window_loss()))
        culprits = list(failing_ranks(None if finite else True, self.group))
        logger.warning(
            "non-finite loss or gradient at epoch %d update %d; ranks with a non-finite loss: "
            "%s: skipping this update on every rank",
            self.state.epoch,
            self.state.global_step + 1,
            culprits,
        )

    def request_stop(self) -> None:
        """Ask every rank to stop; agreed at the next log step, evaluation or checkpoint."""
        self.state.stop_requested = True

    def _sync(self, log_loss: bool = False, check_model: bool = False) -> bool:
        """Agree on stopping, check the losses (and the model), share the ranks' timings.

        One all-reduce of ``5 + 3 * world_size`` numbers: the loss sum and count, three flags
        and every rank's time split (each rank fills its own slot, see ``timing.py``).

        Every rank raises ``FloatingPointError`` if some rank's loss since the last log step
        was NaN/Inf (``on_nonfinite="raise"``) or, with ``check_model``, some rank's parameters
        are. With ``log_loss`` the mean loss since the last log step becomes ``state.loss`` and
        is shown. Returns whether to stop (a request or SIGTERM on any rank), agreed.
        """
        state = self.state
        self.board.publish(step=state.global_step, phase="sync")
        bad_model = check_model and not all_finite(p.detach() for p in self.model.parameters())
        flags = [float(state.stop_requested), float(self.sigterm.received), float(bad_model)]
        numbers = flags + self.timer.payload()
        stats = torch.cat(
            [self.losses.pending(), torch.tensor(numbers, dtype=torch.float64, device=self.device)]
        )
        with self.timer.collective_wait():
            reduced = all_reduce_sum(stats, self.group).tolist()
        loss_sum, count, stop, sigterm, bad_models = reduced[:5]
        self.board.move(phase="train")
        timings = self.timer.received(reduced[5:])
        if timings is not None:
            state.rank_times = [t.as_dict() for t in timings[0]]
            self.slow_ranks.observe(*timings, state.global_step)
        if bad_models or (self.config.on_nonfinite == "raise" and not math.isfinite(loss_sum)):
            self._raise_nonfinite(bad_model)
        if log_loss and count:
            state.loss = loss_sum / count
            self.losses.reset(state.global_step)
            if self.is_master:
                lr = self.optimizer.param_groups[0]["lr"]
                self.progress.log(state.epoch, state.global_step, state.total_steps, state.loss, lr)
        state.stop_requested = stop > 0
        self.preempted = sigterm > 0
        self.stop_agreed = state.stop_requested or self.preempted
        if self.stop_agreed:
            why = "SIGTERM received" if self.preempted else "stop requested"
            logger.info("%s; stopping at step %d", why, state.global_step)
        return self.stop_agreed

    def _raise_nonfinite(self, bad_model: bool) -> NoReturn:
        """Raise on every rank (all are here, agreed), naming who saw what where."""
        step = self.state.global_step
        models = failing_ranks(True if bad_model else None, self.group)
        if models:
            raise FloatingPointError(
                f"the model's parameters are NaN/Inf on ranks {list(models)} at update {step}: "
                "a non-finite gradient was applied (lower the learning rate, clip gradients, "
                "or use on_nonfinite='skip')"
            )
        losses = failing_ranks(self.losses.first_nonfinite(), self.group)
        rank, (_, where) = min(losses.items(), key=lambda item: item[1][0])
        raise FloatingPointError(
            f"non-finite loss by update {step}, first at {where} on rank {rank}; ranks with a "
            f"non-finite loss: {list(losses)}; on_nonfinite='skip' skips such updates"
        )

    def evaluate(self, data: Dataset | None = None) -> dict[str, float]:
        """Evaluate ``data`` (default ``dev_data``) with ``metrics``; same dict on every rank."""
        data = self.dev_data if data is None else data
        if data is None or not self.metrics:
            raise ValueError("evaluate() needs metrics= and data (or dev_data=) on the trainer")
        self.board.publish(phase="evaluate")
        # Each rank's forward updated its own running statistics (batch norm); evaluate all
        # shards with rank 0's, the buffers DDP would broadcast before the next forward.
        self.strategy.broadcast_buffers(self.model)
        result = self.evaluator.evaluate(data)
        self.board.move(phase="train")
        return result

    def predict(
        self,
        data: Dataset,
        batch_size_per_gpu: int | None = None,
        output_path: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> list[Any] | None:
        """Run the model over ``data`` sharded over all ranks; rank 0 gets the outputs in order.

        Call it on every rank. ``kwargs`` go to :func:`fastdist.predict` (``writer``,
        ``shared_dir``, ``to_output``, ``collate_fn``, ``num_workers``).

        Example:
            >>> preds = trainer.predict(test_data)  # a list on rank 0, None elsewhere
        """
        self.board.publish(phase="predict")
        self.strategy.broadcast_buffers(self.model)  # as evaluate() does
        kwargs.setdefault("collate_fn", self.evaluator.collate_fn)
        kwargs.setdefault("num_workers", self.config.num_workers)
        try:
            return run_predict(
                self.model,
                data,
                batch_size_per_gpu or self.config.eval_batch_size,
                output_path=output_path,
                device=self.device,
                group=self.group,
                **kwargs,
            )
        finally:
            self.board.move(phase="train")

    def _validate(self) -> None:
        """Evaluate the dev data, keep the best model, agree on stop requests it led to."""
        if self.dev_data is None:
            return
        self._sync(check_model=True)  # a model with NaN/Inf weights is neither scored nor kept
        self.callbacks.on_valid_begin()
        with self.timer.paused():
            result = self.evaluate(self.dev_data)
        state = self.state
        value = result[self.metric_key]
        best = None if state.best_eval is None else state.best_eval[self.metric_key]
        is_better = best is None or (value > best if self.larger_better else value < best)
        state.eval_result = result
        if is_better:
            state.best_eval, state.best_epoch = result, state.epoch
            state.best_step = state.global_step
            self.best.save(self.metric_key)  # FSDP gathers the weights: on every rank
        logger.info(
            "evaluation at epoch %d step %d: %s%s",
            state.epoch,
            state.global_step,
            ", ".join(f"{k}={v:.6g}" for k, v in result.items()),
            " (best so far)" if is_better else "",
        )
        self.callbacks.on_valid_end(result, self.metric_key, is_better)
        self._sync()  # e.g. early stopping's request, agreed at once

    def _save_checkpoint(self) -> None:
        """Write a checkpoint (if checkpointing is on) of a model checked to be finite."""
        if self.checkpointer.dir is not None:
            self._sync(check_model=True)
            with self.timer.paused():
                self.checkpointer.save(self)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, as tensors and plain data (``weights_only`` loads)."""
        return trainer_state_dict(self)

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (plus the ``rng`` list a checkpoint carries)."""
        load_trainer_state_dict(self, checkpoint)

    def _where(self) -> PositionBoard:
        """The board with this rank's precise position filled in (for failure reports)."""
        state = self.state
        self.board.move(epoch=state.epoch, step=state.global_step, hook=self.callbacks.current)
        return self.board
