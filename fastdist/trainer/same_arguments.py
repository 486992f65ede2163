"""Every rank must be given the same arguments: a check when the group forms.

Ranks given different arguments would train a different model on each (another learning
rate, a callback on one rank only: DDP keeps nothing in step but the gradients), mix two dev
sets into one score, or wait in collectives the others never reach. Each rank describes what
must match (:func:`describe`); one all-gather compares them, and every rank raises the same
error naming what differs, before the strategy's first collective. Per-rank choices stay
free: the device, paths, data-loading workers, the timeout, ``callbacks_master``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
from collections.abc import Sized
from typing import Any

import torch

from fastdist.checkpoint.identity import identity
from fastdist.checks import shortened
from fastdist.distributed import all_gather_object
from fastdist.strategies.same_model import frozen_parameters
from fastdist.trainer.arguments import Arguments

#: Options each rank may choose for itself: where it runs and writes, how it loads data.
PER_RANK = frozenset(
    {
        "save_path",
        "checkpoint_dir",
        "device",
        "use_tqdm",
        "num_workers",
        "pin_memory",
        "persistent_workers",
        "prefetch_factor",
        "multiprocessing_context",
        "timeout",
        "slow_rank_threshold",
    }
)


def describe(args: Arguments) -> dict[str, str]:
    """What of this rank's arguments every rank must share, each as a short string."""
    options = {k: v for k, v in args.options.as_dict().items() if k not in PER_RANK}
    model = repr(sorted(identity(args.model, None)["model"].items())).encode()
    optimizer = args.optimizer
    groups = {
        f"optimizer.param_groups[{i}][{k!r}]": repr(v)
        for i, group in enumerate(optimizer.param_groups)
        for k, v in group.items()
        if k != "params"
    }
    return {
        **{name: repr(value) for name, value in options.items()},
        "len(train_data)": _size(args.train_data),
        "len(dev_data)": "no dev_data" if args.dev_data is None else _size(args.dev_data),
        "model": "state-dict entries and shapes " + hashlib.sha1(model).hexdigest()[:12],
        # a layer frozen on one rank would train another model there, or mix two layers'
        # gradients in DDP's all-reduce where their shapes agree
        "frozen parameters (requires_grad=False)": frozen_parameters(args.model),
        "optimizer": f"{type(optimizer).__qualname__}, {len(optimizer.param_groups)} group(s)",
        **groups,
        "save_path given": repr(args.options.save_path is not None),  # a rank writes alone
        "checkpoint_dir given": repr(args.options.checkpoint_dir is not None),
        **_settings(args.loss, "loss"),
        **_all_settings(args.metrics, "metrics"),
        **_all_settings(args.callbacks_all, "callbacks_all"),
        "sampler": _name(args.sampler) if args.sampler is not None else "None",
        "batch_sampler": _name(args.batch_sampler) if args.batch_sampler is not None else "None",
    }


def check_same_arguments(args: Arguments, group: Any) -> None:
    """Raise ``ValueError`` on every rank if the ranks' arguments differ (see above)."""
    ranks = all_gather_object(describe(args), group)
    differ = [key for key in ranks[0] if any(r.get(key) != ranks[0][key] for r in ranks)]
    if not differ:
        return
    parts = []
    for key in differ[:5]:
        values: dict[str, list[int]] = {}
        for rank, found in enumerate(ranks):
            values.setdefault(found.get(key, "(none)"), []).append(rank)
        parts.append(
            f"{key}: " + ", ".join(f"{shortened(v, 80)} on ranks {r}" for v, r in values.items())
        )
    raise ValueError(
        "DistTrainer was given different arguments on different ranks, which would train "
        f"another model on each or hang: {'; '.join(parts)}. Give every rank the same "
        "arguments (the same script and command line; only device, paths, data-loading "
        "workers, timeout and callbacks_master may differ)"
    )


def _all_settings(items: list[Any], name: str) -> dict[str, str]:
    """``{name: their classes}`` and each one's settings (see :func:`_settings`)."""
    found = {name: repr([_name(item) for item in items])}
    for i, item in enumerate(items):
        found |= _settings(item, f"{name}[{i}]")
    return found


def _settings(obj: Any, prefix: str) -> dict[str, str]:
    """``{prefix: its class}`` and, for a class of fastdist's, torch's or torchmetrics' own,
    ``{prefix.name: value}`` for each argument of its constructor that it keeps under that
    name: a number, flag, short setting string or tensor (a clip value, a warm-up schedule, a
    label smoothing, class weights), and so on into a scheduler it holds. A user's class, or
    anything it added, gives its class only: it may hold its rank or the time; paths are no
    difference."""
    found = {prefix: _name(obj)}
    if type(obj).__module__.split(".")[0] not in ("fastdist", "torch", "torchmetrics"):
        return found
    with contextlib.suppress(TypeError, ValueError):  # a builtin: no signature
        for name in inspect.signature(type(obj)).parameters:
            value = getattr(obj, name, None)
            if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
                found |= _settings(value, f"{prefix}.{name}")
            elif (shown := _setting(name, value)) is not None:
                found[f"{prefix}.{name}"] = shown
    return found


def _setting(name: str, value: Any) -> str | None:
    """``value`` of constructor argument ``name`` as compared, or ``None`` (not compared)."""
    if isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):  # "norm", "cosine"; not a path or a name, which may differ
        pathlike = any(word in name for word in ("dir", "path", "file", "name", "tag"))
        return None if pathlike or os.sep in value else repr(value)
    if isinstance(value, torch.Tensor):  # class weights: their bytes where they can be read
        shown = f"tensor {tuple(value.shape)} {value.dtype}"
        with contextlib.suppress(Exception):  # on the meta device, too large
            if value.numel() <= 1 << 20:
                data = value.detach().cpu().flatten().view(torch.uint8).numpy().tobytes()
                shown += " " + hashlib.sha1(data).hexdigest()[:12]
        return shown
    return None


def _size(data: Any) -> str:
    return str(len(data)) if isinstance(data, Sized) else f"a stream ({type(data).__qualname__})"


def _name(obj: Any) -> str:
    kind = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return kind.__qualname__
