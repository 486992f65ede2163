"""Moving batches to the device, feeding them to the model and reading named fields."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn


def to_device(batch: Any, device: torch.device) -> Any:
    """Copy every tensor in a (nested) dict, list or tuple batch to ``device``; a tensor, or a
    flat tuple, list or dict of tensors, already there is returned as it is (CPU training:
    no dispatch, about 2 us per tensor, and no new container)."""
    kind = type(batch)
    if kind is tuple or kind is list:  # the common case first: no ABC check, no call
        for v in batch:  # noqa: SIM110 (all() of a generator takes twice as long)
            if type(v) is not torch.Tensor or v.device != device:
                return kind([to_device(v, device) for v in batch])
        return batch
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        if kind is dict and _there(batch.values(), device):
            return batch
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return kind(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return kind(to_device(v, device) for v in batch)
    return batch


def _there(values: Iterable[Any], device: torch.device) -> bool:
    """Whether every one of ``values`` is a plain tensor on ``device`` already."""
    for v in values:  # noqa: SIM110 (all() of a generator takes twice as long)
        if type(v) is not torch.Tensor or v.device != device:
            return False
    return True


def batch_bytes(batch: Any) -> int:
    """Bytes of the tensors in a (nested) dict, list or tuple batch."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(map(batch_bytes, batch.values()))
    if isinstance(batch, (list, tuple)):
        return sum(map(batch_bytes, batch))
    return 0


class CountingCollate:
    """A ``collate_fn`` that also returns how many samples the batch holds."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> tuple[int, Any]:
        return len(samples), self.collate(samples)


def make_forward(model: nn.Module, evaluation: bool = False) -> Callable[[nn.Module, Any], Any]:
    """Return ``forward(module, batch)`` that feeds a batch the way ``model`` expects it.

    Dict batches go in as keyword arguments matched to the parameters of ``model.forward``
    (all fields if it takes ``**kwargs``); tuple batches ``(x, ..., y)`` as ``module(x, ...)``;
    a bare tensor as ``module(x)``. The first dict batch is checked against the parameters
    (see :func:`check_batch_fields`); later ones are not, to keep every step cheap.

    With ``evaluation``, a model that defines ``predict`` is fed to ``module.predict`` the
    same way (its own parameters), as fastNLP evaluated and predicted.
    """
    method = "predict" if evaluation and callable(getattr(model, "predict", None)) else "forward"
    forward_name = f"{type(model).__name__}.{method}"
    fn = getattr(model, method)
    if method in vars(model):  # patched on the instance (register_fsdp_forward_method):
        fn = getattr(fn, "__wrapped__", fn)  # the bound method it wraps has the signature
    params = list(inspect.signature(fn).parameters.values())
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unchecked, by_forward = True, method == "forward"

    def forward(module: nn.Module, batch: Any) -> Any:
        nonlocal unchecked
        call = module if by_forward else getattr(module, method)
        kind = type(batch)
        if kind is tuple or kind is list:  # the common case: no ABC check
            return call(batch[0]) if len(batch) <= 2 else call(*batch[:-1])
        if isinstance(batch, Mapping):
            if unchecked:
                check_batch_fields(list(batch), params, forward_name)
                unchecked = False
            return call(**(batch if takes_all else {k: batch[k] for k in names & batch.keys()}))
        if isinstance(batch, (list, tuple)):
            return call(*batch[:-1]) if len(batch) > 1 else call(batch[0])
        if batch is None or isinstance(batch, (str, bytes, int, float)):
            raise TypeError(
                f"collate_fn returned {type(batch).__name__}, which cannot feed {forward_name}: "
                "return a tensor, a tuple or list (x, ..., y), or a dict of forward's fields"
            )
        return call(batch)

    return forward


def check_batch_fields(fields: list[Any], params: list[inspect.Parameter], name: str) -> None:
    """Raise ``TypeError`` when a dict batch with ``fields`` cannot feed the forward ``name``
    with ``params``: a parameter without a default is missing, or (without ``**kwargs``) no
    field matches a parameter, so that nothing would reach the model."""
    by_name = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    missing = [p.name for p in by_name if p.default is p.empty and p.name not in fields]
    if missing:
        problem = f"needs {', '.join(map(repr, missing))}, which the batch lacks"
    elif not takes_all and not {p.name for p in by_name} & set(fields):
        problem = "shares no name with the batch, so no field would reach the model"
    else:
        return
    signature = ", ".join(_shown(p) for p in params)
    raise TypeError(
        f"{name}({signature}) {problem}: the batch's fields are {fields}. A dict batch is fed "
        "to forward by name: rename the dataset's fields (or build them in collate_fn) to "
        "forward's parameter names, or give forward **kwargs to take every field"
    )


def _shown(param: inspect.Parameter) -> str:
    """A parameter as a signature shows it, without annotation or default value (their reprs
    may hold addresses, which differ between ranks)."""
    if param.kind is param.VAR_POSITIONAL:
        return f"*{param.name}"
    if param.kind is param.VAR_KEYWORD:
        return f"**{param.name}"
    return param.name + ("=..." if param.default is not param.empty else "")
