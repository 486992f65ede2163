"""Pipeline: the model cut into stages over ``pp`` ranks, each stage replicated with DDP over
``dp_replicate`` or sharded with FSDP over ``dp_shard`` (its layers split over ``tp`` too);
torch's ``PipelineStage`` and schedules run each update.

Each rank runs one stage (two under interleaved 1F1B); the loss is computed on the last.
The whole model stays on every rank, only its own stage trained there: evaluation,
prediction, the best model and ``save_model`` first gather every stage's parameters.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fastdist.checkpoint import GATHERED, PER_RANK, SHARDED
from fastdist.checks import check_choice, check_int
from fastdist.distributed import all_gather_object, broadcast_object, get_rank, get_world_size
from fastdist.distributed.dtensor import is_dtensor, is_fsdp_module
from fastdist.strategies.base import MemoryShare, Strategy, Update
from fastdist.strategies.ddp import DDP
from fastdist.strategies.fsdp import FSDP, switch_parameters
from fastdist.strategies.output_check import check_output_shapes
from fastdist.strategies.pipeline_checks import (
    LOOPED,
    check_amp,
    check_one_shape,
    check_setup_options,
    check_shardable,
    check_split,
    check_stage_strategy,
    check_window,
    pipeline_degrees,
    schedule_class,
    stage_plan,
    stage_shares,
    stage_tp_plans,
)
from fastdist.strategies.pipeline_state import (
    StageOptimizerShards,
    StageShards,
    WholeModel,
    WholeOptimizer,
    load_whole,
    whole,
)
from fastdist.strategies.stage_check import check_cut, check_gradients, unsharded_copy
from fastdist.strategies.stages import StageModule, UpdateModes, batch_shapes, stage_example, step
from fastdist.strategies.topology import Topology


class Pipeline(Strategy):
    """Pipeline parallelism: ``stages`` ranks each run one stage of the model, the micro-batches
    of every update flowing through them as torch's schedule orders; the ``world_size /
    stages`` pipelines are data parallel (DDP over ``dp_replicate``, or FSDP over
    ``dp_shard``).

    Args:
        stages: ranks per pipeline; it must divide the world size.
        schedule: ``"1f1b"`` (one forward, one backward: activations of at most ``stages``
            micro-batches kept; needs ``update_every >= stages``), ``"gpipe"`` (all
            forwards, then all backwards) or ``"interleaved-1f1b"`` (the model cut into
            ``2 x stages`` stages, rank ``r`` running stages ``r`` and ``r + stages``: a
            smaller bubble, more sends; needs ``update_every >= stages``).
        split: the first block of every stage after the first (``["layers.4"]``), blocks of
            one ``nn.ModuleList``/``nn.ModuleDict``; ``None``: that list's blocks split evenly.
        stage_strategy: how each stage is replicated: ``DDP()`` (the default, ``None``) over
            ``dp_replicate``, or ``FSDP()`` over ``dp_shard``: each of the stage's blocks and
            the modules around them sharded on its own, in the model itself; ``FSDP(tp=N,
            tp_plan={...})`` first splits the stage's planned layers over ``N`` ranks (a
            ``pp x dp_shard x tp`` mesh; the plan names modules, each within one stage).

    An update's ``update_every`` micro-batches are the schedule's, weighted as the trainer
    weighs them (not divided by their number); they must have one shape (a short last batch
    in an update of full ones is refused); each new shape or number of micro-batches gets
    its stages set up anew. Checkpoints hold the whole model and optimizer state, as a plain
    or DDP run's do, resumable by DDP, one process or a pipeline; FSDP stages write DCP
    shards as ``FSDP()`` does. Every rank starts from rank 0's weights; the first update
    checks that the stages compute the model's output and gradients
    (:mod:`~fastdist.strategies.stage_check`) and, split over ``tp``, hand on whole outputs.

    Example:
        >>> strategy = Pipeline(stages=2, schedule="1f1b", split=None, stage_strategy=DDP())
        >>> strategy.degrees(4)  # torchrun --nproc-per-node=4: 2 pipelines of 2 stages
        {'pp': 2, 'dp_replicate': 2}
        >>> Pipeline(stages=2, stage_strategy=FSDP()).degrees(4)  # each stage over 2 ranks
        {'pp': 2, 'dp_shard': 2}
        >>> plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
        >>> Pipeline(stages=2, stage_strategy=FSDP(tp=2, tp_plan=plan)).degrees(8)
        {'pp': 2, 'dp_shard': 2, 'tp': 2}
    """

    #: A stage waits for the others within its compute, and takes micro-batches of one shape.
    waits_in_compute = one_shape = True

    def __init__(
        self,
        stages: int = 2,
        schedule: str = "1f1b",
        split: list[str] | None = None,
        stage_strategy: Strategy | None = None,
    ) -> None:
        check_int("stages", stages, 2, "a rank per stage; a model not cut: DDP() or FSDP()")
        check_choice("schedule", schedule, ("gpipe", "1f1b", "interleaved-1f1b"))
        self.per_rank = LOOPED if schedule == "interleaved-1f1b" else 1
        self.cuts = stages * self.per_rank  # the model's stages
        check_split(split, stages, self.per_rank)
        check_stage_strategy(stage_strategy)
        self.stages, self.schedule, self.stage_strategy = stages, schedule, stage_strategy
        self.split = None if split is None else list(split)
        self.tp_plan = getattr(stage_strategy, "tp_plan", None)  # what the estimate splits

    def degrees(self, world_size: int) -> dict[str, int]:
        """``pp x dp_replicate`` (``pp x dp_shard [x tp]`` with FSDP stages): ``stages`` ranks
        (groups of ``tp``) per pipeline, the rest its replicas or shards."""
        return pipeline_degrees(world_size, self.stages, self.schedule, self.stage_strategy)

    def check(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        amp: str | None,
    ) -> None:
        plan = stage_plan(model, self, get_world_size())
        if isinstance(self.stage_strategy, FSDP):
            check_shardable(model, plan)
        check_amp(amp)
        self.degrees(get_world_size())
        if isinstance(self.stage_strategy, FSDP):
            self.stage_strategy.check(model, optimizer, device, None)  # a fresh optimizer
            if self.stage_strategy.tp > 1:
                stage_tp_plans(model, self.stage_strategy.tp_plan, plan)

    def check_run(
        self, model: nn.Module, batch: Any, forward: Any, amp: str | None, checkpointing: int
    ) -> None:
        """amp, activation checkpointing, and the first update's checks of the cut."""
        check_amp(amp, checkpointing)
        plan = stage_plan(model, self, None)
        check_cut(model, plan, batch, forward)
        check_gradients(model, plan, batch, forward)

    def check_window(self, update_every: int) -> None:
        check_window(self.stages, self.schedule, self.stage_strategy, update_every)

    def memory_shares(self, model: nn.Module, update_every: int) -> list[MemoryShare]:
        """Each stage's share (:func:`~fastdist.strategies.pipeline_checks.stage_shares`)."""
        plan = stage_plan(model, self, None)
        return stage_shares(model, plan, self.schedule, update_every, self.stages)

    def check_batches(self, sizes: list[list[int]], update_every: int) -> None:
        """Refuse a short last batch in an update of full ones (one schedule, one shape)."""
        check_one_shape(sizes, update_every)

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
        """Cut this rank's stage, point the optimizer at its parameters, replicate (DDP) or
        shard (FSDP: each module of the stage on its own, in the model) it."""
        check_setup_options(compile, checkpointing)
        self.attach(model, optimizer, device, group, topology)
        with torch.no_grad():  # as DDP does: every stage starts from rank 0's weights
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                dist.broadcast(tensor, src=0, group=group)
        self.plan = stage_plan(model, self, None)
        self.index = self.topology.coordinate("pp")
        self.local = [self.index + k * self.stages for k in range(self.per_rank)]
        self.sharded = self.equal_forwards = isinstance(self.stage_strategy, FSDP)
        self.amp, self._evaluating = amp, contextlib.ExitStack()
        self._tp_plan: dict[str, Any] = {}  # this rank's stages' part of the tp_plan
        self._unchecked: nn.Module | None = model  # the first update checks against it
        if isinstance(self.stage_strategy, FSDP):
            self._unchecked = unsharded_copy(model)
            self._shard(self.stage_strategy, amp)
        self.stage_modules = [StageModule(model, self.plan, index) for index in self.local]
        self._schedules: dict[Any, Any] = {}  # by micro-batches and shapes
        names = {id(p): name for name, p in model.named_parameters()}
        # The user's groups by name (what a checkpoint holds), then this stage's part of them.
        self.groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        for group_ in optimizer.param_groups:
            group_["params"] = [p for p in group_["params"] if self.owns(names[id(p)])]
        self.modules: list[nn.Module] = list(self.stage_modules)
        if self.topology.size("dp_replicate") > 1:
            self.fixed_trainable = True  # each stage's replicas under DDP
            pairs = zip(self.stage_modules, self.local, strict=True)
            self.modules = [self._replicate(module, index) for module, index in pairs]
        self.module = self.modules[0]
        return optimizer

    def _shard(self, options: FSDP, amp: str | None) -> None:
        """Split this stage's planned layers over ``tp`` (``tp > 1``), then ``fully_shard``
        each module of the stage on its own over ``dp_shard`` (no root wrapper: the model
        stays as it is, whole for evaluation); the optimizer pointed at the new parameters."""
        from torch.distributed.fsdp import fully_shard

        old_names = {id(p): name for name, p in self.model.named_parameters()}
        if options.tp > 1:
            from fastdist.strategies.tensor_parallel import apply_plan

            plans = stage_tp_plans(self.model, options.tp_plan, self.plan)
            own = self._tp_plan = {n: s for i in self.local for n, s in plans[i].items()}
            if own:
                apply_plan(self.model, own, self.topology.mesh("tp"))
        keywords = options.shard_options(self.topology.mesh("dp_shard"), amp)
        for unit in (unit for index in self.local for unit in self.plan.units(index)):
            module = self.model.get_submodule(unit)
            if any(True for _ in module.parameters()):
                fully_shard(module, **keywords)
        switch_parameters(self.optimizer, old_names, self.model)

    def _reshard(self) -> None:
        """Shard this stage's modules again: a forward without backward leaves a root's
        parameters gathered."""
        for module in self.model.modules() if self.sharded else ():
            if is_fsdp_module(module):
                module.reshard()

    def _replicate(self, stage: StageModule, index: int) -> DistributedDataParallel:
        """DDP over stage ``index``'s replicas, blind to the other stages' parameters."""
        options = self.stage_strategy if isinstance(self.stage_strategy, DDP) else DDP()
        others = [
            name
            for name, _ in itertools.chain(stage.named_parameters(), stage.named_buffers())
            if self.plan.owner(name.removeprefix("model.")) != index
        ]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(stage, others)
        extra: dict[str, Any] = {}
        if options.bucket_cap_mb:
            extra["bucket_cap_mb"] = options.bucket_cap_mb
        return DistributedDataParallel(
            stage,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=self.topology.mesh("dp_replicate").get_group(),
            find_unused_parameters=options.find_unused_parameters,
            static_graph=options.static_graph,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            **extra,
        )

    def owns(self, name: str) -> bool:
        """Whether this rank's stages hold the parameter or buffer ``name``."""
        return self.plan.owner(name) % self.stages == self.index

    def forward_backward(self, update: Update) -> None:
        """The update's micro-batches through the schedule's ``step`` (all drawn first), each
        in its modes (:class:`~fastdist.strategies.stages.UpdateModes`)."""
        batches = (modes := UpdateModes(self.model)).draw(update)
        schedule = self._schedule(batches, update)
        for stage in self.stage_modules:  # losses in order
            stage.begin(batches, functools.partial(_run, update, stage), modes)
        last = self.stage_modules[-1]  # the model's last stage, on the pipeline's last rank
        self._loss = lambda output, i: update.loss(last.output(i, output), batches[i])
        step(schedule, len(batches))
        modes.restore()
        for _ in batches:
            update.end()

    def _schedule(self, batches: list[Any], update: Update) -> Any:
        """The schedule of updates of ``len(batches)`` micro-batches of these shapes (made at
        the first such update: a stage of static shapes, found by running the stages)."""
        shapes = [batch_shapes(batch) for batch in batches]
        if (other := next((s for s in shapes if s != shapes[0]), None)) is not None:
            raise ValueError(
                f"the micro-batches of one update differ in shape ({shapes[0]} and {other}), "
                "which a pipeline stage cannot take: give them as many samples, padded to one "
                "length (in collate_fn); drop a short last batch (drop_last=True)"
            )
        key = (len(batches), shapes[0])
        if key not in self._schedules:
            from torch.distributed import pipelining

            hidden = self._check(batches[0], update)
            self._reshard()
            stages = [
                pipelining.PipelineStage(
                    module,
                    index,
                    self.cuts,
                    self.device,
                    input_args=() if index == 0 else stage_example(hidden[index - 1]),
                    output_args=stage_example(hidden[index]),
                    group=self.topology.mesh("pp").get_group(),
                )
                for module, index in zip(self.modules, self.local, strict=True)
            ]
            kind = getattr(
                pipelining, schedule_class(self.schedule, len(batches), self.stages, self.per_rank)
            )
            self._schedules[key] = kind(
                stages if self.per_rank > 1 else stages[0],
                len(batches),
                loss_fn=lambda out, i: self._loss(out, int(i)),
                scale_grads=False,
            )
        return self._schedules[key]

    def _check(self, batch: Any, update: Update) -> list[torch.Tensor]:
        """The activations between the stages (for their shapes); at the first update, the
        checks of the class's docs, refused alike on every rank (one gather of the verdicts)."""
        if self._unchecked is None:
            return check_cut(self.model, self.plan, batch, update.probe)
        model, self._unchecked = self._unchecked, None
        hidden: list[torch.Tensor] = []
        try:
            hidden = check_cut(model, self.plan, batch, update.probe)
            check_gradients(model, self.plan, batch, update.probe)
            for i in self.local if self._tp_plan else ():  # a stage handing on a shard?
                split = check_cut(self.model, self.plan, batch, update.probe)[i]  # as run
                check_output_shapes(hidden[i], split, self._tp_plan, f"pipeline stage {i}")
            verdict = None
        except Exception as exc:  # agreed first: no rank raises alone and leaves the rest waiting
            verdict = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        refused = [v for v in all_gather_object(verdict, self.group) if v is not None]
        if refused:
            raise ValueError(refused[0])
        return hidden

    def replicas(self, step: int) -> list[tuple[str, torch.Tensor]]:
        """This stage's parameters, which its replicas hold copies of (none when sharded)."""
        if self.sharded:
            return []
        return [(n, p) for n, p in self.model.named_parameters() if self.owns(n)]

    def gather(self) -> None:
        """Every stage's parameters and buffers onto every rank of its pipeline."""
        ranks = self.topology.ranks_along(self.topology.rank, "pp")
        group = self.topology.mesh("pp").get_group()
        tensors = itertools.chain(self.model.named_parameters(), self.model.named_buffers())
        with torch.no_grad():
            for name, tensor in tensors:  # this stage's sharded ones gathered first
                value = tensor.full_tensor() if is_dtensor(tensor) else tensor
                src = ranks[self.plan.owner(name) % self.stages]
                dist.broadcast(value, src=src, group=group)

    def end_training(self) -> None:
        """The whole model on every rank when ``train()`` returns, as under DDP."""
        self.gather()

    def before_evaluation(self) -> None:
        """The whole model on every rank (every stage's parameters), rank 0's buffers; with
        bf16 FSDP stages, under autocast (this rank's stage computes in bf16, the others not)."""
        self.gather()
        super().before_evaluation()
        if self.sharded and self.amp is not None:
            self._evaluating.enter_context(torch.autocast(self.device.type, torch.bfloat16))

    def after_evaluation(self) -> None:
        self._evaluating.close()
        self._reshard()

    def full_state_dict(self) -> dict[str, Any] | None:
        self.gather()
        if not self.sharded:
            return super().full_state_dict()
        state = whole(self.model.state_dict())  # every rank: a stage's shards are gathered
        return state if get_rank() == 0 else None

    def load_full_state_dict(self, weights: dict[str, Any] | None) -> None:
        if not self.sharded:
            super().load_full_state_dict(weights)
            return
        load_whole(self.model, broadcast_object(weights, group=self.group))

    def checkpoint_parts(self) -> list[tuple[str, Any, str]]:
        """The whole model and optimizer state, gathered from the stages: the checkpoint of a
        plain or DDP run, which any layout resumes (each stage keeps its own part). FSDP
        stages write DCP shards as a plain FSDP run does, which DCP reshards on load."""
        if self.sharded:
            return [
                ("model", StageShards(self), SHARDED),
                ("optimizer", StageOptimizerShards(self), SHARDED),
                ("strategy", self, PER_RANK),
            ]
        return [
            ("model", WholeModel(self), GATHERED),
            ("optimizer", WholeOptimizer(self), GATHERED),
            ("strategy", self, PER_RANK),
        ]


def _run(update: Update, stage: StageModule, module: nn.Module, batch: Any) -> Any:
    """``stage``'s forward of its latest micro-batch, as the loop runs it."""
    return update.forward(module, batch, stage.count - 1)
