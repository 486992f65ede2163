"""The rank-aware ``fastdist`` logger: INFO on rank 0, WARNING elsewhere, tagged with the rank."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from fastdist.distributed.env import (
    get_local_rank,
    get_node_rank,
    get_rank,
    get_world_size,
    is_multi_node,
)

LOGGER_NAME = "fastdist"
_FORMAT = "%(asctime)s %(levelname)s%(rank_tag)s %(message)s"
_DATEFMT = "%Y-%m-%d %H:%M:%S"


class _RankFilter(logging.Filter):
    """Tag records with the rank; with ``gate``, pass non-zero ranks from WARNING up only."""

    def __init__(self, gate: bool) -> None:
        super().__init__()
        self.gate = gate

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.rank_tag = ""
        if is_multi_node():
            record.rank_tag = f" [rank {rank} = node {get_node_rank()}/{get_local_rank()}]"
        elif get_world_size() > 1:
            record.rank_tag = f" [rank {rank}]"
        return not self.gate or rank == 0 or record.levelno >= logging.WARNING


class _TqdmHandler(logging.Handler):
    """Write to the current ``sys.stderr`` through ``tqdm.write``, so a bar is not torn.

    The line and its newline go out in one write: ranks share torchrun's stderr, and a
    separate newline let another rank's line land in the middle of this one.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record) + "\n", file=sys.stderr, end="")
        except Exception:
            self.handleError(record)


def _attach(handler: logging.Handler, gate: bool) -> None:
    handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    handler.addFilter(_RankFilter(gate))
    logger.addHandler(handler)


logger = logging.getLogger(LOGGER_NAME)
logger.setLevel(logging.INFO)
logger.propagate = False
if not logger.handlers:  # importlib.reload must not double every line
    _attach(_TqdmHandler(), gate=True)


def init_logger_dist(level: int | str = logging.INFO) -> logging.Logger:
    """Set the level rank 0 logs at (other ranks still show only WARNING and up).

    Kept from fastNLP's API; the logger is rank-aware without calling this.
    """
    logger.setLevel(level)
    return logger


def add_file(path: str, all_ranks: bool = False) -> None:
    """Also write the log to ``path``; with ``all_ranks`` each rank writes ``path.rank<N>``.

    Without ``all_ranks`` only rank 0 writes, and it writes everything it logs.
    """
    rank = get_rank()
    if all_ranks:
        path = f"{path}.rank{rank}"
    elif rank != 0:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _attach(logging.FileHandler(path), gate=not all_ranks)
