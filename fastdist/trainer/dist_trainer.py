"""``DistTrainer``, the facade: its signature and docstring are the API; the work is done by
:mod:`~fastdist.trainer.build` (assembly) and :mod:`~fastdist.trainer.loop` (training)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from fastdist.callbacks.callback import Callback
from fastdist.distributed.position import enter_on_every_rank
from fastdist.evaluation.predict import predict as run_predict
from fastdist.loggers import Logger
from fastdist.strategies import Strategy, Topology
from fastdist.trainer.build import build
from fastdist.trainer.loop import Loop
from fastdist.trainer.preemption import SIGTERM_EXIT_CODE
from fastdist.trainer.save_model import save_model as run_save_model


class DistTrainer:
    """Data-parallel training over every process of a torchrun job (or one plain process).

    Args:
        train_data: map-style dataset of dict or ``(input, target)`` samples, or a stream (an
            ``IterableDataset``, sharded over ranks and DataLoader workers; see
            :mod:`fastdist.data.stream`).
        model: the ``nn.Module``; the ``strategy`` wraps it when world size > 1.
        optimizer: built from ``model.parameters()``; default ``Adam(lr=4e-3)``.
        loss: a fastdist loss, a torch loss module, ``callable(output, batch)`` or ``None`` (the
            model returns ``{"loss": ...}``). It returns the mean loss of the micro-batch, or a
            ``(sum, count)`` pair (e.g. summed token losses and the token count): then every
            update is normalised by its count over all ranks and micro-batches.
        callbacks_all: callbacks run on every rank (learning rate, clipping, early stop).
        callbacks_master: callbacks run on rank 0 only (logging, saving); no collectives.
        loggers: where the run's record goes, beside ``log.jsonl``: backends of
            :mod:`fastdist.loggers` (``TensorBoardLogger()``, ``MLflowLogger(...)``,
            ``WandbLogger(...)``, ...). They run on rank 0; one that fails is named in a
            warning and dropped, and training goes on.
        batch_size_per_gpu: micro-batch size of each process; the global batch of one update
            is ``batch_size_per_gpu * world_size * update_every`` (under tensor parallelism
            peers run the same batches: ``world_size / tp`` for ``world_size``).
        n_epochs: passes over ``train_data``.
        num_workers: DataLoader worker processes per rank.
        drop_last: drop the last incomplete batch of every epoch instead of a short one.
        dev_data: evaluated with ``metrics`` every epoch or every ``validate_every`` updates.
        metrics: a :class:`~fastdist.metrics.Metric`, a ``torchmetrics.Metric``, or a list
            or ``{key: metric}`` dict of them.
        metric_key: the result key that picks the best model; ``"-loss"`` means lower is
            better (a NaN value is never the best); default: the first key of the first metric.
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
        best_model_format: how the best model is kept in ``save_path``: ``"torch"`` (a
            ``.pt`` file of its ``state_dict``), ``"safetensors"`` (a ``.safetensors`` file;
            ``pip install safetensors``) or ``"hf"`` (the folder of the model's
            ``save_pretrained``, for a transformers model); see :meth:`save_model`.
        timeout: seconds any collective of the trainer may wait before every rank reports
            where each rank is and exits; default torch's (30 minutes).
        on_nonfinite: ``"raise"``: the losses are checked where they are read (every log step,
            evaluation, checkpoint and at the end), the model before it is evaluated or saved,
            and every rank raises, naming the ranks and the first update with a NaN/Inf loss.
            ``"skip"``: every update's all-reduced gradients are checked (one host read per
            update) and a non-finite update is skipped on every rank.
        check_sync_every: every N updates and after the last one, compare a checksum of the
            parameters every rank holds a copy of across ranks and raise on the first that
            differs (code on some ranks only changed the model); ``None``: after the last
            update only (before ``on_train_end``; across torchft's replica groups only where N
            asks); 0 turns it off. (Under local SGD they are compared where they agree; under
            FSDP each parameter has one copy: there is nothing to compare; under HSDP the
            replica groups' shards are compared, under tensor parallel the parameters the
            plan leaves whole.)
        checkpoint_every: write a checkpoint every N optimizer updates as well as at every
            epoch end (0: epoch ends only).
        checkpoint_dir: where checkpoints go; default ``<save_path>/checkpoints``; with
            neither, no checkpoints are written.
        keep_checkpoints: how many of the newest checkpoints to keep.
        checkpoint_async: write each checkpoint in the background while training goes on
            (DCP's ``async_save`` for FSDP's shards, a thread for the rest), after copying the
            state off the live tensors (host memory for one more copy); one write at a time,
            the manifest last. A failed write raises at the next checkpoint or at the end of
            ``train()``, on every rank.
        amp: mixed precision: ``"bf16"`` (autocast; CPU or GPU) or ``"fp16"`` (autocast and a
            gradient scaler; CUDA only); ``None``: fp32.
        fp16: fastNLP's switch, the same as ``amp="fp16"``.
        pin_memory: page-locked batches for faster copies to the GPU; default: on CUDA.
        persistent_workers, prefetch_factor: passed to the DataLoader (with ``num_workers``).
        stream_read_ahead_mb: host memory (MiB per rank) a stream's batches read ahead may
            hold: the ranks agree on the batch sizes of up to 16 updates at once, fewer where
            their batches would not fit (see :mod:`fastdist.data.stream`).
        multiprocessing_context: how DataLoader workers start: ``None`` (torch's default, a
            fork on Linux), ``"fork"``, ``"forkserver"`` or ``"spawn"``; before Python 3.11.10
            a forked worker can hang (see :mod:`fastdist.data.workers`).
        compile: ``torch.compile`` the model (in place) before wrapping it: under DDP the
            whole model, under FSDP each block on its own before sharding (regional
            compilation: small graphs, compiled once for blocks of the same code).
        activation_checkpointing: recompute the activations of blocks in backward instead of
            keeping them (torch's ``checkpoint_wrapper``): ``True`` every block, ``"every-2"``
            every second one, ... (the blocks: FSDP's ``wrap`` classes, else the children of
            the model's ``nn.ModuleList`` objects); less memory, about one more forward of compute.
        strategy: how the model is spread over the ranks, with its own options:
            ``"ddp"`` = :class:`~fastdist.strategies.DDP` ``()`` (every rank holds the whole
            model; bucket size, communication hooks, local SGD), ``"fsdp"`` =
            :class:`~fastdist.strategies.FSDP` ``()`` (torch's ``fully_shard``: parameters,
            gradients and optimizer state sharded; which blocks, resharding, CPU offload,
            tensor parallelism: ``FSDP(tp=2, tp_plan=...)``, HSDP: ``FSDP(replicate=2)``), or
            such an object, e.g. ``DDP(comm_hook="powersgd")``.
        slow_rank_threshold: rank 0 warns when a rank's time per update (data loading +
            compute, see :mod:`fastdist.trainer.timing`) exceeds the median over ranks by more
            than this fraction; 0 turns the warning off (the per-rank figures are still
            recorded in ``state.rank_times``, ``log.jsonl`` and TensorBoard).

    Attributes:
        state: where training is (:class:`~fastdist.state.TrainerState`).
        model, optimizer: the model (on its device) and the optimizer stepping it.
        options: the options above, checked (:class:`~fastdist.trainer.options.TrainerOptions`).
        strategy: the :class:`~fastdist.strategies.Strategy` running the model.
        rank, world_size, is_master, device: this process's place in the job.
        callbacks_all, callbacks_master: the callback lists (a JSON log added to the second
            when there is a ``save_path`` and none was given).

    Example:
        >>> trainer = DistTrainer(train_data, model, optimizer, loss=CrossEntropyLoss(),
        ...                       dev_data=dev_data, metrics=AccuracyMetric(), n_epochs=3,
        ...                       use_tqdm=False)
        >>> result = trainer.train()  # same dict on every rank
        >>> result["steps"], sorted(result["best_eval"])
        (24, ['acc'])
    """

    #: Exit code after a pre-emption (SIGTERM): 128 + 15, as if killed by the signal.
    PREEMPTED_EXIT_CODE = SIGTERM_EXIT_CODE

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
        save_path: str | os.PathLike | None = None,
        device: str | torch.device | None = "auto",
        use_tqdm: bool = True,
        sampler: Sampler | None = None,
        batch_sampler: Sampler | None = None,
        collate_fn: Callable | None = None,
        dev_batch_size_per_gpu: int | None = None,
        seed: int = 0,
        load_best_model: bool = True,
        best_model_format: str = "torch",
        timeout: float | None = None,
        on_nonfinite: str = "raise",
        check_sync_every: int | None = None,
        checkpoint_every: int = 0,
        checkpoint_dir: str | os.PathLike | None = None,
        keep_checkpoints: int = 2,
        checkpoint_async: bool = False,
        amp: str | None = None,
        fp16: bool = False,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        stream_read_ahead_mb: float = 256.0,
        multiprocessing_context: str | None = None,
        compile: bool = False,
        activation_checkpointing: bool | str = False,
        strategy: str | Strategy = "ddp",
        slow_rank_threshold: float = 0.1,
        loggers: Sequence[Logger] | None = None,
        **unknown: Any,
    ) -> None:
        given = {k: v for k, v in locals().items() if k not in ("self", "unknown")}
        run = build(given, unknown)  # checks everything before any collective, then assembles
        self.options, self.state, self.strategy = run.options, run.state, run.strategy
        self.model, self.optimizer, self.precision = run.model, run.optimizer, run.precision
        self.device, self.rank, self.world_size = run.world.device, run.world.rank, run.world.size
        self.is_master = self.rank == 0
        self.global_batch = run.options.global_batch(run.world.data.size)
        self.callbacks_all = run.callbacks.callbacks_all
        self.callbacks_master = run.callbacks.callbacks_master  # run on rank 0 only
        self.data = run.data  # this rank's batches (their loader: self.data.loader)
        self._loop = Loop(run, self)

    @property
    def topology(self) -> Topology:
        """The layout of the ranks the strategy asked for (read-only,
        :class:`~fastdist.strategies.Topology`): this rank's data shard, whether it holds the
        loss, which ranks hold copies of the parameters, the mesh of each dimension."""
        return self._loop.world.topology

    @property
    def best_model_path(self) -> str | None:
        """The file rank 0 keeps the best model in (``None`` before the first, or on others)."""
        return self._loop.run.validator.best.path

    def train(self, resume: bool | str | os.PathLike = "auto") -> dict[str, Any]:
        """Train for ``n_epochs``; return the same result dict on every rank.

        Args:
            resume: ``"auto"`` continues from the newest valid checkpoint in the checkpoint
                directory if there is one (so a restarted job resumes with the same command);
                a path continues from that checkpoint; ``False`` starts afresh. A run that
                would prune or overwrite checkpoints it does not continue (``False``, or a
                path from elsewhere, where the checkpoint directory holds some) is refused.

        Returns:
            ``best_eval`` (dict or None), ``best_epoch``, ``best_step``, ``steps`` (optimizer
            updates), ``seconds`` (rank 0's wall time).

        On SIGTERM every rank finishes its current update, the ranks agree at the next log
        step, rank 0 writes a checkpoint and every rank exits with code 143. A rank that has
        not agreed 20 s after the signal (a peer died) exits with 143 on its own.
        """
        return self._loop.fit(resume)

    def request_stop(self) -> None:
        """Ask every rank to stop; agreed at the next log step, evaluation or checkpoint."""
        self.state.stop_requested = True

    def evaluate(self, data: Dataset | None = None) -> dict[str, float]:
        """Evaluate ``data`` (default ``dev_data``) with ``metrics``; call it on every rank,
        which all get the same dict."""
        enter_on_every_rank("evaluate", self.options.timeout)  # not a hang under rank == 0
        return self._loop.evaluate(data)

    def save_model(self, path: str | os.PathLike, format: str = "torch") -> str:
        """Write the whole model (its current weights) to ``path``; call it on every rank.

        Under any strategy: a sharded model (FSDP) is gathered, then rank 0 writes it
        atomically (a temp file or folder, then a rename) and every rank returns once it is
        written (or raises if rank 0 could not write it).

        Args:
            path: a file for ``"torch"`` and ``"safetensors"``, a folder for ``"hf"``.
            format: ``"torch"`` (``torch.save`` of the ``state_dict``), ``"safetensors"``
                (``pip install safetensors``) or ``"hf"``: the model's own
                ``save_pretrained`` (a transformers ``PreTrainedModel``), a folder that
                ``from_pretrained`` loads; in an existing folder the model's files are
                replaced and the others (a tokenizer's) stay.

        Returns:
            ``path``, as a ``str``.

        Example:
            >>> trainer = DistTrainer(train_data, model, optimizer, loss=CrossEntropyLoss(),
            ...                       use_tqdm=False)
            >>> _ = trainer.train()
            >>> trainer.save_model("out/model.safetensors", format="safetensors")  # every rank
            'out/model.safetensors'
            >>> trainer.save_model("out/gpt2", format="hf")  # doctest: +SKIP
            >>> GPT2LMHeadModel.from_pretrained("out/gpt2")  # doctest: +SKIP
        """
        group, timeout = self._loop.world.group, self.options.timeout
        return run_save_model(self.strategy, path, format, group, timeout)

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
            >>> trainer = DistTrainer(train_data, model, optimizer, loss=CrossEntropyLoss(),
            ...                       use_tqdm=False)
            >>> preds = trainer.predict(test_data)  # a list on rank 0, None elsewhere
            >>> len(preds), sorted(preds[0])
            (16, ['pred'])
        """
        board = self._loop.world.board
        board.publish(phase="predict")
        enter_on_every_rank("predict", self.options.timeout)  # before_evaluation may broadcast
        self.strategy.before_evaluation()  # as evaluate() does
        kwargs.setdefault("collate_fn", self._loop.run.validator.evaluator.collate_fn)
        kwargs.setdefault("num_workers", self.options.num_workers)
        kwargs.setdefault("multiprocessing_context", self.options.multiprocessing_context)
        try:
            return run_predict(
                self.strategy.eval_module,
                data,
                batch_size_per_gpu or self.options.eval_batch_size,
                output_path=output_path,
                device=self.device,
                group=self._loop.world.group,
                topology=self.topology,
                **kwargs,
            )
        finally:
            self.strategy.after_evaluation()
            board.move(phase="train")
