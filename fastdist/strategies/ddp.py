"""DDP: torch's DistributedDataParallel, its communication hooks, post-local SGD."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fastdist.checkpoint import PER_RANK
from fastdist.checks import check_bool, check_choice, check_int, check_number
from fastdist.distributed import get_world_size, is_distributed
from fastdist.logging import logger
from fastdist.strategies.base import NO_CONTEXT
from fastdist.strategies.fault_tolerant import FaultTolerantStrategy
from fastdist.strategies.ft_comm import wrap_ddp
from fastdist.strategies.topology import Topology

if TYPE_CHECKING:  # the hooks are imported when set
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

    from fastdist.strategies.powersgd import PowerSGD

COMM_HOOKS = (None, "fp16", "bf16", "powersgd")


class DDP(FaultTolerantStrategy):
    """Data parallelism: every rank holds the whole model; each update all-reduces gradients.

    On one process the model runs as it is. ``strategy="ddp"`` (the default) is ``DDP()``.

    Args:
        find_unused_parameters, static_graph, gradient_as_bucket_view: passed to torch's
            ``DistributedDataParallel``.
        bucket_cap_mb: DDP's gradient bucket size in MiB; default torch's (25).
        comm_hook: ``None`` (plain all-reduce), ``"fp16"``/``"bf16"`` (gradients compressed
            to half precision for the all-reduce; bf16 needs CUDA and nccl) or ``"powersgd"``
            (rank-1 low-rank compression with error feedback, after 10 plain updates).
        average_every: post-local SGD: after that many warm-up updates with the plain
            all-reduce, each rank steps on its own gradients and the parameters are averaged
            (torch's ``average_parameters``) after every update whose number is a multiple of
            ``average_every``; 0: off.
        fault_tolerant: run this job as one of several torchft replica groups, launched by
            ``python -m fastdist ft``: a group that fails drops out of the updates while the
            others go on, and heals from a live peer when it comes back
            (:mod:`~fastdist.strategies.replica_groups`; docs: reliability). A group of
            several processes runs DDP within itself; its gradients, averaged over its
            ranks, are then averaged across the groups.
        min_replicas: with ``fault_tolerant``, the fewest groups that may commit an update.
            Each group writes its files under ``<save_path>/replica_group<i>``.

    Each rank's PowerSGD error feedback, and under local SGD each rank's own parameters and
    optimizer state, are checkpointed per rank: a resumed run continues exactly. On another
    world size they restart (from rank 0's parameters), with a warning.

    Example:
        >>> strategy = DDP(bucket_cap_mb=50, comm_hook="powersgd")  # DistTrainer(strategy=...)
    """

    def __init__(
        self,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        comm_hook: str | None = None,
        average_every: int = 0,
        fault_tolerant: bool = False,
        min_replicas: int = 1,
    ) -> None:
        check_bool("find_unused_parameters", find_unused_parameters)
        check_bool("static_graph", static_graph)
        check_bool("gradient_as_bucket_view", gradient_as_bucket_view)
        if bucket_cap_mb is not None:
            check_number("bucket_cap_mb", bucket_cap_mb, 0, inclusive=False)
        check_choice("comm_hook", comm_hook, COMM_HOOKS)
        check_int("average_every", average_every, minimum=0)
        if comm_hook and average_every:
            raise ValueError("comm_hook and average_every both set DDP's hook: choose one")
        check_bool("fault_tolerant", fault_tolerant)
        check_int("min_replicas", min_replicas, minimum=1)
        if fault_tolerant and (comm_hook or average_every):
            raise ValueError(
                "DDP(fault_tolerant=True) sets DDP's hook (torchft's all-reduce): leave "
                "comm_hook and average_every unset"
            )
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        self.comm_hook = comm_hook
        self.average_every = average_every
        self._replica_options("DDP", fault_tolerant, min_replicas)
        self.local_steps = average_every > 0
        self.waits_in_compute = average_every > 0  # in the step's averaging
        self.powersgd: PowerSGD | None = None
        self.local_sgd: post_localSGD_hook.PostLocalSGDState | None = None

    def check(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        amp: str | None,
    ) -> None:
        if self.comm_hook == "bf16" and device.type != "cuda":
            raise ValueError("comm_hook='bf16' needs CUDA and NCCL; use comm_hook='fp16' with gloo")

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
        super().setup(
            model,
            optimizer,
            device,
            group,
            amp,
            compile=compile,
            checkpointing=checkpointing,
            topology=topology,
        )
        self.fixed_trainable = self.fault_tolerant or is_distributed()  # wrapped in DDP
        if self.fault_tolerant:
            manager, gated = self._join(model, optimizer, group, timeout)
            self.module = wrap_ddp(manager, model, group)
            return gated
        if not is_distributed():
            return optimizer  # one process: nothing to all-reduce
        options: dict[str, Any] = (
            {"bucket_cap_mb": self.bucket_cap_mb} if self.bucket_cap_mb else {}
        )
        self.module = ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            **options,
        )
        if self.comm_hook in ("fp16", "bf16"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook
            if self.comm_hook == "bf16":
                hook = default_hooks.bf16_compress_hook
            ddp.register_comm_hook(group, hook)
        elif self.comm_hook == "powersgd":
            from fastdist.strategies.powersgd import PowerSGD

            self.powersgd = PowerSGD(model, group)
            ddp.register_comm_hook(self.powersgd.state, self.powersgd.hook)
        elif self.average_every:
            # Each rank its own subgroup: after the warm-up no gradient is all-reduced at all.
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

            subgroup, _ = dist.new_subgroups(group_size=1)
            self.own_groups.append(subgroup)
            self.local_sgd = post_localSGD_hook.PostLocalSGDState(
                process_group=group, subgroup=subgroup, start_localSGD_iter=self.average_every
            )
            ddp.register_comm_hook(self.local_sgd, post_localSGD_hook.post_localSGD_hook)
        return optimizer

    def no_sync(self) -> contextlib.AbstractContextManager:
        # Wrapped by DDP or torchft, tested by identity: 0.01 us, where isinstance of DDP (an
        # ABC) takes 0.14 us per micro-batch.
        if self.module is not self.model:
            return cast(DistributedDataParallel, self.module).no_sync()
        return NO_CONTEXT

    def after_step(self, step: int) -> None:
        """After update ``step``: average the parameters if the local-SGD period ends here."""
        every = self.average_every
        if self.local_sgd is not None and step > every and step % every == 0:
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            group = self.group or dist.group.WORLD  # WORLD exists: DDP runs in a group
            average_parameters(self.model.parameters(), group)  # type: ignore[arg-type]

    def before_evaluation(self) -> None:
        """Under local SGD the ranks' parameters differ between averagings: they are averaged
        (as at the end of a period) so that one model is evaluated, and kept as the best."""
        if self.local_sgd is not None:
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            average_parameters(self.model.parameters(), self.group or dist.group.WORLD)  # type: ignore[arg-type]
        super().before_evaluation()

    def replicas(self, step: int) -> list[tuple[str, torch.Tensor]]:
        """The parameters, where they must agree: always, or under local SGD only during the
        warm-up and right after an averaging. Fault tolerant, they are compared across the
        replica groups here (this group's ranks compare them as ever)."""
        every = self.average_every
        if self.local_sgd is not None and step > every and step % every:
            return []
        params = super().replicas(step)
        if self.torchft is not None:
            self.torchft.check_in_sync(params, step)
        return params

    def checkpoint_parts(self) -> list[tuple[str, Any, str]]:
        parts = super().checkpoint_parts()
        if not self.average_every:
            return parts
        # Between averagings every rank has its own parameters and momentum.
        return [
            ("model", PerRank(self.model), PER_RANK),
            ("optimizer", PerRank(self.optimizer), PER_RANK),
            parts[2],
        ]

    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state: torchft's counters, PowerSGD's per-parameter state, local
        SGD's iteration."""
        if self.torchft is not None:
            return super().state_dict()
        if self.powersgd is not None:
            return {"powersgd": self.powersgd.state_dict()}
        if self.local_sgd is not None:
            return {"local_sgd_iter": self.local_sgd.iter}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.powersgd is not None and "powersgd" in state:
            self.powersgd.load_state_dict(state["powersgd"])
        if self.local_sgd is not None and "local_sgd_iter" in state:
            self.local_sgd.iter = state["local_sgd_iter"]

    def load_resized(self, states: list[dict[str, Any]]) -> None:
        """Another world size: local SGD keeps its iteration (whether the warm-up is over);
        what is each rank's own restarts, with a warning."""
        saved = states[0]
        if self.local_sgd is not None and "local_sgd_iter" in saved:
            self.local_sgd.iter = saved["local_sgd_iter"]
        own = {
            "powersgd": "PowerSGD's error feedback restarts",
            "local_sgd_iter": "local SGD's per-rank parameters and momentum restart from rank 0's",
        }
        lost = [what for key, what in own.items() if key in saved]
        if lost:
            logger.warning(
                "the checkpoint was written by %d processes, not %d: %s",
                len(states),
                get_world_size(),
                "; ".join(lost),
            )


class PerRank:
    """A model or optimizer whose state differs between ranks, as a per-rank part."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return to_cpu(self.obj.state_dict())

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)

    def load_resized(self, states: list[Any]) -> None:
        """Another world size: every rank starts from rank 0's state (the strategy warns)."""
        self.obj.load_state_dict(states[0])


def to_cpu(state: Any) -> Any:
    """``state`` with every tensor copied to the CPU (it is gathered to rank 0)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state
