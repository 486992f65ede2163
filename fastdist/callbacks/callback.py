"""``Callback``, the base of every hook object, and ``CallbackList``, which dispatches them."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from fastdist.distributed.collectives import rank_zero_first
from fastdist.distributed.guard import no_collectives
from fastdist.logging import logger
from fastdist.state import OptionsView, TrainerState


class _Precision(Protocol):
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...


class _Layout(Protocol):
    """What callbacks read of the trainer's :class:`~fastdist.strategies.Topology`."""

    @property
    def stage_group(self) -> Any: ...


class TrainerView(Protocol):
    """What a callback may use of the :class:`~fastdist.DistTrainer` running it."""

    state: TrainerState
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    rank: int
    world_size: int
    is_master: bool
    global_batch: int

    @property
    def options(self) -> OptionsView: ...

    @property
    def precision(self) -> _Precision: ...

    @property
    def topology(self) -> _Layout: ...

    def request_stop(self) -> None: ...

    def save_model(self, path: str | os.PathLike, format: str = "torch") -> str: ...


class Callback:
    """Override the hooks you need; they are called in the order listed here.

    A callback in ``callbacks_all`` runs on every rank and may change training state (learning
    rate, gradients); one in ``callbacks_master`` runs on rank 0 only and should only write
    (logs, files) and must not call collectives. ``self.trainer`` is the running
    :class:`~fastdist.DistTrainer`; ``self.trainer.state`` says where training is.

    Example:
        >>> class PrintLR(Callback):
        ...     def on_epoch_end(self):
        ...         print(self.trainer.optimizer.param_groups[0]["lr"])
    """

    trainer: TrainerView
    #: Whether this callback changes training (learning rate, gradients), so that every rank
    #: must run it: ``DistTrainer`` refuses it in ``callbacks_master``. Set it on your own.
    changes_training: bool = False

    def on_train_begin(self) -> None:
        """Before the first epoch."""

    def on_epoch_begin(self) -> None:
        """At the start of every epoch (``state.epoch`` is set)."""

    def on_batch_begin(self, batch: Any) -> None:
        """Before the forward pass of a micro-batch (already on the device; the model in
        train mode, whatever mode it came in)."""

    def on_loss_begin(self, batch: Any, output: Any) -> None:
        """After the forward pass, before the loss is computed."""

    def on_backward_begin(self, loss: Any) -> None:
        """Before ``backward`` on the micro-batch loss (unscaled by ``update_every``)."""

    def on_backward_end(self) -> None:
        """After ``backward``; when ``state.is_update`` the gradients are all-reduced."""

    def on_step_end(self) -> None:
        """After an optimizer update (``state.global_step`` already counts it)."""

    def on_batch_end(self) -> None:
        """After every micro-batch."""

    def on_valid_begin(self) -> None:
        """Before an evaluation on the dev data."""

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        """After an evaluation; ``is_better`` says whether it is the best so far."""

    def on_epoch_end(self) -> None:
        """At the end of every epoch."""

    def on_train_end(self) -> None:
        """After the last epoch (or a stop request)."""

    def on_exception(self, exception: BaseException) -> None:
        """When training raises; the exception is re-raised afterwards."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this callback (tensors and plain data); a callback
        with nothing to keep returns ``{}`` (or ``None``) and is left out of checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, before ``on_train_begin`` of a resume."""

    @property
    def state_key(self) -> str | None:
        """This callback's name in a checkpoint; ``None`` (the default): its class's qualified
        name and its index among the callbacks of its class in the same list, e.g.
        ``"WarmupCallback#0"``. Override it to keep the state across a rename or a reorder."""
        return None


HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))  # in loop order
#: The hooks called for each micro-batch (plain calls: no rank waits for another in them).
PER_MICRO_BATCH = (
    "on_batch_begin",
    "on_loss_begin",
    "on_backward_begin",
    "on_backward_end",
    "on_batch_end",
)


class CallbackList:
    """Runs ``callbacks_all`` on every rank, then ``callbacks_master`` on rank 0 only.

    With ``guard_master``, a ``callbacks_master`` hook that calls a collective raises at once
    instead of hanging the job. Hooks a callback does not override are skipped, unless its
    class defines ``__getattribute__`` or ``__getattr__`` (see :func:`answers`).

    It is the checkpoint part of the callbacks' states, keyed by :attr:`Callback.state_key`:
    adding or removing a callback between two runs never blocks a resume.
    """

    def __init__(
        self,
        callbacks_all: Sequence[Callback],
        callbacks_master: Sequence[Callback],
        is_master: bool,
        guard_master: bool = False,
    ) -> None:
        # The one place where the all/master split is decided.
        self.callbacks_all, self.callbacks_master = list(callbacks_all), list(callbacks_master)
        self.is_master = is_master
        self.keyed = {  # on every rank, so that bad keys raise alike everywhere
            "all": state_keys(callbacks_all, "callbacks_all"),
            "master": state_keys(callbacks_master, "callbacks_master"),
        }
        active = [(cb, False) for cb in callbacks_all]
        if is_master:
            active += [(cb, guard_master) for cb in callbacks_master]
        self.callbacks = [cb for cb, _ in active]
        self.master_ids = {id(cb) for cb in self.callbacks_master}
        self.hooks = {
            hook: [
                (cb, f"{type(cb).__name__}.{hook}", guarded)
                for cb, guarded in active
                if answers(cb, hook)
            ]
            for hook in HOOKS
        }
        self.current: str | None = None  # the hook running now, for failure reports
        #: Whether a callback answers a per-micro-batch hook: if none does, the update calls
        #: none of them (an empty call costs 0.4 us; five per micro-batch).
        self.per_micro_batch = any(self.hooks[hook] for hook in PER_MICRO_BATCH)
        for hook in PER_MICRO_BATCH:  # called up to five times per micro-batch: when no
            if not self.hooks[hook]:  # callback answers one, it costs one empty call
                setattr(self, hook, _nothing)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{"all": {key: state}, "master": {key: state}}`` of the callbacks with a state
        (rank 0's is the one saved: where callbacks_master ran)."""
        return {
            which: {key: state for key, cb in keyed.items() if _kept(state := cb.state_dict())}
            for which, keyed in self.keyed.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Give each callback its saved state; a callback with none starts fresh, and the
        saved states no callback claims are named in one warning (on rank 0)."""
        unclaimed = []
        for which, keyed in self.keyed.items():
            saved = _by_key(state[which], keyed, which)
            if which == "master" and not self.is_master:
                continue  # callbacks_master run, and are restored, on rank 0 only
            for key, cb in keyed.items():
                if key in saved:
                    cb.load_state_dict(saved[key])
            unclaimed += [f"callbacks_{which}[{key!r}]" for key in saved if key not in keyed]
        if unclaimed and self.is_master:
            logger.warning(
                "the checkpoint holds the state of %s, which this run does not have: that "
                "state is not restored (give the callback the same class or state_key to keep "
                "it)",
                ", ".join(unclaimed),
            )

    def set_trainer(self, trainer: TrainerView) -> None:
        for cb in self.callbacks:
            cb.trainer = trainer

    def _call(self, hook: str, *args: Any, master: bool | None = None) -> None:
        """Run ``hook`` of the callbacks (``master``: of ``callbacks_master`` only, or of
        ``callbacks_all`` only; ``None``: of both, in order)."""
        for cb, where, guarded in self.hooks[hook]:
            if master is not None and (id(cb) in self.master_ids) != master:
                continue
            self.current = where
            if guarded:
                with no_collectives(f"callbacks_master hook {where}"):
                    getattr(cb, hook)(*args)
            else:
                getattr(cb, hook)(*args)
        self.current = None

    def on_train_begin(self) -> None:
        """``callbacks_all``'s on every rank, then ``callbacks_master``'s on rank 0 while the
        other ranks wait on the rendezvous store, not in a collective: a master hook that takes
        long (a logger opening its tracking store) does not run out the trainer's ``timeout``."""
        self._call("on_train_begin", master=False)
        with rank_zero_first(local=False, what="callbacks_master's on_train_begin"):
            self._call("on_train_begin", master=True)

    def on_epoch_begin(self) -> None:
        self._call("on_epoch_begin")

    def on_batch_begin(self, batch: Any) -> None:
        self._call("on_batch_begin", batch)

    def on_loss_begin(self, batch: Any, output: Any) -> None:
        self._call("on_loss_begin", batch, output)

    def on_backward_begin(self, loss: Any) -> None:
        self._call("on_backward_begin", loss)

    def on_backward_end(self) -> None:
        self._call("on_backward_end")

    def on_step_end(self) -> None:
        self._call("on_step_end")

    def on_batch_end(self) -> None:
        self._call("on_batch_end")

    def on_valid_begin(self) -> None:
        self._call("on_valid_begin")

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        self._call("on_valid_end", eval_result, metric_key, is_better)

    def on_epoch_end(self) -> None:
        self._call("on_epoch_end")

    def on_train_end(self) -> None:
        self._call("on_train_end")

    def on_exception(self, exception: BaseException) -> None:
        self._call("on_exception", exception)


def _nothing(*_args: Any) -> None:
    """A per-micro-batch hook that no callback answers."""


def answers(cb: Callback, hook: str) -> bool:
    """Whether ``cb`` takes part in ``hook``: it overrides it (in its class, or on the object:
    ``cb.on_step_end = fn``), or its class looks attributes up itself (``__getattribute__`` or
    ``__getattr__``, as fastNLP's ``EchoCallback``), so that any hook may answer; such a
    callback is asked for the hook at every call."""
    cls = type(cb)
    dynamic = cls.__getattribute__ is not object.__getattribute__ or hasattr(cls, "__getattr__")
    own = hook in getattr(cb, "__dict__", {})
    return dynamic or own or getattr(cls, hook) is not getattr(Callback, hook)


def _kept(state: Any) -> bool:
    """Whether a callback's ``state_dict()`` result goes in a checkpoint: anything but ``{}``
    (and ``None``), the "nothing to keep" of a callback without state; 0, ``[]`` or a tensor
    are states."""
    return state is not None and not (isinstance(state, dict) and not state)


def state_keys(callbacks: Sequence[Callback], name: str) -> dict[str, Callback]:
    """Each callback by its :attr:`~Callback.state_key`; raise on two with the same key."""
    seen: Counter[str] = Counter()
    keyed: dict[str, Callback] = {}
    for cb in callbacks:
        key = cb.state_key
        if key is None:
            cls = type(cb).__qualname__
            key = f"{cls}#{seen[cls]}"
            seen[cls] += 1
        if key in keyed:
            raise ValueError(
                f"{name} holds two callbacks with state_key {key!r}: give each its own "
                "state_key, so that a checkpoint can tell their states apart"
            )
        keyed[key] = cb
    return keyed


def _by_key(saved: Any, keyed: dict[str, Callback], which: str) -> dict[str, Any]:
    """Saved states by key; a format-1 checkpoint's list is matched by position."""
    if isinstance(saved, dict):
        return saved
    if len(saved) == len(keyed):
        return dict(zip(keyed, saved, strict=True))
    if any(saved):
        raise ValueError(
            f"the checkpoint (format 1) holds {len(saved)} callbacks_{which} state(s) by "
            f"position but the trainer has {len(keyed)} callbacks_{which}: resume with the "
            "callbacks of the run that wrote it, in its order, or start afresh in another "
            "save_path/checkpoint_dir"
        )
    return {}
