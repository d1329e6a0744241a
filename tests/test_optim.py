"""Optimizers, parameter groups and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from difftrain.errors import DeviceError
from difftrain.model import ModelConfig, Transformer
from difftrain.recipe import OptimConfig
from difftrain.train.optim import build_optimizer, lr_multiplier, optimizer_state_bytes, param_groups


def tiny(arch: str = "diff", tie: bool = False) -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        ModelConfig(
            arch=arch, vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tie
        )
    )


@pytest.mark.parametrize("tie", [False, True])
def test_weight_decay_only_on_projection_matrices(tie):
    model = tiny("diff", tie)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert all(("proj" in n or n == "lm_head.weight") for n in decayed)
    assert "model.embed_tokens.weight" in kept
    assert any("lambda_q1" in n for n in kept) and any("subln" in n for n in kept)
    assert any("layernorm" in n for n in kept) and "model.norm.weight" in kept
    # every trainable parameter is in exactly one group (a tied head counted once)
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == sum(p.numel() for p in model.parameters())
    if not tie:  # an untied output head is an ordinary projection: decayed
        assert "lm_head.weight" in decayed


def test_decay_embeddings_flag_moves_embeddings():
    model = tiny()
    decay, _ = param_groups(model, 0.1, decay_embeddings=True)
    assert any(p is model.model.embed_tokens.weight for p in decay["params"])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_schedules_warm_up_linearly_then_end_where_configured(schedule):
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule=schedule, min_lr_ratio=0.1, decay_fraction=0.2)
    f = lr_multiplier(cfg, total_steps=110)
    assert [round(f(s), 6) for s in range(3)] == [round(1 / 11, 6), round(2 / 11, 6), round(3 / 11, 6)]
    assert f(10) == pytest.approx(1.0)
    end = 0.1 if schedule != "constant" else 1.0
    assert f(110) == pytest.approx(end)


def test_cosine_midpoint_and_wsd_plateau():
    cos = lr_multiplier(OptimConfig(lr=1.0, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0), 100)
    assert cos(50) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    wsd = lr_multiplier(
        OptimConfig(lr=1.0, warmup_steps=0, schedule="wsd", min_lr_ratio=0.0, decay_fraction=0.2), 100
    )
    assert wsd(79) == 1.0 and wsd(90) == pytest.approx(0.5)


def test_adamw8bit_holds_about_two_bytes_per_parameter_of_state():
    pytest.importorskip(
        "bitsandbytes", reason="bitsandbytes is a runtime dependency; missing means a broken install"
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    opt = build_optimizer(model, OptimConfig(name="adamw8bit", lr=1e-3), "cpu")
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    per_param = optimizer_state_bytes(opt) / n
    assert per_param <= 2.1, per_param
    ref = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3), "cpu")
    model(torch.randn(4, 256)).sum().backward()
    ref.step()
    assert optimizer_state_bytes(ref) / n >= 8.0


def test_paged_optimizer_needs_cuda():
    with pytest.raises(DeviceError, match="needs CUDA"):
        build_optimizer(tiny(), OptimConfig(name="paged_adamw8bit"), "cpu")
