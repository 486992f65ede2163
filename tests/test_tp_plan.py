"""Tensor-parallel plans resolved and checked in this process (no mesh needed): patterns, a
Hugging Face model's own plan, and the options' errors."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from workers import tp_worker
from workers.fsdp_worker import BlockNet

from fastdist.strategies import FSDP
from fastdist.strategies.tensor_parallel import check_plan, resolve_plan


def tiny_llama() -> nn.Module:
    pytest.importorskip("transformers")
    return tp_worker.tiny_llama()


def test_patterns_match_every_block() -> None:
    plan = resolve_plan(BlockNet(), {"blocks.*": "colwise", "out": RowwiseParallel()})
    assert isinstance(plan, dict)
    assert sorted(plan) == ["blocks.0", "blocks.1", "out"]
    assert isinstance(plan["blocks.0"], ColwiseParallel)
    assert isinstance(plan["out"], RowwiseParallel)


def test_hugging_face_model_brings_its_plan() -> None:
    model = tiny_llama()
    plan = resolve_plan(model, None)  # config.base_model_tp_plan, under the "model." prefix
    assert isinstance(plan, dict)
    assert isinstance(plan["model.layers.1.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.0.mlp.down_proj"], RowwiseParallel)
    assert len(plan) == 2 * 7
    check_plan(model, plan, 2)  # 64 features, 4 heads, 2 key-value heads: all divide by 2
    with pytest.raises(ValueError, match=r"attention heads .*num_key_value_heads=2.* tp=4"):
        check_plan(model, plan, 4)


def test_model_without_a_plan_asks_for_one() -> None:
    with pytest.raises(ValueError, match=r"FSDP\(tp>1\) needs a tp_plan: BlockNet carries none"):
        resolve_plan(BlockNet(), None)


def test_style_on_a_module_it_cannot_split() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    plan = resolve_plan(model, {"1": "colwise"})
    with pytest.raises(ValueError, match=r"splits only nn.Linear and nn.Embedding"):
        check_plan(model, plan, 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp": 0}, "tp must be an integer >= 1"),
        ({"tp": True}, "tp must be an integer >= 1"),
        ({"tp": 1, "tp_plan": {"a": "colwise"}}, "pass tp > 1 with it, or drop it"),
        ({"tp": 2, "tp_plan": {"a": "diagonal"}}, "tp_plan\\['a'\\] must be 'colwise'"),
        ({"tp": 2, "tp_plan": ["a"]}, "tp_plan must be a dict"),
    ],
)
def test_bad_options_fail_when_built(options: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        FSDP(**options)
