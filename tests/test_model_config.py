"""ModelConfig: explicit defaults, helpful validation errors, JSON round trip, parameter counts."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from difftrain.errors import ConfigError
from difftrain.model import ModelConfig, Transformer, lambda_init, num_params
from difftrain.model.config import config_error_from_validation


def test_lambda_init_follows_the_paper_schedule():
    assert lambda_init(0) == pytest.approx(0.2, abs=1e-12)
    assert lambda_init(1) == pytest.approx(0.3555, abs=1e-4)
    assert lambda_init(2) == pytest.approx(0.4707, abs=1e-4)
    assert lambda_init(27) == pytest.approx(0.7998, abs=1e-4)


def test_defaults_are_filled_so_the_saved_config_is_explicit():
    c = ModelConfig(d_model=512, n_heads=8)
    assert c.n_kv_heads == 8
    assert c.head_dim == 64
    assert c.ffn_hidden == 1408  # 8/3·512 = 1365.3 → next multiple of 64
    dumped = c.model_dump()
    assert all(v is not None for v in dumped.values())
    assert dumped["arch"] == "diff" and dumped["vocab_size"] == "auto"


def test_explicit_derived_fields_are_kept():
    c = ModelConfig(d_model=96, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=100)
    assert (c.n_kv_heads, c.head_dim, c.ffn_hidden) == (2, 16, 100)


def test_every_field_is_documented():
    for name, field in ModelConfig.model_fields.items():
        assert field.description and len(field.description) > 15, name


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(arch="diff", d_model=48, n_heads=3), "model.n_heads=3 must be even for arch=diff"),
        (
            dict(arch="diff", d_model=64, n_heads=4, n_kv_heads=1),
            "model.n_kv_heads=1 must be even for arch=diff",
        ),
        (
            dict(arch="baseline", d_model=64, n_heads=4, n_kv_heads=3),
            "model.n_heads=4 with n_kv_heads=3: n_heads must be a multiple of n_kv_heads",
        ),
        (dict(arch="baseline", d_model=100, n_heads=8), "model.d_model=100 is not divisible by n_heads=8"),
        (dict(arch="baseline", d_model=24, n_heads=8), "model.head_dim=3 must be even"),
        (dict(arch="transformer"), "model.arch"),
        (dict(d_model=0), "model.d_model"),
        (dict(vocab_size="big"), "model.vocab_size"),
        (dict(vocab_size=0), "model.vocab_size"),
        (dict(attn_impl="flash"), "model.attn_impl"),
        (dict(n_head=8), "model.n_head: unknown key"),
    ],
)
def test_invalid_configs_raise_config_error_naming_the_field(fields, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")) as info:
        ModelConfig.from_dict(fields)
    assert "\n" not in str(info.value)
    with pytest.raises(ValidationError):  # direct construction: pydantic's own error
        ModelConfig(**fields)


def test_diff_error_explains_the_pairing():
    with pytest.raises(ConfigError, match="differential heads pair query heads 2i and 2i\\+1"):
        ModelConfig.from_dict(dict(arch="diff", d_model=48, n_heads=3))


def test_nested_validation_keeps_pydantic_locations():
    # A recipe schema nests ModelConfig; its loader needs located pydantic errors, not ConfigError.
    from pydantic import BaseModel

    class Recipe(BaseModel):
        model: ModelConfig

    with pytest.raises(ValidationError) as info:
        Recipe.model_validate({"model": {"arch": "diff", "d_model": 48, "n_heads": 3}})
    assert info.value.errors()[0]["loc"][0] == "model"
    assert "n_heads=3 must be even" in str(info.value)
    err = config_error_from_validation(info.value, where="")
    assert str(err).startswith("model.n_heads=3 must be even for arch=diff")


def test_json_round_trip_is_explicit_and_atomic(tmp_path):
    c = ModelConfig(arch="diff2", vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2)
    path = tmp_path / "config.json"
    c.to_json(path)
    assert ModelConfig.from_json(path) == c
    data = json.loads(path.read_text())
    assert data["head_dim"] == 16 and data["ffn_hidden"] == 192
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temp file left behind


def test_from_json_errors_name_the_file_and_field(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json: model config file not found"):
        ModelConfig.from_json(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"arch": "diff",\n "d_model": }')
    with pytest.raises(ConfigError, match="broken.json, line 2: invalid JSON"):
        ModelConfig.from_json(broken)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"arch": "diff", "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "dropout": 0.1}))
    with pytest.raises(ConfigError, match=r"bad.json.dropout: unknown key"):
        ModelConfig.from_json(bad)
    hf = tmp_path / "hf" / "config.json"
    hf.parent.mkdir()
    hf.write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64})
    )
    with pytest.raises(
        ConfigError, match=r"is a transformers config \(llama\), not a difftrain one; .*difftrain import"
    ):
        ModelConfig.from_json(hf)


def test_replace_validates_and_resolves_auto_vocab():
    c = ModelConfig(d_model=64, n_heads=4)
    with pytest.raises(ConfigError, match="vocab_size is 'auto'"):
        Transformer(c)
    resolved = c.replace(vocab_size=123)
    assert resolved.vocab_size == 123 and resolved.head_dim == c.head_dim
    assert Transformer(resolved).lm_head.weight.shape == (123, 64)
    with pytest.raises(ConfigError, match="n_heads=1 must be even"):
        c.replace(n_heads=1, n_kv_heads=1, head_dim=64)


def _tiny(arch: str, **kw) -> ModelConfig:
    base = dict(arch=arch, vocab_size=97, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_diff_has_baseline_parameters_plus_lambda_and_subln(n_kv_heads):
    base, diff = _tiny("baseline", n_kv_heads=n_kv_heads), _tiny("diff", n_kv_heads=n_kv_heads)
    d = diff.head_dim
    assert num_params(diff)["total"] == num_params(base)["total"] + diff.n_layers * (4 * d + 2 * d)
    assert Transformer(diff).num_params()["total"] == Transformer(base).num_params()["total"] + 3 * 6 * d


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
@pytest.mark.parametrize("tie", [False, True])
def test_counted_parameters_match_the_module(arch, tie):
    c = _tiny(arch, tie_embeddings=tie)
    model = Transformer(c)
    counts = model.num_params()
    assert counts == num_params(c)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["head"] == (0 if tie else 97 * 64)
    if arch == "diff2":
        assert counts["lambda"] == c.n_layers * c.d_model * c.n_heads


def test_diff2_query_projection_has_twice_the_heads():
    model = Transformer(_tiny("diff2"))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (2 * 4 * 16, 64)
    assert attn.o_proj.weight.shape == (64, 4 * 16)
    assert attn.lambda_proj.weight.shape == (4, 64)
    assert torch.is_floating_point(attn.lambda_proj.weight)
