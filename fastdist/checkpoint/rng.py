"""The random generators of a process (Python, NumPy, torch, CUDA) as a per-rank part."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def encode_numpy_state(state: Any) -> dict[str, Any]:
    """A NumPy ``RandomState.get_state()`` tuple as tensors and plain data."""
    _, keys, pos, has_gauss, gauss = state
    return {
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(gauss),
    }


def decode_numpy_state(state: dict[str, Any]) -> tuple:
    """The tuple ``RandomState.set_state`` takes, from :func:`encode_numpy_state`."""
    keys = state["keys"].numpy().astype(np.uint32)
    return ("MT19937", keys, state["pos"], state["has_gauss"], state["cached_gaussian"])


def rng_state() -> dict[str, Any]:
    """This process's random generator states, as tensors and plain data."""
    return {
        "python": random.getstate(),
        "numpy": encode_numpy_state(np.random.get_state(legacy=True)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(decode_numpy_state(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RandomState:
    """This rank's generators as a per-rank checkpoint part.

    A loaded state is applied when :meth:`apply` is called, not at once: the training loop
    restores it on the right side of the draw a new pass makes (see its ``epoch_batches``).
    On another world size, ranks that existed before get their own state back.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = state

    def load_resized(self, states: list[Any]) -> None:
        self.pending = states[self.rank] if self.rank < len(states) else None

    def apply(self) -> bool:
        """Restore the loaded state, once; return whether there was one."""
        state, self.pending = self.pending, None
        if state is not None:
            set_rng_state(state)
        return state is not None
