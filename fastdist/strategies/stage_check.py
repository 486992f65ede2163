"""Whether a model cut into pipeline stages (:mod:`~fastdist.strategies.stages`) is still the
model: its stages, run one after the other on one micro-batch, must compute the whole model's
output (:func:`check_cut`) and, each stage training only the parameters it holds, its
gradients (:func:`check_gradients`). Both run on one rank, without communication, on the
model (for sharded stages, a copy holding its parameters whole) in eval mode, each module's
mode restored after; the pipeline runs them once, at its first update.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastdist.modes import evaluating
from fastdist.strategies.stages import StageModule, StagePlan


def _stages(model: nn.Module, plan: StagePlan, batch: Any, run: Callable) -> list[StageModule]:
    """Every stage, then the whole model as one stage, each fed ``batch``."""
    whole = StagePlan(plan.container, [sum(plan.blocks, [])], [], [])
    modules = [StageModule(model, plan, i) for i in range(len(plan.blocks))]
    modules.append(StageModule(model, whole, 0))
    for module in modules:
        module.begin([batch], run)
    return modules


def check_cut(
    model: nn.Module, plan: StagePlan, batch: Any, run: Callable[[nn.Module, Any], Any]
) -> list[torch.Tensor]:
    """Run ``batch`` through every stage in turn and through the whole model, in eval mode
    without gradients; return the activations passed between the stages. Raise a
    ``ValueError`` if the stages' output differs from the model's (the model cannot be cut).
    The last entry is the model's output."""
    *stages, whole = _stages(model, plan, batch, run)
    with torch.no_grad(), torch.random.fork_rng(_devices(model)), evaluating(model):
        expected = whole()  # the model's own error raises as itself
    foreign: list[list[str]] = [[] for _ in stages]
    hooks = [h for i, stage in enumerate(stages) for h in _watch(stage, i, plan, foreign[i])]
    hidden: list[Any] = []
    try:
        with torch.no_grad(), torch.random.fork_rng(_devices(model)), evaluating(model):
            for stage in stages:
                hidden.append(stage(*hidden[-1:]))
    except Exception as exc:
        raise ValueError(_uncut(model, plan, f"{type(exc).__name__}: {exc}")) from exc
    finally:
        for hook in hooks:
            hook.remove()
    for index, names in enumerate(foreign):
        if names:
            raise ValueError(
                f"{names[0]} runs on pipeline stage {index}, but its parameters are another "
                "stage's: modules registered before the blocks belong to the first stage, "
                f"after them to the last; register {names[0]} in the order forward runs it"
            )
    out = hidden[-1]
    same = len(out) == len(expected) and all(
        a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(out, expected, strict=True)
    )
    if not same:
        raise ValueError(_uncut(model, plan, "cut so, it computes another output"))
    return hidden


def check_gradients(
    model: nn.Module, plan: StagePlan, batch: Any, run: Callable[[nn.Module, Any], Any]
) -> None:
    """One backward of ``batch`` (eval mode, a fixed random weighting of the outputs) through
    the whole model, and through the stages as the pipeline runs them: each stage fed the
    activation before it as a leaf, backpropagating the gradient the stage after it returns,
    keeping the gradients of the parameters it holds. Raise a ``ValueError`` naming the
    module whose gradients differ (a stage computes gradients for another stage's
    parameters, which the pipeline would lose) and the fix. Does not touch ``.grad``; holds
    the gradients of one stage's parameters at a time, twice (the model's and the stage's)."""
    *stages, whole = _stages(model, plan, batch, run)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.enable_grad(), torch.random.fork_rng(_devices(model)), evaluating(model):
        expected = _weighted(whole())
        inputs: list[tuple[torch.Tensor, ...]] = []
        outputs: list[Any] = []
        for stage in stages:
            received = () if not outputs else (_leaf(outputs[-1]),)
            inputs.append(received)
            outputs.append(stage(*received))
        upstream: torch.Tensor | None = None
        for index in reversed(range(len(stages))):
            own = [(n, p) for n, p in params if plan.owner(n) == index]
            others = [(n, p) for n, p in params if plan.owner(n) != index]
            out: torch.Tensor | None = None
            if index == len(stages) - 1:
                out = _weighted(outputs[index])
            elif upstream is not None:
                out = (outputs[index] * upstream).sum()
            got = _grads(out, [p for _, p in own + others] + list(inputs[index]))
            upstream = got[len(params)] if inputs[index] else None
            lost = [n for (n, _), g in zip(others, got[len(own) :], strict=False) if _some(g)]
            want = _grads(expected, [p for _, p in own], retain=True)
            scale = max((float(g.abs().max()) for g in want if g is not None), default=0.0)
            if lost:
                raise ValueError(_lost_gradient(model, plan, lost[0], index))
            for (name, _), grad, wanted in zip(own, got, want, strict=False):
                if not _close(grad, wanted, 1e-5 * scale + 1e-12):
                    raise ValueError(_lost_gradient(model, plan, name, None))


def _some(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.any())


def unsharded_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` sharing its parameters and buffers as they are now (before
    ``fully_shard`` replaces them: the copy keeps them whole)."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo=shared)


def _weighted(output: Any) -> torch.Tensor:
    """A fixed random weighting of the floating-point tensors of ``output`` (a tensor or a
    tuple of them), summed: every output element's gradient path counts."""
    tensors = [output] if torch.is_tensor(output) else list(output)
    generator = torch.Generator().manual_seed(0)
    total = torch.zeros(())
    for t in tensors:
        if t.is_floating_point() and t.requires_grad:
            weight = torch.rand(t.shape, generator=generator, dtype=t.dtype).to(t.device)
            total = total + (t * weight).sum().to(total.device, torch.float64)
    return total


def _leaf(hidden: torch.Tensor) -> torch.Tensor:
    """The activation a stage receives: cut from the graph that made it, as a send does."""
    return hidden.detach().requires_grad_(hidden.is_floating_point())


def _grads(
    out: torch.Tensor | None, inputs: list[torch.Tensor], retain: bool = False
) -> list[torch.Tensor | None]:
    """``d out / d inputs`` (``None`` where ``out`` does not depend on one)."""
    if out is None or not out.requires_grad or not inputs:
        return [None] * len(inputs)
    return list(torch.autograd.grad(out, inputs, allow_unused=True, retain_graph=retain))


def _close(got: torch.Tensor | None, want: torch.Tensor | None, atol: float) -> bool:
    if got is None or want is None:
        other = want if got is None else got
        return other is None or float(other.abs().max()) <= atol
    return bool(torch.allclose(got, want, rtol=1e-4, atol=atol))


def _lost_gradient(model: nn.Module, plan: StagePlan, name: str, stage: int | None) -> str:
    """Why the stages' gradient of parameter ``name`` is not the model's, and the fix."""
    module = name.rpartition(".")[0] or f"{type(model).__name__} itself"
    owner = plan.owner(name)
    where = (
        f"pipeline stage {stage} computes a gradient for {name} ({module}), but stage {owner} "
        "holds and trains it, so that part of its gradient would be lost"
        if stage is not None
        else f"the pipeline stages' gradient of {name} ({module}) is not the whole model's"
    )
    return (
        f"{type(model).__name__} cut into pipeline stages at {plan.starts()} would train "
        f"another model: {where}. A value computed from {name} reaches the output other "
        f"than through the blocks in order (a skip connection around them), or {name} is "
        "used inside another stage's blocks: keep every path from the inputs to the output "
        "through the blocks, hold each parameter in the block that uses it, or pass "
        f"split=[...] so that the stage holding {name} runs all that uses it"
    )


def _watch(stage: StageModule, index: int, plan: StagePlan, foreign: list[str]) -> list[Any]:
    """Hooks that list in ``foreign`` the modules with parameters of another stage that run
    in ``stage``'s own part (from its first block on); return their handles."""
    hooks = []
    for name, module in stage.model.named_modules():
        params = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
        if any(plan.owner(p) != index for p in params):
            note = functools.partial(_note, stage, foreign, name)
            hooks.append(module.register_forward_pre_hook(note))
    return hooks


def _note(stage: StageModule, foreign: list[str], name: str, *hook_args: Any) -> None:
    if stage.live:
        foreign.append(name)


def _uncut(model: nn.Module, plan: StagePlan, what: str) -> str:
    """Why ``model`` cannot be cut into stages at the plan's boundaries, and the fix."""
    return (
        f"{type(model).__name__} cannot be cut into pipeline stages at {plan.starts()} "
        f"({what}): its "
        "forward must run the blocks in order and hand each block's output only to the next "
        "block (h = block(h), residual connections inside the blocks, as transformer layers "
        "do), computing nothing after a block from values before it but the inputs, and "
        "reading none of the model's modules or parameters itself (self.modules(), "
        "self.parameters()): on a stage the other stages' blocks are pass-throughs"
    )


def _devices(model: nn.Module) -> list[torch.device]:
    """The CUDA devices of ``model``'s parameters (whose random generators are forked)."""
    return list({p.device for p in model.parameters() if p.device.type == "cuda"})
