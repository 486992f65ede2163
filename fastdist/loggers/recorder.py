"""``RunLog``, the one logging component: it decides when to log (the log step, every
evaluation, the end) and what (one ``log.jsonl`` record); its backends only write."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fastdist.checkpoint.loadable import unloadable
from fastdist.distributed.guard import BACKEND, no_collectives
from fastdist.loggers.backend import Logger, RunContext
from fastdist.logging import logger
from fastdist.state import OptionsView, TrainerState

#: What :meth:`RunLog._guarded` returns for a call that raised.
FAILED = object()


class LoggedTrainer(Protocol):
    """What :class:`RunLog` reads of the trainer."""

    state: TrainerState
    optimizer: torch.optim.Optimizer
    device: torch.device
    world_size: int
    global_batch: int

    @property
    def options(self) -> OptionsView: ...


class RunLog:
    """Hands every backend the same records, on rank 0, at the same moments.

    The records are ``log.jsonl``'s (see :class:`~fastdist.loggers.JsonLogger`): ``"start"``
    (the run's options, once), ``"train"`` every ``print_every`` updates (loss, learning rate,
    throughput, memory, per-rank timings), ``"eval"`` after every evaluation, and ``"end"`` or
    ``"exception"``. A backend that raises is named in one warning, closed as failed (if that
    raises too, silently) and dropped for the rest of the run (one whose ``state_dict``
    raises is left out of later checkpoints; one whose ``load_state_dict`` raises starts
    afresh); training, its checkpoints and a resume go on.

    Args:
        backends: the :class:`~fastdist.loggers.Logger` objects to write to.
    """

    def __init__(self, backends: Sequence[Logger]) -> None:
        self.backends = list(backends)
        self.active: list[Logger] = []  # opened and not failed
        self.unsaved: list[Logger] = []  # their state_dict raised: left out of checkpoints
        self.trainer: LoggedTrainer | None = None
        self._start = self._last_time = 0.0
        self._last_step = 0
        self._eval_seconds = 0.0
        self._valid_start: float | None = None
        self._marked: dict[int, tuple[float, float]] = {}  # log step -> its time, its rate
        self._written: int | None = None  # the loss_step of the last "train" record

    def begin(self, trainer: LoggedTrainer) -> None:
        """Training begins: open the backends, write the ``"start"`` record."""
        self.close(failed=False)  # a second train() of the same trainer
        self.trainer, state = trainer, trainer.state
        run = RunContext(trainer.options.save_path, state.global_step, state.rolled_back)
        self.active = [
            b for b in self.backends if self._guarded(b, "open", b.open, run) is not FAILED
        ]
        self._start = self._last_time = time.monotonic()
        self._last_step, self._eval_seconds, self._valid_start = state.global_step, 0.0, None
        self._marked, self._written = {}, state.loss_step
        self._emit(
            "start",
            start_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            world_size=trainer.world_size,
            total_steps=state.total_steps,
            global_batch=trainer.global_batch,
            optimizer=type(trainer.optimizer).__name__,
            lr=float(trainer.optimizer.param_groups[0]["lr"]),
            config=trainer.options.as_dict(),
        )

    def step_end(self) -> None:
        """After an update: note a log step's time and rate; write a fresh loss."""
        if self.trainer is None:
            return
        state = self.trainer.state
        if state.global_step % self.trainer.options.print_every == 0:
            lr = float(self.trainer.optimizer.param_groups[0]["lr"])
            self._marked[state.global_step] = time.monotonic(), lr
        self.write_loss()

    def write_loss(self) -> None:
        """A ``"train"`` record of the loss agreed last, unless written: as of its log step,
        whose time and rate :meth:`step_end` noted (the loss may come an update later, see
        :meth:`~fastdist.trainer.loop.Loop.log_step`). Called before anything else is written."""
        trainer = self.trainer
        if trainer is None:
            return
        state, step = trainer.state, trainer.state.loss_step
        if state.loss is None or step is None or step == self._written:
            return
        self._written = step
        lr_now = float(trainer.optimizer.param_groups[0]["lr"])
        then, lr = self._marked.pop(step, (time.monotonic(), lr_now))
        self._marked = {s: mark for s, mark in self._marked.items() if s > step}
        seconds = then - self._last_time - self._eval_seconds
        samples = trainer.global_batch * (step - self._last_step)
        self._last_time, self._last_step, self._eval_seconds = then, step, 0.0
        self._emit(
            "train",
            step=step,
            time=then - self._start,
            loss=state.loss,
            lr=lr,
            samples_per_s=samples / seconds if seconds > 0 else None,
            memory_mb=peak_memory_mb(trainer.device),
            ranks=state.rank_times,
        )

    def valid_begin(self) -> None:
        """An evaluation begins: its time is left out of the throughput."""
        self.write_loss()
        self._valid_start = time.monotonic()

    def valid_end(self, eval_result: dict[str, float], is_better: bool) -> None:
        """After an evaluation: an ``"eval"`` record with every key of the result."""
        if self._valid_start is not None:
            self._eval_seconds += time.monotonic() - self._valid_start
            self._valid_start = None
        fields = ("kind", "step", "epoch", "time", "is_better")
        result = {f"metric_{k}" if k in fields else k: v for k, v in eval_result.items()}
        self._emit("eval", is_better=is_better, **result)

    def end(self) -> None:
        """Training ended: the ``"end"`` record (the best result), then close."""
        self.write_loss()
        if self.trainer is not None:
            state = self.trainer.state
            self._emit(
                "end",
                best_eval=state.best_eval,
                best_epoch=state.best_epoch,
                best_step=state.best_step,
                steps=state.global_step,
                seconds=time.monotonic() - self._start,
            )
        self.close(failed=False)

    def fail(self, exception: BaseException) -> None:
        """Training raised: the ``"exception"`` record, then close."""
        self._emit("exception", error=f"{type(exception).__name__}: {exception}")
        self.close(failed=True)

    def close(self, failed: bool) -> None:
        """Close every open backend (each at most once)."""
        active, self.active, self.trainer = self.active, [], None
        for backend in active:
            self._guarded(backend, "close", backend.close, failed)

    def state_dict(self) -> dict[str, Any]:
        """Each backend's state (e.g. its run id), by class and occurrence among the backends
        of that class (``"MLflowLogger"``, ``"MLflowLogger#2"``)."""
        states = {}
        for key, backend in self._keyed():
            if backend in self.unsaved:
                continue
            state = self._guarded(backend, "state_dict", saved_state, backend)
            if state is FAILED:
                self.unsaved.append(backend)
            elif state:
                states[key] = state
        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Give each backend its saved state, before :meth:`begin` of a resume; warn about
        state for backends no longer given."""
        state = unpositioned(state)
        keyed = self._keyed()
        for key, backend in keyed:
            if key in state:
                self._guarded(backend, "load_state_dict", backend.load_state_dict, state[key])
        left = sorted(set(state) - {key for key, _ in keyed})
        if left:
            logger.warning(
                "the checkpoint holds the state of logging backends no longer given (%s): "
                "their runs are not continued",
                ", ".join(left),
            )

    def _keyed(self) -> list[tuple[str, Logger]]:
        return keyed(self.backends)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.trainer is None:
            return
        state = self.trainer.state
        record = {
            "kind": kind,
            "step": state.global_step,
            "epoch": state.epoch,
            "time": time.monotonic() - self._start,
            **fields,
        }
        for backend in list(self.active):
            self._guarded(backend, kind, backend.write, record)

    def _guarded(self, backend: Logger, what: str, call: Any, *args: Any) -> Any:
        """``call(*args)``; if it raises, warn once, drop ``backend`` and return ``FAILED``."""
        try:
            with no_collectives(f"{BACKEND}{type(backend).__name__} ({what})"):
                return call(*args)
        except Exception as exc:
            logger.warning(
                "logger %s failed (%s, at %s: %s: %s); %s, training goes on",
                type(backend).__name__,
                what,
                "the start" if self.trainer is None else f"step {self.trainer.state.global_step}",
                type(exc).__name__,
                exc,
                "it starts afresh (a new run)"
                if what == "load_state_dict"
                else "it writes nothing more in this run",
            )
            if backend in self.active or what == "open":
                self.active = [b for b in self.active if b is not backend]
                with contextlib.suppress(Exception):  # e.g. an MLflow run left RUNNING
                    backend.close(True)
            return FAILED


def keyed(backends: Sequence[Logger]) -> list[tuple[str, Logger]]:
    """Each backend under its class's name, with ``#N`` from the second of a class on."""
    seen: dict[str, int] = {}
    found = []
    for backend in backends:
        name = type(backend).__name__
        seen[name] = n = seen.get(name, 0) + 1
        found.append((name if n == 1 else f"{name}#{n}", backend))
    return found


def unpositioned(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the keys of checkpoints before it was keyed by class (``"<i>:<class>"``,
    by position) renamed as :func:`keyed` names them, in their old order."""
    old = sorted(
        (k for k in state if k.partition(":")[0].isdigit()), key=lambda k: int(k.split(":")[0])
    )
    seen: dict[str, int] = {}
    renamed = {k: v for k, v in state.items() if k not in old}
    for key in old:
        name = key.partition(":")[2]
        seen[name] = n = seen.get(name, 0) + 1
        renamed[name if n == 1 else f"{name}#{n}"] = state[key]
    return renamed


def saved_state(backend: Logger) -> dict[str, Any]:
    """``backend.state_dict()``, or ``TypeError`` if a checkpoint could not load it back (a
    ``Path``, a NumPy scalar: every resume would then skip the checkpoint)."""
    state = backend.state_dict()
    problem = unloadable(state, f"{type(backend).__name__}.state_dict()")
    if problem is not None:
        raise TypeError(problem)
    return state


def peak_memory_mb(device: torch.device) -> float:
    """Rank 0's peak memory in MiB: allocated on its GPU, else the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
