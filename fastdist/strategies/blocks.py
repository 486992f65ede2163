"""A model's repeated blocks, and what is done to them before the model is wrapped:
activation checkpointing of every n-th block and compiling each block on its own.

Both are trainer options (``DistTrainer(activation_checkpointing=..., compile=...)``) that
every strategy realises at the moment its wrapping allows: DDP before wrapping, FSDP after
tensor parallelism and before sharding (torchtitan's order: TP, checkpointing, compile, FSDP).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)

from fastdist.checks import describe

#: What ``activation_checkpointing`` accepts, for error messages.
CHECKPOINTING_FORMS = "True (every block), False, or 'every-N' (every N-th block, e.g. 'every-2')"


def find_blocks(model: nn.Module, wrap: Sequence[type[nn.Module]] | None) -> list[str]:
    """Names of the model's repeated blocks: instances of ``wrap``, or by default the
    children of every ``nn.ModuleList`` (transformer layers). Outermost matches only: a
    list inside a block (an MoE layer's experts) is part of that block."""
    names: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer in names):
            continue
        if wrap:
            if name and isinstance(module, tuple(wrap)):
                names.append(name)
        elif isinstance(module, nn.ModuleList):
            names += [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    return names


def checkpoint_period(value: object) -> int:
    """``activation_checkpointing`` as the period of checkpointed blocks (0: off, 1: every
    block, N: the first of every N blocks)."""
    if value is True or value is False:
        return int(value)
    match = re.fullmatch(r"every-([1-9][0-9]*)", value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"activation_checkpointing must be {CHECKPOINTING_FORMS}; got {describe(value)}"
        )
    return int(match.group(1))


def checkpoint_blocks(model: nn.Module, blocks: Sequence[str], period: int) -> list[str]:
    """Wrap blocks ``0, period, 2 * period, ...`` of ``blocks`` in torch's
    ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``: the block's activations
    are recomputed in backward instead of kept); return their names. The wrapper takes the
    block's place, so its name and its state-dict keys stay the same. The recompute leaves
    the block's buffers as the forward left them (BatchNorm's running statistics are updated
    once per forward, not again in backward)."""
    if not period:
        return []
    chosen = list(blocks)[::period]
    for name in chosen:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        block = owner.get_submodule(child)
        contexts = functools.partial(_checkpoint_contexts, block)
        owner.register_module(child, checkpoint_wrapper(block, context_fn=contexts))
    return chosen


def _checkpoint_contexts(
    block: nn.Module,
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward, the buffers
    restored around the recompute."""
    return contextlib.nullcontext(), _buffers_restored(block)


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    """Put ``module``'s buffers back to their values on entry when the block exits."""
    saved = [(buffer, buffer.clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def compile_blocks(model: nn.Module, blocks: Sequence[str]) -> None:
    """``torch.compile`` each block in place (regional compilation: one small graph reused by
    every block of the same code, compiled once); the whole model when it has no blocks."""
    for name in blocks:
        model.get_submodule(name).compile()
    if not blocks:
        model.compile()


def plain_name(name: str) -> str:
    """A parameter's name without the checkpoint wrapper's part (as state dicts write it)."""
    return name.replace(_CHECKPOINT_PREFIX, "")
