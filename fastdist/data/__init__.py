"""Training data: the resumable sampler, token-budget batches, the per-pass batch plan,
streams."""

from fastdist.data.batches import TrainBatches, split_batches, window_weights
from fastdist.data.sampler import ResumableSampler
from fastdist.data.stream import StreamBatches
from fastdist.data.stream_shards import ShardedStream, StreamShard
from fastdist.data.token_batch import TokenBatchSampler

__all__ = [
    "ResumableSampler",
    "ShardedStream",
    "StreamBatches",
    "StreamShard",
    "TokenBatchSampler",
    "TrainBatches",
    "split_batches",
    "window_weights",
]
