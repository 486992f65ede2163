"""TokenBatchSampler vs fixed-size batches: padding fraction and real tokens per second.

Run on demand from the repository root (one process, or under torchrun)::

    python benchmarks/token_batches.py [--max-docs N] [--max-len L] [--batch B] [--rounds K]

Samples are the language-model example's docstrings (``examples/language_model.py``), one per
sample, as bytes cut to ``--max-len``; a batch is padded to its longest sample and the loss is
a ``(sum, count)`` over the real bytes. Both modes train the example's ``ByteLM`` for one epoch
with ``DistTrainer``, alternating per round: fixed batches of ``--batch`` samples, and
``TokenBatchSampler`` with ``max_tokens = batch x max_len`` (the fixed batches' worst case).
Prints the padding fraction of each mode's batches and the median real tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from language_model import ByteLM, build_or_load_cached, encode  # noqa: E402

import fastdist  # noqa: E402
from fastdist import DistTrainer, rank_zero_first  # noqa: E402
from fastdist.data import TokenBatchSampler  # noqa: E402
from fastdist.data.sampler import epoch_order  # noqa: E402


class Docs(Dataset):
    """One docstring per sample: ``x`` its bytes, ``y`` shifted by one (at most ``max_len``)."""

    def __init__(self, docs: list[str], max_len: int) -> None:
        self.items = [encode(d)[: max_len + 1] for d in docs if len(d.encode("utf-8")) > 1]
        self.lengths = [len(t) - 1 for t in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def pad_collate(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the longest sample: ``x`` with 0, ``y`` with -100 (ignored by the loss)."""
    n = max(len(t) for t in items) - 1
    x = torch.zeros(len(items), n, dtype=torch.long)
    y = torch.full((len(items), n), -100, dtype=torch.long)
    for row, t in enumerate(items):
        x[row, : len(t) - 1], y[row, : len(t) - 1] = t[:-1], t[1:]
    return {"x": x, "y": y}


def token_loss(output: dict[str, Any], batch: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """Cross entropy summed over the real bytes, and their number."""
    logits, y = output["pred"], batch["y"]
    total = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum")
    return total, (y != -100).sum()


def padding_fraction(batches: list[list[int]], lengths: list[int]) -> float:
    """Share of the padded batch positions that are padding."""
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - real / padded


def train_once(data: Docs, args: argparse.Namespace, token: bool) -> float:
    """One epoch; rank 0's wall seconds."""
    torch.manual_seed(0)
    model = ByteLM(128, 2, 4, args.max_len, 0.0)
    options: dict[str, Any] = {"batch_size_per_gpu": args.batch}
    if token:
        options = {"batch_sampler": TokenBatchSampler(data.lengths, args.batch * args.max_len)}
    trainer = DistTrainer(
        data,
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss=token_loss,
        collate_fn=pad_collate,
        n_epochs=1,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        **options,
    )
    return float(trainer.train()["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-docs", type=int, default=1500)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", default="cache")
    args = parser.parse_args()
    with rank_zero_first():
        docs = build_or_load_cached(args.cache_dir)[: args.max_docs]
    data = Docs(docs, args.max_len)
    order = epoch_order(len(data), True, 0, 1)
    fixed = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
    tokens = TokenBatchSampler(data.lengths, args.batch * args.max_len).batches(1)
    real = sum(data.lengths)
    seconds: dict[str, list[float]] = {"fixed": [], "token": []}
    for _ in range(args.rounds):
        for name in seconds:
            seconds[name].append(train_once(data, args, token=name == "token"))
    if fastdist.is_master():
        print(f"{len(data)} samples, {real} real tokens, {fastdist.get_world_size()} process(es)")
        for name, batches in (("fixed", fixed), ("token", tokens)):
            median = statistics.median(seconds[name])
            padding = padding_fraction(batches, data.lengths)
            print(
                f"{name}: {len(batches)} batches, padding {padding:.1%}, "
                f"{median:.2f} s/epoch (median of {args.rounds}), {real / median:.0f} tokens/s"
            )


if __name__ == "__main__":
    main()
