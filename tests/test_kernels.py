"""Every attention implementation computes what `eager` computes, forward and backward.

fp32, relative error (max |a − b| / max |b|) ≤ 1e-5, for all three archs, with and without GQA,
under the plain causal mask and under a KV-cache-style mask (query offset + left padding).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from difftrain.errors import DeviceError
from difftrain.model import AttnMask, ModelConfig, Transformer, kernels
from difftrain.model.attention import AttnOptions
from difftrain.model.kernels import (
    DIFF_SDPA_STRATEGIES,
    baseline_attention,
    diff2_attention,
    diff_attention,
    resolve_impl,
)

B, H, d = 2, 4, 8
ARCHS = ["baseline", "diff", "diff2"]
KV = pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def inputs(arch: str, n_kv: int, T: int, S: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Leaf tensors q, k, v, lam (shapes of kernels.py's table) requiring grad."""
    g = torch.Generator().manual_seed(seed)
    n_q = 2 * H if arch == "diff2" else H
    n_v, v_dim = (n_kv // 2, 2 * d) if arch == "diff" else (n_kv, d)
    t = {
        "q": torch.randn(B, n_q, T, d, generator=g),
        "k": torch.randn(B, n_kv, S, d, generator=g),
        "v": torch.randn(B, n_v, S, v_dim, generator=g),
    }
    if arch == "diff":
        t["lam"] = torch.tensor(0.37)
    elif arch == "diff2":
        t["lam"] = torch.randn(B, H, T, generator=g)
    return {k: v.requires_grad_() for k, v in t.items()}


def call(arch: str, t: dict[str, torch.Tensor], mask: AttnMask, impl: str) -> torch.Tensor:
    if arch == "baseline":
        return baseline_attention(t["q"], t["k"], t["v"], mask, impl).out
    fn = diff_attention if arch == "diff" else diff2_attention
    return fn(t["q"], t["k"], t["v"], t["lam"], mask, impl).out


def masks(T: int) -> dict[str, AttnMask]:
    pad = torch.ones(B, T + 3, dtype=torch.bool)
    pad[1, :4] = False  # sequence 1 is left-padded by 4 slots
    return {"causal": AttnMask(T, T), "cached+padded": AttnMask(T, T + 3, q_offset=3, key_padding_mask=pad)}


def fwd_bwd(arch, t, mask, impl):
    out = call(arch, t, mask, impl)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, list(t.values()), grad_out)
    return out, dict(zip(t, grads, strict=True))


@pytest.mark.parametrize("mask_kind", ["causal", "cached+padded"])
@pytest.mark.parametrize("arch", ARCHS)
@KV
def test_sdpa_matches_eager_forward_and_backward(arch, n_kv, mask_kind):
    T = 6
    mask = masks(T)[mask_kind]
    t = inputs(arch, n_kv, T, mask.kv_len)
    out_e, g_e = fwd_bwd(arch, t, mask, "eager")
    out_s, g_s = fwd_bwd(arch, t, mask, "sdpa")
    assert rel_err(out_s, out_e) <= 1e-5
    for name in t:
        assert rel_err(g_s[name], g_e[name]) <= 1e-5, name
    assert torch.isfinite(out_e).all()


@pytest.mark.parametrize("strategy", sorted(DIFF_SDPA_STRATEGIES))
@pytest.mark.parametrize("mask_kind", ["causal", "cached+padded"])
@KV
def test_every_diff_sdpa_strategy_matches_eager_forward_and_backward(strategy, mask_kind, n_kv):
    T = 6
    mask = masks(T)[mask_kind]
    t = inputs("diff", n_kv, T, mask.kv_len)
    out_e, g_e = fwd_bwd("diff", t, mask, "eager")
    fn = DIFF_SDPA_STRATEGIES[strategy]
    out = fn(t["q"], t["k"], t["v"], t["lam"], mask)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, list(t.values()), grad_out)
    assert rel_err(out, out_e) <= 1e-5
    for name, g in zip(t, grads, strict=True):
        assert rel_err(g, g_e[name]) <= 1e-5, name


@pytest.mark.parametrize("T", [9, 16])
@pytest.mark.parametrize("mask_kind", ["causal", "cached+padded"])
@pytest.mark.parametrize("map_bytes", [1 << 30, 1])
@KV
def test_blocked_math_over_several_query_blocks_matches_eager(T, mask_kind, map_bytes, n_kv, monkeypatch):
    # blocks of ≥ 2 rows, at most 4: 4 blocks (uneven at T = 9), each against only the keys it can
    # see; the whole batch at once, or (map_bytes = 1) one sequence at a time, each with its own
    # padding mask
    monkeypatch.setattr(kernels, "BLOCK_MIN_ROWS", 2)
    monkeypatch.setattr(kernels, "BLOCK_MAX_COUNT", 4)
    monkeypatch.setattr(kernels, "BLOCK_MAP_BYTES", map_bytes)
    assert len(kernels.query_blocks(T)) == 4
    assert len(kernels.batch_chunks(B, H, T, T)) == (1 if map_bytes > 1 else B)
    mask = masks(T)[mask_kind]
    t = inputs("diff", n_kv, T, mask.kv_len)
    out_e, g_e = fwd_bwd("diff", t, mask, "eager")
    out = kernels.diff_blocked_math(t["q"], t["k"], t["v"], t["lam"], mask)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, list(t.values()), grad_out)
    assert rel_err(out, out_e) <= 1e-5
    for name, g in zip(t, grads, strict=True):
        assert rel_err(g, g_e[name]) <= 1e-5, name


@pytest.mark.parametrize("mask_kind", ["causal", "cached+padded"])
def test_blocked_math_without_gradients_matches_eager(mask_kind, monkeypatch):
    # eval and prefill: no map is kept past its block, the output is the same
    monkeypatch.setattr(kernels, "BLOCK_MIN_ROWS", 2)
    mask = masks(9)[mask_kind]
    t = inputs("diff", 2, 9, mask.kv_len)
    with torch.no_grad():
        out = kernels.diff_blocked_math(t["q"], t["k"], t["v"], t["lam"], mask)
        ref = call("diff", t, mask, "eager")
    assert rel_err(out, ref) <= 1e-5


@KV
def test_blocked_math_reads_projection_views_and_returns_gradients_in_their_layout(n_kv, monkeypatch):
    # In the model q, k, v are transposed views of the projections' (B, T, heads, d) outputs: the
    # kernel reads them in place and writes ∂q, ∂k in that layout, so the views back are free.
    monkeypatch.setattr(kernels, "BLOCK_MIN_ROWS", 3)
    T = 10
    assert len(kernels.query_blocks(T)) == 3
    g = torch.Generator().manual_seed(5)
    leaves = [
        torch.randn(B, T, H, d, generator=g, requires_grad=True),
        torch.randn(B, T, n_kv, d, generator=g, requires_grad=True),
        torch.randn(B, T, n_kv // 2, 2 * d, generator=g, requires_grad=True),
        torch.tensor(0.44, requires_grad=True),
    ]
    mask = AttnMask(T, T)
    views = [x.transpose(1, 2) for x in leaves[:3]] + [leaves[3]]
    out = kernels.diff_blocked_math(*views, mask)
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, views, grad_out)
    ref_views = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in leaves[:3]]
    ref_views.append(leaves[3].detach().clone().requires_grad_())
    ref = diff_attention(*ref_views, mask, "eager").out
    ref_grads = torch.autograd.grad(ref, ref_views, grad_out)
    assert rel_err(out, ref) <= 1e-5
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H/2, 2d): subln and o_proj read it in place
    for name, a, b in zip("qkvλ", grads, ref_grads, strict=True):
        assert rel_err(a, b) <= 1e-5, name
    assert grads[0].transpose(1, 2).is_contiguous() and grads[1].transpose(1, 2).is_contiguous()


def test_blocked_math_runs_eagerly_under_torch_compile(monkeypatch):
    # Traced, the core's backward became one slow fused kernel (kernels.diff_blocked_math): under
    # torch.compile the autograd.Function must run as it does eagerly, on real tensors, forward
    # and backward, and give eager's bits.
    seen = []
    forward, backward = kernels._DiffBlockedMath.forward, kernels._DiffBlockedMath.backward

    def spy_forward(ctx, q, *rest):
        seen.append(("forward", type(q)))
        return forward(ctx, q, *rest)

    def spy_backward(ctx, g):
        seen.append(("backward", type(g)))
        return backward(ctx, g)

    monkeypatch.setattr(kernels._DiffBlockedMath, "forward", staticmethod(spy_forward))
    monkeypatch.setattr(kernels._DiffBlockedMath, "backward", staticmethod(spy_backward))
    torch._dynamo.reset()
    T = 16
    mask = AttnMask(T, T)
    t = inputs("diff", 2, T, T)

    def layer(q, k, v, lam):
        return diff_attention(q * 1.5, k, v, lam, mask, "sdpa").out.square().sum()

    ref = layer(*t.values())
    ref_grads = torch.autograd.grad(ref, list(t.values()))
    seen.clear()
    got = torch.compile(layer, backend="aot_eager")(*t.values())
    grads = torch.autograd.grad(got, list(t.values()))
    assert seen == [("forward", torch.Tensor), ("backward", torch.Tensor)]
    assert torch.equal(got, ref)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)


def test_blocked_math_in_bf16_computes_in_fp32_and_returns_bf16_gradients():
    T = 12
    t = inputs("diff", 2, T, T)
    mask = AttnMask(T, T)
    low = [t[n].detach().bfloat16().requires_grad_() for n in ("q", "k", "v")] + [t["lam"]]
    out = kernels.diff_blocked_math(*low, mask)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), low)
    assert [x.dtype for x in grads] == [torch.bfloat16] * 3 + [torch.float32]
    exact = [x.detach().float().requires_grad_() for x in low[:3]] + [t["lam"]]
    ref = call("diff", dict(zip(("q", "k", "v", "lam"), exact, strict=True)), mask, "eager")
    ref_grads = torch.autograd.grad(ref.sum(), exact)
    assert rel_err(out.float(), ref) <= 1e-2  # only the output's rounding to bf16
    for a, b in zip(grads, ref_grads, strict=True):
        assert rel_err(a.float(), b) <= 1e-2


def test_batch_chunks_cover_the_batch_once_within_the_map_budget():
    """Chunks of the batch in order, none empty, their maps within BLOCK_MAP_BYTES unless a
    single sequence already exceeds it (then one sequence at a time)."""
    for batch, heads, T, S in (
        (16, 4, 256, 256),
        (8, 8, 512, 512),
        (3, 2, 9, 12),
        (1, 4, 64, 64),
        (5, 16, 4096, 4096),
    ):
        chunks = kernels.batch_chunks(batch, heads, T, S)
        assert chunks[0][0] == 0 and chunks[-1][1] == batch
        assert all(b1 > b0 for b0, b1 in chunks)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
        rows = T // len(kernels.query_blocks(T))
        per_seq = 2 * heads * rows * S * 4
        size = chunks[0][1] - chunks[0][0]
        assert size == 1 or size * per_seq <= kernels.BLOCK_MAP_BYTES
        assert size == batch or (size + 1) * per_seq > kernels.BLOCK_MAP_BYTES
    assert kernels.batch_chunks(16, 4, 256, 256) == [(0, 8), (8, 16)]  # the bench's quickstart


def test_query_blocks_cover_every_query_once():
    for T in (1, 63, 64, 127, 128, 255, 256, 1000, 4096):
        blocks = kernels.query_blocks(T)
        assert blocks[0][0] == 0 and blocks[-1][1] == T
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
        assert 1 <= len(blocks) <= kernels.BLOCK_MAX_COUNT
        assert len(blocks) == 1 or min(t1 - t0 for t0, t1 in blocks) >= kernels.BLOCK_MIN_ROWS


def test_diff_flash_cpu_takes_strided_projection_views_and_returns_their_layout():
    # In the model q, k, v are transposed views of the projections' (B, T, heads, d) outputs;
    # the kernel must read them as they are and give gradients in the same layout.
    T, n_kv = 7, 2
    g = torch.Generator().manual_seed(3)
    q0 = torch.randn(B, T, H, d, generator=g, requires_grad=True)
    k0 = torch.randn(B, T, n_kv, d, generator=g, requires_grad=True)
    v0 = torch.randn(B, T, n_kv // 2, 2 * d, generator=g, requires_grad=True)
    lam = torch.tensor(0.61, requires_grad=True)
    mask = AttnMask(T, T)
    leaves = [q0, k0, v0, lam]
    outs = {}
    for impl in ("eager", "sdpa"):
        out = diff_attention(q0.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2), lam, mask, impl).out
        outs[impl] = (out, torch.autograd.grad(out.pow(2).sum(), leaves))
    (oe, ge), (os_, gs) = outs["eager"], outs["sdpa"]
    assert rel_err(os_, oe) <= 1e-5
    assert os_.transpose(1, 2).is_contiguous()  # (B, T, H/2, 2d): the reshape before o_proj is free
    for a, b in zip(gs, ge, strict=True):
        assert rel_err(a, b) <= 1e-5


def test_diff_flash_cpu_in_bf16_stays_close_to_fp32_eager():
    T = 16
    t = inputs("diff", 4, T, T)
    mask = AttnMask(T, T)
    ref = call("diff", t, mask, "eager")
    low = {k: (v.detach().bfloat16() if k != "lam" else v.detach()) for k, v in t.items()}
    out = DIFF_SDPA_STRATEGIES["flash_cpu"](low["q"], low["k"], low["v"], low["lam"], mask)
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref) <= 2e-2


@pytest.mark.parametrize("arch", ARCHS)
@KV
def test_attention_module_sdpa_gives_eager_gradients_for_lambda_params(arch, n_kv):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=11, d_model=32, n_layers=2, n_heads=H, n_kv_heads=n_kv)
    attn = Transformer(cfg).model.layers[1].self_attn
    T = 6
    x = torch.randn(B, T, 32, requires_grad=True)
    pos = torch.arange(T)[None].expand(B, T)
    from difftrain.model.rope import RotaryEmbedding

    rope = RotaryEmbedding(d).tables(pos, x.dtype)
    leaves = [x, *attn.parameters()]
    results = {}
    for impl in ("eager", "sdpa"):
        out = attn(x, rope, AttnMask(T, T), None, AttnOptions(impl)).out
        results[impl] = (out, torch.autograd.grad(out.square().sum(), leaves))
    (out_e, g_e), (out_s, g_s) = results["eager"], results["sdpa"]
    assert rel_err(out_s, out_e) <= 1e-5
    names = ["x"] + [n for n, _ in attn.named_parameters()]
    for name, a, b in zip(names, g_s, g_e, strict=True):
        assert rel_err(a, b) <= 1e-5, name
    lam_names = [n for n in names if n.startswith("lambda")]
    assert lam_names == ({"baseline": [], "diff": ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"],
                          "diff2": ["lambda_proj.weight"]}[arch])  # fmt: skip
    for name in lam_names:
        assert g_e[names.index(name)].abs().sum() > 0, f"{name} gets no gradient"


def test_auto_resolves_to_sdpa_and_unknown_impl_is_refused():
    assert resolve_impl("auto", torch.device("cpu")) == "sdpa"
    assert resolve_impl("eager", torch.device("cpu")) == "eager"
    from difftrain.errors import ConfigError

    with pytest.raises(ConfigError, match="attn_impl='flash' is unknown"):
        resolve_impl("flash", torch.device("cpu"))


def test_flex_on_cpu_refuses_backward_with_an_actionable_error():
    t = inputs("baseline", 4, 4, 4)
    with pytest.raises(DeviceError, match="attn_impl=sdpa"):
        call("baseline", t, AttnMask(4, 4), "flex")


@pytest.mark.parametrize("T", [16, 6], ids=["compiled", "short-as-sdpa"])
def test_flex_matches_eager_forward_on_cpu(T):
    # Few shapes on purpose: each new shape compiles flex attention (seconds on CPU). Below
    # FLEX_CPU_MIN_KEYS keys CPU flex runs as sdpa (torch 2.14.1's CPU kernel is wrong at 8 keys).
    assert (T >= kernels.FLEX_CPU_MIN_KEYS) == (T == 16)
    cases = [(arch, AttnMask(T, T)) for arch in ARCHS]
    pad = torch.ones(B, T + 2, dtype=torch.bool)
    pad[0, :3] = False
    cases.append(("diff2", AttnMask(T, T + 2, q_offset=2, key_padding_mask=pad)))
    with torch.no_grad():
        for arch, mask in cases:
            t = inputs(arch, 2, T, mask.kv_len)
            assert rel_err(call(arch, t, mask, "flex"), call(arch, t, mask, "eager")) <= 1e-5, arch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_kernels_match_eager_forward_and_backward(arch, impl):
    T = 64
    for mask in masks(T).values():
        mask.key_padding_mask = None if mask.key_padding_mask is None else mask.key_padding_mask.cuda()
        t = {k: v.detach().cuda().requires_grad_() for k, v in inputs(arch, 2, T, mask.kv_len).items()}
        out_e, g_e = fwd_bwd(arch, t, mask, "eager")
        out_i, g_i = fwd_bwd(arch, t, mask, impl)
        assert rel_err(out_i, out_e) <= 1e-4  # TF32 / kernel accumulation order on GPU
        for name in t:
            assert rel_err(g_i[name], g_e[name]) <= 1e-4, name


@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_diff_decode_step_matches_eager_without_building_a_mask(n_kv):
    S = 9
    mask = AttnMask(1, S, q_offset=S - 1)  # one new token after 8 cached ones, no padding
    assert mask.unmasked and not mask.plain_causal
    t = inputs("diff", n_kv, 1, S)
    with torch.no_grad():
        out = call("diff", t, mask, "sdpa")  # takes grouped_math: few queries, no gradients
        grouped = DIFF_SDPA_STRATEGIES["grouped_math"](t["q"], t["k"], t["v"], t["lam"], mask)
        assert mask._dense is None  # nothing was materialised for the mask
        ref = call("diff", t, mask, "eager")
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out, grouped)


def test_the_blocked_core_does_not_import_dynamo_where_nothing_compiles():
    # the graph break it needs under torch.compile must not cost an eager caller the import of
    # torch._dynamo (2.4 s on a 2-core CPU: generate's first token took 1.4 s instead of 10 ms)
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "from difftrain.model import ModelConfig, Transformer, kernels\n"
        "calls, apply = [], kernels._DiffBlockedMath.apply\n"
        "kernels._DiffBlockedMath.apply = lambda *a: calls.append(1) or apply(*a)\n"
        "torch.manual_seed(0)\n"
        "m = Transformer(ModelConfig(arch='diff', vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))\n"
        "ids = torch.randint(0, 64, (1, 20))\n"
        "with torch.no_grad():\n"
        "    m(ids)\n"
        "m(ids).logits.sum().backward()\n"
        "print(len(calls), m.model.layers[0].self_attn.lambda_q1.grad is not None, 'torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "True", "False"], done.stderr
