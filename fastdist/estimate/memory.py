"""Per-rank memory of a training configuration, before launch: what each rank holds under DDP,
FSDP, FSDP with tensor parallelism or on each pipeline stage, from the model's parameters, the
optimizer's state after one step on the meta device, and the activations of one micro-batch
measured on the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastdist.checks import check_choice, check_int
from fastdist.data.feed import make_forward, to_device
from fastdist.estimate.activations import Activations, measure
from fastdist.estimate.optimizer import state_shapes
from fastdist.losses import as_loss_fn
from fastdist.modes import kept_modes
from fastdist.strategies import MemoryShare, Strategy, Topology, resolve_strategy
from fastdist.strategies.blocks import checkpoint_period

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

_AMP = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by kind; :attr:`peak` the most at once.

    Attributes:
        strategy: the strategy, as its ``repr`` (with tensor parallelism ``FSDP(tp=N)``).
        world_size, batch_size, update_every: the configuration estimated.
        parameters: the rank's parameters (its shards under FSDP).
        gradients: its gradients at the optimizer step (DDP: with its buckets).
        optimizer: its optimizer state.
        activations: what one micro-batch keeps for backward (measured; with checkpointing),
            and the gradient of its largest tensor, allocated as backward starts.
        in_flight: FSDP's buffers: whole copies gathered for compute (the root's parameters
            and two blocks', one computing, one being gathered) and one block's gradient
            reduce-scatter (its gradients whole, and their shard).
        held: gradients held through a forward: DDP's buckets (twice when DDP rebuilds
            them, once, while the first ones live) or within an accumulation window the
            buckets and the accumulated gradients; FSDP's accumulated gradients (unsharded
            until the window's last micro-batch reduce-scatters them).
        step_temp: the optimizer step's temporaries (foreach on CUDA: one copy of the
            parameters; else the largest parameter).
        stages: under a pipeline, every stage's figures (``strategy`` names the stage);
            the fields above are the stage with the highest peak, ``peak_at`` and
            ``max_batch_size`` the most any stage needs. Empty otherwise.
    """

    strategy: str
    world_size: int
    batch_size: int
    update_every: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    in_flight: int
    held: int
    step_temp: int
    stages: tuple[MemoryEstimate, ...] = ()

    def peak_at(self, batch_size: int) -> int:
        """The peak with ``batch_size`` samples per micro-batch (activations grow in
        proportion): the end of the forward or the optimizer step, whichever is larger."""
        if self.stages:
            return max(stage.peak_at(batch_size) for stage in self.stages)
        activations = math.ceil(self.activations * batch_size / self.batch_size)
        states = self.parameters + self.optimizer
        forward = states + self.held + activations + self.in_flight
        return max(forward, states + self.gradients + self.step_temp)

    @property
    def peak(self) -> int:
        return self.peak_at(self.batch_size)

    def max_batch_size(self, budget: int) -> int:
        """The largest ``batch_size_per_gpu`` whose peak fits ``budget`` bytes (0: none)."""
        low, high = 0, 1
        while self.peak_at(high) <= budget and high < 2**40:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.peak_at(mid) <= budget else (low, mid)
        return low


def estimate_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    strategy: str | Strategy = "ddp",
    world_size: int = 1,
    *,
    loss: Any = None,
    update_every: int = 1,
    activation_checkpointing: bool | str = False,
    amp: str | None = None,
) -> MemoryEstimate:
    """Estimate the bytes each rank holds when training ``model`` with ``optimizer`` on
    micro-batches like ``batch`` under ``strategy`` over ``world_size`` processes.

    One forward of ``batch`` (and ``loss``, if given) runs on the model's device, under
    tensor parallelism on one rank's view of the split layers; the optimizer steps once on a
    copy on the meta device. Nothing else is allocated and the model is left as it was.

    Accuracy: activations count what autograd keeps and one gradient, not the tensors alive
    only while an operation runs (unkept intermediates of a block, the gradients of backward);
    measured peaks were 0.79 to 1.35 times the estimate (conv nets the most above: docs).

    Args:
        model, optimizer: as given to ``DistTrainer`` (the optimizer has not stepped).
        batch: one micro-batch (``batch_size_per_gpu`` samples), as the model is fed.
        strategy, world_size: ``"ddp"``, ``"fsdp"``, ``DDP(...)``, ``FSDP(tp=..., ...)``,
            ``Pipeline(...)`` (each stage's figures in ``stages``: the strategy says what
            each kind of rank trains and keeps, :meth:`Strategy.memory_shares`) and the
            number of processes.
        loss, update_every, activation_checkpointing, amp: as for ``DistTrainer``.

    Example:
        >>> est = estimate_memory(model, optimizer, batch, FSDP(tp=2, tp_plan=plan), 8)
        >>> est.peak < 10**8, est.max_batch_size(80 * 10**9) > 32
        (True, True)
    """
    check_int("world_size", world_size, minimum=1)
    check_int("update_every", update_every, minimum=1)
    check_choice("amp", amp, tuple(_AMP))
    strategy = resolve_strategy(strategy)
    strategy.check_window(update_every)  # as the trainer refuses it
    layout = Topology(strategy.degrees(world_size), 0, world_size)  # rank 0's view of it
    tp = layout.size("tp")
    styles = _plan(model, strategy, tp)
    device = next(model.parameters()).device
    period = checkpoint_period(activation_checkpointing)
    feed = make_forward(model)  # the trainer's refusals, from its own checks
    strategy.check_run(model, to_device(batch, device), feed, amp, period)
    activations = _activations(model, batch, loss, amp, styles, tp, strategy, device)
    setting = _Setting(
        model, optimizer, strategy, layout, styles, update_every, amp, device, activations
    )
    found = [
        _estimate(setting, share, period) for share in strategy.memory_shares(model, update_every)
    ]
    if len(found) == 1:
        return found[0]
    tallest = max(found, key=lambda e: e.peak)
    return dataclasses.replace(tallest, stages=tuple(found))


@dataclass(frozen=True)
class _Setting:
    """What every share's estimate reads."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    layout: Topology
    styles: Mapping[str, ParallelStyle]
    update_every: int
    amp: str | None
    device: torch.device
    activations: Activations


def _estimate(setting: _Setting, share: MemoryShare, period: int) -> MemoryEstimate:
    """The figures of the ranks of one ``share`` of the model."""
    model, strategy, layout = setting.model, setting.strategy, setting.layout
    tp, world_size = layout.size("tp"), layout.world_size
    names = [name for name, _ in model.named_parameters()]
    trains = set(names) if share.trains is None else set(share.trains)
    sizes = _shards(model, layout.size("dp_shard"), setting.styles, tp, trains)
    own = {name: size for name, size in sizes.items() if name in trains}
    sharded = layout.shards_parameters
    param_dtype = _AMP[setting.amp] if sharded else None  # FSDP gathers cast parameters
    stored = sum(s.stored for s in own.values())
    unsharded = sum(s.compute for s in own.values())
    views = getattr(strategy, "gradient_as_bucket_view", False)  # DDP's option
    replicas = world_size // layout.size("pp")  # each stage's copies
    grads, held = _gradients(sharded, views, replicas, setting.update_every, stored, unsharded)
    activations = setting.activations
    if share.blocks is not None:
        every = strategy.blocks(model)
        index = [every.index(b) for b in share.blocks if b in every]
        activations = activations.part(index, share.first, share.last)
    kept = activations.backward_start(period, casts=not sharded)
    kept += round((share.kept - 1) * activations.kept(period, casts=not sharded))
    label = repr(strategy) if tp == 1 else f"{type(strategy).__name__}(tp={tp})"
    return MemoryEstimate(
        strategy=f"{label} {share.label}".rstrip(),
        world_size=world_size,
        batch_size=activations.batch_size,
        update_every=setting.update_every,
        parameters=sum(s.stored for s in sizes.values()),
        gradients=grads,
        optimizer=_optimizer_bytes(setting.optimizer, model, own),
        activations=kept,
        in_flight=_in_flight(model, strategy, layout, own, param_dtype) if sharded else 0,
        held=held,
        step_temp=_step_temp(setting.optimizer, own, setting.device),
    )


@dataclass(frozen=True)
class _Shard:
    """One parameter on one rank: bytes stored, bytes of its whole (tensor-parallel local)
    copy gathered for compute, and the fraction of its elements stored."""

    stored: int
    compute: int
    fraction: float


def _plan(model: nn.Module, strategy: Strategy, tp: int) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan over ``tp`` ranks (checked); ``{}`` without one."""
    if tp == 1:
        return {}
    from fastdist.strategies.tensor_parallel import check_plan, resolve_plan

    plan = resolve_plan(model, getattr(strategy, "tp_plan", None))
    if callable(plan):
        raise ValueError(
            "estimate_memory needs tp_plan as a dict: what a plan function splits is only "
            "known once it has run on a mesh"
        )
    check_plan(model, plan, tp)
    return plan


def _shards(
    model: nn.Module,
    shards: int,
    styles: Mapping[str, ParallelStyle],
    tp: int,
    trains: set[str],
) -> dict[str, _Shard]:
    """Each parameter's bytes on one rank: split by the plan (tensor parallel), then by
    FSDP along its first dimension (padded to a multiple of the shards, as ``fully_shard``
    does) over the ``shards`` ranks of ``dp_shard``; those the rank does not train, whole."""
    from fastdist.strategies.tensor_parallel import split_dim

    found = {}
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        style = styles.get(owner)
        shape = list(param.shape)
        dim = None if style is None else split_dim(model.get_submodule(owner), attr, style)
        if dim is not None and name in trains:  # a pipeline's other stages: whole
            shape[dim] //= tp
        local = math.prod(shape)
        if shape and shards > 1 and name in trains:
            local = math.ceil(shape[0] / shards) * math.prod(shape[1:])
        size = param.element_size()
        fraction = local / param.numel() if param.numel() else 1.0
        found[name] = _Shard(local * size, math.prod(shape) * size, fraction)
    return found


def _gradients(
    sharded: bool, views: bool, replicas: int, update_every: int, stored: int, unsharded: int
) -> tuple[int, int]:
    """``(gradients at the step, gradients held through a forward)``: sharded (FSDP) or in
    DDP's buckets (``views``: ``gradient_as_bucket_view``); ``replicas``: the ranks holding
    each parameter (or its shards)."""
    accumulating = update_every > 1
    if replicas == 1:
        return stored, stored if accumulating else 0
    if sharded:  # no-sync micro-batches keep unsharded gradients
        return stored, unsharded if accumulating else 0
    buckets = stored  # DDP's flat buckets; with gradient_as_bucket_view the grads are views
    grads = 0 if views else stored
    # In a window's later forwards the accumulated gradients live beside the buckets; at the
    # first forward of the second window (grads freed) DDP rebuilds its buckets, the old
    # ones still alive: two sets.
    return buckets + grads, max(2 * buckets, buckets + (grads if accumulating else 0))


def _optimizer_bytes(
    optimizer: torch.optim.Optimizer, model: nn.Module, sizes: Mapping[str, _Shard]
) -> int:
    """The rank's optimizer state: states shaped like their parameter are sharded like it."""
    names = {id(p): name for name, p in model.named_parameters()}
    total = 0
    for param, states in state_shapes(optimizer).items():
        if names[id(param)] not in sizes:  # another pipeline stage's
            continue
        fraction = sizes[names[id(param)]].fraction
        for shape, dtype in states:
            numel = math.prod(shape) * dtype.itemsize
            total += math.ceil(numel * fraction) if shape == param.shape else numel
    return total


def _in_flight(
    model: nn.Module,
    strategy: Strategy,
    layout: Topology,
    sizes: Mapping[str, _Shard],
    param_dtype: torch.dtype | None,
) -> int:
    """FSDP's buffers: gathered copies of the root's parameters (kept through the forward and
    backward) and of two blocks' (computing one, gathering the next), and one block's
    reduce-scatter of its gradients (over the ``dp_shard`` ranks)."""
    blocks = strategy.blocks(model)
    params = {n: p for n, p in model.named_parameters() if n in sizes}  # the rank's to train

    def whole(names: list[str]) -> int:  # in the compute dtype (amp: FSDP gathers bf16/fp16)
        size = [param_dtype.itemsize if param_dtype else params[n].element_size() for n in names]
        return sum(
            sizes[n].compute // params[n].element_size() * s
            for n, s in zip(names, size, strict=True)
        )

    inside = [[n for n in params if n.startswith(block + ".")] for block in blocks]
    inside = [group for group in inside if group]
    root = [n for n in params if not any(n in group for group in inside)]
    largest = max((whole(group) for group in inside), default=0)
    # A block's reduce-scatter in backward: its gradients copied whole into the collective's
    # input, and the output shard.
    grads = max((sum(sizes[n].compute for n in group) for group in inside), default=0)
    reduce = grads + grads // layout.size("dp_shard")
    return whole(root) + 2 * largest + reduce


def _step_temp(
    optimizer: torch.optim.Optimizer, sizes: Mapping[str, _Shard], device: torch.device
) -> int:
    """Temporaries of the step: torch's foreach implementations (the default on CUDA) make
    whole-group intermediates, the single-tensor ones (CPU) one parameter's."""
    stored = [s.stored for s in sizes.values()]
    foreach = device.type == "cuda" and optimizer.defaults.get("foreach") is not False
    return sum(stored) if foreach else max(stored, default=0)


def _activations(
    model: nn.Module,
    batch: Any,
    loss: Any,
    amp: str | None,
    styles: Mapping[str, ParallelStyle],
    tp: int,
    strategy: Strategy,
    device: torch.device,
) -> Any:
    """Measure one micro-batch's activations on ``device`` (train mode, autocast as asked)."""
    batch = to_device(batch, device)
    forward = make_forward(model)
    loss_fn = None if loss is None else as_loss_fn(loss)
    dtype = _AMP[amp]

    def run() -> Any:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            output = forward(model, batch)
            return output if loss_fn is None else (output, loss_fn(output, batch))

    with kept_modes(model), torch.enable_grad():
        model.train()
        return measure(model, run, strategy.blocks(model), styles, tp, _batch_size(batch))


def _batch_size(batch: Any) -> int:
    """The micro-batch's number of samples: the first dimension of its first tensor."""
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, torch.Tensor):
        return int(values.shape[0])
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError("batch holds no tensor with a batch dimension: pass one micro-batch")
