"""The loop's part in computing one optimizer update (:class:`Update`): what a strategy's
:meth:`~fastdist.strategies.Strategy.forward_backward` calls for each micro-batch while it
runs the forward and backward passes its own way: the callbacks' per-micro-batch hooks, the
loss bookkeeping, mixed precision and the timing.

Per micro-batch the hooks come in this order: ``on_batch_begin`` as it is drawn,
``on_loss_begin`` and ``on_backward_begin`` in :meth:`Update.loss`, ``on_backward_end`` and
(but for the update's last micro-batch, whose ``on_batch_end`` follows the optimizer step in
the loop) ``on_batch_end`` in :meth:`Update.end`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fastdist.logging import logger
from fastdist.modes import evaluating, modes, set_modes
from fastdist.trainer.build import Run


class Update:
    """One optimizer update's micro-batches, drawn from the pass's ``batches`` (on the device,
    timed) as the strategy asks for them (see :class:`fastdist.strategies.base.Update`, the
    interface it implements). One object serves a whole pass: :meth:`open` starts each update.

    The data owns the windows (:meth:`~fastdist.data.protocol.Batches.ends_window`).
    ``state.batch_idx``, ``is_update`` and ``is_filler`` say which micro-batch a hook is about.
    """

    def __init__(self, run: Run, batches: Iterator[Any], modes: TrainingModes) -> None:
        self.state, self.callbacks, self.data = run.state, run.callbacks, run.data
        self.model, self.precision, self.losses = run.model, run.precision, run.losses
        self.timer, self.world, self.strategy = run.timer, run.world, run.strategy
        self.feed, self.loss_fn = run.forward, run.loss_fn
        self.fp32 = run.precision.amp is None
        self.hooked = run.callbacks.per_micro_batch  # else no hook is called per micro-batch
        self.plain = self.fp32  # the micro-batch drawn last is fp32 and trains (no filler)
        self.batches = batches
        self.modes = modes
        modes.begin_pass()
        self.last = False
        self._first: Any = None
        self._drawn = self._lost = self._ended = 0  # the pass's micro-batches so far

    def open(self, first: Any) -> Update:
        """Start the next update at its ``first`` micro-batch, already drawn."""
        self._first = first
        return self

    def __iter__(self) -> Iterator[Any]:
        """The update's micro-batches, each announced in the mode it trains in; the next
        update's first is not drawn."""
        first, self._first = self._first, None
        for batch in itertools.chain((first,), self.batches):
            self._at(self._drawn)
            self._drawn += 1
            self.last = self.state.is_update
            if not self.model.training:  # a callback's model.eval(): the pass's modes again
                self.modes.restore()
            if self.hooked:
                self.callbacks.on_batch_begin(batch)
            yield batch
            if self.last:
                return

    def _at(self, index: int) -> None:
        """Point the state at micro-batch ``index`` of the pass."""
        state = self.state
        state.batch_idx = index
        state.is_update = self.data.ends_window(index + 1)
        state.is_filler = filler = self.data.weights[index] == 0.0  # trains nothing
        self.plain = self.fp32 and not filler

    def forward(self, module: nn.Module, batch: Any, index: int | None = None) -> Any:
        """``module``'s output on the micro-batch drawn last, or on the update's ``index``-th
        (a schedule's: it runs them once all are drawn)."""
        if index is not None:
            self._at(self._ended + index)  # the update's first is the pass's next to end
        if self.plain and self.model.training:  # no context: a `with` costs a micro-second
            return self.feed(module, batch)
        with self._context(module):
            return self.feed(module, batch)

    def probe(self, module: nn.Module, batch: Any) -> Any:
        """``module``'s output on ``batch``, modes untouched (a strategy's check)."""
        with self.precision.autocast():
            return self.feed(module, batch)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The next micro-batch's loss to backpropagate: weighted, scaled."""
        index, data, losses = self._lost, self.data, self.losses
        self._lost = index + 1
        if index != self.state.batch_idx:  # a schedule's: every micro-batch is drawn
            self._at(index)
        share, samples = data.weights[index], data.samples[index]
        if self.hooked:  # not in a filler's eval mode: its changes hold
            self.callbacks.on_loss_begin(batch, output)
        if self.plain and self.model.training:
            loss = losses.add(self.loss_fn(output, batch), share, samples)
        else:
            with self._context():
                loss = losses.add(self.loss_fn(output, batch), share, samples)
        if self.hooked:
            self.callbacks.on_backward_begin(loss)
        # A mean weighs by its share of the update's samples; a (sum, count) loss by 1 (end
        # divides the gradients by the update's count); a filler's by 0.
        weight = float(share > 0) if losses.counted else share
        if weight != 1.0:
            loss = loss * weight
        precision = self.precision  # fp16: times the gradient scaler's scale
        return loss if precision.scaler is None else precision.scale(loss)

    def end(self) -> None:
        """After the next micro-batch's backward."""
        index, state = self._ended, self.state
        self._ended += 1
        if index != state.batch_idx:
            self._at(index)
        if state.is_update:  # (sum, count) losses: divide by the update's global count
            topology = self.world.topology
            self.losses.normalize(
                self.model,
                topology.loss_ranks,
                self.world.group,
                topology.sizes["pp"] > 1,
                self.strategy.average_over_groups,
            )
            self.timer.backward_done()  # splits off the all-reduce wait
        if self.hooked:
            self.callbacks.on_backward_end()
            if not state.is_update:
                self.callbacks.on_batch_end()

    def mode(self, module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """The mode of the micro-batch drawn last, on ``module`` (a wrapper of the model, or
        the model: the default) inside: for one that trains, the pass's training modes where a
        callback put the model in eval mode (submodules a callback switched alone keep their
        mode); for a filler eval mode (no batch-norm statistics, no dropout), then every
        module's mode again."""
        if self.state.is_filler:
            return evaluating(self.model if module is None else module)
        if not self.model.training:  # the root's flag: a walk of every module only then
            self.modes.restore()
        return contextlib.nullcontext()

    def _context(self, module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Autocast (amp) in the micro-batch's :meth:`mode`."""
        if self.model.training and not self.state.is_filler:  # amp's common case
            return self.precision.autocast()
        both = contextlib.ExitStack()
        both.enter_context(self.precision.autocast())
        both.enter_context(self.mode(module))
        return both


class TrainingModes:
    """The modes of the model's modules that its micro-batches train in, so that a submodule
    frozen in eval mode stays so: those the model came to ``train()`` in (train mode
    throughout for a model in eval mode, as ``from_pretrained`` returns one), read again as
    each pass starts unless a callback left the whole model in eval mode."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.modules = model, list(model.modules())
        self.modes: list[bool] = []

    def start(self) -> None:
        """At ``train()``'s start, before any hook: the modes the model came in."""
        training = self.model.training
        if not training:
            logger.info(
                "the model came in eval mode (as from_pretrained returns it): it trains in "
                "train mode (dropout on) and is put back in eval mode after training"
            )
        self.modes = modes(self.modules) if training else [True] * len(self.modules)

    def begin_pass(self) -> None:
        """Read the modes a pass trains in, or put them back (see above)."""
        if self.model.training:
            self.modes = modes(self.modules)
        else:
            self.restore()

    def restore(self) -> None:
        """The modes micro-batches train in again (after a callback's ``model.eval()``)."""
        set_modes(self.modules, self.modes)
