"""Streaming training data: an ``IterableDataset`` sharded over ranks and DataLoader workers.

Every reader (each DataLoader worker of each rank, or each rank without workers) takes a
disjoint part of the stream: item ``i`` goes to reader ``i % readers``
(:class:`~fastdist.data.StreamShard`), unless the dataset already reads only its own part and
says so (:class:`~fastdist.data.ShardedStream`).
Nobody knows in advance how many batches a rank gets, so the ranks agree on them before
training on them: every rank reads its next :data:`AGREED_UPDATES` update windows (fewer where
they exceed ``read_ahead_mb``) and one small all-reduce (CPU, on a gloo group of its own)
gives every rank every rank's batch sizes (:meth:`StreamBatches._agree`). From them each rank
weighs its micro-batches as for map-style data (:func:`~fastdist.data.batches.window_weights`),
a rank with fewer batches repeats its last batch with weight 0 (a filler), and the epoch ends
on every rank after the last window in which some rank has a batch. The next agreement starts
while the current one's last window trains (docs/benchmarks.rst).

Resume: a dataset with ``state_dict()``/``load_state_dict()`` (torchdata's ``Stateful``: the
position of its current iteration; loaded before the next ``iter()``, in the worker that reads)
is read through torchdata's ``StatefulDataLoader``; a checkpoint holds every rank's loader state
and a resumed run continues the epoch exactly (same world size and ``num_workers``). Any other
stream restarts the interrupted epoch from its start, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

from fastdist.data.batches import window_weights
from fastdist.data.feed import CountingCollate, batch_bytes
from fastdist.data.stream_shards import EpochCarrier, ShardedStream, StreamShard, is_stateful
from fastdist.distributed.collectives import start_all_reduce_sum
from fastdist.logging import logger

#: Updates one agreement all-reduce (~0.1-1 ms on 2 CPU processes) covers at most.
AGREED_UPDATES = 16
Window = tuple[list[tuple[int, Any]], "dict[str, Any] | None"]  # (size, batch)s, position after


class StreamBatches:
    """This rank's batches of a stream, an update window at a time (see the module docstring).

    The interface of :class:`~fastdist.data.TrainBatches`, with what a stream cannot know in
    advance left unknown: ``n_updates`` is ``None`` and ``ends_pass`` is never true before the
    end. ``weights`` grows by one window just before its first batch is yielded, so after a
    window's last batch ``len(weights)`` is the micro-batches so far. The windows of one
    agreement are read ahead together; :meth:`state_dict` is the loader's position after the
    window yielded last.

    Args:
        read_ahead_mb: host memory (MiB) the windows read ahead may hold.
        group: a gloo (CPU) group of its own for the agreement (never behind a GPU or DDP).
        wait: a context manager factory timing the agreement as collective wait.
    """

    plans_uneven = True  # uneven ends are agreed and weighed as they come

    def __init__(
        self,
        data: Any,
        batch_size: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        update_every: int,
        read_ahead_mb: float = 256.0,
        group: Any = None,
        wait: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        collate_fn: Callable | None = None,
        **loader_options: Any,
    ) -> None:
        self.rank, self.world_size, self.update_every = rank, world_size, update_every
        self.read_ahead_mb = read_ahead_mb
        self.group, self.wait = group, wait
        self.source: EpochCarrier
        if isinstance(data, ShardedStream):  # reads its own part: taken as it is
            self.source, self.stateful = data, is_stateful(data.dataset)
        else:
            self.source, self.stateful = StreamShard(data, rank, world_size), is_stateful(data)
        loader_class: Any = DataLoader
        if self.stateful:
            try:
                from torchdata.stateful_dataloader import StatefulDataLoader
            except ImportError as exc:
                raise ImportError(
                    "train_data is a stream with state_dict/load_state_dict: resuming it "
                    "exactly needs torchdata's StatefulDataLoader: pip install torchdata"
                ) from exc
            loader_class = StatefulDataLoader
        with warnings.catch_warnings():  # torchdata 0.11 still calls torch.set_vital
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self.loader = loader_class(
                self.source,
                batch_size,
                drop_last=drop_last,
                collate_fn=CountingCollate(collate_fn or default_collate),
                **loader_options,
            )
        self.num_workers = loader_options.get("num_workers", 0)
        self.weights: list[float] = []
        self.samples: list[int] = []  # this rank's micro-batch sizes, fillers 0
        self.exhausted = False  # this rank's stream has ended in the current pass
        self.last: Any = None  # the latest batch this rank read: what a filler repeats
        self._resume: dict[str, Any] | None = None  # the position the next pass starts from
        self._saved: dict[str, Any] | None = None  # a checkpoint's position, until resumed
        self._unsaved_why: str | None = None  # why a checkpoint holds no usable position
        self._state: dict[str, Any] | None = None  # the loader's position after the window
        self._read_last: dict[str, Any] | None = None  # that after the last window read
        self._ends: dict[int, tuple[int, int]] = {}  # micro-batches done -> position
        self._after: Any = None  # the next window's sizes per rank, or their agreement
        self.epoch = 0

    def n_updates(self, epoch: int, samples: int = 0, batches: int = 0) -> None:
        """Unknown for a stream."""
        return None

    def begin(self, epoch: int, samples: int, batches: int) -> None:
        """Start a pass of ``epoch`` from the position ``(samples, batches)``."""
        self.source.set_epoch(epoch)
        self.epoch, self.weights, self.samples = epoch, [], []
        self._ends, self._after = {0: (samples, batches)}, None

    def iterate(self) -> Iterator[Any]:
        """This rank's batches of the pass, with fillers; ``iter()`` of the loader runs now."""
        resume, self._resume = self._resume, None
        self.exhausted, self._read_last = resume is not None and resume["exhausted"], None
        if resume is not None and self.last is None and not resume.get("ended"):  # for fillers
            self.last = self._first_batch()
        if resume is not None and not self.exhausted:
            self.loader.load_state_dict(resume["loader"])
        return self._windows(iter(()) if self.exhausted else iter(self.loader))

    def _no_item(self) -> str:
        """Why no rank got a batch in this epoch: what the stream may be."""
        why = "it is empty, or it can be read only once (its __iter__ must start anew every epoch)"
        return f"train_data, a stream, gave no item in epoch {self.epoch} on any rank: " + (
            self._dropped("each rank's") + why
        )

    def _no_item_on(self, empty: list[int]) -> str:
        """Why ranks ``empty`` got no batch while others did."""
        readers = self.world_size * max(self.num_workers, 1)
        return (
            f"the streaming train_data gave rank(s) {empty} no item while other ranks had "
            f"some: {self._dropped('their')}it holds fewer items than its {readers} readers "
            "(processes x num_workers); use fewer processes or workers, or more data"
        )

    def _dropped(self, whose: str) -> str:
        """The first cause of a missing batch under ``drop_last`` ("" without it)."""
        if not getattr(self.loader, "drop_last", False):
            return ""
        return (
            f"drop_last=True dropped {whose} last batch, which held fewer than "
            f"batch_size_per_gpu={self.loader.batch_size} items (pass drop_last=False, or a "
            "smaller batch_size_per_gpu), or "
        )

    def _first_batch(self) -> Any:
        """This rank's first batch of the pass (``None`` if it has none), read without moving
        the stream: what a resumed rank repeats as its fillers (weight 0)."""
        start = self.loader.state_dict()
        _, batch = next(iter(self.loader), (0, None))
        self.loader.load_state_dict(start)  # the next iter() starts where this one did
        return batch

    def _windows(self, batches: Iterator[tuple[int, Any]]) -> Iterator[Any]:
        k, group = self.update_every, self._read(batches, 1)
        count = self._size_read_ahead(group)
        group += self._read(batches, count - 1)
        agreed = self._agree(group)
        while True:
            windows = agreed()
            for j, sizes in enumerate(windows):
                length = max(map(len, sizes))
                if not length and self._ends == {0: (0, 0)}:  # every rank's, from the start
                    raise ValueError(self._no_item())
                if not length:  # no rank has a batch left: the epoch ends here, on every rank
                    return
                own, self._state = group[j]  # a checkpoint after this window resumes there
                if j == count - 1:  # read the next windows; their agreement runs meanwhile
                    ahead = self._read(batches, count)
                    agreed = self._agree(ahead)
                self._after = agreed if j == count - 1 else windows[j + 1]
                samples, n_batches = self._ends[len(self.weights)]
                self.weights += window_weights(sizes, self.rank, k)
                self.samples += sizes[self.rank] + [0] * (length - len(sizes[self.rank]))
                done = (samples + sum(map(sum, sizes)), n_batches + sum(map(len, sizes)))
                self._ends[len(self.weights)] = done
                for _, batch in own:
                    yield batch
                for _ in range(len(own), length):
                    yield self.last
            group = ahead

    def _read(self, batches: Iterator[tuple[int, Any]], count: int) -> list[Window]:
        """This rank's next ``count`` windows of ``update_every`` (size, batch) pairs, each
        with the loader's position after it; the windows after its stream ended are empty."""
        windows = []
        for _ in range(count):
            own = [] if self.exhausted else list(itertools.islice(batches, self.update_every))
            if not own and not self.exhausted and self._read_last is not None:
                # The window before ended the stream: a resume there reads nothing more (its
                # position may not say so: a stream may start anew after its last item).
                self._read_last.update(loader=None, exhausted=True)
            self.exhausted = len(own) < self.update_every
            if own:
                self.last = own[-1][1]
            self._read_last = self._loader_state()
            windows.append((own, self._read_last))
        return windows

    def _size_read_ahead(self, first: list[Window]) -> int:
        """Windows per agreement within ``read_ahead_mb``, from the largest batch of the pass's
        first window on any rank (one all-reduce: every rank finds the same)."""
        sizes = torch.zeros(self.world_size, dtype=torch.float64)
        sizes[self.rank] = max((batch_bytes(b) for pairs, _ in first for _, b in pairs), default=0)
        with self.wait():
            window_mb = max(start_all_reduce_sum(sizes, self.group)().tolist()) / 2**20
        window_mb *= self.update_every
        fit = int(self.read_ahead_mb // window_mb) if window_mb else AGREED_UPDATES
        return min(max(fit, 1), AGREED_UPDATES)

    def _agree(self, windows: list[Window]) -> Callable[[], list[list[list[int]]]]:
        """Start the all-reduce that tells every rank every rank's batch sizes of the
        ``windows``; return the function that waits for them (per window, per rank).

        Each rank writes its sizes and whether it has a batch to repeat into its own slot. A
        rank that must repeat a batch and has none (its part of the stream was empty) makes
        every rank raise the same error, as all of them see it.
        """
        k, n = self.update_every, self.update_every * len(windows)
        vector = torch.zeros(self.world_size, n + 1, dtype=torch.float64)
        own = [size for pairs, _ in windows for size, _ in pairs]
        vector[self.rank, : len(own)] = torch.tensor(own, dtype=torch.float64)
        vector[self.rank, n] = float(self.last is not None)
        summed = start_all_reduce_sum(vector, self.group)

        def sizes() -> list[list[list[int]]]:
            with self.wait():
                rows = summed().tolist()
            per_window = [
                [[int(s) for s in row[start : start + k] if s > 0] for row in rows]
                for start in range(0, n, k)
            ]
            for window in per_window:
                length = max(map(len, window))
                empty = [r for r, row in enumerate(rows) if len(window[r]) < length and not row[n]]
                if empty:
                    raise RuntimeError(self._no_item_on(empty))
            return per_window

        return functools.cache(sizes)  # read by ends_pass(wait=True) too

    def ends_window(self, done: int) -> bool:
        """Whether ``done`` micro-batches end a window (one agreed so far)."""
        return done in self._ends

    def ends_pass(self, done: int, wait: bool = False) -> bool:
        """Whether ``done`` micro-batches end the pass: known where the next window's sizes
        were agreed with this one's, else once their agreement (under way) is read, which
        ``wait`` does (every rank finds the same)."""
        after = self._after
        if done != len(self.weights) or after is None or (callable(after) and not wait):
            return False
        return not max(map(len, after()[0] if callable(after) else after))

    def position(self, done: int) -> tuple[int, int]:
        """(samples, batches) of the epoch trained on by all ranks after ``done`` micro-batches
        of this pass each (``done`` ends a window)."""
        return self._ends[done]

    def _loader_state(self) -> dict[str, Any] | None:
        """The loader's position now (a stateful stream), else ``None``."""
        if not self.stateful:
            return None
        loader = None if self.exhausted else self.loader.state_dict()
        return {"loader": loader, "exhausted": self.exhausted, "workers": self.num_workers}

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's loader position after the last window yielded (a stateful stream: the
        batches read ahead are not behind it), else ``None``; where the pass is known to end
        there (the agreement, waited for), that it ended: a resume there reads nothing more,
        whatever the stream or the number of processes."""
        if self.ends_pass(len(self.weights), wait=True):
            return {"loader": None, "exhausted": True, "workers": self.num_workers, "ended": True}
        return self._state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Keep this rank's saved position for :meth:`resume_at`."""
        self._saved, self._unsaved_why = state, None

    def load_resized(self, states: list[Any]) -> None:
        """Positions of another world size cannot continue (the epoch will restart), but for
        the pass's end."""
        ended = all(state is not None and state.get("ended") for state in states)
        self._saved = states[0] if ended else None
        self._unsaved_why = (
            None if ended else "the checkpoint was written by a different number of processes"
        )

    def resume_at(self, samples: int, batches: int) -> tuple[int, int]:
        """Continue the interrupted pass from the saved position if it allows; else warn and
        restart the epoch from its start."""
        state, why = self._saved, self._unsaved_why
        if state is not None and state.get("ended"):  # nothing is left to read, on any rank
            self._resume = state
            return samples, batches
        if not self.stateful:
            why = "it has no state_dict()/load_state_dict() to save its position"
        elif state is not None and state["workers"] != self.num_workers:
            why = f"num_workers was {state['workers']} and is {self.num_workers} now"
        elif state is None and why is None:
            why = "the checkpoint holds no position of this rank's stream"
        if why is None:
            self._resume = state
            return samples, batches
        logger.warning(
            "the streaming train_data cannot continue its interrupted epoch: %s; the epoch "
            "restarts from its start (what it trained on before is trained on again)",
            why,
        )
        return 0, 0
