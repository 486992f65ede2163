"""A tensor-parallel plan must leave the model's outputs as one process's: a column-split last
layer hands on a shard of its output, which a loss broadcasts against the target. Checked at
the first forward (``FSDP(tp=...)``) or the first update (tensor-parallel pipeline stages).
Imports no DTensor until a check fails: ``import fastdist`` stays light.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def guard_output(model: nn.Module, plan: dict[str, ParallelStyle] | Callable) -> None:
    """Before ``plan`` is applied: at ``model``'s first forward, refuse outputs whose shapes
    differ from those of one process's model (a meta-device copy, run on the same inputs;
    unchecked where meta tensors cannot run the forward)."""
    shadow, name = meta_copy(model), type(model).__name__  # before fully_shard renames it

    def check(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        handle.remove()
        shadow.train(module.training)
        try:
            expected = shadow(*_to_meta(args), **_to_meta(kwargs))
        except Exception:  # a data-dependent forward (.item(), masks): nothing to compare
            return
        check_output_shapes(expected, output, plan, name)

    handle = model.register_forward_hook(check, with_kwargs=True)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    return copy.deepcopy(model, memo)


def _to_meta(tree: Any) -> Any:
    return _pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), tree)


def output_shapes(output: Any) -> list[tuple[int, ...]]:
    """The shapes of the tensors in ``output`` (a tensor, or a dict, tuple or list of them)."""
    return [tuple(t.shape) for t in _pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]


def check_output_shapes(
    whole: Any, split: Any, plan: dict[str, ParallelStyle] | Callable, where: str
) -> None:
    """Raise unless ``where``'s outputs under ``plan`` (``split``) have the shapes of one
    process's (``whole``): a column-split last layer hands on a shard of its output, which
    a loss broadcasts against the target, training another model without a word."""
    expected, got = output_shapes(whole), output_shapes(split)
    if got == expected:
        return
    from torch.distributed.tensor.parallel import ColwiseParallel

    colwise = (
        [] if callable(plan) else [n for n, s in plan.items() if isinstance(s, ColwiseParallel)]
    )
    layers = ", ".join(colwise[-1:]) or "a column-split layer"
    raise ValueError(
        f"under tp_plan, {where} gives outputs of shapes {got} where one process's model gives "
        f"{expected}: a 'colwise' layer at its end ({layers}) hands on its shard of the "
        "features, which the loss would broadcast against the target (another model). Give it "
        "ColwiseParallel(output_layouts=Replicate()) (its output gathered), follow it by a "
        "'rowwise' layer, or leave it out of the plan"
    )
