"""fastdist: distributed data-parallel training for PyTorch, as easy as one process.

Example:
    >>> from fastdist import DistTrainer, CrossEntropyLoss, AccuracyMetric
    >>> trainer = DistTrainer(train_data, model, optimizer, loss=CrossEntropyLoss(),
    ...                       dev_data=dev_data, metrics=AccuracyMetric(), use_tqdm=False)
    >>> result = trainer.train()  # torchrun --nproc-per-node=2 train.py: the same script
    >>> result["steps"]
    8
"""

from fastdist.callbacks import Callback
from fastdist.distributed import (
    all_gather_object,
    barrier,
    broadcast_object,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_master,
    rank_zero_first,
    rank_zero_only,
)
from fastdist.estimate import estimate_memory
from fastdist.evaluation import predict
from fastdist.logging import add_file, init_logger_dist, logger
from fastdist.losses import CrossEntropyLoss, Loss
from fastdist.metrics import AccuracyMetric, ClassifyFPreRecMetric, LossMetric, Metric
from fastdist.seed import set_seed
from fastdist.state import TrainerState
from fastdist.strategies import DDP, FSDP, Pipeline
from fastdist.trainer import DistTrainer

__version__ = "0.1.0"

__all__ = [
    "AccuracyMetric",
    "Callback",
    "ClassifyFPreRecMetric",
    "CrossEntropyLoss",
    "DDP",
    "DistTrainer",
    "FSDP",
    "Loss",
    "LossMetric",
    "Metric",
    "Pipeline",
    "TrainerState",
    "add_file",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "estimate_memory",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "init_logger_dist",
    "is_master",
    "logger",
    "predict",
    "rank_zero_first",
    "rank_zero_only",
    "set_seed",
]
