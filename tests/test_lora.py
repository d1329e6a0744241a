"""LoRA layers, merging, 4-bit NF4 base layers and vocabulary growth (model level, no training)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftrain.errors import ConfigError
from difftrain.model import ModelConfig, Transformer
from difftrain.model.lora import (
    LoRALinear,
    apply_lora,
    count_params,
    dense_weight,
    grow_vocab,
    lora_layers,
    match_targets,
    merge_lora,
    nf4_round_trip_,
    quantize_4bit,
)

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(arch: str = "diff", tie: bool = True, vocab: int = 96) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch, vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, tie_embeddings=tie
    )
    return Transformer(cfg).eval()


def randomize_lora(model: nn.Module, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * scale)


IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_lora_starts_at_the_base_model_and_merges_to_the_same_function(arch):
    model = tiny(arch)
    base_logits = model(IDS).logits
    targets = match_targets(model, ALL_PROJ)
    apply_lora(model, targets, rank=4, alpha=8, dropout=0.1)
    model.eval()
    assert torch.equal(model(IDS).logits, base_logits)  # B = 0: exactly the base
    randomize_lora(model)
    unmerged = model(IDS).logits
    assert (unmerged - base_logits).abs().max() > 1e-3  # the adapter does something
    # the update is (α/r)·B·A, written out
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 32)
    expected = x @ q.base.weight.T + (x @ q.lora_A.T @ q.lora_B.T) * (8 / 4)
    torch.testing.assert_close(q(x), expected, rtol=0, atol=1e-6)
    assert merge_lora(model) == len(targets) == 14
    assert not lora_layers(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    torch.testing.assert_close(model(IDS).logits, unmerged, rtol=0, atol=1e-5)
    assert set(model.state_dict()) == set(tiny(arch).state_dict())  # plain HF-Llama names again


def test_target_patterns_match_full_names_and_dotted_suffixes():
    model = tiny("diff2")
    assert match_targets(model, ["q_proj"]) == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    assert match_targets(model, ["mlp.*"]) == [
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert match_targets(model, ["model.layers.1.self_attn.v_proj"]) == ["model.layers.1.self_attn.v_proj"]
    assert match_targets(model, ["layers.0.*_proj"], exclude=["model.layers.0.self_attn.lambda_proj"]) == [
        f"model.layers.0.{p}"
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]


def test_target_pattern_matching_nothing_lists_the_available_names():
    with pytest.raises(ConfigError) as e:
        match_targets(tiny("diff"), ["q_proj", "qkv_proj"], where="finetune.lora.target_modules")
    msg = str(e.value)
    assert "finetune.lora.target_modules" in msg and "`qkv_proj` matches no linear layer" in msg
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "lm_head"):
        assert name in msg


def test_only_lora_matrices_are_new_trainable_parameters():
    model = tiny("baseline")
    model.requires_grad_(False)
    apply_lora(model, match_targets(model, ["q_proj", "v_proj"]), rank=2, alpha=4)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == {
        f"model.layers.{i}.self_attn.{p}.lora_{ab}"
        for i in range(2)
        for p in ("q_proj", "v_proj")
        for ab in "AB"
    }
    assert sum(trainable.values()) == 2 * 2 * 2 * (32 + 32)  # layers × targets × r·(in + out)
    total, n_trainable = count_params(model)
    assert (
        n_trainable == sum(trainable.values())
        and total == tiny("baseline").num_params()["total"] + n_trainable
    )


@pytest.mark.parametrize("tie", [True, False])
def test_growing_the_vocabulary_keeps_old_rows_and_starts_new_ones_at_the_mean(tie):
    model = tiny("diff", tie=tie, vocab=96)
    before = model(IDS).logits
    old_emb = model.model.embed_tokens.weight.detach().clone()
    old_head = model.lm_head.weight.detach().clone()
    grow_vocab(model, [90, 96, 97], vocab_size=128, used_rows=90)
    assert model.config.vocab_size == 128 and model.model.embed_tokens.weight.shape == (128, 32)
    assert model.lm_head.weight.shape == (128, 32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert torch.equal(model.model.embed_tokens.weight[:90], old_emb[:90])
    assert torch.equal(model.model.embed_tokens.weight[91:96], old_emb[91:96])  # spare rows untouched
    mean = old_emb[:90].mean(0)
    for i in (90, 96, 97, 127):
        torch.testing.assert_close(model.model.embed_tokens.weight[i], mean)
    if not tie:
        torch.testing.assert_close(model.lm_head.weight[96], old_head[:90].mean(0))
    after = model(IDS).logits  # old tokens in → the same logits over the old vocabulary
    torch.testing.assert_close(after[..., :90], before[..., :90], rtol=0, atol=0)
    with pytest.raises(ConfigError, match="shrink"):
        grow_vocab(model, [], vocab_size=64, used_rows=90)


def test_qlora_4bit_layers_match_their_dequantized_weights_in_forward_and_backward():
    """CPU NF4 (bitsandbytes): the 4-bit model computes x·dequant(W)ᵀ, passes gradients to the LoRA
    matrices below it, keeps doing so after a no-grad eval forward, and merges to the same function."""
    pytest.importorskip("bitsandbytes")
    q_model, d_model = tiny("diff"), tiny("diff")
    names = [n for n in match_targets(q_model, ALL_PROJ)]
    quantize_4bit(q_model, names, device="cpu")
    nf4_round_trip_(d_model, names)
    for n in names:  # 4-bit storage, dense size counted
        assert type(q_model.get_submodule(n)).__name__ == "Linear4bit"
        torch.testing.assert_close(dense_weight(q_model.get_submodule(n)), d_model.get_submodule(n).weight)
    assert count_params(q_model)[0] == count_params(d_model)[0]
    for m in (q_model, d_model):
        m.requires_grad_(False)
        torch.manual_seed(3)
        apply_lora(m, names, rank=4, alpha=8)
        randomize_lora(m)
    with torch.no_grad():  # an eval forward first (validation): must not break the backward
        torch.testing.assert_close(q_model(IDS).logits, d_model(IDS).logits, rtol=0, atol=1e-5)
    q_model.train(), d_model.train()
    tgt = torch.roll(IDS, -1, 1)
    q_model(IDS, tgt).loss.backward()
    d_model(IDS, tgt).loss.backward()
    for (n, p), (_, r) in zip(q_model.named_parameters(), d_model.named_parameters(), strict=True):
        if p.requires_grad:
            assert p.grad is not None and r.grad is not None, n
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6)
    first = q_model.model.layers[0].self_attn.q_proj
    assert isinstance(first, LoRALinear) and first.lora_A.grad.abs().sum() > 0  # reached layer 0
    merged = merge_lora(q_model)
    assert merged == len(names)
    q_model.eval(), d_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(q_model(IDS).logits, d_model(IDS).logits, rtol=0, atol=1e-5)
