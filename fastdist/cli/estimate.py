"""``python -m fastdist estimate SETUP``: the memory each rank needs, before launching.

``SETUP`` is ``module:function`` or ``path/to/file.py:function``; the function takes no
arguments and returns a dict with ``model``, ``optimizer`` and ``batch`` (one micro-batch of
``batch_size_per_gpu`` samples), optionally ``loss`` and ``tp_plan``. One column per strategy
(DDP, FSDP, FSDP with ``--tp``, and one per stage of ``Pipeline(stages=PP)`` with ``--pp``):
parameters, gradients, optimizer state, activations and
FSDP's buffers per rank, the peak, and with ``--memory`` the largest ``batch_size_per_gpu``
that fits. See :func:`fastdist.estimate.estimate_memory`.

Example:
    >>> main(["estimate", "setup.py:make", "--world-size", "8", "--tp", "2", "--memory", "80GB"])
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fastdist.checks import check_int, first_line
from fastdist.estimate import estimate_memory, parse_bytes, table
from fastdist.strategies import DDP, FSDP, Pipeline, Strategy


def add_parser(commands: Any) -> None:
    """Register the ``estimate`` command on the ``python -m fastdist`` sub-parsers."""
    parser = commands.add_parser(
        "estimate",
        help="estimate per-rank memory under DDP, FSDP, FSDP with tensor parallelism and "
        "pipeline stages",
        description=__doc__.split("\n\nExample")[0] if __doc__ else None,
    )
    parser.add_argument("setup", metavar="SETUP", help="module:function or file.py:function")
    parser.add_argument("--world-size", type=int, default=1, help="processes (default: 1)")
    parser.add_argument("--tp", type=int, default=1, help="add FSDP(tp=TP) (default: 1: none)")
    parser.add_argument(
        "--pp", type=int, default=None, help="add Pipeline(stages=PP >= 2), a column per stage"
    )
    parser.add_argument("--update-every", type=int, default=1, help="as DistTrainer's")
    parser.add_argument(
        "--activation-checkpointing", default="false", help="true, false or every-N"
    )
    parser.add_argument("--amp", choices=("bf16", "fp16"), default=None, help="as DistTrainer's")
    parser.add_argument("--memory", default=None, help="memory per device, e.g. 80GB or 24GiB")
    # Read "-5GB" as --memory's value (argparse takes it for an option): its error names it.
    parser._negative_number_matcher = re.compile(r"^-[0-9.]")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the table; return 0, or 1 with a message on stderr."""
    try:
        for option in ("world_size", "tp", "update_every"):
            check_int("--" + option.replace("_", "-"), getattr(args, option), minimum=1)
        if args.pp is not None and args.pp < 2:
            raise ValueError(
                f"--pp {args.pp} is no pipeline (Pipeline needs 2 or more stages): pass "
                "--pp 2 or more for a column per stage, or drop --pp"
            )
        budget = None if args.memory is None else parse_bytes(args.memory)
        if budget == 0:
            raise ValueError("--memory must be more than 0 bytes, e.g. --memory 80GB")
        setup = load_setup(args.setup)
        checkpointing = {"true": True, "false": False}.get(args.activation_checkpointing.lower())
        strategies: list[Strategy] = [DDP(), FSDP()]
        if args.tp > 1:
            strategies.append(FSDP(tp=args.tp, tp_plan=setup.get("tp_plan")))
        if args.pp is not None:
            strategies.append(Pipeline(stages=args.pp))
        for strategy in strategies:  # a layout the trainer refuses: refused before measuring
            strategy.degrees(args.world_size)
            strategy.check_window(args.update_every)
        estimates = [
            estimate_memory(
                setup["model"],
                setup["optimizer"],
                setup["batch"],
                strategy,
                args.world_size,
                loss=setup.get("loss"),
                update_every=args.update_every,
                activation_checkpointing=(
                    args.activation_checkpointing if checkpointing is None else checkpointing
                ),
                amp=args.amp,
            )
            for strategy in strategies
        ]
    except (ValueError, TypeError, KeyError, ImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the model's forward or backward on SETUP's batch
        line = first_line(exc, limit=200)
        print(f"error: the model failed on SETUP's batch ({line}): fix the batch", file=sys.stderr)
        return 1
    print(table([stage for e in estimates for stage in e.stages or [e]], budget))
    return 0


def load_setup(spec: str) -> dict[str, Any]:
    """Call ``module:function`` (or ``file.py:function``) and check the dict it returns."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"SETUP must be module:function or file.py:function, got {spec!r}")
    if where.endswith(".py"):
        location = importlib.util.spec_from_file_location(Path(where).stem, where)
        if location is None or location.loader is None:
            raise ImportError(f"cannot load {where}")
        module = importlib.util.module_from_spec(location)
        location.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(
            f"SETUP {spec!r}: {where} has no function {name}: name a function defined in it"
        )
    try:
        setup = function()
    except Exception as exc:  # the user's code: its error and its line, not our frames
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise ValueError(
            f"SETUP {spec} raised {type(exc).__name__}: {exc} ({frame.filename}, line "
            f"{frame.lineno})"
        ) from exc
    if not isinstance(setup, Mapping):
        raise TypeError(
            f"SETUP {spec} returned {type(setup).__name__}: return a dict with model, "
            "optimizer and batch"
        )
    missing = [k for k in ("model", "optimizer", "batch") if k not in setup]
    if missing:
        raise ValueError(f"{spec} returned no {', '.join(missing)}: return a dict with them")
    kinds: dict[str, tuple[type | tuple[type, ...], str]] = {
        "model": (torch.nn.Module, "a torch.nn.Module"),
        "optimizer": (torch.optim.Optimizer, "a torch.optim.Optimizer"),
        "batch": ((dict, tuple, list, torch.Tensor), "a batch (a dict, tuple or tensor)"),
    }
    for key, (kind, words) in kinds.items():
        if not isinstance(setup[key], kind):
            given = type(setup[key]).__name__
            raise TypeError(f"SETUP {spec} returned {key}={given}: return {words}")
    if not any(p.requires_grad for p in setup["model"].parameters()):
        raise ValueError(f"SETUP {spec} returned a model with no trainable parameters")
    return dict(setup)
