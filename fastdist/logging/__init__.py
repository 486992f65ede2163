"""Rank-aware logging."""

from fastdist.logging.logger import add_file, init_logger_dist, logger

__all__ = ["add_file", "init_logger_dist", "logger"]
