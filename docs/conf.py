"""Sphinx configuration of the fastdist site: ``sphinx-build -W docs docs/_build``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import fastdist  # noqa: E402

project = "fastdist"
author = "the fastdist developers"
release = version = fastdist.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "sphinx.ext.autosectionlabel",
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"fastdist {release}"
exclude_patterns = ["_build"]

# The docstrings' examples run as doctests (``sphinx-build -b doctest docs ...``) in one
# process, in a fresh directory, against these names; examples that need several processes
# are marked ``+SKIP`` and say how they are launched.
doctest_global_setup = """
import os, tempfile
import torch
from torch import nn
import fastdist
from fastdist import *
from fastdist.callbacks import *
from fastdist.data import ShardedStream
from fastdist.evaluation import split_output
from fastdist.loggers import *
from fastdist.strategies import DDP, FSDP, Topology

os.chdir(tempfile.mkdtemp())
torch.manual_seed(0)


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TransformerBlock(), TransformerBlock()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return {"pred": self.head(x)}


def samples(n):
    x = torch.randn(n, 8)
    return [{"x": x[i], "target": int(x[i, :3].argmax())} for i in range(n)]


train_data, dev_data, test_data = samples(64), samples(32), samples(16)
model = Classifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
batch = {"x": torch.randn(32, 8), "target": torch.zeros(32, dtype=torch.long)}
plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
"""
