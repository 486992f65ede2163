"""``DistTrainer``: set-up (validate, process group, DDP, loaders) and the training loop."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from tqdm import tqdm

from fastdist.callbacks.callback import Callback, CallbackList
from fastdist.distributed import (
    all_gather_object,
    all_reduce_sum,
    broadcast_object,
    broadcast_tensors,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
)
from fastdist.distributed.position import PositionBoard
from fastdist.logging import logger
from fastdist.losses import as_loss_fn
from fastdist.metrics import Metric
from fastdist.trainer import validation
from fastdist.trainer.batch import make_forward, to_device, window_weights
from fastdist.trainer.checkpoint import atomic_save
from fastdist.trainer.config import TrainerConfig
from fastdist.trainer.evaluator import Evaluator
from fastdist.trainer.failure import install_excepthook, report_failure
from fastdist.trainer.state import TrainerState


class DistTrainer:
    """Data-parallel training over every process of a torchrun job (or one plain process).

    Args:
        train_data: map-style dataset of dict or ``(input, target)`` samples.
        model: the ``nn.Module``; wrapped in ``DistributedDataParallel`` when world size > 1.
        optimizer: built from ``model.parameters()``; default ``Adam(lr=4e-3)``.
        loss: a fastdist loss, a torch loss module, ``callable(output, batch)`` or ``None`` (the
            model returns ``{"loss": ...}``). It must return the mean loss of the micro-batch.
        callbacks_all: callbacks run on every rank (learning rate, clipping, early stop).
        callbacks_master: callbacks run on rank 0 only (logging, saving); no collectives.
        batch_size_per_gpu: micro-batch size of each process; the global batch of one update
            is ``batch_size_per_gpu * world_size * update_every``.
        n_epochs: passes over ``train_data``.
        num_workers: DataLoader worker processes per rank.
        drop_last: drop the last incomplete batch of every epoch instead of a short one.
        dev_data: evaluated with ``metrics`` every epoch or every ``validate_every`` updates.
        metrics: a :class:`~fastdist.metrics.Metric` or a list of them.
        metric_key: the result key that picks the best model; ``"-loss"`` means lower is
            better; default: the first key of the first metric.
        update_every: micro-batches per optimizer update (gradient accumulation).
        print_every: updates between logged losses (also when stop requests are agreed).
        validate_every: evaluate every N updates; ``-1`` at the end of every epoch.
        save_path: directory for the best model's ``state_dict``; ``None`` saves nothing.
        device: ``"auto"``/``None`` (``cuda:LOCAL_RANK`` if CUDA is available, else CPU),
            ``"cpu"``, ``"cuda"`` or a ``torch.device``.
        use_tqdm: progress bar on rank 0 when it writes to a terminal.
        sampler: a distributed-aware training sampler; default ``DistributedSampler``.
        collate_fn: turns a list of samples into a batch; default torch's.
        dev_batch_size_per_gpu: evaluation batch size; default ``batch_size_per_gpu``.
        seed: seed of the shuffled order of the training data (the same on every rank).
        load_best_model: load the best evaluated weights into ``model`` when training ends.
        find_unused_parameters: passed to ``DistributedDataParallel``.
        timeout: seconds any collective of the trainer may wait before every rank reports
            where each rank is and exits; default torch's (30 minutes).
        on_nonfinite: ``"raise"`` or ``"skip"`` when a loss or gradient is NaN/Inf; every
            rank sees the same all-reduced gradients, so every rank decides the same.
        check_sync_every: every N updates (and at the end) compare a checksum of the
            parameters across ranks and raise on the first that differs; 0 turns it off.

    Example:
        >>> trainer = DistTrainer(train_data, model, optimizer, loss=CrossEntropyLoss(),
        ...                       dev_data=dev_data, metrics=AccuracyMetric(), n_epochs=3)
        >>> result = trainer.train()  # same dict on every rank
    """

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
        metrics: Metric | Sequence[Metric] | None = None,
        metric_key: str | None = None,
        update_every: int = 1,
        print_every: int = 10,
        validate_every: int = -1,
        save_path: str | None = None,
        device: str | torch.device | None = "auto",
        use_tqdm: bool = True,
        sampler: Sampler | None = None,
        collate_fn: Callable | None = None,
        dev_batch_size_per_gpu: int | None = None,
        seed: int = 0,
        load_best_model: bool = True,
        find_unused_parameters: bool = False,
        timeout: float | None = None,
        on_nonfinite: str = "raise",
        check_sync_every: int = 0,
    ) -> None:
        # 1. Validate everything, identically on every rank, before any collective.
        self.config = TrainerConfig(
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
        )
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        validation.check_dataset("train_data", train_data)
        if dev_data is not None:
            validation.check_dataset("dev_data", dev_data)
        if sampler is not None and not hasattr(sampler, "__len__"):
            raise TypeError("sampler must have __len__ (the number of samples of this rank)")
        self.metrics = validation.as_metric_list(metrics)
        if dev_data is not None and not self.metrics:
            raise ValueError("dev_data needs metrics=: pass e.g. metrics=AccuracyMetric()")
        self.metric_key, self.larger_better = validation.resolve_metric_key(
            metric_key, self.metrics
        )
        if optimizer is None:
            optimizer = torch.optim.Adam(model.parameters(), lr=4e-3)
        validation.check_optimizer(optimizer, model)
        callbacks_all = validation.check_callbacks("callbacks_all", callbacks_all)
        callbacks_master = validation.check_callbacks("callbacks_master", callbacks_master)
        self.loss_fn = as_loss_fn(loss)
        self.device = validation.resolve_device(device)

        # 2. Process group, model placement and DDP.
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if get_world_size() > 1:
            init_distributed(backend=backend)
        self.rank, self.world_size = get_rank(), get_world_size()
        self.is_master = self.rank == 0
        install_excepthook()
        self.board = PositionBoard(self.rank, self.world_size)
        # A group of our own bounds every wait of the trainer by ``timeout``.
        self.group = None
        if is_distributed() and timeout is not None:
            self.group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.ddp_model: nn.Module = self.model
        if is_distributed():
            self.ddp_model = DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=find_unused_parameters,
                process_group=self.group,
            )
        self.forward = make_forward(self.model)

        # 3. Data, evaluation, callbacks and state.
        self.train_data, self.dev_data = train_data, dev_data
        self.sampler = sampler or DistributedSampler(
            train_data,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=True,
            seed=seed,
            drop_last=drop_last,
        )
        self.train_loader = DataLoader(
            train_data,
            batch_size=batch_size_per_gpu,
            sampler=self.sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            drop_last=drop_last,
            pin_memory=self.device.type == "cuda",
        )
        n_samples = len(self.sampler)  # type: ignore[arg-type]
        self.weights = window_weights(n_samples, batch_size_per_gpu, update_every, drop_last)
        if not self.weights:
            raise ValueError(
                f"train_data gives this rank {n_samples} samples, fewer than one batch "
                f"with batch_size_per_gpu={batch_size_per_gpu} and drop_last=True"
            )
        self.evaluator = Evaluator(
            self.model,
            self.forward,
            self.metrics,
            self.device,
            self.config.eval_batch_size,
            num_workers,
            collate_fn,
            self.group,
        )
        self._check_even_shards()
        self.callbacks = CallbackList(
            callbacks_all, callbacks_master, self.is_master, guard_master=is_distributed()
        )
        self.callbacks.set_trainer(self)
        steps_per_epoch = -(-len(self.weights) // update_every)
        self.state = TrainerState(n_epochs=n_epochs, total_steps=n_epochs * steps_per_epoch)
        self.best_model_path: str | None = None
        self._best_state: dict[str, torch.Tensor] | None = None
        self._loss_sum = torch.zeros((), device=self.device)  # since the last log line
        self._loss_count = 0
        self._window_loss = torch.zeros((), device=self.device)  # of the current update
        self._window_count = 0
        self._bar: tqdm | None = None

    def train(self) -> dict[str, Any]:
        """Train for ``n_epochs``; return the same result dict on every rank.

        Returns:
            ``best_eval`` (dict or None), ``best_epoch``, ``best_step``, ``steps`` (optimizer
            updates), ``seconds`` (rank 0's wall time).
        """
        start = time.time()
        logger.info(
            "training on %d process(es), %s; global batch %d = %d per process x %d x "
            "update_every %d; %d updates",
            self.world_size,
            self.device,
            self.config.batch_size_per_gpu * self.world_size * self.config.update_every,
            self.config.batch_size_per_gpu,
            self.world_size,
            self.config.update_every,
            self.state.total_steps,
        )
        if self.is_master and self.config.use_tqdm:
            # disable=None turns the bar off when stderr is not a terminal.
            self._bar = tqdm(total=self.state.total_steps, disable=None, dynamic_ncols=True)
        try:
            self._loop()
            if self.config.check_sync_every:
                self._check_in_sync()
            if self.config.load_best_model and self.state.best_eval is not None:
                self._load_best()
        except Exception as exc:
            report_failure(exc, self._where(), self.config.timeout)
            self.callbacks.on_exception(exc)
            raise
        finally:
            if self._bar is not None:
                self._bar.close()
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
        for epoch in range(state.epoch + 1, cfg.n_epochs + 1):
            state.epoch = epoch
            self.board.publish(epoch=epoch, step=state.global_step, phase="train")
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on all ranks
            callbacks.on_epoch_begin()
            stop = False
            for batch_idx, batch in enumerate(self.train_loader):
                state.batch_idx = batch_idx
                state.is_update = self._ends_window(batch_idx)
                batch = to_device(batch, self.device)
                callbacks.on_batch_begin(batch)
                # Only the last micro-batch of a window all-reduces gradients.
                with contextlib.nullcontext() if state.is_update else self._no_sync():
                    output = self.forward(self.ddp_model, batch)
                    callbacks.on_loss_begin(batch, output)
                    loss = self._compute_loss(output, batch)
                    callbacks.on_backward_begin(loss)
                    (loss * self.weights[batch_idx]).backward()
                callbacks.on_backward_end()
                if state.is_update and self._optimizer_step():
                    callbacks.on_step_end()
                    every = cfg.validate_every
                    validate = every > 0 and state.global_step % every == 0
                    if validate:
                        self._validate()
                    if validate or state.global_step % cfg.print_every == 0:
                        stop = self._sync_and_log()
                callbacks.on_batch_end()
                if stop:
                    break
            if not stop and cfg.validate_every < 0:
                self._validate()
            callbacks.on_epoch_end()
            if stop or self._sync_and_log():
                break
        callbacks.on_train_end()

    def _ends_window(self, batch_idx: int) -> bool:
        n = batch_idx + 1
        return n % self.config.update_every == 0 or n == len(self.weights)

    def _optimizer_step(self) -> bool:
        """Step unless the gradients are non-finite (``on_nonfinite="skip"``); say if it did."""
        state = self.state
        finite = self._gradients_finite()
        if finite:
            self.optimizer.step()
            self._loss_sum += self._window_loss
            self._loss_count += self._window_count
        self.optimizer.zero_grad(set_to_none=True)
        self._window_loss.zero_()
        self._window_count = 0
        if not finite:
            state.skipped_steps += 1
            return False
        state.global_step += 1
        if self._bar is not None:
            self._bar.update()
        every = self.config.check_sync_every
        if every and state.global_step % every == 0:
            self._check_in_sync()
        return True

    def _gradients_finite(self) -> bool:
        """Whether the all-reduced gradients are finite: the same answer on every rank.

        A NaN/Inf loss on any rank makes the averaged gradients non-finite everywhere, so no
        extra collective is needed to agree; only then do the ranks compare their own losses
        to name the culprit. One host read per update, none per micro-batch.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads or torch.isfinite(torch.nn.utils.get_total_norm(grads)).item():
            return True
        local_ok = bool(torch.isfinite(self._window_loss).item())
        culprits = [r for r, ok in enumerate(all_gather_object(local_ok, self.group)) if not ok]
        where = f"epoch {self.state.epoch} update {self.state.global_step + 1}"
        message = (
            f"non-finite loss or gradient at {where}; ranks with a non-finite loss: {culprits}"
        )
        if self.config.on_nonfinite == "raise":
            raise FloatingPointError(message + " (on_nonfinite='skip' skips such updates)")
        logger.warning("%s: skipping this update on every rank", message)
        return False

    def _check_in_sync(self) -> None:
        """Compare per-parameter checksums across ranks; raise on the first that differs."""
        names = [name for name, _ in self.model.named_parameters()]
        sums = [float(p.detach().double().sum()) for p in self.model.parameters()]
        everyone = all_gather_object(sums, self.group)
        for i, name in enumerate(names):
            values = [rank_sums[i] for rank_sums in everyone]
            if len(set(values)) > 1:
                raise RuntimeError(
                    f"parameter {name!r} differs across ranks at step {self.state.global_step} "
                    f"(checksums by rank: {values}): code running on some ranks only (e.g. in "
                    "callbacks_master) changed the model; change it in callbacks_all instead"
                )

    def _check_even_shards(self) -> None:
        """Ranks with different numbers of batches would hang in DDP: refuse up front."""
        counts = all_gather_object(len(self.train_loader), self.group)
        if len(set(counts)) > 1:
            raise ValueError(
                f"the training sampler gives the ranks different numbers of batches per epoch "
                f"({counts}, by rank): DDP would hang when one rank runs out. Use the default "
                "DistributedSampler (sampler=None) or make every rank's shard the same size"
            )

    def _where(self) -> PositionBoard:
        """The board with this rank's precise position filled in (for failure reports)."""
        state = self.state
        self.board.move(epoch=state.epoch, step=state.global_step, hook=self.callbacks.current)
        return self.board

    def _no_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.ddp_model, DistributedDataParallel):
            return self.ddp_model.no_sync()
        return contextlib.nullcontext()

    def _compute_loss(self, output: Any, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(output, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss must return a scalar tensor (the mean over the micro-batch), got {shape}: "
                "reduce it inside the loss, e.g. with .mean()"
            )
        self._window_loss += loss.detach()
        self._window_count += 1
        return loss

    def request_stop(self) -> None:
        """Ask every rank to stop; agreed at the next log step, evaluation or epoch end."""
        self.state.stop_requested = True

    def _sync_and_log(self) -> bool:
        """One all-reduce of (loss sum, count, stop flag); log the loss; return agreed stop."""
        self.board.publish(step=self.state.global_step, phase="sync")
        flags = [0.0, self._loss_count, float(self.state.stop_requested)]
        stats = torch.tensor(flags, dtype=torch.float64, device=self.device)
        stats[0] = self._loss_sum
        loss_sum, count, stop = all_reduce_sum(stats, self.group).tolist()
        self.board.move(phase="train")
        if count:
            self.state.loss = loss_sum / count
            self._loss_sum.zero_()
            self._loss_count = 0
            if self._bar is not None and not self._bar.disable:
                self._bar.set_postfix(epoch=self.state.epoch, loss=f"{self.state.loss:.4f}")
            else:
                logger.info(
                    "epoch %d step %d/%d loss %.4f",
                    self.state.epoch,
                    self.state.global_step,
                    self.state.total_steps,
                    self.state.loss,
                )
        self.state.stop_requested = stop > 0
        if self.state.stop_requested:
            logger.info("stop requested; stopping at step %d", self.state.global_step)
        return self.state.stop_requested

    def evaluate(self, data: Dataset | None = None) -> dict[str, float]:
        """Evaluate ``data`` (default ``dev_data``) with ``metrics``; same dict on every rank."""
        data = self.dev_data if data is None else data
        if data is None or not self.metrics:
            raise ValueError("evaluate() needs metrics= and data (or dev_data=) on the trainer")
        # Each rank's forward updated its own running statistics (batch norm); evaluate all
        # shards with rank 0's, the buffers DDP would broadcast before the next forward.
        self.board.publish(phase="evaluate")
        with torch.no_grad():
            broadcast_tensors(self.model.buffers(), group=self.group)
        result = self.evaluator.evaluate(data)
        self.board.move(phase="train")
        return result

    def _validate(self) -> None:
        if self.dev_data is None:
            return
        self.callbacks.on_valid_begin()
        result = self.evaluate(self.dev_data)
        state = self.state
        value = result[self.metric_key]
        best = None if state.best_eval is None else state.best_eval[self.metric_key]
        is_better = best is None or (value > best if self.larger_better else value < best)
        state.eval_result = result
        if is_better:
            state.best_eval, state.best_epoch = result, state.epoch
            state.best_step = state.global_step
            if self.is_master:
                self._save_best()
        logger.info(
            "evaluation at epoch %d step %d: %s%s",
            state.epoch,
            state.global_step,
            ", ".join(f"{k}={v:.6g}" for k, v in result.items()),
            " (best so far)" if is_better else "",
        )
        self.callbacks.on_valid_end(result, self.metric_key, is_better)

    def _save_best(self) -> None:
        """Rank 0 keeps the best weights: in a file under ``save_path``, else in memory."""
        weights = self.model.state_dict()
        if self.config.save_path is None:
            if self.config.load_best_model:
                self._best_state = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
            return
        if self.best_model_path is None:
            stamp = time.strftime("%Y-%m-%d-%H-%M-%S")
            name = f"best_{type(self.model).__name__}_{self.metric_key}_{stamp}.pt"
            self.best_model_path = os.path.join(self.config.save_path, name)
        atomic_save(weights, self.best_model_path)

    def _load_best(self) -> None:
        """Rank 0 loads the best weights; a broadcast gives them to every other rank."""
        if self.is_master:
            if self.best_model_path is not None:
                best = torch.load(self.best_model_path, map_location=self.device, weights_only=True)
                self.model.load_state_dict(best)
            elif self._best_state is not None:
                self.model.load_state_dict(self._best_state)
        with torch.no_grad():
            broadcast_tensors(self.model.state_dict().values(), group=self.group)
        state = self.state
        logger.info("loaded the best model of epoch %d step %d", state.best_epoch, state.best_step)
