"""The training loop (:meth:`Loop.train_epochs`, one screen; the per-micro-batch hooks are
called by :class:`~fastdist.trainer.update.Update` as the strategy computes each update) and
the run around it: resume, the end of training, pre-emption."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from torch.utils.data import Dataset

from fastdist.callbacks.callback import TrainerView
from fastdist.checkpoint import Resumed
from fastdist.checkpoint.lock import hold_dirs
from fastdist.distributed import broadcast_object
from fastdist.logging import logger
from fastdist.modes import kept_modes
from fastdist.trainer.build import Run
from fastdist.trainer.failure import report_failure, report_interrupt
from fastdist.trainer.preemption import report_preempted, requeue
from fastdist.trainer.progress import Progress, log_plan
from fastdist.trainer.safety import TrainableCheck, all_finite, check_in_sync, warn_skipped
from fastdist.trainer.sync import Agreement
from fastdist.trainer.update import TrainingModes, Update

#: The agreement before any sync point: nothing agreed, nothing to stop.
NOTHING = Agreement(stop_requested=False, preempted=False, loss=None, rank_times=None)


class Loop:
    """Runs the assembled parts of one trainer; callbacks see ``trainer`` (the facade)."""

    def __init__(self, run: Run, trainer: TrainerView) -> None:
        self.run = run
        self.state, self.callbacks, self.data = run.state, run.callbacks, run.data
        self.model, self.strategy, self.world = run.model, run.strategy, run.world
        self.precision, self.losses, self.timer = run.precision, run.losses, run.timer
        self.options, self.stop_logged = run.options, False  # the stop is logged once per run
        self.progress = Progress(show=False, use_tqdm=False, total=0, initial=0, global_batch=0)
        self.training_modes = TrainingModes(run.model)
        run.callbacks.set_trainer(trainer)
        # A log step is read at once with print_every=1 (the next one's loss could replace it
        # unseen) and under torchft's replica groups (its read averages over the groups, and
        # one that heals at the next update's quorum would not join that average).
        self.read_logs_at_once = run.options.print_every == 1 or run.strategy.replica_group[1] > 1
        self.trainable = TrainableCheck(run.model, run.strategy.fixed_trainable)

    def train_epochs(self) -> Agreement:
        """Train from the state's position to the end of the last epoch; return the last
        agreement (its ``stop`` says whether training stopped early)."""
        state, callbacks, run = self.state, self.callbacks, self.run
        callbacks.on_train_begin()
        agreed = NOTHING
        for epoch in self._epochs():
            self._enter(epoch)
            callbacks.on_epoch_begin()
            for update in self._updates(epoch):  # one optimizer update's micro-batches
                # Per micro-batch: on_batch_begin, on_loss_begin, on_backward_begin,
                # on_backward_end and, but for the last, on_batch_end (see Update).
                self.strategy.forward_backward(update)
                applied = self._optimizer_step()
                agreed = self.settle() or agreed  # the last log step's, read after compute
                validate = save = False
                if applied:
                    validate = run.validator.due_after_update(state.global_step)
                    due = run.checkpointer.due(state.global_step)
                    ends_epoch = self.data.ends_pass(state.batch_idx + 1, wait=due)  # saved below
                    save = due and not ends_epoch
                    if state.global_step % self.options.print_every == 0:
                        # Read at once where a sync point follows anyway (see __init__ too).
                        wait = validate or save or ends_epoch or self.read_logs_at_once
                        agreed = self.log_step(wait) or agreed
                    elif run.sync.check_due(state.global_step):  # log steps far apart
                        agreed = self.sync(signals_only=True)
                    callbacks.on_step_end()
                callbacks.on_batch_end()  # before a checkpoint: its hooks all ran, none replays
                if validate:
                    agreed = self._validate()
                if save:
                    agreed = self._save_checkpoint() or agreed
                if agreed.stop:
                    break
            agreed = self.settle() or agreed  # e.g. a stream's last update's log step
            if state.lost_samples:  # replica groups failed (DDP(fault_tolerant=True))
                logger.warning("epoch %d: %d samples lost", epoch, state.lost_samples)
            # A stop agreed at the epoch's last update ends it (its checkpoint is written below).
            last = agreed.stop and not agreed.preempted
            last = last and self.data.ends_pass(state.batch_idx + 1, wait=True)
            if not agreed.stop or last:
                state.epoch_complete = True
                if not agreed.stop and run.validator.due_at_epoch_end:
                    agreed = self._validate()
            if not agreed.preempted:  # a pre-empted epoch has not ended: it resumes later
                callbacks.on_epoch_end()
            if state.epoch_complete:
                agreed = self._save_checkpoint() or agreed
            if agreed.stop:
                break
        if not agreed.preempted:  # the replicas compared before on_train_end's own changes
            check_in_sync(self.strategy, state.global_step, self.options.check_sync_every, True)
            self.strategy.end_training()  # e.g. a pipeline's stages gathered
            run.checkpointer.wait()  # the last checkpoint on disk, if written in the background
            callbacks.on_train_end()
        return agreed

    def _epochs(self) -> range:
        """The epochs left, the current one first if it is not complete."""
        first = self.state.epoch + (1 if self.state.epoch_complete else 0)
        return range(max(first, 1), self.options.n_epochs + 1)

    def _enter(self, epoch: int) -> None:
        """Enter ``epoch``: a new one from its start, one resumed inside from where it was
        (``on_epoch_begin`` then sees ``batches_in_epoch > 0``)."""
        state = self.state
        state.epoch = epoch
        if state.epoch_complete:
            state.samples_in_epoch = state.batches_in_epoch = state.lost_samples = 0
        state.epoch_complete = False
        self.world.board.publish(epoch=epoch, step=state.global_step, phase="train")

    def _updates(self, epoch: int) -> Iterator[Update]:
        """This epoch's optimizer updates, from where training stands in it, each drawing its
        micro-batches as the strategy computes them. The timer times ``next()`` and the copy
        to the device as the data wait."""
        state = self.state
        self.trainable.check()  # after on_epoch_begin, before a forward
        self.data.begin(epoch, state.samples_in_epoch, state.batches_in_epoch)
        # iter() draws from the torch RNG. A checkpoint at an epoch end was taken before that
        # draw, one inside an epoch after it: restore the saved state on the matching side.
        mid_epoch = state.samples_in_epoch > 0 or state.batches_in_epoch > 0
        if not mid_epoch:
            self.run.rng.apply()  # a no-op unless a checkpoint was just restored
        batches = self.data.iterate()
        if mid_epoch:
            self.run.rng.apply()
        batches = self.timer.batches(batches, self.world.device)
        update = Update(self.run, batches, self.training_modes)
        for first in batches:  # drawn after the previous update's on_batch_end
            yield update.open(first)

    def _optimizer_step(self) -> bool:
        """Step, unless the gradients are non-finite or fp16 overflowed; say whether it did."""
        state, optimizer = self.state, self.run.optimizer
        # With fp16 the gradient scaler handles overflow itself, skipping such steps.
        skip = self.options.on_nonfinite == "skip" and self.precision.scaler is None
        stages = self.world.topology.stage_group  # a pipeline's stages judge together
        if skip and not all_finite((p.grad for p in self.model.parameters()), stages):
            warn_skipped(self.losses.window_loss(), self.state, self.world.group)
            self.strategy.skipped_update()  # e.g. its samples count as lost (torchft)
            applied = False
        else:
            applied = self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.losses.end_window(applied)
        # The position moves past a skipped update too: a peer that heals from this state
        # (torchft) must start at the next update, as this rank does.
        state.samples_in_epoch, state.batches_in_epoch = self.data.position(state.batch_idx + 1)
        if not applied:
            state.skipped_steps += 1
            return False
        state.global_step += 1
        self.world.board.update(step=state.global_step, phase="train")  # a second old at most
        self.strategy.after_step(state.global_step)  # e.g. local SGD's averaging
        self.progress.update()
        check_in_sync(self.strategy, state.global_step, self.options.check_sync_every, False)
        return True

    def log_step(self, wait: bool) -> Agreement | None:
        """Start the log step's all-reduce (mean loss, timings, stop and NaN flags); read it
        now (``wait``: an evaluation, a checkpoint or the epoch's end follows, or see
        :attr:`read_logs_at_once`), or leave it to :meth:`settle`: after the next update (no
        wait), at the epoch's end or before any other sync point. ``state.loss`` and the log
        line then come one update late, with their step (``state.loss_step``); a stop or a NaN
        is acted on at that next update, on every rank alike."""
        state = self.state
        if self.world.rank == 0:
            self.progress.mark(state.global_step, self.run.optimizer.param_groups[0]["lr"])
        self.run.sync.start(state.global_step, state.stop_requested)
        return self.settle() if wait else None

    def settle(self) -> Agreement | None:
        """Read and record the log step's all-reduce under way, if any."""
        return self._record(self.run.sync.finish()) if self.run.sync.started else None

    def sync(self, check_model: bool = False, signals_only: bool = False) -> Agreement:
        """A sync point (see :mod:`fastdist.trainer.sync`; ``signals_only``: a signal check),
        after the log step's under way; record what it returns."""
        state, sync = self.state, self.run.sync
        self.settle()
        if signals_only:
            agreed = sync.check(state.global_step, state.stop_requested)
        else:
            agreed = sync.agree(state.global_step, state.stop_requested, check_model)
        return self._record(agreed)

    def _record(self, agreed: Agreement) -> Agreement:
        """Record an agreement: the mean loss (logged), the ranks' timings, the stop."""
        state = self.state
        if agreed.rank_times is not None:
            times, updates = agreed.rank_times
            state.rank_times = [t.as_dict() for t in times]
            self.run.slow_ranks.observe(times, updates, agreed.step)
        if agreed.loss is not None:
            state.loss, state.loss_step = agreed.loss, agreed.step
            if self.world.rank == 0:
                self.progress.log(state.epoch, agreed.step, state.total_steps, state.loss)
        # A stop requested since the all-reduce started is sent at the next one.
        state.stop_requested = agreed.stop_requested or state.stop_requested
        if agreed.preempted:
            self.run.sigterm.settle()  # every rank is here: the checkpoint may take its time
        if agreed.stop and not self.stop_logged:
            self.stop_logged = True
            why = "SIGTERM received" if agreed.preempted else "stop requested"
            why = "the requeue signal received" if agreed.requeue else why
            logger.info("%s; stopping at step %d", why, state.global_step)
        return agreed

    def evaluate(self, data: Dataset | None) -> dict[str, float]:
        """Score ``data`` (default the dev data) with the metrics; same dict on every rank."""
        validator = self.run.validator
        data = validator.dev_data if data is None else data
        if data is None or not validator.evaluator.metrics:
            raise ValueError("evaluate() needs metrics= and data (or dev_data=) on the trainer")
        self.world.board.publish(phase="evaluate")
        # Every shard is scored by the same model: e.g. rank 0's batch-norm statistics, the
        # buffers DDP would broadcast before the next forward (each rank's forward updated its
        # own), and local SGD's parameters averaged.
        self.strategy.before_evaluation()
        try:
            result = validator.evaluator.evaluate(data)
        finally:
            self.strategy.after_evaluation()
        self.world.board.move(phase="train")
        return result

    def _validate(self) -> Agreement:
        """Evaluate the dev data, keep the best model; agree on stop requests it led to."""
        self.sync(check_model=True)  # a model with NaN/Inf weights is neither scored nor kept
        self.callbacks.on_valid_begin()
        with self.timer.paused():
            result = self.evaluate(None)
        validator = self.run.validator
        is_better = validator.judge(result, self.state)
        self.callbacks.on_valid_end(result, validator.metric_key, is_better)
        return self.sync()  # e.g. early stopping's request, agreed at once

    def _save_checkpoint(self) -> Agreement | None:
        """Write a checkpoint (if checkpointing is on) of a model checked to be finite; none
        once a pre-emption is agreed: its checkpoint, of this same update, follows."""
        if self.run.checkpointer.dir is None:
            return None
        agreed = self.sync(check_model=True)
        if not agreed.preempted:
            with self.timer.paused():
                self._checkpoint(agreed)
        return agreed

    def _checkpoint(self, agreed: Agreement) -> str | None:
        """Write a checkpoint right after the sync point ``agreed`` (its loss not yet read goes
        in); rank 0's path, ``None`` elsewhere or when it is written in the background."""
        state = self.state
        state.unread_loss = None if agreed.pending is None else list(agreed.pending)
        try:
            return self.run.checkpointer.save(state.global_step)
        finally:
            state.unread_loss = None

    def fit(self, resume: bool | str | os.PathLike) -> dict[str, Any]:
        """What ``DistTrainer.train`` does: resume, train, end; the result on every rank. Rank 0
        holds the locks of ``save_path`` and ``checkpoint_dir`` meanwhile
        (:mod:`fastdist.checkpoint.lock`)."""
        dirs = {"save_path": self.options.save_path, "checkpoint_dir": self.options.checkpoint_dir}
        with hold_dirs(dirs, self.world.group), kept_modes(self.model):  # each module's after
            return self._fit(resume)

    def _fit(self, resume: bool | str | os.PathLike) -> dict[str, Any]:
        start, state, options = time.time(), self.state, self.options
        self.training_modes.start()
        self.run.validator.best.remove_dead_writes()  # rank 0, holding save_path's lock
        self._begin(self.run.checkpointer.restore(resume))
        self.stop_logged = False
        try:
            with self.run.sigterm.watching(), self.timer.hooked(self.model):
                agreed = self.train_epochs()
                if agreed.preempted:  # still watching: a second signal must not stop the write
                    self._save_preempted(agreed)
            self._end()
        except KeyboardInterrupt as exc:  # Ctrl-C: one line, no traceback; the callbacks told
            report_interrupt(exc, state, self.run.checkpointer.dir, self.callbacks.on_exception)
            raise
        except (Exception, SystemExit) as exc:  # sys.exit() in a callback: the others would wait
            if not self.run.sigterm.exiting:  # a failure, not the pre-emption's exit
                report_failure(exc, self.where(), options.timeout)
                self.callbacks.on_exception(exc)
            raise
        finally:
            self.progress.close()
        result = {
            "best_eval": state.best_eval,
            "best_epoch": state.best_epoch,
            "best_step": state.best_step,
            "steps": state.global_step,
            "seconds": round(time.time() - start, 3),
        }
        self.world.board.publish(phase="finished")
        return broadcast_object(result, group=self.world.group)

    def _save_preempted(self, agreed: Agreement) -> NoReturn:
        """The pre-emption: rank 0 writes a checkpoint, which every rank waits for; requeue the
        SLURM job if its signal came; exit with 143."""
        path = None
        if self.run.checkpointer.dir is not None:
            agreed = self.sync(check_model=True)
            with self.timer.paused():
                path = self._checkpoint(agreed)
                path = self.run.checkpointer.wait() or path  # written in the background
        path = broadcast_object(path, group=self.world.group)  # sent after rank 0's write
        report_preempted(self.state.global_step, path, self.world.rank == 0)
        if agreed.requeue:  # SLURM's time-limit signal: the job runs again, resumed
            requeue(self.world.rank == 0, path is not None)
        self.run.sigterm.exit()

    def _begin(self, resumed: Resumed | None) -> None:
        """Continue from a restored checkpoint, count the updates left, log the plan."""
        state, options, world = self.state, self.options, self.world
        moved = resumed is not None and resumed.data_shards != world.data.size
        state.rolled_back = resumed is not None and (resumed.rollback or moved)
        global_batch = options.global_batch(world.data.size)
        mid_epoch = not state.epoch_complete and (state.samples_in_epoch or state.batches_in_epoch)
        if resumed is not None and mid_epoch:
            position = self.data.resume_at(state.samples_in_epoch, state.batches_in_epoch)
            state.samples_in_epoch, state.batches_in_epoch = position
        left = self._updates_left()
        state.total_steps = None if left is None else state.global_step + left
        if resumed is not None:
            where = f"{state.samples_in_epoch} samples into epoch {state.epoch}"
            logger.info(
                "resumed from %s: %s, step %d%s",
                resumed.path,
                f"the end of epoch {state.epoch}" if state.epoch_complete else where,
                state.global_step,
                ""
                if left != 0
                else " (nothing left to train: another save_path/checkpoint_dir starts afresh)",
            )
            if moved and world.rank == 0:
                logger.warning(
                    "resuming a %d-process run on %d processes%s: the rest of the epoch is "
                    "sharded anew (%d data shards, from %d); global batch now %d",
                    resumed.world_size,
                    world.size,
                    " laid out anew" if resumed.world_size == world.size else "",
                    world.data.size,
                    resumed.data_shards,
                    global_batch,
                )
        log_plan(
            world, global_batch, options.batch_size_per_gpu, options.update_every, state.total_steps
        )
        show = world.rank == 0
        self.progress = Progress(
            show, options.use_tqdm, state.total_steps, state.global_step, global_batch
        )
        self.losses.reset(state.global_step)
        if resumed is not None and state.unread_loss is not None and world.rank == 0:
            self.losses.carry(*state.unread_loss)  # the next log step covers them too
        state.unread_loss = None

    def _updates_left(self) -> int | None:
        """Optimizer updates from the current position to the end of the last epoch (``None``:
        unknown, a stream)."""
        state = self.state
        left = 0
        for epoch in self._epochs():
            mid = epoch == state.epoch and not state.epoch_complete
            position = (state.samples_in_epoch, state.batches_in_epoch) if mid else (0, 0)
            n = self.data.n_updates(epoch, *position)
            if n is None:
                return None
            left += n
        return left

    def _end(self) -> None:
        """After the last epoch: the last losses and weights checked, the verdict on slow
        ranks, the best model loaded where asked."""
        state = self.state
        self.sync(check_model=True)
        self.run.slow_ranks.summary()
        if self.options.load_best_model and state.best_eval is not None:
            self.run.validator.best.load(self.world.rank == 0, state.best_epoch, state.best_step)

    def where(self) -> Any:
        """The position board with this rank's precise position (for failure reports)."""
        state, board = self.state, self.world.board
        board.move(epoch=state.epoch, step=state.global_step, hook=self.callbacks.current)
        return board
