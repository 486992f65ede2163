"""Sphinx configuration of the fastdist documentation site (``sphinx-build -W docs docs/_build``)."""

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
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"fastdist {release}"
exclude_patterns = ["_build"]
