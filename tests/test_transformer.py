"""Transformer: HF names, tied embeddings, KV cache, padding, probes' hooks, checkpointing, loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from difftrain.errors import CheckpointError, ConfigError
from difftrain.model import KVCache, LMOutput, ModelConfig, Transformer

ARCHS = ["baseline", "diff", "diff2"]
V = 61


def make(arch: str = "diff", n_kv: int = 4, seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    fields = dict(arch=arch, vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv, max_seq_len=32)
    return Transformer(ModelConfig(**{**fields, **kw})).eval()


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


# ----- names and weights ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_uses_hf_llama_names(arch):
    keys = set(make(arch).state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    per_layer += ["self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if arch == "diff":
        per_layer += [
            "self_attn.lambda_q1",
            "self_attn.lambda_k1",
            "self_attn.lambda_q2",
            "self_attn.lambda_k2",
        ]
        per_layer += ["self_attn.subln.weight"]
    if arch == "diff2":
        per_layer += ["self_attn.lambda_proj.weight"]
    expected |= {f"model.layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert keys == expected


def test_initialisation_follows_the_documented_scheme():
    model = make("diff", d_model=64, n_layers=4, init_std=0.02, lambda_std=0.1)
    layer = model.model.layers[1]
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert layer.mlp.down_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.1)
    lam = torch.cat(
        [getattr(b.self_attn, f"lambda_{n}") for b in model.model.layers for n in ("q1", "k1", "q2", "k2")]
    )
    assert lam.std().item() == pytest.approx(0.1, rel=0.2)
    assert torch.equal(layer.self_attn.subln.weight, torch.ones(32))
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))


def test_tied_embeddings_share_one_tensor_and_save_without_the_duplicate(tmp_path):
    from safetensors.torch import load_file

    from difftrain.io import atomic_save_safetensors

    model = make("diff", tie_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = model.state_dict_for_safetensors()
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    atomic_save_safetensors(tmp_path / "model.safetensors", sd)

    other = make("diff", tie_embeddings=True, seed=5)
    other.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert other.lm_head.weight is other.model.embed_tokens.weight
    x = ids(2, 9)
    assert torch.equal(other(x).logits, model(x).logits)

    assigned = make("diff", tie_embeddings=True, seed=6)
    assigned.load_state_dict(load_file(tmp_path / "model.safetensors"), assign=True)
    assert assigned.lm_head.weight is assigned.model.embed_tokens.weight

    bad = dict(sd, **{"lm_head.weight": torch.randn(V, 32)})
    with pytest.raises(CheckpointError, match="tie_embeddings"):
        other.load_state_dict(bad)


def test_untied_model_needs_its_lm_head_weight():
    model = make("baseline")
    sd = model.state_dict_for_safetensors()
    assert "lm_head.weight" in sd
    sd.pop("lm_head.weight")
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        make("baseline").load_state_dict(sd)


# ----- loss, outputs ----------------------------------------------------------------------------
def test_loss_is_mean_cross_entropy_over_unmasked_targets():
    model = make("diff2")
    x, y = ids(2, 10), ids(2, 10, seed=2)
    y[0, :4] = -100  # e.g. a prompt masked out in SFT
    out = model(x, y)
    assert isinstance(out, LMOutput)
    keep = y != -100
    expected = F.cross_entropy(out.logits[keep], y[keep])
    assert torch.allclose(out.loss, expected, rtol=1e-6)
    all_ignored = model(x, torch.full_like(y, -100)).loss
    assert all_ignored.item() == 0.0


def test_hidden_states_are_block_outputs_before_the_final_norm():
    model = make("baseline", n_layers=3)
    out = model(ids(2, 8), output_hidden_states=True)
    assert len(out.hidden_states) == 3
    assert torch.allclose(model.lm_head(model.model.norm(out.hidden_states[-1])), out.logits)
    assert model(ids(2, 8)).hidden_states is None


@pytest.mark.parametrize("arch", ARCHS)
def test_output_attentions_returns_effective_maps_and_masked_logits(arch):
    model = make(arch, n_kv=2)
    x = ids(2, 9)
    out = model(x, output_attentions=True)
    assert rel_err(out.logits, model(x).logits) <= 1e-5  # probes see the model that trains
    assert len(out.attentions) == len(out.attn_logits) == 2
    n_maps = {"baseline": 4, "diff": 2, "diff2": 4}[arch]
    n_logit_heads = {"baseline": 4, "diff": 4, "diff2": 8}[arch]
    A, S = out.attentions[1], out.attn_logits[1]
    assert A.shape == (2, n_maps, 9, 9) and S.shape == (2, n_logit_heads, 9, 9)
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    assert torch.isneginf(S[..., future]).all() and torch.isfinite(S[..., ~future]).all()
    assert (A[..., future] == 0).all()
    rows = A.sum(-1)  # softmax rows sum to 1, so the effective maps' rows sum to 1 − weight
    attn = model.model.layers[1].self_attn
    if arch == "baseline":
        expected = torch.ones_like(rows)
    elif arch == "diff":
        expected = (1 - attn.lam()).expand_as(rows)
    else:
        h = model.model.layers[1].input_layernorm(
            out.hidden_states[0] if out.hidden_states else _h0(model, x)
        )
        expected = 1 - torch.sigmoid(attn.lambda_proj(h)).transpose(1, 2)
    assert torch.allclose(rows, expected, atol=1e-5)


def _h0(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    return model(x, output_hidden_states=True).hidden_states[0]


def test_identity_logit_transform_changes_nothing():
    model = make("diff", n_kv=2)
    model.attn_impl = "eager"
    x = ids(2, 10)
    plain = model(x).logits
    seen = []
    model.set_attn_logit_transform(lambda s, layer: seen.append(layer) or s)
    assert torch.equal(model(x).logits, plain)
    assert seen == [0, 1]
    model.set_attn_logit_transform(None)
    model.attn_impl = "sdpa"
    assert rel_err(model(x).logits, plain) <= 1e-5


def test_logit_transform_changes_attention_but_cannot_unmask_the_future():
    model = make("diff2")
    x = ids(1, 10)
    y = x.clone()
    y[0, 6:] = (y[0, 6:] + 1) % V  # change only the future of position 5
    model.set_attn_logit_transform(lambda s, layer: torch.zeros_like(s))  # would unmask if not re-masked
    a, b = model(x).logits, model(y).logits
    assert torch.equal(a[0, :6], b[0, :6])
    model.set_attn_logit_transform(None)
    assert not torch.allclose(model(x).logits, a)


def test_activation_checkpointing_gives_the_same_loss_and_grads():
    model = make("diff", n_kv=2).train()
    x, y = ids(2, 12), ids(2, 12, seed=3)
    grads = []
    for enabled in (False, True):
        model.set_activation_checkpointing(enabled)
        model.zero_grad()
        loss = model(x, y).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1)
    for a, b in zip(g0, g1, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)


def test_bf16_autocast_forward_and_backward_are_finite():
    model = make("diff", n_kv=2).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids(2, 8), ids(2, 8, seed=4)).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.model.layers[0].self_attn.lambda_q1.grad is not None


def test_param_groups_decay_only_matrices():
    model = make("diff")
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# ----- KV cache ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_cached_incremental_logits_equal_the_full_forward(arch, n_kv, impl):
    model = make(arch, n_kv=n_kv)
    model.attn_impl = impl
    x = ids(2, 11)
    full = model(x).logits
    cache = model.new_cache(2, max_len=16)
    assert isinstance(cache, KVCache)
    steps = [model(x[:, :4], cache=cache).logits]  # prefill a chunk, then one token at a time
    steps += [model(x[:, t : t + 1], cache=cache).logits for t in range(4, 11)]
    assert cache.length == 11
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-5


def test_diff_cache_holds_both_key_halves_and_wide_values():
    model = make("diff", n_kv=2)
    cache = model.new_cache(3, max_len=10)
    assert cache.keys[0].shape == (3, 2, 10, 8)  # key heads 2g and 2g+1 of width d
    assert cache.values[0].shape == (3, 1, 10, 16)  # value head g of width 2d
    diff2 = make("diff2", n_kv=2).new_cache(3, max_len=10)
    assert diff2.keys[0].shape == diff2.values[0].shape == (3, 2, 10, 8)
    assert len(cache.keys) == 2 and cache.max_len == 10 and cache.batch_size == 3


@torch.no_grad()
def test_full_cache_raises_and_reset_reuses_it():
    model = make("baseline")
    cache = model.new_cache(1, max_len=6)
    x = ids(1, 6)
    model(x[:, :5], cache=cache)
    with pytest.raises(ConfigError, match="KV cache is full"):
        model(x[:, 4:6], cache=cache)
    cache.reset()
    first = model(x, cache=cache).logits
    assert rel_err(first, model(x).logits) <= 1e-5


def greedy(model: Transformer, prompt: torch.Tensor, n: int, pad: torch.Tensor | None = None) -> tuple:
    """Greedy decode with the cache; returns (tokens (B, n), logits of each step (B, n, V))."""
    cache = model.new_cache(prompt.shape[0], max_len=prompt.shape[1] + n)
    logits = model(prompt, cache=cache, key_padding_mask=pad).logits[:, -1]
    toks, all_logits = [], []
    for _ in range(n):
        all_logits.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        toks.append(nxt)
        logits = model(nxt, cache=cache).logits[:, -1]
    return torch.cat(toks, 1), torch.stack(all_logits, 1)


@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_left_padded_batch_equals_each_sequence_alone(arch, n_kv):
    model = make(arch, n_kv=n_kv)
    a, b = ids(1, 7, seed=7), ids(1, 4, seed=8)
    batch = torch.zeros(2, 7, dtype=torch.long)  # pad id 0: its embedding must not matter
    batch[0], batch[1, 3:] = a[0], b[0]
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :3] = False

    full = model(batch, key_padding_mask=pad).logits  # positions come from the mask
    assert rel_err(full[0], model(a).logits[0]) <= 1e-5
    assert rel_err(full[1, 3:], model(b).logits[0]) <= 1e-5
    assert torch.isfinite(full).all()

    toks, logits = greedy(model, batch, 5, pad)
    for row, alone in ((0, a), (1, b)):
        t_alone, l_alone = greedy(model, alone, 5)
        assert torch.equal(toks[row], t_alone[0])
        assert rel_err(logits[row], l_alone[0]) <= 1e-5


@torch.no_grad()
def test_explicit_positions_override_the_defaults_and_the_cache_continues_from_them():
    model = make("diff2")
    x = ids(1, 6)
    strided = torch.arange(0, 12, 2)[None]  # RoPE is relative: only uneven gaps change the result
    assert not torch.allclose(model(x, positions=strided).logits, model(x).logits)
    cache = model.new_cache(1, max_len=6)
    first = model(x[:, :3], cache=cache, positions=strided[:, :3]).logits
    rest = model(x[:, 3:], cache=cache, positions=strided[:, 3:]).logits
    assert rel_err(torch.cat((first, rest), 1), model(x, positions=strided).logits) <= 1e-5

    cache.reset()
    model(x[:, :3], cache=cache, positions=torch.arange(20, 23)[None])
    assert cache.next_position.tolist() == [23]
    rest = model(x[:, 3:], cache=cache).logits  # continues at 23, 24, 25
    expected = model(x, positions=torch.arange(20, 26)[None]).logits[:, 3:]
    assert rel_err(rest, expected) <= 1e-5


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_static_cache_steps_equal_the_full_forward_with_padded_prompts(arch):
    """The compiled decode step's cache (fixed shapes: every slot attended, masked) computes what
    the growing cache and the full forward compute."""
    model = make(arch)
    x = ids(2, 9)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, :2] = False  # row 0 is left-padded by 2
    full = model(x, key_padding_mask=pad).logits
    cache = model.new_cache(2, max_len=12)
    with torch.no_grad():
        model(x[:, :5], cache=cache, key_padding_mask=pad[:, :5])
        cache.start_static()
        steps = []
        for t in range(5, 9):
            steps.append(model(x[:, t : t + 1], cache=cache).logits)
            cache.static_step_done()
    assert cache.length == 9 and cache.next_position.tolist() == [7, 9]
    assert rel_err(torch.cat(steps, 1), full[:, 5:]) <= 1e-5
    with pytest.raises(ValueError, match="one token per sequence"):
        model(x[:, :2], cache=cache)
