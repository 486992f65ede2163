"""Distributed prediction: every rank runs its shard, rank 0 gets the outputs in dataset order.

The data is sharded with :class:`~fastdist.evaluation.evaluator.ShardSampler` (rank ``r`` of ``w``
takes indices ``r, r + w, ...``, no padding duplicates). Each rank runs the model with no
collective inside its loop, so uneven shards never hang, and streams its per-sample outputs to
a spill file in a directory every rank can see. After one collective rank 0 merges the files
round-robin (index ``i`` is record ``i // w`` of rank ``i % w``), reading one record at a time:
no rank holds all outputs in memory unless a list is asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fastdist.data.feed import make_forward, to_device
from fastdist.data.workers import worker_context
from fastdist.distributed import all_gather_object, get_rank
from fastdist.distributed.position import enter_on_every_rank
from fastdist.evaluation.evaluator import ShardSampler, padded_batches
from fastdist.evaluation.spill import Writer, cleanup, merge, open_work_dir, spill_path
from fastdist.modes import evaluating
from fastdist.strategies import Strategy, Topology, eval_view

#: ``to_output(output, batch)``: the per-sample outputs of one batch, in batch order.
ToOutput = Callable[[Any, Any], list[Any]]


def predict(
    model: nn.Module,
    data: Dataset | Sequence[Any],
    batch_size_per_gpu: int = 8,
    output_path: str | os.PathLike | None = None,
    writer: Writer | None = None,
    collate_fn: Callable | None = None,
    device: str | torch.device | None = None,
    shared_dir: str | os.PathLike | None = None,
    to_output: ToOutput | None = None,
    group: Any = None,
    num_workers: int = 0,
    multiprocessing_context: str | None = None,
    topology: Topology | None = None,
) -> list[Any] | None:
    """Run ``model`` over ``data`` on every rank; rank 0 gets the outputs in dataset order.

    Call it on every rank (where one does not, the others raise: at once if its script ended,
    else after the process group's timeout). Each rank predicts its shard in eval mode under
    ``torch.no_grad()`` (a ``DistributedDataParallel`` model is unwrapped first) and streams
    each sample's output to ``<shared_dir>/fastdist-predict-XXXX/rank<r>.*``; rank 0 then
    merges the files in dataset order. Every sample is predicted exactly once, whatever the
    world size.

    By default a batch's output becomes per-sample outputs like this: a tensor is split along
    dim 0 into Python lists (``output.tolist()``); a dict gives a dict per sample of its
    per-sample entries: tensors whose first dimension is the batch size (another tensor with
    dimensions raises: pass ``to_output``), lists as long as the batch (an item each), and
    tuples (or other lists) of batch-first tensors, such as a ``ModelOutput``'s per-layer
    ``hidden_states`` (a tuple of rows each: return per-layer tensors in a tuple, since a list
    as long as the batch is taken item by item); scalar tensors such as a batch loss, and
    other values, are left out.
    A tuple output (several outputs, e.g. ``(logits, hidden)``) gives a tuple per sample of
    them, alike; a list output as long as the batch, an item per sample.
    ``to_output(output, batch)`` overrides this and must return one object per sample of the
    batch.

    The spill directory is created by rank 0 in ``shared_dir`` (default: rank 0's temp dir,
    ``TMPDIR``) with owner-only permissions, checked up front to be visible from every rank,
    and removed at the end, also when a rank raises. On several nodes ``shared_dir`` must be
    on a filesystem every node mounts at the same path (NFS, Lustre, ...); if it is not, every
    rank raises before predicting anything. A rank killed outright (SIGKILL, segfault) may
    leave a ``fastdist-predict-*`` directory behind.

    Args:
        model: the module (or its DDP wrapper); batches are fed as in training
            (:func:`~fastdist.data.feed.make_forward`).
        data: map-style dataset (a list will do).
        batch_size_per_gpu: batch size of each rank.
        output_path: rank 0 writes one JSON line per sample, in dataset order, to this file
            (through a temporary file renamed at the end) and returns ``None``; the outputs
            must then be JSON-serializable.
        writer: instead of a list or a file, rank 0 calls ``writer(index, output)`` for every
            sample in dataset order and returns ``None``.
        collate_fn: turns a list of samples into a batch; default torch's.
        device: where batches go; default the device of the model's first parameter.
        shared_dir: the directory the spill directory is created in.
        to_output: ``to_output(output, batch) -> list``, one object per sample of the batch.
        group: process group of the collectives (all ranks); default the world.
        num_workers: DataLoader worker processes per rank.
        multiprocessing_context: how they start (see :mod:`fastdist.data.workers`).
        topology: the layout the model runs on, which says this rank's data shard
            (``trainer.topology``; tensor-parallel peers predict the same samples);
            default: every rank a shard of its own.

    Returns:
        On rank 0 the list of per-sample outputs in dataset order, or ``None`` with
        ``output_path`` or ``writer``; ``None`` on every other rank.

    Example:
        >>> preds = predict(model, test_data, batch_size_per_gpu=32)  # on every rank
        >>> if get_rank() == 0:
        ...     print(len(preds) == len(test_data))
        True
        >>> predict(model, test_data, output_path="pred.jsonl")  # rank 0 writes the file
    """
    n = _check_args(data, batch_size_per_gpu, output_path, writer, to_output, num_workers)
    enter_on_every_rank("predict", None)  # a rank not calling it: an error, not a hang
    rank = get_rank()
    model, equal_forwards = eval_view(model)  # a DDP wrapper is unwrapped
    shard = (topology or Topology.of(Strategy())).data_shard  # tp peers share one; one writes
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    as_json = output_path is not None
    work = open_work_dir(shared_dir, output_path, rank, group)
    spill = spill_path(work, shard.rank, as_json) if shard.primary else None
    handed_over = False  # another rank's spill file stays until rank 0 has read it
    try:
        sampler = ShardSampler(n, shard.rank, shard.size)
        loader = DataLoader(
            data,  # type: ignore[arg-type]  # any sequence works at run time
            batch_size=batch_size_per_gpu,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=device.type == "cuda",
            multiprocessing_context=worker_context(multiprocessing_context)
            if num_workers
            else None,
        )
        error: str | None = None
        failure: Exception | None = None
        try:
            shards = shard.size
            _predict_shard(model, equal_forwards, loader, device, to_output, spill, as_json, shards)
        except Exception as exc:  # the others must still learn of it: no rank may hang
            failure, error = exc, f"{type(exc).__name__}: {exc}"
        # The one collective after the loop: a barrier that also carries every rank's outcome.
        failed = _agree(error, group)
        own = () if spill is None else (spill,)
        if failed:
            cleanup(work, rank, own)
            _barrier(group)  # nobody raises (and exits) before rank 0 has removed the dir
            if failure is not None:
                raise failure
            raise RuntimeError(f"predict failed on {_describe(failed)}")
        if rank != 0:
            handed_over = True
            return None
        return merge(work, n, shard.size, as_json, output_path, writer)
    finally:
        if not handed_over:
            cleanup(work, rank, () if spill is None else (spill,))


def split_output(output: Any, n: int) -> list[Any]:
    """The default per-sample split of one batch's model output (see :func:`predict`).

    Example:
        >>> split_output(torch.tensor([[1, 2], [3, 4]]), 2)
        [[1, 2], [3, 4]]
        >>> split_output({"pred": torch.tensor([0, 1]), "loss": torch.tensor(0.5)}, 2)
        [{'pred': 0}, {'pred': 1}]
        >>> split_output((torch.tensor([0, 1]), torch.tensor([[5], [6]])), 2)
        [(0, [5]), (1, [6])]
    """
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.size(0) != n:
            raise ValueError(
                f"the model output has shape {tuple(output.shape)}, not a first dimension of the "
                f"batch size {n}: pass to_output=fn(output, batch) returning one item per sample"
            )
        return output.detach().cpu().tolist()
    if isinstance(output, (Mapping, tuple)):  # a tuple is split as a dict of its positions
        mapping = isinstance(output, Mapping)
        entries = output.items() if isinstance(output, Mapping) else enumerate(output)
        columns: dict[Any, list[Any]] = {}
        for key, value in entries:
            column = _column(key, value, n)
            if column is not None:
                columns[key] = column
        if not columns:
            what = f"dict output {sorted(map(str, output))}" if mapping else "tuple output"
            raise ValueError(
                f"no entry of the model's {what} holds one value per sample (batch size {n}): "
                "pass to_output=fn(output, batch)"
            )
        if not mapping:
            return [tuple(column[i] for column in columns.values()) for i in range(n)]
        return [{key: column[i] for key, column in columns.items()} for i in range(n)]
    if isinstance(output, list) and len(output) == n:
        return [_plain(item) for item in output]
    raise TypeError(
        f"cannot split a model output of type {type(output).__name__} into {n} samples: "
        "pass to_output=fn(output, batch) returning one item per sample"
    )


def _column(key: Any, value: Any, n: int) -> list[Any] | None:
    """The per-sample values of one dict entry, or ``None`` for a batch-level entry."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return None
        if value.size(0) != n:
            raise ValueError(
                f"output[{key!r}] has shape {tuple(value.shape)}, not a first dimension of the "
                f"batch size {n}: pass to_output=fn(output, batch) returning one item per sample"
            )
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        # A tuple of batch-first tensors (hidden states, say) gives rows; a list as long as
        # the batch is an item per sample, whatever its items.
        each = len(value) == n
        rows = None if each and isinstance(value, list) else _rows(value, n)
        if rows is None and each:
            rows = [_plain(item) for item in value]
        return rows
    return None


def _rows(value: Any, n: int) -> list[Any] | None:
    """Per-sample rows of a batch-first tensor, or per-sample tuples of the rows of a tuple or
    list of them (nested alike), else ``None``."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist() if value.dim() and value.size(0) == n else None
    if isinstance(value, (list, tuple)) and value:
        parts = [_rows(item, n) for item in value]
        if all(part is not None for part in parts):
            return [tuple(part[i] for part in parts) for i in range(n)]  # type: ignore[index]
    return None


def _plain(item: Any) -> Any:
    return item.detach().cpu().tolist() if isinstance(item, torch.Tensor) else item


def _check_args(
    data: Any,
    batch_size: Any,
    output_path: Any,
    writer: Any,
    to_output: Any,
    num_workers: Any,
) -> int:
    """Validate alike on every rank, before any collective; return ``len(data)``."""
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError("data must be a map-style dataset (with __len__ and __getitem__)")
    for name, value, minimum in (
        ("batch_size_per_gpu", batch_size, 1),
        ("num_workers", num_workers, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if output_path is not None and writer is not None:
        raise ValueError("pass output_path= or writer=, not both")
    for name, fn in (("writer", writer), ("to_output", to_output)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return len(data)


def _predict_shard(
    model: nn.Module,
    equal_forwards: bool,
    loader: DataLoader,
    device: torch.device,
    to_output: ToOutput | None,
    spill: str | None,
    as_json: bool,
    shards: int,
) -> None:
    """Predict this rank's shard (``loader``, of a :class:`ShardSampler`, one of ``shards``)
    and stream the outputs to ``spill`` (``None``: run the forwards only, a tensor-parallel
    peer's); no collectives of its own (an FSDP model's forwards are, made equally many on
    every rank)."""
    sampler, batch_size = loader.sampler, loader.batch_size or 1
    assert isinstance(sampler, ShardSampler)
    forward = make_forward(model, evaluation=True)  # the model's predict() if it has one
    position = 0
    with evaluating(model), _spill_file(spill, as_json) as f, torch.no_grad():
        for batch, real in padded_batches(loader, equal_forwards, shards):
            batch = to_device(batch, device)
            output = forward(model, batch)
            if not real or f is None:
                continue
            indices = sampler.indices[position : position + batch_size]
            items = (
                split_output(output, len(indices))
                if to_output is None
                else to_output(output, batch)
            )
            if len(items) != len(indices):
                raise ValueError(
                    f"to_output returned {len(items)} outputs for a batch of "
                    f"{len(indices)} samples: it must return one per sample"
                )
            for index, item in zip(indices, items, strict=True):
                if as_json:
                    f.write(json.dumps(item) + "\n")
                else:
                    pickle.dump((index, item), f, protocol=pickle.HIGHEST_PROTOCOL)
            position += len(indices)


@contextlib.contextmanager
def _spill_file(spill: str | None, as_json: bool) -> Iterator[IO[Any] | None]:
    """The open spill file, or ``None`` where there is none to write."""
    if spill is None:
        yield None
        return
    with open(spill, "w" if as_json else "wb") as f:
        yield f


def _agree(error: str | None, group: Any) -> dict[int, str]:
    """Share every rank's error (``None``: fine); return ``{rank: error}`` of those that failed."""
    errors = all_gather_object(error, group)
    return {rank: e for rank, e in enumerate(errors) if e is not None}


def _barrier(group: Any) -> None:
    all_gather_object(None, group)  # fastdist's barrier() takes no group


def _describe(failed: dict[int, str]) -> str:
    return "; ".join(f"rank {rank}: {error}" for rank, error in sorted(failed.items()))
