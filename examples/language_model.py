"""Train a byte-level Transformer language model on the docstrings of Python's standard library.

    torchrun --nproc-per-node=2 examples/language_model.py    # 2 processes (CPU: gloo)
    python examples/language_model.py                         # 1 process

The text ships with Python itself (no download): the docstrings of a fixed list of standard
library modules and of their public classes, methods and functions, in a fixed order (about
310 KB with Python 3.11; ``--max-bytes`` takes the first 300 KB). Rank 0 collects and caches
them first while the other ranks wait (``rank_zero_first``); every 10th docstring is held out
as dev data. The model returns its own loss (``loss=None``); the dev loss and perplexity are
reduced over all ranks by a metric built on ``LossMetric``. After training,
``trainer.predict`` samples a continuation of every prompt: each rank decodes its shard of
the prompts with no collective inside, and rank 0 prints them in prompt order.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import fastdist
from fastdist import DistTrainer, LossMetric, Metric, logger, rank_zero_first
from fastdist.callbacks import Callback, GradientClipCallback, WarmupCallback

# Standard-library modules whose docstrings make the corpus, in this order.
MODULES = (
    "abc argparse base64 bisect calendar collections contextlib copy csv dataclasses datetime "
    "decimal difflib enum fractions functools heapq inspect io ipaddress itertools json logging "
    "math operator os pathlib pickle pprint queue random re shutil statistics string subprocess "
    "tarfile tempfile textwrap threading typing unittest uuid zipfile"
)
PROMPTS = (
    "Return the ",
    "If the ",
    "This module provides ",
    "Raise ValueError if ",
    "class ",
    "The default ",
    "Create a new ",
    "A list of ",
)


def collect_docstrings() -> list[str]:
    """The docstrings of ``MODULES`` and of their public classes, methods and functions."""
    docs: list[str | None] = []
    for name in MODULES.split():
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module))
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue  # private, or imported from elsewhere
            if inspect.isclass(obj) or inspect.isroutine(obj):
                docs.append(inspect.getdoc(obj))
            if inspect.isclass(obj):
                for member, value in sorted(vars(obj).items()):
                    if not member.startswith("_") and (
                        inspect.isroutine(value) or isinstance(value, property)
                    ):
                        docs.append(inspect.getdoc(value))
    texts = list(dict.fromkeys(doc for doc in docs if doc))  # each text once, in order
    if not texts:
        raise RuntimeError("no docstrings found: is Python running with -OO?")
    return texts


def build_or_load_cached(cache_dir: str) -> list[str]:
    """Collect the docstrings once per Python version and cache them; later calls load them."""
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    path = os.path.join(cache_dir, f"stdlib_docs_py{version}.json")
    if not os.path.exists(path):
        docs = collect_docstrings()
        os.makedirs(cache_dir, exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(docs, f)
        os.replace(path + ".tmp", path)  # readers never see a half-written cache
        size = sum(len(doc.encode()) for doc in docs)
        logger.info("cached %d docstrings (%d bytes) in %s", len(docs), size, path)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def split_corpus(docs: list[str], max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``max_bytes`` of docstrings as bytes: every 10th to dev, the rest to train."""
    train: list[str] = []
    dev: list[str] = []
    size = 0
    for i, doc in enumerate(docs):
        if size >= max_bytes:
            break
        (dev if i % 10 == 9 else train).append(doc)
        size += len(doc.encode("utf-8")) + 2
    return encode("\n\n".join(train)), encode("\n\n".join(dev))


class Chunks(Dataset):
    """Consecutive windows of a byte stream: ``x`` (``block_size`` bytes), ``y`` shifted by 1."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return {"x": chunk[:-1], "y": chunk[1:]}


class Prompts(Dataset):
    """The prompts to continue, as bytes (the last ``block_size``), with their index."""

    def __init__(self, prompts: list[str], block_size: int) -> None:
        self.prompts, self.block_size = prompts, block_size

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": encode(self.prompts[i])[-self.block_size :], "index": i}


class ByteLM(nn.Module):
    """A small causal Transformer over bytes (pre-norm ``nn.TransformerEncoder`` layers)."""

    def __init__(
        self, d_model: int, n_layers: int, n_heads: int, block_size: int, dropout: float
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        n = x.size(1)
        h = self.embed(x) + self.pos(torch.arange(n, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=x.device)
        logits = self.head(self.norm(self.encoder(h, mask=mask, is_causal=True)))
        output = {"pred": logits}
        if y is not None:  # training and evaluation: the mean loss over the batch's bytes
            output["loss"] = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        return output


class PerplexityMetric(Metric):
    """The mean dev loss per byte (``loss``, the model's own) and its perplexity (``ppl``)."""

    keys = ("loss", "ppl")

    def __init__(self) -> None:
        self.loss = LossMetric(loss=None, target="y")  # the output's "loss", weighted by batch
        super().__init__(target="y")

    def reset(self) -> None:
        self.loss.reset()

    def update(self, output: Any, batch: Any) -> None:
        self.loss.update(output, batch)

    def state(self) -> torch.Tensor:
        return self.loss.state()

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        loss = self.loss.compute(state)["loss"]
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}


def sampler(
    model: ByteLM, max_new_tokens: int, temperature: float, seed: int
) -> Callable[[Any, Any], list[dict[str, Any]]]:
    """``to_output`` for ``predict``: continue each prompt of the batch, on this rank only.

    The forward pass ``predict`` already ran gives the first next-byte logits; the loop feeds
    the model again for every further byte. Prompt ``i`` samples with a generator seeded with
    ``seed + i``, so its text does not depend on which rank decodes it. ``temperature=0``:
    greedy decoding.
    """

    def next_byte(logits: torch.Tensor, gen: torch.Generator) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def to_output(output: dict[str, torch.Tensor], batch: dict[str, Any]) -> list[dict[str, Any]]:
        samples = []
        for row, (prompt, index) in enumerate(
            zip(batch["x"], batch["index"].tolist(), strict=True)
        ):
            gen = torch.Generator(device=prompt.device).manual_seed(seed + index)
            tokens, new = prompt.tolist(), []
            logits = output["pred"][row, -1]
            for step in range(max_new_tokens):
                new.append(next_byte(logits, gen))
                if step + 1 < max_new_tokens:
                    context = torch.tensor([(tokens + new)[-model.block_size :]], device=gen.device)
                    logits = model(context)["pred"][0, -1]
            samples.append({"index": index, "prompt": decode(tokens), "text": decode(new)})
        return samples

    return to_output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-bytes", type=int, default=300_000, help="corpus size cap")
    parser.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--batch-size-per-gpu", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-new-tokens", type=int, default=120, help="bytes to sample")
    parser.add_argument("--temperature", type=float, default=0.5, help="0: greedy")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--cache-dir", default="cache")
    parser.add_argument("--save-path", default="save_lm")
    parser.add_argument("--tensorboard", metavar="DIR", help="also log to TensorBoard in DIR")
    args = parser.parse_args()
    if args.prompt and not all(args.prompt):
        parser.error("--prompt must not be empty")

    fastdist.set_seed(42)
    with rank_zero_first():
        docs = build_or_load_cached(args.cache_dir)
    train_bytes, dev_bytes = split_corpus(docs, args.max_bytes)
    train_data = Chunks(train_bytes, args.block_size)
    dev_data = Chunks(dev_bytes, args.block_size)
    logger.info(
        "%d train / %d dev bytes: %d / %d windows of %d",
        len(train_bytes),
        len(dev_bytes),
        len(train_data),
        len(dev_data),
        args.block_size,
    )
    model = ByteLM(args.d_model, args.layers, args.heads, args.block_size, args.dropout)
    callbacks_master: list[Callback] = []
    if args.tensorboard:
        from fastdist.callbacks.tensorboard import TensorBoardCallback

        callbacks_master.append(TensorBoardCallback(args.tensorboard, hparams=vars(args)))
    trainer = DistTrainer(
        train_data=train_data,
        dev_data=dev_data,
        model=model,
        loss=None,  # the model returns {"loss": ...}
        metrics=PerplexityMetric(),
        metric_key="-loss",
        optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01),
        callbacks_all=[WarmupCallback(warmup=0.1, schedule="cosine"), GradientClipCallback(1.0)],
        callbacks_master=callbacks_master,
        batch_size_per_gpu=args.batch_size_per_gpu,
        n_epochs=args.epochs,
        print_every=20,
        save_path=args.save_path,
    )
    result = trainer.train()
    best = result["best_eval"]
    logger.info(
        "best dev loss %.4f (perplexity %.2f, %.3f bits per byte) at epoch %d (%d updates, %.1f s)",
        best["loss"],
        best["ppl"],
        best["loss"] / math.log(2),
        result["best_epoch"],
        result["steps"],
        result["seconds"],
    )

    # Every rank samples its shard of the prompts; rank 0 gets all of them, in prompt order.
    prompts = Prompts(args.prompt or list(PROMPTS), args.block_size)
    to_output = sampler(model, args.max_new_tokens, args.temperature, seed=42)
    # One prompt per batch: prompts differ in length, and a batch of 1 needs no padding.
    samples = trainer.predict(prompts, batch_size_per_gpu=1, to_output=to_output)
    if samples is not None:  # rank 0
        for sample in samples:
            print(f"--- sample {sample['index']}: {sample['prompt']!r}")
            print(sample["prompt"] + sample["text"], flush=True)


if __name__ == "__main__":
    main()
