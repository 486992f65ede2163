"""activation_checkpointing=True / "every-2" under DDP and FSDP in one 2-rank gloo launch (the
2-D mesh's case is in tests/test_tensor_parallel.py): the same parameters as without, and less
peak memory, measured per rank as the rise of the resident memory over ``train()``; and
fastdist.estimate_memory within 15% of that peak (plus the parameters held) for each setting;
and BatchNorm's running statistics updated once, not again by the recompute.

glibc is told to serve every allocation above 64 KiB with its own mapping
(``MALLOC_MMAP_THRESHOLD_``), so that freed tensors leave the resident memory at once and its
high-water mark follows the live tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import make_trainer
from launch import run_ranks

from fastdist import Callback

WORKER = Path(__file__).resolve().parent / "workers" / "checkpointing_worker.py"
MIB = 2**20

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("checkpointing")
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    _, ranks = run_ranks(WORKER, 2, [str(out)], out, torchrun=True, timeout=180, env=env)
    return ranks


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_same_parameters(ranks: list[dict[str, Any]], strategy: str) -> None:
    plain = torch.tensor(ranks[0][f"{strategy}-False"]["params"])
    for setting in ("True", "every-2"):
        checkpointed = torch.tensor(ranks[0][f"{strategy}-{setting}"]["params"])
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_less_peak_memory(ranks: list[dict[str, Any]], strategy: str) -> None:
    # 4 blocks of 6 layers keeping 4 MiB each: ~96 MiB of activations; checkpointing every
    # block keeps their inputs and one block's recomputed layers (~40 MiB).
    for rank in ranks:
        plain, every, half = (rank[f"{strategy}-{s}"]["peak"] for s in ("False", "True", "every-2"))
        assert plain > 80 * MIB, plain
        assert every < plain - 40 * MIB, (every, plain)
        assert every < half < plain, (every, half, plain)


def test_batchnorm_statistics_updated_once(ranks: list[dict[str, Any]]) -> None:
    # The recompute in backward runs BatchNorm's forward again: its running statistics must
    # stay as the forward left them (4 micro-batches: num_batches_tracked 4, not 8).
    plain, checkpointed = ranks[0]["batchnorm-False"], ranks[0]["batchnorm-True"]
    assert plain["blocks.0.1.num_batches_tracked"] == [4]
    assert checkpointed.keys() == plain.keys()
    for key, value in plain.items():
        torch.testing.assert_close(
            torch.tensor(checkpointed[key]), torch.tensor(value), msg=key, rtol=0, atol=1e-6
        )


def test_model_without_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing=True checkpoints the model's"):
        make_trainer(Callback(), activation_checkpointing=True)


def test_bad_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="'every-N'"):
        make_trainer(Callback(), activation_checkpointing="every-0")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_memory_estimate_follows_checkpointing(ranks: list[dict[str, Any]], strategy: str) -> None:
    # fastdist.estimate_memory of the same configuration against the parameters held plus
    # the rise over train() (measured peaks of 49 to 112 MiB over the parameters here).
    for rank in ranks:
        for setting in ("False", "True", "every-2"):
            found = rank[f"{strategy}-{setting}"]
            assert 0.85 <= found["measured"] / found["estimate"] <= 1.15, (setting, found)
