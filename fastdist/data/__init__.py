"""Training data: the resumable sampler, token-budget batches, the per-pass batch plan."""

from fastdist.data.batches import TrainBatches, split_batches
from fastdist.data.sampler import ResumableSampler
from fastdist.data.token_batch import TokenBatchSampler

__all__ = ["ResumableSampler", "TokenBatchSampler", "TrainBatches", "split_batches"]
