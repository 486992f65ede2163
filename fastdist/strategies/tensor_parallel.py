"""Tensor parallelism: a plan of torch's parallel styles applied with ``parallelize_module`` on
the ``tp`` dimension of the topology's ``DeviceMesh`` (:mod:`~fastdist.strategies.topology`).

A plan maps module names to styles. Names may hold ``*`` for one name component
(``"layers.*.mlp.up_proj"``); styles are ``"colwise"`` (``ColwiseParallel``: the output
features split), ``"rowwise"`` (``RowwiseParallel``: the input features split, outputs summed)
, ``"sequence"`` (``SequenceParallel``: the sequence dimension split, for norms and dropout) or
any ``ParallelStyle``. A plan is checked against the model before any collective.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fastdist.checks import describe

#: ``tp_plan=`` as given: ``{pattern: style}`` or ``plan(model, tp_mesh)``.
Plan = Mapping[str, str | ParallelStyle] | Callable[[nn.Module, DeviceMesh], None]

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence": SequenceParallel,
}
#: The styles of Hugging Face's ``config.base_model_tp_plan`` that torch's styles express.
HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
}
#: Attributes (of a module or of its ``config``) that count attention heads.
HEAD_COUNTS = (
    "num_heads",
    "n_heads",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
)


def check_plan_option(tp: Any, tp_plan: Any) -> None:
    """``FSDP(tp=..., tp_plan=...)`` on their own: types, styles, and a plan only with tp > 1."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(
            f"tp must be an integer >= 1 (ranks per tensor-parallel group), got {describe(tp)}"
        )
    if tp_plan is not None and tp == 1:
        raise ValueError("tp_plan applies to tensor parallelism: pass tp > 1 with it, or drop it")
    if tp_plan is None or callable(tp_plan):
        return
    if not isinstance(tp_plan, Mapping):
        raise TypeError(
            "tp_plan must be a dict {module name pattern: 'colwise' | 'rowwise' | 'sequence' | "
            f"a ParallelStyle}}, a function plan(model, tp_mesh), or None; got {describe(tp_plan)}"
        )
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"tp_plan's keys must be module names (str), got {describe(pattern)}")
        if not (style in STYLES or isinstance(style, ParallelStyle)):
            raise ValueError(
                f"tp_plan[{pattern!r}] must be 'colwise', 'rowwise', 'sequence' or a "
                f"ParallelStyle (torch.distributed.tensor.parallel), got {describe(style)}"
            )


def resolve_plan(model: nn.Module, tp_plan: Plan | None) -> dict[str, ParallelStyle] | Callable:
    """The plan for ``model``: ``{module name: style}`` with every pattern matched (each must
    name a module), the model's own Hugging Face plan when none is given, or the function."""
    if callable(tp_plan):
        return tp_plan
    styles: Mapping[str, Callable[[], ParallelStyle]] = STYLES
    prefix = ""
    if tp_plan is None:
        tp_plan, prefix = hf_plan(model)
        styles = HF_STYLES
    names = [name for name, _ in model.named_modules() if name]
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in tp_plan.items():
        regex = re.compile(re.escape(prefix + pattern).replace(r"\*", r"[^.]+"))
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched:
            raise ValueError(
                f"tp_plan names {prefix + pattern!r}, which matches no module of "
                f"{type(model).__name__} (its modules include {_sample(names)}): name modules "
                "by their path in model.named_modules(), '*' standing for one part"
            )
        for name in matched:
            plan[name] = styles[style]() if isinstance(style, str) else style
    return plan


def hf_plan(model: nn.Module) -> tuple[Mapping[str, Any], str]:
    """The plan a Hugging Face model carries (``config.base_model_tp_plan``, its names under
    the base model's prefix), or an error asking for ``tp_plan``."""
    config = getattr(model, "config", None)
    given = getattr(config, "base_model_tp_plan", None)
    if not given:
        raise ValueError(
            f"FSDP(tp>1) needs a tp_plan: {type(model).__name__} carries none "
            "(config.base_model_tp_plan); pass e.g. tp_plan={'layers.*.mlp.up': 'colwise', "
            "'layers.*.mlp.down': 'rowwise'}"
        )
    unknown = sorted({str(style) for style in given.values() if style not in HF_STYLES})
    if unknown:
        raise ValueError(
            f"the model's own plan (config.base_model_tp_plan) uses {unknown}, which torch's "
            f"styles here do not express ({sorted(HF_STYLES)}): pass tp_plan= yourself"
        )
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    return given, f"{prefix}." if inner else ""


def check_plan(model: nn.Module, plan: Mapping[str, ParallelStyle], tp: int) -> None:
    """Raise unless every planned module suits its style and splits evenly over ``tp`` ranks:
    features (a linear layer's outputs or inputs, an embedding's width or rows) and the
    attention heads of the modules holding split projections."""
    for name, style in plan.items():
        module = model.get_submodule(name)
        split = _split_size(name, module, style)
        if split is not None and split[1] % tp:
            what, size = split
            raise ValueError(
                f"tp_plan splits {name} ({type(module).__name__}) over tp={tp} ranks along its "
                f"{what} ({size}), which {tp} does not divide: choose a tp that divides {size}, "
                "or leave the module out of the plan"
            )
    colwise = [name for name, style in plan.items() if isinstance(style, ColwiseParallel)]
    for owner, attr, heads in _head_counts(model, colwise):
        if heads % tp:
            raise ValueError(
                f"tp_plan splits the attention heads of {owner or 'the model'} ({attr}={heads}) "
                f"over tp={tp} ranks, which {tp} does not divide: choose a tp that divides "
                f"{heads}"
            )


def _split_size(name: str, module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """What a colwise or rowwise style splits of ``module`` and its size."""
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return None
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        return (
            ("output features", module.out_features)
            if colwise
            else ("input features", module.in_features)
        )
    if isinstance(module, nn.Embedding):
        return (
            ("embedding width", module.embedding_dim)
            if colwise
            else ("rows", module.num_embeddings)
        )
    kind = "ColwiseParallel" if colwise else "RowwiseParallel"
    raise ValueError(
        f"tp_plan gives {name} ({type(module).__name__}) the style {kind}, which splits only "
        "nn.Linear and nn.Embedding layers: plan its linear layers instead"
    )


def split_dim(module: nn.Module, attr: str, style: ParallelStyle) -> int | None:
    """The dimension of ``module``'s parameter ``attr`` that ``style`` splits over the
    tensor-parallel ranks, as torch's colwise and rowwise styles split linear and embedding
    layers (``None``: every rank holds it whole)."""
    colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear) and (colwise or (rowwise and attr == "weight")):
        return 0 if colwise else 1
    if isinstance(module, nn.Embedding) and (colwise or rowwise):
        return 1 if colwise else 0
    return None


def _head_counts(model: nn.Module, colwise: list[str]) -> list[tuple[str, str, int]]:
    """``(module, attribute, count)`` of the head counts held by the modules (or their
    ``config``) above the column-split layers."""
    owners = {name.rpartition(".")[0] for name in colwise}
    found = []
    for owner in sorted(owners):
        module = model.get_submodule(owner) if owner else model
        for source in (module, getattr(module, "config", None)):
            for attr in HEAD_COUNTS:
                value = getattr(source, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.append((owner, attr, value))
    return found


def apply_plan(
    model: nn.Module, plan: dict[str, ParallelStyle] | Callable, tp_mesh: DeviceMesh
) -> None:
    """Parallelize ``model`` on ``tp_mesh`` (``parallelize_module``, or the user's function);
    raise if no parameter became tensor-parallel."""
    if callable(plan):
        plan(model, tp_mesh)
    else:
        parallelize_module(model, tp_mesh, plan)
    if not any(getattr(p, "device_mesh", None) == tp_mesh for p in model.parameters()):
        raise ValueError(
            "tp_plan made no parameter tensor-parallel: its function must call torch's "
            "parallelize_module(model, tp_mesh, ...) on the modules to split"
        )


def _sample(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:6])
    return shown + (", ..." if len(names) > 6 else "")
