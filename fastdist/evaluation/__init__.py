"""Evaluation and prediction over data sharded across ranks: exact, every sample once."""

from fastdist.evaluation.evaluator import Evaluator, ShardSampler
from fastdist.evaluation.predict import predict, split_output
from fastdist.evaluation.validator import Validator

__all__ = ["Evaluator", "ShardSampler", "Validator", "predict", "split_output"]
