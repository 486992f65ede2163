"""Activation memory, measured: one forward of one micro-batch on the real device, counting
the bytes autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``) and the
output, each storage once and no parameter.

Under tensor parallelism the forward runs on a local view of the model, as one rank holds it
(split layers narrowed to their first shard, no communication: the shapes, not the values,
are what count), and what ``SequenceParallel`` modules keep is divided by ``tp``. Which block
kept what is recorded too, so that activation checkpointing of any set of blocks is worked
out from the same forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

#: The owner of what is kept outside every block (embeddings, the head, the loss).
OUTSIDE = -1


@dataclass(frozen=True)
class Activations:
    """What one micro-batch of ``batch_size`` samples keeps for backward, per storage.

    Attributes:
        sizes: bytes of each kept storage (keyed by its address).
        owners: the blocks (their index; ``OUTSIDE``) whose forward kept each storage.
        inputs: the storages of each block's input tensors (what checkpointing keeps).
        casts: the storages that are autocast's low-precision copies of parameters (FSDP's
            mixed precision gathers such copies instead: they are not activations there).
        after: the storages kept outside every block once a block has run (the head's, the
            loss's, the output: what a pipeline's last stage keeps).
    """

    sizes: Mapping[int, int]
    owners: Mapping[int, frozenset[int]]
    inputs: Sequence[frozenset[int]]
    casts: frozenset[int]
    batch_size: int
    after: frozenset[int] = frozenset()

    def part(self, blocks: Sequence[int], first: bool, last: bool) -> Activations:
        """What a part of the model keeps (a pipeline stage): the ``blocks`` (their
        indices, in order), with what is kept outside them before the blocks (``first``)
        and after them (``last``)."""
        index = {block: i for i, block in enumerate(blocks)}
        owners = {}
        for ptr, who in self.owners.items():
            mine = {index[o] for o in who if o in index}
            if OUTSIDE in who and (last if ptr in self.after else first):
                mine.add(OUTSIDE)
            if mine:
                owners[ptr] = frozenset(mine)
        inputs = [self.inputs[block] for block in blocks]
        return Activations(self.sizes, owners, inputs, self.casts, self.batch_size, self.after)

    def kept(self, period: int = 0, casts: bool = True) -> int:
        """Peak bytes of the activations with every ``period``-th block checkpointed (0: none),
        without parameter ``casts`` unless asked: the larger of what the forward keeps (the
        other blocks' activations, the checkpointed blocks' inputs) and, while a checkpointed
        block recomputes its own in backward, what is still kept for the blocks before it
        (those after it have run their backward and freed theirs)."""
        chosen = set(range(0, len(self.inputs), period)) if period else set()
        dropped = set() if casts else set(self.casts)

        def size(ptrs: set[int]) -> int:
            return sum(self.sizes[ptr] for ptr in ptrs - dropped)

        def kept_before(block: int) -> set[int]:  # OUTSIDE (-1) counts as before every block
            kept = {
                p for p, owners in self.owners.items() if any(o < block for o in owners - chosen)
            }
            return kept | {p for i in chosen if i <= block for p in self.inputs[i]}

        forward = size(kept_before(len(self.inputs)))
        recomputing = (size(kept_before(i)) + self._inside(i, casts) for i in chosen)
        return max([forward, *recomputing])

    def backward_start(self, period: int = 0, casts: bool = True) -> int:
        """:meth:`kept`, plus the gradient of the largest kept tensor (typically the loss's
        input, the logits), allocated while everything is still kept as backward starts."""
        sizes = [
            s for p, s in self.sizes.items() if p in self.owners and (casts or p not in self.casts)
        ]
        return self.kept(period, casts) + max(sizes, default=0)

    def _inside(self, block: int, casts: bool) -> int:
        inside = {p for p, owners in self.owners.items() if block in owners}
        return sum(self.sizes[p] for p in (inside if casts else inside - self.casts))


def measure(
    model: nn.Module,
    run: Callable[[], Any],
    blocks: Sequence[str],
    styles: Mapping[str, ParallelStyle],
    tp: int,
    batch_size: int,
) -> Activations:
    """Run ``run()`` (one forward, and the loss if any) on ``model`` and record what it keeps;
    ``styles``: the tensor-parallel plan (``{module name: style}``) over ``tp`` ranks."""
    from torch.distributed.tensor.parallel import SequenceParallel

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    record = _Record(params, tp)
    modules = [model.get_submodule(name) for name in blocks]
    sequence = [
        model.get_submodule(n) for n, s in styles.items() if isinstance(s, SequenceParallel)
    ]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_local_view(model, styles, tp))
        for index, module in enumerate(modules):
            stack.enter_context(_entering(module, record.enter_block(index)))
        for module in sequence:
            stack.enter_context(_entering(module, record.enter_sequence()))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(record.pack, _unpack))
        output = run()
    for tensor in _tensors(output):
        record.keep(tensor)
    owners = {ptr: frozenset(who) for ptr, who in record.owners.items()}
    inputs = [frozenset(record.inputs.get(i, ())) for i in range(len(modules))]
    after = frozenset(record.after)
    return Activations(
        dict(record.sizes), owners, inputs, frozenset(record.casts), batch_size, after
    )


class _Record:
    """The storages kept so far: their sizes (what ``SequenceParallel`` modules keep divided
    by ``tp``), the blocks that kept them, and each block's inputs."""

    def __init__(self, params: set[int], tp: int) -> None:
        self.params, self.tp = params, tp
        self.sizes: dict[int, int] = {}
        self.owners: dict[int, set[int]] = {}
        self.inputs: dict[int, set[int]] = {}
        self.stack: list[int] = []  # the blocks the forward is in, innermost last
        self.in_sequence = 0
        self.casts: set[int] = set()
        self.after: set[int] = set()  # kept outside the blocks once one has run
        self.entered = False

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.keep(tensor)
        if self._is_cast(tensor):
            self.casts.add(tensor.untyped_storage().data_ptr())
        # Kept alive (no address reused while counting) without its grad_fn: a saved output
        # holding its own node would be a cycle through C++ that no collector frees.
        return tensor.detach()

    def _is_cast(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a copy of a parameter (autocast's cast to bf16/fp16)."""
        step = tensor.grad_fn
        if step is None or not type(step).__name__.startswith("ToCopyBackward"):
            return False
        source = getattr(step.next_functions[0][0], "variable", None)
        return source is not None and source.untyped_storage().data_ptr() in self.params

    def keep(self, tensor: torch.Tensor) -> None:
        ptr = self._size(tensor, divide=self.in_sequence > 0)
        if ptr is not None:
            self.owners.setdefault(ptr, set()).add(self.stack[-1] if self.stack else OUTSIDE)
            if not self.stack and self.entered:
                self.after.add(ptr)

    def _size(self, tensor: torch.Tensor, divide: bool = False) -> int | None:
        """Note the size of ``tensor``'s storage; its address (``None``: a parameter's)."""
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if not size or ptr in self.params:
            return None
        self.sizes.setdefault(ptr, size // self.tp if divide else size)
        return ptr

    def enter_block(self, index: int) -> Callable[[bool, tuple[Any, ...]], None]:
        def hook(entering: bool, args: tuple[Any, ...]) -> None:
            if entering:
                self.inputs[index] = {p for t in _tensors(args) if (p := self._size(t))}
                self.stack.append(index)
                self.entered = True
            else:
                self.stack.pop()

        return hook

    def enter_sequence(self) -> Callable[[bool, tuple[Any, ...]], None]:
        def hook(entering: bool, args: tuple[Any, ...]) -> None:
            self.in_sequence += 1 if entering else -1

        return hook


@contextlib.contextmanager
def _entering(module: nn.Module, hook: Callable[[bool, tuple[Any, ...]], None]) -> Iterator[None]:
    """Call ``hook(True, args)`` before ``module``'s forward and ``hook(False, ())`` after."""
    before = module.register_forward_pre_hook(lambda _m, args: hook(True, args))
    after = module.register_forward_hook(lambda _m, _args, _out: hook(False, ()))
    try:
        yield
    finally:
        before.remove()
        after.remove()


@contextlib.contextmanager
def _local_view(model: nn.Module, styles: Mapping[str, ParallelStyle], tp: int) -> Iterator[None]:
    """Narrow each split layer's parameters to one rank's shard (views: no copy), and put the
    originals back after. A row-split embedding stays whole: a rank looks up whole rows."""
    from fastdist.strategies.tensor_parallel import split_dim

    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for name, style in styles.items() if tp > 1 else ():
            module = model.get_submodule(name)
            for attr, param in list(module.named_parameters(recurse=False)):
                dim = split_dim(module, attr, style)
                if dim is None or (isinstance(module, nn.Embedding) and dim == 0):
                    continue
                saved.append((module, attr, param))
                part = param.narrow(dim, 0, param.shape[dim] // tp)
                setattr(module, attr, nn.Parameter(part, requires_grad=param.requires_grad))
        yield
    finally:
        for module, attr, param in reversed(saved):
            setattr(module, attr, param)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a (nested) output: tensors, dicts (and model outputs), lists, tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
