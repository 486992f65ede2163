"""The state an optimizer keeps per parameter, found by one step of a copy on the meta device
(no memory, no change to the real one); where a step cannot run there, known rules."""

from __future__ import annotations

import inspect

import torch

#: Copies of each parameter an optimizer keeps (for those whose step needs real values).
RULES = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Adagrad": 1,
    "ASGD": 2,
    "Rprop": 2,
}

Shapes = dict[torch.nn.Parameter, list[tuple[torch.Size, torch.dtype]]]


def state_shapes(optimizer: torch.optim.Optimizer) -> Shapes:
    """``{parameter: [(shape, dtype) of each state tensor]}`` after one step."""
    meta = {
        p: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
        for group in optimizer.param_groups
        for p in group["params"]
    }
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [meta[p] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    try:
        copy = cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        for p in meta.values():
            p.grad = torch.empty_like(p)
        copy.step()
    except Exception as exc:  # e.g. a step that reads a value (.item()) of its state
        return _by_rule(optimizer, exc)
    shapes: Shapes = {}
    for real, fake in meta.items():
        state = copy.state.get(fake, {})
        shapes[real] = [(v.shape, v.dtype) for v in state.values() if isinstance(v, torch.Tensor)]
    return shapes


def _by_rule(optimizer: torch.optim.Optimizer, error: Exception) -> Shapes:
    """The state by :data:`RULES`, or an error naming why neither way works."""
    name = type(optimizer).__name__
    copies = RULES.get(name)
    if copies is None:
        raise ValueError(
            f"cannot tell the state {name} keeps: its step does not run on the meta device "
            f"({type(error).__name__}: {error}) and it has no rule in "
            "fastdist.estimate.optimizer.RULES (copies of each parameter): add one"
        ) from error
    return {
        p: [(p.shape, p.dtype)] * copies
        for group in optimizer.param_groups
        for p in group["params"]
    }
