"""The attention modules equal the published formulas, written out here head by head.

The references below use only the weights (copied out of the module) and the math of
DESIGN.md §3 -- per-head loops, explicit RoPE angles, explicit softmax -- and call nothing from
difftrain.model except to read the weights and run the module under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from difftrain.model import AttnMask, ModelConfig, Transformer

D, H, d, T, B = 32, 4, 8, 7, 2
THETA = 10000.0


def rope_ref(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (B, T, d) at positions 0..T−1: pairs (i, i + d/2) turn by p·θ^(−2i/d)."""
    half = x.shape[-1] // 2
    inv = torch.tensor([THETA ** (-2 * i / x.shape[-1]) for i in range(half)])
    ang = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv  # (T, d/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), dim=-1)


def cos_sin(batch: int, seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = torch.tensor([THETA ** (-2 * i / dim) for i in range(dim // 2)])
    ang = torch.arange(seq, dtype=torch.float32)[:, None] * inv
    ang = torch.cat((ang, ang), dim=-1).expand(batch, seq, dim)
    return ang.cos(), ang.sin()


def causal_softmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
    return torch.softmax(s.masked_fill(future, float("-inf")), dim=-1)


def head(x: torch.Tensor, W: torch.Tensor, j: int, width: int) -> torch.Tensor:
    """Rows j·width … (j+1)·width of a projection applied to x: the j-th head of that width."""
    return x @ W[j * width : (j + 1) * width].T


def diff_reference(x: torch.Tensor, attn, layer: int, n_kv: int) -> torch.Tensor:
    Wq, Wk, Wv, Wo = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight)
    n_rep = H // n_kv
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * layer)
    lam = (
        math.exp(float(attn.lambda_q1 @ attn.lambda_k1))
        - math.exp(float(attn.lambda_q2 @ attn.lambda_k2))
        + lam_init
    )
    outs = []
    for i in range(H // 2):
        g = i // n_rep
        A1 = causal_softmax(rope_ref(head(x, Wq, 2 * i, d)), rope_ref(head(x, Wk, 2 * g, d)))
        A2 = causal_softmax(rope_ref(head(x, Wq, 2 * i + 1, d)), rope_ref(head(x, Wk, 2 * g + 1, d)))
        o = (A1 - lam * A2) @ head(x, Wv, g, 2 * d)  # (B, T, 2d)
        o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.subln.weight
        outs.append(o * (1 - lam_init))
    return torch.cat(outs, dim=-1) @ Wo.T


def diff2_reference(x: torch.Tensor, attn, n_kv: int) -> torch.Tensor:
    Wq, Wk, Wv, Wo = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight)
    group = 2 * H // n_kv
    lam = x @ attn.lambda_proj.weight.T  # (B, T, H)

    def a(j: int) -> torch.Tensor:
        g = j // group
        A = causal_softmax(rope_ref(head(x, Wq, j, d)), rope_ref(head(x, Wk, g, d)))
        return A @ head(x, Wv, g, d)

    outs = [a(2 * i) - torch.sigmoid(lam[..., i : i + 1]) * a(2 * i + 1) for i in range(H)]
    return torch.cat(outs, dim=-1) @ Wo.T


def baseline_reference(x: torch.Tensor, attn, n_kv: int) -> torch.Tensor:
    Wq, Wk, Wv, Wo = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight)
    n_rep = H // n_kv
    outs = []
    for h in range(H):
        g = h // n_rep
        A = causal_softmax(rope_ref(head(x, Wq, h, d)), rope_ref(head(x, Wk, g, d)))
        outs.append(A @ head(x, Wv, g, d))
    return torch.cat(outs, dim=-1) @ Wo.T


def build(arch: str, n_kv: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch, vocab_size=11, d_model=D, n_layers=3, n_heads=H, n_kv_heads=n_kv, max_seq_len=16
    )
    model = Transformer(cfg)
    with torch.no_grad():  # make every parameter matter: non-unit subln, larger λ vectors
        for name, p in model.named_parameters():
            if "subln" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "lambda_" in name and p.dim() == 1:
                p.copy_(0.5 * torch.randn_like(p))
            elif "lambda_proj" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return model


def run_module(attn, x: torch.Tensor, impl: str) -> torch.Tensor:
    from difftrain.model.attention import AttnOptions

    return attn(x, cos_sin(B, T, d), AttnMask(T, T), None, AttnOptions(impl)).out


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    err = (actual - expected).abs().max().item() / expected.abs().max().item()
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_diff_attention_equals_the_paper_formula(impl, n_kv):
    model = build("diff", n_kv)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        for layer in (0, 2):
            attn = model.model.layers[layer].self_attn
            assert_rel_close(run_module(attn, x, impl), diff_reference(x, attn, layer, n_kv))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("n_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_diff2_attention_equals_the_v2_formula(impl, n_kv):
    model = build("diff2", n_kv)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        attn = model.model.layers[1].self_attn
        assert_rel_close(run_module(attn, x, impl), diff2_reference(x, attn, n_kv))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_baseline_attention_equals_llama_formula(impl, n_kv):
    model = build("baseline", n_kv)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        assert_rel_close(run_module(attn, x, impl), baseline_reference(x, attn, n_kv))


def test_diff_lambda_is_the_layer_scalar_of_the_paper():
    model = build("diff", 4)
    attn = model.model.layers[2].self_attn
    expected = (
        torch.exp((attn.lambda_q1 * attn.lambda_k1).sum())
        - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
        + 0.8
        - 0.6 * math.exp(-0.6)
    )
    assert attn.lam().dtype == torch.float32
    assert torch.allclose(attn.lam(), expected)


def test_rope_matches_hf_llama_rotate_half():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from difftrain.model.rope import RotaryEmbedding, apply_rotary

    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500.0)
    hf = LlamaRotaryEmbedding(hf_cfg)
    ours = RotaryEmbedding(16, theta=500.0)
    pos = torch.tensor([[0, 1, 2, 7, 100], [3, 4, 5, 6, 1000]])
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos_hf, sin_hf = hf(q, pos)
    cos, sin = ours(pos)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    assert torch.equal(apply_rotary(q, cos, sin), q_hf)
    assert torch.equal(apply_rotary(k, cos, sin), k_hf)


def test_under_bf16_autocast_the_core_receives_q_and_k_in_bf16(monkeypatch):
    """The fp32 RoPE tables are cast to the heads' dtype: rotating must not promote q and k back
    to fp32 (which the core would then run in, or cast again)."""
    from difftrain.model import kernels

    seen = []

    def recording(q, k, v, mask):
        seen.append((q.dtype, k.dtype, v.dtype))
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=v.dtype)

    monkeypatch.setattr(kernels, "attend_sdpa", recording)
    for arch in ("baseline", "diff", "diff2"):
        model = build(arch, 2)
        model.attn_impl = "sdpa"
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randint(0, 11, (B, T)))
        assert seen and set(seen) == {(torch.bfloat16,) * 3}, arch


def test_rope_frequencies_stay_fp32_when_the_model_is_cast():
    model = build("baseline", 4)
    before = model.model.rotary_emb.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, before)
    assert "model.rotary_emb.inv_freq" not in model.state_dict()
