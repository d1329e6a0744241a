"""The hand-written backward passes CPU training runs in place of autograd through a formula:
RoPE (`rope._Rotate`) and RMSNorm (`attention._RMSNormCPU`). Each must give the formula's forward
bits and its gradients, and step aside where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftrain.model import ModelConfig, Transformer
from difftrain.model.attention import RMSNorm, _RMSNormCPU
from difftrain.model.rope import RotaryEmbedding, _Rotate, apply_rotary, rotate


def projection_view(B: int, T: int, n: int, d: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf (B, T, n·d) like a projection's output, and its (B, n, T, d) view, as attention has."""
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(B, T, n * d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return leaf, leaf.view(B, T, n, d).transpose(1, 2)


def test_rotate_with_gradients_has_the_formulas_bits_and_gradients():
    B, T, n, d = 2, 7, 3, 16
    rot = RotaryEmbedding(d, theta=500.0)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 50, 51, 52, 1000]])
    cos, sin = rot(pos, torch.float32)
    tables = rot.tables(pos, torch.float32)
    leaf, x = projection_view(B, T, n, d)
    y = rotate(x, tables)
    assert y.grad_fn is not None and "Rotate" in type(y.grad_fn).__name__  # the fast path ran
    ref_leaf, ref_x = projection_view(B, T, n, d)
    ref = apply_rotary(ref_x, cos, sin)
    assert torch.equal(y, ref)  # HF's rotate_half formula, bit for bit
    assert y.stride() == x.stride()  # the projections' layout, as the formula's result has
    g = torch.randn(B, n, T, d, generator=torch.Generator().manual_seed(1))
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=0, atol=1e-6)
    # without gradients (inference) it is the formula itself
    with torch.no_grad():
        assert torch.equal(rotate(x, tables), ref)


def test_rotate_backward_is_the_transposed_rotation_in_float64():
    rot = RotaryEmbedding(8)
    pos = torch.arange(5)[None].expand(2, 5)
    cos, sin = rot(pos, torch.float64)
    tables = rot.tables(pos, torch.float64)
    _, x = projection_view(2, 5, 2, 8, torch.float64)
    assert torch.autograd.gradcheck(lambda x: _Rotate.apply(x, tables.cos, tables.signed_sin), (x,))
    contiguous = torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: _Rotate.apply(x, tables.cos, tables.signed_sin), (contiguous,))
    del cos, sin


def test_rotate_of_bf16_queries_with_fp32_tables_promotes_and_returns_a_bf16_gradient():
    # bf16-mixed: the projections run in bf16 under autocast, the tables are fp32
    rot = RotaryEmbedding(8)
    pos = torch.arange(6)[None]
    cos, sin = rot(pos, torch.float32)
    leaf, x = projection_view(1, 6, 2, 8, torch.bfloat16)
    y = rotate(x, rot.tables(pos, torch.float32))
    assert y.dtype == torch.float32
    assert torch.equal(y, apply_rotary(x.detach(), cos, sin))
    y.sum().backward()
    assert leaf.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(3, 5, 16), (2, 4, 3, 8)])
def test_rms_norm_with_gradients_has_f_rms_norms_bits_and_gradients(shape, cpu_kernels_off):
    # torch's operations (test_cpu_kernels.py tests the fused kernels against float64)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(*shape, generator=g) * 3
    w0 = torch.rand(shape[-1], generator=g) + 0.5
    grad = torch.randn(*shape, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = _RMSNormCPU.apply(x, w, 1e-5)
    rx, rw = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = F.rms_norm(rx, (shape[-1],), rw, 1e-5)
    assert torch.equal(y, ref)
    y.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, rw.grad, rtol=1e-5, atol=1e-5)


def test_rms_norm_backward_in_float64_and_with_a_frozen_weight():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormCPU.apply(x, w, 1e-5), (x, w))
    frozen = w.detach()
    y = _RMSNormCPU.apply(x, frozen, 1e-5)
    y.sum().backward()
    assert frozen.grad is None and x.grad is not None


def test_rms_norm_module_takes_the_fast_path_only_where_it_applies(cpu_kernels_off):
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8, requires_grad=True)
    assert "RMSNormCPU" in type(norm(x).grad_fn).__name__
    assert "RMSNormCPU" in type(norm(x, scale=0.2).grad_fn).__name__
    ref = F.rms_norm(x, (8,), norm.weight * 0.2, norm.eps)
    assert torch.equal(norm(x, scale=0.2), ref)  # subln's (1 − λinit) folded into the weight
    with torch.no_grad():
        assert torch.equal(norm(x), F.rms_norm(x, (8,), norm.weight, norm.eps))
    bf16 = RMSNorm(8).to(torch.bfloat16)
    assert "RMSNormCPU" not in type(bf16(x.bfloat16()).grad_fn).__name__


class _RotateFormula:
    """`_Rotate` turned off: `rotate`'s formula under autograd."""

    @staticmethod
    def apply(x, cos, signed_sin):
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class _RMSNormFormula:
    """`_RMSNormCPU` turned off: F.rms_norm under autograd."""

    @staticmethod
    def apply(x, w, eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_a_training_step_matches_autograd_through_the_formulas(arch, monkeypatch):
    """The whole model: loss and every parameter gradient with the fast paths, against the same
    model with both turned off (the formulas under plain autograd)."""
    cfg = ModelConfig(
        arch=arch, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], ids[:, 1:], return_logits=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, fast = grads()
    import difftrain.model.attention as attention
    import difftrain.model.rope as rope

    monkeypatch.setattr(rope, "_Rotate", _RotateFormula)
    monkeypatch.setattr(attention, "_RMSNormCPU", _RMSNormFormula)
    ref_loss, ref = grads()
    assert torch.equal(loss, ref_loss)  # both forwards have the same bits
    assert fast.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_no_grad_caches_see_a_fused_adamw_step_which_does_not_bump_versions():
    """torch's fused AdamW (the default optimizer) updates parameters in place without bumping
    their `_version`: λ and the pair-norm weight, cached between no-grad calls, must still follow."""
    cfg = ModelConfig(
        arch="diff", vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, max_seq_len=8
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    attn = model.model.layers[0].self_attn
    norm = model.model.norm
    norm.cpu_inference = True  # as `cpu_inference_layout` sets it: no-grad rows < 16 use the pair form
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        lam_before, y_before = attn.lam().clone(), norm(x).clone()
    params = [*attn._lambda_vectors(), norm.weight]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    versions = [p._version for p in params]
    opt.step()
    assert [p._version for p in params] == versions  # what made the caches go stale
    with torch.no_grad():
        assert not torch.equal(attn.lam(), lam_before)
        assert torch.equal(attn.lam(), attn._lam())
        assert not torch.equal(norm(x), y_before)
        torch.testing.assert_close(norm(x), F.rms_norm(x, (32,), norm.weight, norm.eps), rtol=1e-6, atol=1e-6)
