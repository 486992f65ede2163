"""Train a Hugging Face GPT-2 under DDP and FSDP, export it, reload it and generate.

    torchrun --nproc-per-node=2 examples/hf_causal_lm.py    # 2 processes (CPU: gloo)
    python examples/hf_causal_lm.py                         # 1 process

Needs ``pip install "fastdist[hf]"`` (transformers, safetensors). Nothing is downloaded
(``HF_HUB_OFFLINE=1``): rank 0 writes a tiny GPT-2 (a config built here, random weights) with
``save_pretrained``, as a hub checkpoint would be, and every rank loads it with
``from_pretrained``, which returns it in eval mode (fastdist trains it in train mode). The
text is the docstrings of a few standard-library modules, one token per byte. Under each
strategy the model trains with its own loss (``loss=None``), reports the dev loss and
perplexity (``LossMetric``), keeps its best model as a Hugging Face folder, and
``trainer.save_model(..., format="hf")``, called on every rank, writes it; rank 0 reloads
that folder with ``from_pretrained``, checks that its logits equal the trained model's and
generates a continuation of a prompt (greedy; a model this small, trained for seconds, mostly
continues with spaces: the point is the round trip).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import fastdist
from fastdist import DistTrainer, LossMetric, logger, rank_zero_first

MODULES = "json re textwrap functools itertools pathlib argparse logging collections"
LENGTH = 64  # tokens (bytes) per sequence
PROMPT = "Return the "


def config() -> GPT2Config:
    """A 2-layer GPT-2 over the 256 byte values (0, which text never holds, ends a text)."""
    return GPT2Config(
        vocab_size=256,
        n_positions=LENGTH,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def sequences() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Train and dev sequences of ``LENGTH`` bytes (every 10th is dev), as HF batches want
    them: ``input_ids`` and ``labels`` (the model shifts the labels itself)."""
    text = "\n\n".join(importlib.import_module(name).__doc__ or "" for name in MODULES.split())
    data = torch.tensor(list(text.encode()), dtype=torch.long)
    windows = data[: len(data) // LENGTH * LENGTH].view(-1, LENGTH)
    samples = [{"input_ids": w, "labels": w} for w in windows]
    return [s for i, s in enumerate(samples) if i % 10], samples[::10]


def train(strategy: str, pretrained: Path, out: Path, epochs: int) -> None:
    """Train, export as a Hugging Face folder, reload it on rank 0 and generate."""
    train_data, dev_data = sequences()
    model = GPT2LMHeadModel.from_pretrained(pretrained)  # in eval mode, as from the hub
    trainer = DistTrainer(
        train_data,
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        loss=None,  # the model's own loss
        dev_data=dev_data,
        metrics=LossMetric(target="labels"),  # the dev loss, weighted by batch size
        metric_key="-loss",
        batch_size_per_gpu=8,
        n_epochs=epochs,
        print_every=10,
        save_path=out / strategy,
        best_model_format="hf",  # the best model as a from_pretrained folder
        strategy=strategy,
    )
    result = trainer.train()
    loss = result["best_eval"]["loss"]
    logger.info("%s: best dev loss %.4f, perplexity %.2f", strategy, loss, math.exp(loss))
    prompt = torch.tensor([list(PROMPT.encode())], device=trainer.device)
    with torch.no_grad():  # every rank: under FSDP each forward gathers the weights
        logits = model(prompt).logits.cpu()  # back in eval mode after training
    exported = trainer.save_model(out / strategy / "model", format="hf")  # every rank
    if trainer.is_master:
        reloaded = GPT2LMHeadModel.from_pretrained(exported)
        with torch.no_grad():
            same = torch.equal(reloaded(prompt.cpu()).logits, logits)
        logger.info("%s: reloaded %s, identical logits: %s", strategy, exported, same)
        ids = reloaded.generate(prompt.cpu(), max_new_tokens=48, do_sample=False)
        text = bytes(ids[0].tolist()).decode(errors="replace")
        logger.info("%s: generated %r", strategy, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="hf_out", help="where models and checkpoints go")
    parser.add_argument("--strategies", default="ddp,fsdp", help="comma-separated")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    fastdist.set_seed(0)
    out = Path(args.out)
    pretrained = out / "pretrained"
    with rank_zero_first(local=False):  # the others wait, then load what rank 0 wrote
        if fastdist.is_master() and not pretrained.exists():
            GPT2LMHeadModel(config()).save_pretrained(pretrained)
    for strategy in args.strategies.split(","):
        train(strategy, pretrained, out, args.epochs)


if __name__ == "__main__":
    main()
