"""FlatDecoder (model/decode.py) and the pair-norm form of RMSNorm: the same decode step as the
module path, up to float rounding, and only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from difftrain.errors import ConfigError
from difftrain.infer.device import cpu_inference_layout
from difftrain.infer.generate import GenerationConfig, generate_all
from difftrain.infer.sampling import SamplingConfig
from difftrain.model import ModelConfig, Transformer
from difftrain.model.attention import RMSNorm, pair_norm, pair_weight
from difftrain.model.decode import FlatDecoder

PROMPTS = [[5, 9, 2, 33, 17, 8, 41], [12, 3], [60, 1, 44, 7, 7, 19, 25, 30, 11, 2, 50]]


def tiny(arch: str, n_kv_heads: int | None = 2, seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
        max_seq_len=48, init_std=0.2, **kw,
    )  # fmt: skip
    return Transformer(cfg).eval()


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = True
    return ids, mask


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1], PROMPTS * 6], ids=["padded", "one", "18-rows"])
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_flat_step_equals_the_module_step_and_leaves_the_same_cache(arch, n_kv_heads, prompts):
    # tied embeddings where heads are shared (GQA): the lookup then reads the column-major head
    model = tiny(arch, n_kv_heads, tie_embeddings=n_kv_heads is not None)
    assert cpu_inference_layout(model) > 0
    flat = FlatDecoder.build(model)
    assert flat is not None
    ids, mask = left_padded(prompts)
    B = ids.shape[0]
    caches = [model.new_cache(B, max_len=24) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids, cache=cache, key_padding_mask=mask)
        nxt = torch.randint(0, 64, (B,), generator=torch.Generator().manual_seed(3))
        for _ in range(6):  # several steps: each reads what the previous ones wrote
            got = flat(nxt, caches[0])
            want = model(nxt[:, None], cache=caches[1]).logits[:, -1]
            assert got.shape == want.shape == (B, 64)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            nxt = want.argmax(-1)
    a, b = caches
    assert a.length == b.length == ids.shape[1] + 6
    assert torch.equal(a.next_position, b.next_position)
    assert torch.equal(a.key_padding_mask, b.key_padding_mask)
    for ka, kb, va, vb in zip(a.keys, b.keys, a.values, b.values, strict=True):
        torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_generate_takes_the_flat_step_and_keeps_the_greedy_tokens(arch, monkeypatch):
    reference = tiny(arch)  # row-major weights: not laid out, so the module path
    assert FlatDecoder.build(reference) is None
    model = tiny(arch)
    cpu_inference_layout(model)
    calls = []
    step = FlatDecoder.__call__
    monkeypatch.setattr(FlatDecoder, "__call__", lambda self, *a: calls.append(1) or step(self, *a))
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(greedy=True), stop_at_eos=False)
    want = [c.token_ids for c in generate_all(reference, PROMPTS, cfg)]
    assert not calls
    assert [c.token_ids for c in generate_all(model, PROMPTS, cfg)] == want
    assert len(calls) == 11  # every token after the prefill's
    # sampling too (the same seeds): the same draws from (nearly) the same logits
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0.8, top_k=20), seed=7)
    assert [c.token_ids for c in generate_all(model, PROMPTS, cfg)] == [
        c.token_ids for c in generate_all(reference, PROMPTS, cfg)
    ]


def test_flat_decoder_is_not_built_where_it_would_not_compute_the_model():
    def laid(arch="diff", **kw):
        m = tiny(arch, **kw)
        cpu_inference_layout(m)
        return m

    assert FlatDecoder.build(laid()) is not None
    with FlatDecoder.disabled():  # the bench's "module forward" row
        assert FlatDecoder.build(laid()) is None
        with FlatDecoder.disabled(False):  # nested: still off
            assert FlatDecoder.build(laid()) is None
    assert FlatDecoder.build(laid()) is not None
    m = laid()  # a forward hook (a probe) must see the module calls
    m.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert FlatDecoder.build(m) is None
    m = laid()  # an attention-logit transform (a probe)
    m._logit_transform = lambda s, layer: s
    assert FlatDecoder.build(m) is None
    m = laid()  # a replaced projection (as LoRA does): its fusion is no longer valid
    attn = m.model.layers[0].self_attn
    attn.k_proj = nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    assert FlatDecoder.build(m) is None
    m = laid()  # another kind of output layer
    m.lm_head = nn.Sequential(m.lm_head)
    assert FlatDecoder.build(m) is None
    m = laid().double()  # a cast gives the weights new memory (and the wrong dtype)
    assert FlatDecoder.build(m) is None
    assert FlatDecoder.build(laid(tie_embeddings=True)) is not None


def test_generate_falls_back_to_the_module_step_after_explicit_positions():
    model = tiny("diff")
    cpu_inference_layout(model)
    flat = FlatDecoder.build(model)
    cache = model.new_cache(1, max_len=16)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]), cache=cache, positions=torch.tensor([[7, 8, 9]]))
    assert not cache.slot_positions  # generate then keeps the module path (its RoPE positions)
    assert not flat.accepts(cache) and flat.accepts(model.new_cache(1, max_len=16))
    assert not flat.accepts(model.new_cache(1, max_len=16, dtype=torch.float64))
    full = model.new_cache(1, max_len=4)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6]]), cache=full)
        with pytest.raises(ConfigError, match="KV cache is full"):
            flat(torch.tensor([1]), full)


@pytest.mark.parametrize("shape", [(1, 32), (3, 1, 64), (2, 5, 7), (15, 256)])
def test_pair_norm_is_rms_norm_within_float_rounding(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # widely spread magnitudes
    w = torch.randn(shape[-1])
    for scale in (1.0, 0.37):
        want = F.rms_norm(x, (shape[-1],), w * scale, 1e-5)
        got = pair_norm(x, pair_weight(w, scale), 1e-5)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    z = torch.zeros(shape)  # ε alone in the denominator: 0, not NaN
    assert torch.equal(pair_norm(z, pair_weight(w), 1e-5), torch.zeros(shape))


def test_rms_norm_module_takes_the_pair_form_only_for_cpu_inference_of_a_few_rows():
    torch.manual_seed(0)
    norm = RMSNorm(64)
    norm.weight.data.normal_()
    few, many = torch.randn(2, 3, 64), torch.randn(4, 8, 64)
    exact = {k: F.rms_norm(x, (64,), norm.weight, 1e-5).detach() for k, x in (("few", few), ("many", many))}
    norm.cpu_inference = True
    with torch.no_grad():
        torch.testing.assert_close(norm(few), exact["few"], rtol=2e-6, atol=1e-7)
        assert norm(few).stride(-2) == 128  # the first half of [x, −x] rows: the pair form ran
        assert torch.equal(norm(many), exact["many"])  # 32 rows: F.rms_norm, bit for bit
        norm.weight.mul_(2.0)  # an in-place update invalidates the cached pair weight
        torch.testing.assert_close(norm(few), 2 * exact["few"], rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(norm(few, scale=0.5), exact["few"], rtol=2e-6, atol=1e-7)
    # with gradients: the training norm (`_RMSNormCPU`; the fused CPU kernel sums in its own order)
    torch.testing.assert_close(norm(few), 2 * exact["few"], rtol=2e-6, atol=1e-7)
    assert "RMSNormCPU" in type(norm(few).grad_fn).__name__
