"""The chunked LM-head cross-entropy equals logits + F.cross_entropy, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftrain.model import ModelConfig, Transformer
from difftrain.model.loss import chunk_rows, linear_cross_entropy


def _reference(h, w, t):
    logits = (h @ w.t()).float()
    flat = t.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, w.shape[0]), flat, ignore_index=-100, reduction="sum")
    return total / (flat != -100).sum().clamp(min=1)


@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_matches_cross_entropy_values_and_gradients(rows):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 21, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (3, 21), generator=g)
    t[0, :5] = -100  # ignored targets contribute nothing, to the loss or the gradients
    t[2, -1] = -100
    ref = _reference(h, w, t)
    gh, gw = torch.autograd.grad(ref * 3.0, (h, w))
    got = linear_cross_entropy(h, w, t, rows=rows)
    fh, fw = torch.autograd.grad(got * 3.0, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # fp32 sums in another order: ~1e-7 apart on entries of ~1e-3 (a wrong scale or mask is ≥ 1e-3)
    torch.testing.assert_close(fh, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fw, gw, rtol=1e-5, atol=1e-6)


def test_all_ignored_is_zero_with_zero_gradients():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_frozen_head_and_no_grad():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8)  # frozen (e.g. LoRA fine-tuning without the head)
    t = torch.randint(0, 10, (6,))
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, t), (h,))
    (rh,) = torch.autograd.grad(_reference(h, w, t), (h,))
    torch.testing.assert_close(gh, rh)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t), _reference(h, w, t))


def test_chunk_rows():
    assert chunk_rows(4096) == 1024
    assert chunk_rows(32768) == 256  # never fewer rows than the minimum
    assert chunk_rows(100) == (1 << 22) // 100


@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_model_loss_only_forward_trains_like_the_logits_path(arch):
    cfg = ModelConfig(arch=arch, vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
    torch.manual_seed(0)
    a = Transformer(cfg)
    b = Transformer(cfg)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 97, (2, 16))
    y = torch.randint(0, 97, (2, 16))
    y[1, :4] = -100
    out_a = a(x, y)
    out_b = b(x, y, return_logits=False)
    assert out_b.logits is None and out_a.logits is not None
    torch.testing.assert_close(out_b.loss, out_a.loss, rtol=1e-6, atol=1e-6)
    out_a.loss.backward()
    out_b.loss.backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_bf16_autocast_matches_autocast_linear():
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(30, 16, requires_grad=True)
    t = torch.randint(0, 30, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, t, rows=16)
        ref_logits = F.linear(h, w)
    assert ref_logits.dtype == torch.bfloat16
    ref = F.cross_entropy(ref_logits.float(), t)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    got.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_fused_loss_compiles_as_one_graph_and_matches_eager():
    """Under torch.compile(fullgraph=True) the loss traces without a graph break (no
    data-dependent branch reaches the graph) and gives eager's loss and gradients, with
    ignored targets and without."""
    g = torch.Generator().manual_seed(21)
    h = torch.randn(24, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    compiled = torch.compile(linear_cross_entropy, backend="eager", fullgraph=True)
    for ignored in (0, 5):
        t = torch.randint(0, 30, (24,), generator=g)
        t[:ignored] = -100
        ref = linear_cross_entropy(h, w, t, rows=10)
        got = compiled(h, w, t, rows=10)
        torch.testing.assert_close(got, ref)
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w)), strict=True):
            torch.testing.assert_close(a, b)
