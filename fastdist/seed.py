"""Seeding every random number generator a training run uses."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (CUDA included) with ``seed``.

    Call it with the same seed on every rank before building the model; DDP also copies rank
    0's initial weights to the other ranks, so the replicas always start equal.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
