"""The trainer's scalar options as a typed, validated config.

Validation runs before the process group starts, on every rank alike, so bad input fails the
same way everywhere and never leaves a rank waiting in a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerConfig:
    """Options of :class:`~fastdist.DistTrainer`; see its docstring for their meaning."""

    batch_size_per_gpu: int = 8
    dev_batch_size_per_gpu: int | None = None
    n_epochs: int = 1
    update_every: int = 1
    print_every: int = 10
    validate_every: int = -1
    num_workers: int = 0
    drop_last: bool = False
    metric_key: str | None = None
    save_path: str | None = None
    use_tqdm: bool = True
    seed: int = 0
    load_best_model: bool = True
    find_unused_parameters: bool = False
    timeout: float | None = None
    on_nonfinite: str = "raise"
    check_sync_every: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 2
    amp: str | None = None
    ddp_comm_hook: str | None = None
    average_every: int = 0
    bucket_cap_mb: float | None = None
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    strategy: str = "ddp"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    prefetch_factor: int | None = None
    slow_rank_threshold: float = 0.1

    def __post_init__(self) -> None:
        for name in ("batch_size_per_gpu", "n_epochs", "update_every", "print_every"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.dev_batch_size_per_gpu is not None:
            _check_int("dev_batch_size_per_gpu", self.dev_batch_size_per_gpu, minimum=1)
        _check_int("num_workers", self.num_workers, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        _check_int("validate_every", self.validate_every, minimum=-1)
        if self.validate_every == 0:
            raise ValueError(
                "validate_every=0 is not valid: use -1 to evaluate at the end of every epoch, "
                "or N > 0 to evaluate every N optimizer updates"
            )
        _check_int("check_sync_every", self.check_sync_every, minimum=0)
        _check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        _check_int("keep_checkpoints", self.keep_checkpoints, minimum=1)
        if self.timeout is not None and not (
            isinstance(self.timeout, (int, float)) and self.timeout > 0
        ):
            raise ValueError(
                f"timeout must be a number of seconds > 0 or None, got {self.timeout!r}"
            )
        _check_int("average_every", self.average_every, minimum=0)
        if self.ddp_comm_hook not in (None, "fp16", "bf16", "powersgd"):
            hook = self.ddp_comm_hook
            raise ValueError(f"ddp_comm_hook must be None, fp16, bf16 or powersgd; got {hook!r}")
        if self.ddp_comm_hook and self.average_every:
            raise ValueError("ddp_comm_hook and average_every both set DDP's hook: choose one")
        self._check_strategy()
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")
        if self.prefetch_factor is not None:
            _check_int("prefetch_factor", self.prefetch_factor, minimum=1)
        threshold = self.slow_rank_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
            raise ValueError(
                f"slow_rank_threshold must be a number >= 0 (0.1: warn when a rank is 10% slower "
                f"than the median; 0: off), got {threshold!r}"
            )
        if self.on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {self.on_nonfinite!r}")
        if self.on_nonfinite == "skip" and self.average_every:
            raise ValueError(
                "on_nonfinite='skip' needs the gradients all-reduced every update, so that every "
                "rank skips the same updates; average_every steps on local gradients: use "
                "on_nonfinite='raise' with it"
            )
        if self.metric_key is not None and not isinstance(self.metric_key, str):
            raise TypeError(
                f"metric_key must be a str such as 'acc' or '-loss', got {self.metric_key!r}"
            )
        if self.save_path is not None and not isinstance(self.save_path, (str, os.PathLike)):
            raise TypeError(f"save_path must be a directory path or None, got {self.save_path!r}")

    def _check_strategy(self) -> None:
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError(
                f"strategy must be 'ddp' (every rank holds the whole model) or 'fsdp' (sharded "
                f"parameters, gradients and optimizer state), got {self.strategy!r}"
            )
        if self.strategy == "ddp":
            if not self.reshard_after_forward or self.cpu_offload:
                raise ValueError(
                    "reshard_after_forward and cpu_offload are options of strategy='fsdp'"
                )
            return
        ddp_only = {
            "ddp_comm_hook": self.ddp_comm_hook is not None,
            "average_every": self.average_every != 0,
            "bucket_cap_mb": self.bucket_cap_mb is not None,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "find_unused_parameters": self.find_unused_parameters,
        }
        for name, given in ddp_only.items():
            if given:
                raise ValueError(
                    f"{name} is an option of DDP; strategy='fsdp' has no use for it: drop it, "
                    "or use strategy='ddp'"
                )

    @property
    def eval_batch_size(self) -> int:
        return self.dev_batch_size_per_gpu or self.batch_size_per_gpu


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
