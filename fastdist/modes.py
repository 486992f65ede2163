"""Train and eval mode, each module's own.

``model.train()`` and ``model.eval()`` set every submodule alike, so a submodule frozen with
``.eval()`` (a batch norm kept in eval mode while the rest trains) would train again after
``model.train()``. What fastdist switches, it puts back module by module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def modes(modules: list[nn.Module]) -> list[bool]:
    """Whether each of ``modules`` is in training mode."""
    return [module.training for module in modules]


def set_modes(modules: list[nn.Module], training: list[bool]) -> None:
    """Put each of ``modules`` in the mode ``training`` gives it (a module's own flag only,
    as :func:`modes` read them)."""
    for module, mode in zip(modules, training, strict=True):
        if module.training is not mode:  # nn.Module's __setattr__ is slow: only if changed
            module.training = mode


@contextlib.contextmanager
def kept_modes(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in its own mode again after the block."""
    modules = list(model.modules())
    kept = modes(modules)
    try:
        yield
    finally:
        set_modes(modules, kept)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside; every module in its own mode again after."""
    with kept_modes(model):
        model.eval()
        yield
