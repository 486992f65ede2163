"""FSDP: torch's ``fully_shard`` (FSDP2) per block, then on the root.

Each rank keeps only its shard of every parameter, gradient and optimizer state; a block's
parameters are all-gathered for its forward and backward, and gradients reduce-scattered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastdist.checkpoint import PER_RANK, SHARDED
from fastdist.checks import check_bool, check_int, describe
from fastdist.distributed import get_rank, get_world_size, is_distributed
from fastdist.distributed.dtensor import is_fsdp_module, local_shards
from fastdist.logging import logger
from fastdist.strategies.blocks import checkpoint_blocks, compile_blocks, find_blocks, plain_name
from fastdist.strategies.fault_tolerant import FaultTolerantStrategy
from fastdist.strategies.topology import Topology

if TYPE_CHECKING:  # torch's FSDP and DTensor packages (~0.6 s) are imported when used
    from fastdist.strategies.tensor_parallel import Plan

_PARAM_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def switch_parameters(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module
) -> None:
    """Point ``optimizer`` (its class, groups and hyperparameters kept; a learning-rate
    scheduler built on it stays valid) at the model's new parameters: ``fully_shard`` and
    ``parallelize_module`` replace every ``Parameter``, and the optimizer would step the stale
    ones. ``old_names``: the parameters' names before (checkpoint wrappers add none)."""
    new = {plain_name(name): p for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        group["params"] = [new[old_names[id(p)]] for p in group["params"]]


def check_wrap(wrap: Any) -> None:
    """``FSDP(wrap=...)``: ``None`` or a list of ``nn.Module`` subclasses."""
    if isinstance(wrap, type) and issubclass(wrap, nn.Module):
        name = wrap.__name__
        raise TypeError(f"wrap must be a list of nn.Module classes: pass a list, wrap=[{name}]")
    if wrap is None:
        return
    if not isinstance(wrap, (list, tuple)):
        raise TypeError(
            f"wrap must be a list of nn.Module classes (the model's blocks) or None, got "
            f"{describe(wrap)}"
        )
    for item in wrap:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            hint = f": pass the class, {type(item).__name__}" if isinstance(item, nn.Module) else ""
            raise TypeError(
                f"wrap must hold nn.Module classes (the model's blocks), got {describe(item)}{hint}"
            )


class FSDP(FaultTolerantStrategy):
    """Fully sharded data parallelism with torch's ``fully_shard`` (FSDP2), optionally
    replicated over groups (HSDP) and with tensor parallelism.

    ``strategy="fsdp"`` is ``FSDP()``. The optimizer is pointed at the sharded parameters
    (same class, groups and hyperparameters). Checkpoints are sharded (DCP: every rank writes
    its shards, and any world size or mesh resumes them), also on one process, where the model
    runs as it is.

    Args:
        wrap: module classes sharded one by one (the repeated blocks); ``None``: the children
            of the model's ``nn.ModuleList`` objects. The root is sharded last, holding the rest.
        reshard_after_forward: free each block's gathered parameters after its forward (and
            gather again in backward): less memory, more communication. The root keeps its
            parameters gathered from forward to backward, which needs them first (torch's
            default for the root).
        cpu_offload: keep the parameter shards, gradients and optimizer state in host memory
            (``CPUOffloadPolicy``); the optimizer steps on the CPU. CUDA only.
        replicate: replica groups (HSDP): the parameters are sharded within each group of
            ``world_size / (replicate * tp)`` ranks and replicated across the groups (the
            ``dp_replicate`` x ``dp_shard`` mesh of ``fully_shard``): less communication
            between groups (one all-reduce of the gradient shards), more memory per rank.
            ``replicate=1`` is plain FSDP.
        tp: ranks per tensor-parallel group. With ``tp > 1`` the ranks form a ``DeviceMesh``
            ``[dp_replicate x] dp_shard x tp`` (torch's ``init_device_mesh``; peers adjacent:
            rank ``r`` is in tensor-parallel group ``r // tp``): ``parallelize_module`` splits
            the planned layers over each group, then ``fully_shard`` shards over the rest.
            Peers run the same batches, so the global batch is ``batch_size_per_gpu x
            (world_size / tp) x update_every``. ``tp=1``: no tensor parallelism.
        tp_plan: ``{module name pattern: "colwise" | "rowwise" | "sequence" | ParallelStyle}``
            (see :mod:`fastdist.strategies.tensor_parallel`), or a function ``plan(model,
            tp_mesh)`` that parallelizes the model itself; ``None``: the model's own Hugging
            Face plan (``config.base_model_tp_plan``).
        fault_tolerant: run this job as one of several torchft replica groups, launched by
            ``python -m fastdist ft --procs-per-group N``: HSDP whose replicate dimension is
            torchft's (``fully_shard`` over the group's processes, each gradient shard then
            averaged with the same rank of every other group); a group that fails drops
            out of the updates while the others go on, and each of its ranks heals its
            shards from the same rank of a live group (docs: reliability). ``replicate`` and
            ``tp`` stay 1.
        min_replicas: with ``fault_tolerant``, the fewest groups that may commit an update.

    The trainer's ``amp`` sets the ``MixedPrecisionPolicy``: parameters cast to bf16/fp16 for
    compute, gradients reduced in fp32.

    Example:
        >>> strategy = FSDP(wrap=[TransformerBlock])  # DistTrainer(..., strategy=strategy)
        >>> plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
        >>> strategy = FSDP(tp=2, tp_plan=plan)  # torchrun --nproc-per-node=4: a 2x2 mesh
        >>> strategy.degrees(4)
        {'dp_shard': 2, 'tp': 2}
        >>> FSDP(replicate=2).degrees(4)  # HSDP: 2 groups, each sharding over 2 ranks
        {'dp_replicate': 2, 'dp_shard': 2}
    """

    equal_forwards = True
    waits_in_compute = True

    def __init__(
        self,
        wrap: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        tp: int = 1,
        tp_plan: Plan | None = None,
        replicate: int = 1,
        fault_tolerant: bool = False,
        min_replicas: int = 1,
    ) -> None:
        from fastdist.strategies.tensor_parallel import check_plan_option

        check_wrap(wrap)
        check_bool("reshard_after_forward", reshard_after_forward)
        check_bool("cpu_offload", cpu_offload)
        check_plan_option(tp, tp_plan)
        check_int("replicate", replicate, minimum=1)
        self.wrap = wrap
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.replicate = replicate
        self.tp = tp
        self.tp_plan = tp_plan
        check_bool("fault_tolerant", fault_tolerant)
        check_int("min_replicas", min_replicas, minimum=1)
        if fault_tolerant and (replicate > 1 or tp > 1):
            raise ValueError(
                "FSDP(fault_tolerant=True) shards over each replica group's processes and "
                "replicates across the groups through torchft: leave replicate and tp at 1 "
                "(launch more groups for more replicas)"
            )
        self._replica_options("FSDP", fault_tolerant, min_replicas)

    def check(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        amp: str | None,
    ) -> None:
        if optimizer.state and get_world_size() > 1:
            raise ValueError(
                "FSDP needs an optimizer that has not stepped yet (its state is keyed by the "
                "parameters fully_shard replaces): build it just before DistTrainer"
            )
        present = {type(m) for m in model.modules()}
        absent = [cls.__name__ for cls in self.wrap or () if cls not in present]
        if absent:
            raise ValueError(
                f"FSDP(wrap=...) names {absent}, which the model does not contain: pass the "
                "classes of its repeated blocks (e.g. its transformer layer class), or None to "
                "shard the children of its nn.ModuleLists"
            )
        if self.cpu_offload and device.type != "cuda":
            raise ValueError(
                "FSDP(cpu_offload=True) moves sharded state from the GPU to host memory; on a "
                "CPU device it already lives there: drop cpu_offload"
            )
        self.degrees(get_world_size())
        if self.tp > 1:
            from fastdist.strategies.tensor_parallel import check_plan, resolve_plan

            plan = resolve_plan(model, self.tp_plan)
            if not callable(plan):
                check_plan(model, plan, self.tp)

    def degrees(self, world_size: int) -> dict[str, int]:
        """``[dp_replicate x] dp_shard [x tp]``: ``replicate`` groups, each sharding over the
        ranks left by its tensor-parallel groups of ``tp``."""
        per = self.replicate * self.tp
        if world_size % per:
            options = (("replicate", self.replicate), ("tp", self.tp))
            given = [f"{name}={value}" for name, value in options if value > 1]
            raise ValueError(
                f"FSDP({', '.join(given)}) splits the ranks into groups of {per}, but the world "
                f"has {world_size} process(es), not a multiple of {' x '.join(given)}: launch "
                f"a multiple of {per} processes, or pick "
                f"{' and '.join(name for name, value in options if value > 1)} so that "
                f"{' x '.join(name for name, value in options if value > 1)} divides {world_size}"
            )
        degrees = {"dp_replicate": self.replicate} if self.replicate > 1 else {}
        degrees["dp_shard"] = world_size // per
        if self.tp > 1:
            degrees["tp"] = self.tp
        return degrees

    def blocks(self, model: nn.Module) -> list[str]:
        """The blocks sharded one by one: ``wrap``'s classes, or the ModuleLists' children."""
        return find_blocks(model, self.wrap)

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        group: Any,
        amp: str | None,
        *,
        compile: bool = False,
        checkpointing: int = 0,
        timeout: float | None = None,
        topology: Topology | None = None,
    ) -> torch.optim.Optimizer:
        """Tensor parallelism (``tp > 1``), activation checkpointing, each block compiled,
        then ``fully_shard`` per block and on the root: torchtitan's order. The meshes are
        the ``topology``'s."""
        self.attach(model, optimizer, device, group, topology)
        blocks = self.blocks(model)
        if not is_distributed():
            logger.info("strategy FSDP on one process: the plain model, nothing to shard")
            checkpoint_blocks(model, blocks, checkpointing)
            if compile:
                compile_blocks(model, blocks)
            return self._join_groups(optimizer, group, timeout)
        from torch.distributed.fsdp import (
            fully_shard,
            register_fsdp_forward_method,
        )

        from fastdist.strategies.sharded_io import refuse_sharded_save_pretrained

        old_names = {id(p): name for name, p in model.named_parameters()}
        mesh = self._apply_layout(model)
        checkpoint_blocks(model, blocks, checkpointing)
        if compile:
            compile_blocks(model, blocks)
        options = self.shard_options(mesh, amp)
        for name in blocks:
            fully_shard(model.get_submodule(name), **options)
        # Resharding the root after forward would gather its parameters again at once in
        # backward: one more all-gather per micro-batch, ~1 ms per update on a small CPU model.
        fully_shard(model, **{**options, "reshard_after_forward": False})
        if callable(getattr(model, "predict", None)):  # evaluation calls it: gather there too
            register_fsdp_forward_method(model, "predict")
        refuse_sharded_save_pretrained(model)  # an error at once, not a hang under rank == 0
        logger.info(
            "fsdp: sharded %d block(s) one by one%s, then the root %s",
            len(blocks),
            f" ({blocks[0]} ... {blocks[-1]})" if blocks else "",
            type(model).__name__,
        )
        switch_parameters(optimizer, old_names, model)
        return self._join_groups(optimizer, group, timeout)

    def _join_groups(
        self, optimizer: torch.optim.Optimizer, group: Any, timeout: float | None
    ) -> torch.optim.Optimizer:
        """With ``fault_tolerant``: join torchft's replica groups, average the gradient
        shards across them, step only on the updates torchft commits."""
        if not self.fault_tolerant:
            return optimizer
        from fastdist.strategies.ft_comm import reduce_across_groups, wrap_ddp

        manager, gated = self._join(self.model, optimizer, group, timeout)
        if is_fsdp_module(self.model):
            reduce_across_groups(manager, self.model)
        else:  # a group of one process: the plain model, averaged across groups as by DDP
            self.module = wrap_ddp(manager, self.model, group)
        return gated

    def shard_options(self, mesh: Any, amp: str | None) -> dict[str, Any]:
        """``fully_shard``'s keyword arguments under these options, over ``mesh``."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        return {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=_PARAM_DTYPES[amp], reduce_dtype=torch.float32 if amp else None
            ),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }

    def _apply_layout(self, model: nn.Module) -> Any:
        """Apply the plan on the topology's ``tp`` mesh (``tp > 1``); return the mesh FSDP
        shards over: ``dp_shard``, or ``dp_replicate`` x ``dp_shard`` (HSDP)."""
        topology = self.topology
        if self.tp > 1:
            from fastdist.strategies.output_check import guard_output
            from fastdist.strategies.tensor_parallel import apply_plan, resolve_plan

            plan = resolve_plan(model, self.tp_plan)
            guard_output(model, plan)
            apply_plan(model, plan, topology.mesh("tp"))
            logger.info(
                "tensor parallel: %s split over tp=%d ranks",
                "a plan function's modules" if callable(plan) else f"{len(plan)} module(s)",
                self.tp,
            )
        data = tuple(d for d in ("dp_replicate", "dp_shard") if d in topology.dims)
        if len(data) > 1:
            logger.info("HSDP: sharded over %s", topology)
        return topology.mesh(*data)

    def replicas(self, step: int) -> list[tuple[str, torch.Tensor]]:
        """The parameters (DTensors: each rank's piece is compared with the ranks holding the
        same, as HSDP's replica groups and tensor-parallel peers do); none under plain FSDP
        (each parameter has one copy, split over the ranks)."""
        if self.torchft is not None:  # compared with the same rank of every group
            shards = [(name, local_shards(p)) for name, p in self.model.named_parameters()]
            self.torchft.check_in_sync(shards, step)
            return []  # no copy within the group
        if is_fsdp_module(self.model) and self.topology.size("dp_replicate", "tp") == 1:
            return []
        return super().replicas(step)

    def after_evaluation(self) -> None:
        """Shard the root's parameters again: a forward without backward leaves them gathered
        (the root keeps them for backward), beside the sharded blocks'."""
        if is_fsdp_module(self.model):
            self.model.reshard()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate unreduced; the window's last micro-batch reduce-scatters them."""
        if not is_fsdp_module(self.model):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict[str, Any] | None:
        """The whole model's ``state_dict`` on the CPU of rank 0 (a collective)."""
        if not is_fsdp_module(self.model):  # one process: the plain model
            return super().full_state_dict()
        from fastdist.strategies.sharded_io import gather_full

        return gather_full(self.model, get_rank())

    def load_full_state_dict(self, weights: dict[str, Any] | None) -> None:
        """Load rank 0's full ``weights`` into every rank's shards (a collective)."""
        if not is_fsdp_module(self.model):
            super().load_full_state_dict(weights)
            return
        from fastdist.strategies.sharded_io import scatter_full

        scatter_full(self.model, weights)

    def checkpoint_parts(self) -> list[tuple[str, Any, str]]:
        """Model and optimizer as DCP shards (any world size resumes them)."""
        from fastdist.strategies.sharded_io import ShardedModel, ShardedOptimizer

        return [
            ("model", ShardedModel(self.model), SHARDED),
            ("optimizer", ShardedOptimizer(self.model, self.optimizer), SHARDED),
            ("strategy", self, PER_RANK),
        ]
