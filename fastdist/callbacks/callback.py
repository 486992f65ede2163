"""``Callback``, the base of every hook object, and ``CallbackList``, which dispatches them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastdist.distributed.guard import no_collectives

if TYPE_CHECKING:
    from fastdist.trainer.dist_trainer import DistTrainer


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

    trainer: DistTrainer

    def on_train_begin(self) -> None:
        """Before the first epoch."""

    def on_epoch_begin(self) -> None:
        """At the start of every epoch (``state.epoch`` is set)."""

    def on_batch_begin(self, batch: Any) -> None:
        """Before the forward pass of a micro-batch (already on the device)."""

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
        """What a checkpoint must keep of this callback (tensors and plain data)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, before ``on_train_begin`` of a resume."""


HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))  # in loop order


class CallbackList:
    """Runs ``callbacks_all`` on every rank, then ``callbacks_master`` on rank 0 only.

    With ``guard_master``, a ``callbacks_master`` hook that calls a collective raises at once
    instead of hanging the job. Hooks a callback does not override are skipped.
    """

    def __init__(
        self,
        callbacks_all: Sequence[Callback],
        callbacks_master: Sequence[Callback],
        is_master: bool,
        guard_master: bool = False,
    ) -> None:
        # The one place where the all/master split is decided.
        active = [(cb, False) for cb in callbacks_all]
        if is_master:
            active += [(cb, guard_master) for cb in callbacks_master]
        self.callbacks = [cb for cb, _ in active]
        self.hooks = {
            hook: [
                (getattr(cb, hook), f"{type(cb).__name__}.{hook}", guarded)
                for cb, guarded in active
                if getattr(type(cb), hook) is not getattr(Callback, hook)
            ]
            for hook in HOOKS
        }
        self.current: str | None = None  # the hook running now, for failure reports

    def set_trainer(self, trainer: DistTrainer) -> None:
        for cb in self.callbacks:
            cb.trainer = trainer

    def _call(self, hook: str, *args: Any) -> None:
        for method, where, guarded in self.hooks[hook]:
            self.current = where
            if guarded:
                with no_collectives(f"callbacks_master hook {where}"):
                    method(*args)
            else:
                method(*args)
        self.current = None

    def on_train_begin(self) -> None:
        self._call("on_train_begin")

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
