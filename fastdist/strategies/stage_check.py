"""Whether a model cut into pipeline stages (:mod:`~fastdist.strategies.stages`) is still the
model: its stages, run one after the other on one micro-batch, must compute the whole model's
output (:func:`check_cut`) and, each stage training only the parameters it holds, its
gradients (:func:`check_gradients`). Both run on one rank, without communication, on copies
sharing the model's parameters; the pipeline runs them once, at its first update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastdist.strategies.stages import StageModule, StagePlan


def _stages(model: nn.Module, plan: StagePlan, batch: Any, run: Callable) -> list[StageModule]:
    """Every stage's copy, then the whole model's, in eval mode, each fed ``batch``."""
    whole = StagePlan(plan.container, [sum(plan.blocks, [])], [], [])
    modules = [StageModule(model, plan, i) for i in range(len(plan.blocks))]
    modules.append(StageModule(model, whole, 0))
    for module in modules:
        module.eval()
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
    foreign: list[list[str]] = [[] for _ in stages]
    hooks = [h for i, stage in enumerate(stages) for h in _watch(stage, i, plan, foreign[i])]
    hidden: list[Any] = []
    try:
        with torch.no_grad(), torch.random.fork_rng(_devices(model)):
            for stage in stages:
                hidden.append(stage(*hidden[-1:]))
            expected = whole()
    except Exception as exc:
        raise ValueError(_uncut(model, plan, f"{type(exc).__name__}: {exc}")) from exc
    finally:
        for hook in hooks:  # sharded modules are the model's own
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
    parameters, which the pipeline would lose) and the fix. Does not touch ``.grad``."""
    *stages, whole = _stages(model, plan, batch, run)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    tensors: list[torch.Tensor] = [params[name] for name in names]
    with torch.enable_grad(), torch.random.fork_rng(_devices(model)):
        expected = _grads(_weighted(whole()), tensors)
        inputs: list[tuple[torch.Tensor, ...]] = []
        outputs: list[Any] = []
        for stage in stages:
            received = () if not outputs else (_leaf(outputs[-1]),)
            inputs.append(received)
            outputs.append(stage(*received))
        piped: dict[str, torch.Tensor] = {}
        lost: dict[str, int] = {}  # a parameter's gradient computed on another stage
        upstream: torch.Tensor | None = None
        for index in reversed(range(len(stages))):
            last = index == len(stages) - 1
            if not last and upstream is None:
                continue  # nothing flows back into this stage
            out = _weighted(outputs[index]) if last else (outputs[index] * upstream).sum()
            grads = _grads(out, tensors + list(inputs[index]))
            upstream = grads[len(tensors)] if inputs[index] else None
            for name, grad in zip(names, grads[: len(tensors)], strict=False):
                if grad is None or not bool(grad.any()):
                    continue
                if plan.owner(name) == index:
                    piped[name] = piped[name] + grad if name in piped else grad
                else:
                    lost.setdefault(name, index)
    for name, want in zip(names, expected, strict=True):
        got = piped.get(name)
        scale = max((g.abs().max().item() for g in expected if g is not None), default=0.0)
        if not _close(got, want, 1e-5 * scale + 1e-12):
            raise ValueError(_lost_gradient(model, plan, name, lost.get(name)))


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


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """``d out / d inputs`` (``None`` where ``out`` does not depend on one)."""
    if not out.requires_grad:
        return [None] * len(inputs)
    return list(torch.autograd.grad(out, inputs, allow_unused=True))


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
        f"another model: {where}. A value {module} computes reaches the output other than "
        "through the blocks in order (a skip connection around the blocks), or a parameter "
        f"is used inside another stage's blocks: keep every path from the inputs to the "
        f"output through the blocks, hold each parameter in the block that uses it, or pass "
        f"split=[...] so that the stage holding {module} is the one that uses it"
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
        "do), computing nothing after a block from values before it but the inputs"
    )


def _devices(model: nn.Module) -> list[torch.device]:
    """The CUDA devices of ``model``'s parameters (whose random generators are forked)."""
    return list({p.device for p in model.parameters() if p.device.type == "cuda"})
