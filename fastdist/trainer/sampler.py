"""Moved to :mod:`fastdist.data.sampler`; this name keeps old imports working."""

from fastdist.data.sampler import ResumableSampler

__all__ = ["ResumableSampler"]
