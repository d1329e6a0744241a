"""Every attention core computes what `eager` computes, forward and backward; `auto` picks the
core of the documented table; a compiled model computes what the eager one does.

fp32, relative error (max |a − b| / max |b|) ≤ 1e-5 per core, for all three archs, with and
without GQA, under the plain causal mask and under a KV-cache-style mask (query offset + left
padding); compiled models within 1e-4 of eager ones.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import sdpa_flop_count

from difftrain.errors import ConfigError, DeviceError
from difftrain.model import AttnMask, ModelConfig, Transformer, kernels
from difftrain.model.attention import AttnOptions
from difftrain.model.kernels import attention_core, resolve_impl
from difftrain.model.rope import RotaryEmbedding

B, H, d = 2, 4, 8
ARCHS = ["baseline", "diff", "diff2"]
KV = pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


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
    return attention_core(arch, t["q"], t["k"], t["v"], t.get("lam"), mask, impl).out


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


@KV
def test_a_decode_step_over_the_cache_matches_eager_without_building_a_mask(n_kv):
    S = 9
    for arch in ARCHS:
        mask = AttnMask(1, S, q_offset=S - 1)  # one new token after 8 cached ones, no padding
        assert mask.sees_all and not mask.plain_causal
        t = inputs(arch, n_kv, 1, S)
        with torch.no_grad():
            out = call(arch, t, mask, "sdpa")
            assert mask._dense is None  # nothing was materialised for the mask
            assert rel_err(out, call(arch, t, mask, "eager")) <= 1e-5, arch


@pytest.mark.parametrize("arch", ARCHS)
@KV
def test_attention_module_sdpa_gives_eager_gradients_for_lambda_params(arch, n_kv):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=11, d_model=32, n_layers=2, n_heads=H, n_kv_heads=n_kv)
    attn = Transformer(cfg).model.layers[1].self_attn
    T = 6
    x = torch.randn(B, T, 32, requires_grad=True)
    rope = RotaryEmbedding(d)(torch.arange(T)[None].expand(B, T))
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


# ----- auto ------------------------------------------------------------------------------------
def test_auto_follows_the_documented_table(monkeypatch):
    causal, padded = AttnMask(8, 8), masks(8)["cached+padded"]
    assert resolve_impl("auto", CPU, causal) == "sdpa"
    assert resolve_impl("auto", torch.device("mps"), causal) == "sdpa"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_impl("auto", CUDA, causal) == "flex"
    assert resolve_impl("auto", CUDA, padded) == "sdpa"  # flex runs the plain causal mask only
    assert resolve_impl("flex", CPU, padded) == "sdpa"
    assert resolve_impl("eager", CUDA, causal) == "eager"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert resolve_impl("auto", CUDA, causal) == "sdpa"  # older than Ampere
    with pytest.raises(ConfigError, match="attn_impl='flash' is unknown"):
        resolve_impl("flash", CPU)


def test_the_diff_core_auto_picks_on_cuda_costs_at_most_1_5x_the_baselines_attention_flops(monkeypatch):
    """Counted from the primitive calls the chosen core makes (torch's own formula for each), on
    CPU tensors: the calls' shapes do not depend on the device."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    T = 16
    impl = resolve_impl("auto", CUDA, AttnMask(T, T))
    calls: list[int] = []

    def counting(q, k, v, mask):
        calls.append(sdpa_flop_count(q.shape, k.shape, v.shape))
        return kernels.attend_sdpa(q, k, v, mask)

    monkeypatch.setattr(kernels, f"attend_{impl}", counting)
    flops = {}
    for arch in ("baseline", "diff"):
        calls.clear()
        with torch.no_grad():
            call(arch, inputs(arch, 4, T, T), AttnMask(T, T), impl)
        flops[arch] = sum(calls)
        # H heads × (QKᵀ + PV over d); diff: H/2 heads × 2 maps × (QKᵀ over d + PV over 2d)
        assert flops[arch] == {"baseline": 4, "diff": 6}[arch] * B * T * T * H * d
    assert flops["diff"] <= 1.5 * flops["baseline"]


# ----- flex ------------------------------------------------------------------------------------
def test_flex_on_cpu_refuses_backward_with_an_actionable_error():
    t = inputs("baseline", 4, 4, 4)
    with pytest.raises(DeviceError, match="model.attn_impl=auto"):
        call("baseline", t, AttnMask(4, 4), "flex")


def test_flex_matches_eager_on_cpu_and_stays_fused_across_lengths():
    """Lengths that are not multiples of flex's 128-token block (padded), and more distinct shapes
    than Dynamo's recompile limit: with `fail_on_recompile_limit_hit` a fallback to the unfused
    path would raise instead of passing silently."""
    import torch._dynamo

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.no_grad():
        for i, T in enumerate([5, 130, 17, 260, 9, 64, 200, 3, 140, 31]):
            arch = ARCHS[i % 3]
            t = inputs(arch, 2, T, T)
            assert (
                rel_err(call(arch, t, AttnMask(T, T), "flex"), call(arch, t, AttnMask(T, T), "eager")) <= 1e-5
            )


def tiny(arch: str, impl: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64
    )
    model = Transformer(cfg)
    model.attn_impl = impl
    return model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_a_compiled_model_equals_the_eager_one(arch):
    """sdpa: forward and backward; flex: forward (torch has no flex backward on CPU). Flex's
    inputs are diff's strided halves q[:, 1::2], k[:, 1::2] inside the compiled region, the
    pattern inductor computes wrongly without the copies `attend_flex` makes."""
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    eager = tiny(arch, "eager")
    ref = eager(ids, ids).loss
    ref.backward()
    ref_logits = eager(ids).logits.detach()
    model = tiny(arch, "sdpa")
    out = torch.compile(model)(ids, ids)
    out.loss.backward()
    assert rel_err(out.logits.detach(), ref_logits) <= 1e-4
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= 1e-4, name
    flex = tiny(arch, "flex")
    with torch.no_grad():
        assert rel_err(torch.compile(flex)(ids).logits, ref_logits) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_cores_match_eager_forward_and_backward(arch, impl):
    T = 64
    for mask in masks(T).values():
        mask.key_padding_mask = None if mask.key_padding_mask is None else mask.key_padding_mask.cuda()
        core = resolve_impl(impl, CUDA, mask)
        t = {k: v.detach().cuda().requires_grad_() for k, v in inputs(arch, 2, T, mask.kv_len).items()}
        out_e, g_e = fwd_bwd(arch, t, mask, "eager")
        out_i, g_i = fwd_bwd(arch, t, mask, core)
        assert rel_err(out_i, out_e) <= 1e-4  # TF32 / kernel accumulation order on GPU
        for name in t:
            assert rel_err(g_i[name], g_e[name]) <= 1e-4, name
