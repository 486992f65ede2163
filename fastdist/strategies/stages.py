"""Cutting a model into pipeline stages by name, as torchtitan prunes a copy per stage, but
without the copy: each stage runs the model itself, the blocks of other stages swapped for
pass-throughs while the stage's forward runs.

The models it takes: the repeated blocks are the children (of one class) of an
``nn.ModuleList`` or ``nn.ModuleDict`` and run in order; each takes the hidden state as its
first positional argument and returns a tensor of the same kind. Modules registered before
the blocks (or before a module holding them, as nanoGPT's ``transformer`` holds ``h``) run
before them and belong to the first stage (embeddings); those registered after run after
them and belong to the last (final norm, head). A parameter two stages would use (tied
embedding and head weights) is refused, and :mod:`~fastdist.strategies.stage_check` refuses at
the first update a model whose stages would compute another output or other gradients than
the whole model, or run a module in a stage other than the one holding it. State-dict keys
stay the model's own, and between the stages' forwards the model is whole (evaluation and
``save_model`` read it); the modes, attributes and hooks a callback gives its modules hold
in every stage, as in one process.

A stage runs the model's ``forward`` on the micro-batch: on every stage but the first,
the first block of the stage has its input replaced by the activation received from the
stage before (what runs before it on this stage, cheap non-block modules on the inputs and
pass-throughs, is discarded); on every stage but the last, the forward stops when it reaches
the next stage's first block and returns that block's input.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from fastdist.modes import modes, set_modes
from fastdist.strategies.base import Update


class PassThrough(nn.Module):
    """Stands in for a block of another stage: returns its first argument."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden


@dataclass(frozen=True)
class StagePlan:
    """Which stage holds what: ``blocks[s]`` are stage ``s``'s block names, in order;
    ``container``: the name of the ``ModuleList``/``ModuleDict`` holding them; ``after``: the
    modules registered after it (or after a module holding it), which the last stage holds;
    ``before``: those registered before, the first stage's."""

    container: str
    blocks: list[list[str]]
    after: list[str]
    before: list[str]

    def starts(self) -> list[str]:
        """The first block of every stage after the first (the boundaries)."""
        return [names[0] for names in self.blocks[1:]]

    def units(self, index: int) -> list[str]:
        """The modules holding stage ``index``'s parameters (what FSDP shards one by one)."""
        first, last = self.before if index == 0 else [], []
        if index == len(self.blocks) - 1:
            last = self.after
        return [*first, *self.blocks[index], *last]

    def owner(self, name: str) -> int:
        """The stage holding the parameter or buffer ``name``."""
        for stage, names in enumerate(self.blocks):
            if any(name.startswith(block + ".") for block in names):
                return stage
        if any(name.startswith(module + ".") for module in self.after):
            return len(self.blocks) - 1
        return 0


def module_lists(model: nn.Module) -> list[tuple[str, list[str]]]:
    """``(name, child names)`` of every ``nn.ModuleList``/``nn.ModuleDict`` in ``model``."""
    return [
        (name, [f"{name}.{child}" for child, _ in module.named_children()])
        for name, module in model.named_modules()
        if name and isinstance(module, (nn.ModuleList, nn.ModuleDict))
    ]


def containers(model: nn.Module) -> list[tuple[str, list[str]]]:
    """``(name, block names)`` of the model's outermost ``ModuleList``/``ModuleDict``s of
    repeated blocks (children of one class)."""
    found: list[tuple[str, list[str]]] = []
    for name, blocks in module_lists(model):
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if len({type(model.get_submodule(block)) for block in blocks}) == 1:
            found.append((name, blocks))
    return found


def _plan(model: nn.Module, container: str, blocks: list[list[str]]) -> StagePlan:
    """The plan of ``blocks``, with the modules registered after ``container``, checked for
    parameters that two stages would share."""
    parts, after, before = container.split("."), [], []
    for depth, part in enumerate(parts):
        parent = ".".join(parts[:depth])
        names = [
            f"{parent}.{n}" if parent else n
            for n, _ in model.get_submodule(parent).named_children()
        ]
        at = names.index(f"{parent}.{part}" if parent else part)
        before += names[:at]
        after += names[at + 1 :]
    plan = StagePlan(container, blocks, after, before)
    uses: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        uses.setdefault(id(param), []).append(name)
    for names in uses.values():
        if len({plan.owner(name) for name in names}) > 1:
            raise ValueError(
                f"{names} are one parameter, held by two pipeline stages: tied weights across "
                "stages are not supported; untie them (e.g. give the head its own weight)"
            )
    return plan


class TooFewBlocks(ValueError):
    """More stages than the model's blocks (``blocks``: how many it has)."""

    def __init__(self, message: str, blocks: int) -> None:
        super().__init__(message)
        self.blocks = blocks


def plan_stages(model: nn.Module, stages: int, split: list[str] | None) -> StagePlan:
    """The blocks of each of ``stages`` stages: cut at ``split`` (the first block of every
    stage after the first), or evenly over the model's largest list of blocks. Raise a
    ``ValueError`` naming the fix if the model cannot be cut so."""
    found = containers(model)
    cls = type(model).__name__
    if split is None:
        if not found:
            _refuse_mixed(model, stages)
            raise ValueError(_no_blocks("split=None", cls))
        container, blocks = max(found, key=lambda item: len(item[1]))
        if len(blocks) < stages:
            raise TooFewBlocks(
                f"it needs at least {stages} blocks, but {cls}'s {container} holds {len(blocks)}",
                len(blocks),
            )
        per, extra = divmod(len(blocks), stages)
        bounds = [s * per + min(s, extra) for s in range(stages + 1)]
        return _plan(model, container, [blocks[a:b] for a, b in itertools.pairwise(bounds)])
    return _cut_at(model, found, split)


def _refuse_mixed(model: nn.Module, stages: int) -> None:
    """Refuse ``split=None`` naming the model's largest list of blocks of several classes,
    if it has one, and the ``split`` that cuts it evenly."""
    lists = [(name, blocks) for name, blocks in module_lists(model) if len(blocks) >= stages]
    if not lists:
        return
    name, blocks = max(lists, key=lambda item: len(item[1]))
    classes = sorted({type(model.get_submodule(block)).__name__ for block in blocks})
    per = len(blocks) // stages
    example = [blocks[k * per] for k in range(1, stages)]
    raise ValueError(
        f"Pipeline(split=None) splits evenly the blocks of one class in an nn.ModuleList (or "
        f"nn.ModuleDict), but {type(model).__name__}'s {name} holds blocks of "
        f"{len(classes)} classes ({', '.join(classes)}): pass split={example} (the first "
        "block of every stage after the first), or make its blocks one class"
    )


def _cut_at(model: nn.Module, found: list[tuple[str, list[str]]], split: list[str]) -> StagePlan:
    names = dict(model.named_modules())
    missing = [name for name in split if name not in names]
    if missing:
        raise ValueError(
            f"Pipeline(split={split}) names {missing}, which {type(model).__name__} does not "
            "contain: name modules of model.named_modules(), e.g. 'layers.4'"
        )
    for container, blocks in module_lists(model):  # blocks of any classes
        if all(name in blocks for name in split):
            cuts = [0] + [blocks.index(name) for name in split] + [len(blocks)]
            if all(a < b for a, b in itertools.pairwise(cuts)):
                return _plan(model, container, [blocks[a:b] for a, b in itertools.pairwise(cuts)])
    if not module_lists(model):
        raise ValueError(_no_blocks(f"split={split}", type(model).__name__))
    shown = "; ".join(f"{c}: {blocks[0]} ... {blocks[-1]}" for c, blocks in found) or "none"
    raise ValueError(
        f"Pipeline(split={split}) must name blocks of one nn.ModuleList/ModuleDict, in order, "
        f"after its first block (each the first block of a stage); the model's blocks: {shown}"
    )


def _no_blocks(given: str, cls: str) -> str:
    """Why a model with no list of blocks cannot be cut (``given``: the ``split`` argument)."""
    return (
        f"Pipeline({given}) cuts a model between the blocks of one nn.ModuleList (or "
        f"nn.ModuleDict) that its forward runs in order, but {cls} holds none, so no split "
        "can cut it as it is: put its repeated layers in one (self.blocks = "
        "nn.ModuleList([...])); then split=None cuts them evenly"
    )


#: Where a tensor was among the leaves of the model's output.
_TENSOR = object()


class Boundary(Exception):
    """Raised by the next stage's first block to end this stage's forward with its input."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


class StageModule(nn.Module):
    """One stage of ``model`` (see the module's docs), fed the micro-batches of the update
    :meth:`begin` names, one per forward, in order.

    The stage runs the model itself: while its forward runs, the blocks of the other stages
    are swapped for pass-throughs in their container (and the stage's first block fed the
    activation received); after it, the model is whole again. Every module, mode, attribute
    and hook is the model's own.

    Args:
        model: the whole model.
        plan: the stages.
        index: which stage this is.
    """

    def __init__(self, model: nn.Module, plan: StagePlan, index: int) -> None:
        super().__init__()
        self.model = model
        starts = plan.starts()
        self.next = starts[index] if index < len(starts) else None
        stand_ins: dict[str, nn.Module] = {
            name: PassThrough()
            for stage, names in enumerate(plan.blocks)
            if stage != index
            for name in names
        }
        if index > 0:
            first = starts[index - 1]
            stand_ins[first] = Receiver(model.get_submodule(first), self._take)
        if self.next is not None:
            stand_ins[self.next].register_forward_pre_hook(_stop)
        # The container's children by key (``blocks.3``: ``3``), and their stand-ins: plain
        # dicts, not submodules of the stage (not in its state dict, nor twice in DDP's).
        self._children = model.get_submodule(plan.container)._modules
        self._stand_ins = {name.rpartition(".")[2]: m for name, m in stand_ins.items()}
        self.batches: list[Any] = []
        self.run: Callable[[nn.Module, Any], Any] | None = None
        self.modes: UpdateModes | None = None
        self.count, self.live = 0, False
        self.hidden: torch.Tensor | None = None
        self.outputs: list[tuple[Any, list[Any]]] = []  # the last stage's, in pieces

    def begin(
        self,
        batches: list[Any],
        run: Callable[[nn.Module, Any], Any],
        modes: UpdateModes | None = None,
    ) -> None:
        """The next forwards are those of ``batches``, each run as ``run(module, batch)``
        (in the modes ``modes`` kept for it)."""
        self.batches, self.run, self.modes, self.count, self.outputs = batches, run, modes, 0, []

    def forward(self, *received: torch.Tensor) -> Any:
        """The activation for the next stage; on the last stage, the tensors of the model's
        output (:meth:`output` puts them together again)."""
        assert self.run is not None, "StageModule.begin() names the micro-batches"
        batch = self.batches[self.count]
        if self.modes is not None:
            self.modes.apply(self.count)
        self.count += 1
        self.hidden = received[0] if received else None
        self.live = not received  # the stage's own part runs (from its first block on)
        children = self._children
        blocks = {key: children[key] for key in self._stand_ins}
        children.update(self._stand_ins)
        try:
            output = self.run(self.model, batch)
        except Boundary as boundary:
            return boundary.hidden
        finally:
            children.update(blocks)
            self.hidden, self.live = None, False
        if self.next is not None:
            raise ValueError(
                f"{type(self.model).__name__}'s forward never ran {self.next}, where a "
                "pipeline stage starts: split the model at blocks its forward runs"
            )
        leaves, spec = tree_flatten(output)
        self.outputs.append((spec, [_TENSOR if torch.is_tensor(x) else x for x in leaves]))
        return tuple(x for x in leaves if torch.is_tensor(x))

    def output(self, index: int, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The model's output of micro-batch ``index`` from the tensors :meth:`forward`
        returned (a schedule passes on tensors only)."""
        spec, leaves = self.outputs[index]
        given = iter(tensors)
        return tree_unflatten([next(given) if x is _TENSOR else x for x in leaves], spec)

    def _take(self) -> torch.Tensor | None:
        """The activation this stage received, for its first block."""
        self.live = True
        return self.hidden


class Receiver(nn.Module):
    """A stage's first block, fed the activation its stage received instead of its input."""

    def __init__(self, block: nn.Module, take: Callable[[], torch.Tensor | None]) -> None:
        super().__init__()
        self.block, self.take = block, take

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return self.block(self.take(), *args, **kwargs)


def _stop(module: nn.Module, args: tuple[Any, ...]) -> None:
    raise Boundary(args[0])


class UpdateModes:
    """The modes of ``model``'s modules each micro-batch of an update runs in, kept as its
    micro-batches are drawn (after its ``on_batch_begin``, in the loop's mode for it: as one
    process sets them) and set again before its forward on each stage (a stage's forward
    changes the modes of its own modules only)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.modules = model, list(model.modules())
        self.kept: list[list[bool]] = []  # per micro-batch
        self.after: list[bool] = []

    def draw(self, update: Update) -> list[Any]:
        """The update's micro-batches, each one's modes kept."""
        batches = []
        for batch in update:
            batches.append(batch)
            with update.mode(self.model):
                self.kept.append(modes(self.modules))
        self.after = modes(self.modules)  # as the update's last forward leaves them
        return batches

    def apply(self, index: int) -> None:
        """The modes of micro-batch ``index``."""
        set_modes(self.modules, self.kept[index])

    def restore(self) -> None:
        """The modes the update's last forward leaves in one process."""
        set_modes(self.modules, self.after)


def batch_shapes(batch: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of the tensors of ``batch`` (dicts, lists, tuples)."""
    leaves = tree_leaves(batch)
    return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))


def stage_example(hidden: Any) -> Any:
    """An activation of ``hidden``'s shape as it flows in training (requiring gradients); for
    the last stage's output (a tuple of tensors, not sent), its shapes on the meta device (as
    torch's own shape inference gives them: torch 2.11 checks every output against them)."""
    if isinstance(hidden, tuple):
        return tuple(torch.empty_like(h, device="meta") for h in hidden)
    return torch.empty_like(hidden).requires_grad_(hidden.is_floating_point())


def step(schedule: Any, micro_batches: int) -> None:
    """``schedule.step`` over ``micro_batches`` (the loss function's targets: their indices);
    an exception of a stage's code raised as itself, not as the ``RuntimeError("[Stage 0]
    failed to run forward: args: ...")`` torch wraps it in (which names no error)."""
    try:
        schedule.step(target=torch.arange(micro_batches), return_outputs=False)
    except RuntimeError as exc:
        if exc.__cause__ is None or "failed to run" not in str(exc).lower():
            raise
        raise exc.__cause__ from None
