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
from collections.abc import Sized
from typing import Any

from torch import nn

from fastdist.checkpoint.identity import identity
from fastdist.distributed import all_gather_object
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
        "optimizer": f"{type(optimizer).__qualname__}, {len(optimizer.param_groups)} group(s)",
        **groups,
        "loss": _settings(args.loss),
        "metrics": repr([_settings(m) for m in args.metrics]),
        "callbacks_all": repr([_settings(cb) for cb in args.callbacks_all]),
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
        parts.append(f"{key}: " + ", ".join(f"{_short(v)} on ranks {r}" for v, r in values.items()))
    raise ValueError(
        "DistTrainer was given different arguments on different ranks, which would train "
        f"another model on each or hang: {'; '.join(parts)}. Give every rank the same "
        "arguments (the same script and command line; only device, paths, data-loading "
        "workers, timeout and callbacks_master may differ)"
    )


def _settings(obj: Any) -> str:
    """``obj``'s class and, for fastdist's, torch's and torchmetrics' classes, the numbers and
    flags it holds and those of a scheduler (any ``state_dict()``) it holds: what sets how it
    trains (a clip value, a warm-up, a decay, a label smoothing). A user's class gives its name
    only (it may hold its rank), and strings are left out (a per-rank path is no difference)."""
    numbers: dict[str, Any] = {}
    known = type(obj).__module__.split(".")[0] in ("fastdist", "torch", "torchmetrics")
    for name, value in sorted(vars(obj).items()) if known and hasattr(obj, "__dict__") else []:
        if isinstance(value, (bool, int, float)):
            numbers[name] = value
        elif callable(getattr(value, "state_dict", None)) and not isinstance(value, nn.Module):
            with contextlib.suppress(Exception):  # a scheduler's; an optimizer's is compared
                state = value.state_dict()
                numbers |= {
                    f"{name}.{k}": v
                    for k, v in sorted(state.items())
                    if isinstance(v, (bool, int, float))
                }
    return f"{_name(obj)}({', '.join(f'{k}={v!r}' for k, v in numbers.items())})"


def _short(value: str) -> str:
    return value if len(value) <= 80 else value[:77] + "..."


def _size(data: Any) -> str:
    return str(len(data)) if isinstance(data, Sized) else f"a stream ({type(data).__qualname__})"


def _name(obj: Any) -> str:
    kind = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return kind.__qualname__
