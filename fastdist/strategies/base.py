"""The interface every strategy implements; the base class is the plain model, nothing shared.

The training loop, evaluation and the checkpointer call only these methods and never ask
which strategy runs. A strategy object holds its own options (checked when it is built),
checks its fit to the model and the device before any collective (:meth:`check`), wraps the
model (:meth:`setup`), computes each optimizer update's forward and backward passes
(:meth:`forward_backward`) and owns its checkpoint format (:meth:`checkpoint_parts`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fastdist.checkpoint import PER_RANK, REPLICATED
from fastdist.checkpoint.checkpointer import Peer
from fastdist.distributed import broadcast_tensors, get_rank
from fastdist.state import TrainerState
from fastdist.strategies.blocks import checkpoint_blocks, find_blocks
from fastdist.strategies.topology import Topology

#: A context that does nothing, made once (entered per micro-batch).
NO_CONTEXT = contextlib.nullcontext()


class Update(Protocol):
    """One optimizer update's micro-batches, as the training loop hands them to
    :meth:`Strategy.forward_backward`, with the loop's part of their compute: the callbacks'
    per-micro-batch hooks, the loss bookkeeping, mixed precision and the timing.

    :meth:`loss` and :meth:`end` are called once per micro-batch each, in the micro-batches'
    order; each call is about the next micro-batch it has not yet been called for.
    """

    #: Whether the micro-batch drawn last is the update's last (its backward reduces the
    #: gradients; the ones before it accumulate them, see :meth:`Strategy.no_sync`).
    last: bool

    def __iter__(self) -> Iterator[Any]:
        """The update's micro-batches on the device, each read when it is asked for (the
        data wait is timed) and announced to ``on_batch_begin`` just before it is yielded,
        the model in the mode it trains in; ``list(update)`` gives them all at once."""
        ...

    def forward(self, module: nn.Module, batch: Any, index: int | None = None) -> Any:
        """``module``'s output on the micro-batch drawn last, or on the update's ``index``-th
        (a schedule runs them once all are drawn): mixed precision, the micro-batch's mode
        (eval for a filler)."""
        ...

    def mode(self, module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """The mode the micro-batch drawn last runs in, set on ``module`` (the model by
        default) inside, as :meth:`forward` sets it (a filler's eval mode ends on exit)."""
        ...

    def probe(self, module: nn.Module, batch: Any) -> Any:
        """``module``'s output on ``batch`` with mixed precision, its modules left in their
        modes: a strategy's check, which trains nothing and changes no mode."""
        ...

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The next micro-batch's loss from its ``output``: ``on_loss_begin``, the loss
        function (mixed precision), recorded for the logged loss, ``on_backward_begin``;
        returned weighted within the update and scaled by amp's gradient scaler: the tensor
        to call ``backward()`` on."""
        ...

    def end(self) -> None:
        """After the next micro-batch's backward: on the update's last, the gradients of a
        ``(sum, count)`` loss divided by the update's count; the timing; ``on_backward_end``;
        ``on_batch_end`` unless it is the update's last (that one ends after the step)."""
        ...


@dataclass(frozen=True)
class MemoryShare:
    """What a kind of rank trains and keeps, as the memory estimate
    (:func:`fastdist.estimate_memory`) asks each strategy.

    Attributes:
        label: which ranks (``""``: every rank; ``"stage 0"``).
        trains: the parameters whose gradients and optimizer state they hold (``None``:
            all); the others they hold whole and unsharded.
        blocks: the blocks whose forward they run (``None``: all), with what runs before
            the blocks (``first``) and after them (``last``).
        kept: how many micro-batches' activations they hold at once (a fraction: some of
            their blocks' only).
    """

    label: str = ""
    trains: frozenset[str] | None = None
    blocks: tuple[str, ...] | None = None
    first: bool = True
    last: bool = True
    kept: float = 1


class Strategy:
    """Runs the model as it is: one process, or ranks that share nothing but the gradients'
    all-reduce done by a subclass. Every method of the base class is a no-op where it can be.

    Attributes (set by :meth:`setup`):
        model: the user's module, on its device.
        module: what the training forward runs through (a wrapper, or ``model``).
        optimizer: the optimizer stepping ``model``'s parameters.
        own_groups: process groups the strategy created (torn down with the trainer).
        topology: the layout it runs on (:class:`~fastdist.strategies.topology.Topology`).
    """

    #: Every rank must run equally many forwards (each forward is a collective).
    equal_forwards = False
    #: The forward, backward or step wait for the other ranks (FSDP's all-gathers, local
    #: SGD's averaging): a rank's compute time then includes waiting for a slower one.
    waits_in_compute = False
    #: Ranks step on their own gradients between synchronisations (local SGD): every rank
    #: does not see the same gradients, so they cannot all skip the same non-finite update.
    local_steps = False
    #: Every micro-batch of an update must have one shape (a pipeline's schedule): batches
    #: of varying sample counts (token-budget batches) are refused.
    one_shape = False
    #: ``(index, count)`` of this process's replica group among the job's: each group trains
    #: its own shard of the data (``DDP(fault_tolerant=True)``); ``(0, 1)``: one group.
    replica_group: tuple[int, int] = (0, 1)
    #: What heals this group's checkpoint parts from a live peer group (``None``: nothing).
    peer: Peer | None = None
    #: The parameters that train (``requires_grad``) must stay as they were at setup: torch's
    #: DDP all-reduces the gradients of those it wrapped only (set where it wraps).
    fixed_trainable = False

    def degrees(self, world_size: int) -> dict[str, int]:
        """How many of ``world_size`` ranks this strategy lays along each dimension it runs on
        (:mod:`~fastdist.strategies.topology`): here every rank a replica of the model. Raise,
        naming the option, if the world does not fit (alike on every rank)."""
        return {"dp_replicate": world_size}

    def check(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        amp: str | None,
    ) -> None:
        """Raise if this strategy cannot run ``model`` on ``device`` (alike on every rank,
        before any collective)."""

    def bind(self, state: TrainerState, update_samples: Callable[[], list[int]]) -> None:
        """Once the trainer is assembled: its ``state`` (a strategy may count into it, e.g. the
        samples lost to failed replica groups) and ``update_samples()``: each replica group's
        samples in the current update."""

    def average_over_groups(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over the replica groups that train this update (torchft's
        quorum; the trainer's (sum, count) token totals and logged loss); here one group:
        ``tensor`` itself."""
        return tensor

    def check_window(self, update_every: int) -> None:
        """Raise if this strategy cannot run updates of ``update_every`` micro-batches (alike
        on every rank, before any collective)."""

    def check_run(
        self, model: nn.Module, batch: Any, forward: Any, amp: str | None, checkpointing: int
    ) -> None:
        """Raise what the trainer would refuse, beyond :meth:`check`, of training ``model``
        on micro-batches like ``batch`` (fed by ``forward(model, batch)``) with ``amp`` and
        activation checkpointing every ``checkpointing`` blocks: the memory estimate asks it
        (the trainer raises the same errors from the same checks)."""

    def check_batches(self, sizes: list[list[int]], update_every: int) -> None:
        """Raise if this strategy cannot run an epoch whose data shards' batch sizes
        (samples) are ``sizes``, in updates of ``update_every`` (alike on every rank, before
        any collective)."""

    def memory_shares(self, model: nn.Module, update_every: int) -> list[MemoryShare]:
        """What each kind of rank trains and keeps (the memory estimate's question): here
        every rank the whole model, one micro-batch's activations at a time."""
        return [MemoryShare()]

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
        """Wrap ``model`` (already on ``device``) for training over ``group``; return the
        optimizer to use (a strategy that replaces the parameters repoints it).

        Before wrapping, every ``checkpointing``-th block (:meth:`blocks`) gets activation
        checkpointing (0: none) and, with ``compile``, the model is compiled in place (the
        base class and DDP compile it whole). ``timeout``: seconds the process groups a
        strategy creates may wait (``None``: torch's default). ``topology``: the trainer's
        layout, built from :meth:`degrees` (``None``: this strategy's over the job)."""
        self.attach(model, optimizer, device, group, topology)
        checkpoint_blocks(model, self.blocks(model), checkpointing)
        if compile:
            model.compile()
        return optimizer

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        group: Any,
        topology: Topology | None = None,
    ) -> None:
        """Hold the parts :meth:`setup` wraps (the first thing every ``setup`` does)."""
        self.topology = topology or Topology.of(self, device.type)
        self.model = self.module = model
        self.optimizer, self.device, self.group = optimizer, device, group
        self.own_groups: list[Any] = []  # process groups this strategy created

    def blocks(self, model: nn.Module) -> list[str]:
        """Names of the model's repeated blocks (what activation checkpointing wraps): the
        children of its ``nn.ModuleList`` objects."""
        return find_blocks(model, None)

    @property
    def eval_module(self) -> nn.Module:
        """What evaluation and prediction run through (no gradient synchronisation)."""
        return self.model

    def forward_backward(self, update: Update) -> None:
        """Run the forward and backward passes of one optimizer update's micro-batches.

        Here each micro-batch in turn, reducing the gradients on the last only (the others
        run in :meth:`no_sync`): the callbacks' hooks come in the order of
        :class:`~fastdist.callbacks.Callback`'s docs, micro-batch after micro-batch.

        A strategy that runs the whole update at once (a pipeline's schedule, which consumes
        every micro-batch together and calls backward itself) overrides this: it takes the
        micro-batches with ``list(update)`` (``on_batch_begin`` of each, in order, before any
        forward), gives its schedule :meth:`Update.loss` as the loss function of the last
        stage (called once per micro-batch, in order; what it returns carries the update's
        weights, ``(sum, count)`` losses' included, and amp's scaling, so the schedule must
        not divide by the number of micro-batches), and then calls :meth:`Update.end` once
        per micro-batch. Under it ``on_loss_begin`` and ``on_backward_begin`` run inside the
        schedule on the last stage only, and ``on_backward_end`` after the schedule's last
        backward, when every micro-batch's gradients are accumulated.
        """
        for batch in update:
            context = NO_CONTEXT if update.last else self.no_sync()
            if context is NO_CONTEXT:  # nothing to enter: a `with` costs a microsecond
                update.loss(update.forward(self.module, batch), batch).backward()
            else:
                with context:
                    update.loss(update.forward(self.module, batch), batch).backward()
            update.end()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context of a micro-batch whose gradients are not reduced (inside a window)."""
        return NO_CONTEXT

    def skipped_update(self) -> None:
        """The current update was skipped on every rank (non-finite, ``on_nonfinite="skip"``):
        nothing applied it."""

    def after_step(self, step: int) -> None:
        """Called after optimizer update ``step`` (e.g. local SGD's parameter averaging)."""

    def replicas(self, step: int) -> list[tuple[str, torch.Tensor]]:
        """The named tensors every rank holds a copy of, which must be equal after update
        ``step`` (``check_sync_every`` compares them)."""
        return list(self.model.named_parameters())

    def before_evaluation(self) -> None:
        """Make every rank's model the same one before it is evaluated or predicted with:
        rank 0's buffers (batch-norm statistics, which each rank's forward updated)."""
        with torch.no_grad():
            broadcast_tensors(self.model.buffers(), group=self.group)

    def end_training(self) -> None:
        """After the last update, before ``on_train_end``: leave the model as the user reads it
        after ``train()`` (a pipeline's stages gathered onto every rank)."""

    def after_evaluation(self) -> None:
        """Put the model back as training left it, once evaluation or prediction ended."""

    def full_state_dict(self) -> dict[str, Any] | None:
        """The whole model's ``state_dict`` on rank 0's CPU (``None`` elsewhere)."""
        if get_rank() != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_full_state_dict(self, weights: dict[str, Any] | None) -> None:
        """Load rank 0's ``weights`` (``None`` on the other ranks) into every rank's model."""
        if weights is not None:
            self.model.load_state_dict(weights)
        with torch.no_grad():
            broadcast_tensors(self.model.state_dict().values(), group=self.group)

    def checkpoint_parts(self) -> list[tuple[str, Any, str]]:
        """``(name, part, scope)`` of the model, the optimizer and this strategy's own state,
        for the checkpointer (:mod:`fastdist.checkpoint.checkpointer`)."""
        return [
            ("model", self.model, REPLICATED),
            ("optimizer", self.optimizer, REPLICATED),
            ("strategy", self, PER_RANK),
        ]

    def state_dict(self) -> dict[str, Any]:
        """This rank's own resumable state (e.g. a communication hook's), plain data."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's :meth:`state_dict`."""

    def load_resized(self, states: list[dict[str, Any]]) -> None:
        """Restore from a checkpoint of another world size: per-rank state restarts."""

    def __repr__(self) -> str:
        """The class and the options that differ from their defaults (options are kept as
        attributes named like the constructor's arguments)."""
        params = inspect.signature(type(self).__init__).parameters.values()
        given = [
            f"{p.name}={getattr(self, p.name)!r}"
            for p in params
            if p.name != "self" and getattr(self, p.name) != p.default
        ]
        return f"{type(self).__name__}({', '.join(given)})"
