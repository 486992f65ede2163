"""A setup for ``python -m fastdist estimate``: a 0.13B-parameter Llama built from its config
(no download; needs ``pip install transformers``), AdamW, and one micro-batch of 4 x 1024
tokens. Its ``config.base_model_tp_plan`` serves as the tensor-parallel plan.

    python -m fastdist estimate examples/estimate_llama.py:setup \
        --world-size 8 --tp 2 --amp bf16 --memory 80GB
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 32000


def setup() -> dict[str, Any]:
    """The model, its optimizer and one micro-batch (the model returns its own loss)."""
    config = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=VOCAB,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (4, 1024))
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
        "batch": {"input_ids": ids, "labels": ids},
    }
