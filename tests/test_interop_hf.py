"""Interop with transformers: exported runs compute what difftrain computes, and come back bit for bit.

Every test uses tiny random models whose subln weights, λ vectors and RMSNorm weights are pushed
away from their initial values, so a missing fold, a wrong head permutation or a dropped λ shows
up in the logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftrain.cli.app import main
from difftrain.data.config import TokenizerTrainConfig
from difftrain.data.tokenizer import Tokenizer, train_tokenizer
from difftrain.errors import DifftrainError, InteropError, RunDirError
from difftrain.interop.convert import SUBLN_EPS, deinterleave_heads, interleave_heads
from difftrain.interop.hf import SIDECAR, config_from_hf, export_hf, import_hf
from difftrain.model import ModelConfig, Transformer
from difftrain.rundir import load_run, save_weights

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
import transformers  # noqa: E402  (a dev dependency; imported after HF_HUB_OFFLINE is set)

TEXT = "Grüße, 世界! مرحبا 👋 def f(x): return x"
CORPUS = [
    "Grüße aus Köln, schöne Grüße! 世界你好，世界。 مرحبا بالعالم 👋🙂",
    "def f(x):\n    return x * 2\n\nclass A:\n    pass\n",
    "The quick brown fox jumps over the lazy dog 0123456789.",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(CORPUS * 20, TokenizerTrainConfig(vocab_size=320))


def build_model(
    tok: Tokenizer, arch: str, n_heads: int = 4, n_kv: int = 4, tied: bool = False, seed: int = 0, **kw
) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=tok.vocab_size + 3,
        d_model=64,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        max_seq_len=64,
        tie_embeddings=tied,
        **kw,
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights: differences between layouts show in the logits
            p.mul_(3.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
            if arch == "diff":
                a = layer.self_attn
                a.subln.weight.uniform_(0.3, 2.0)
                for n in ("q1", "k1", "q2", "k2"):
                    getattr(a, f"lambda_{n}").normal_(0.0, 0.4)
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def write_run(path: Path, model: Transformer, tok: Tokenizer) -> Path:
    path.mkdir(parents=True)
    model.config.to_json(path / "config.json")
    save_weights(path / "model.safetensors", model)
    tok.save(path / "tokenizer.json")
    return path


def load_hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens(vocab: int, B: int = 2, T: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model: Transformer, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The reference decoder: recompute the whole sequence, take the argmax, n times."""
    for _ in range(n):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def sd_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


# ----- the permutation --------------------------------------------------------------------------
def test_deinterleave_puts_pair_members_in_halves_and_interleave_inverts_it():
    n, d = 6, 3
    w = torch.arange(n)[:, None, None].expand(n, d, 2).reshape(n * d, 2).float()  # row value = head index
    hf = deinterleave_heads(w, n)
    heads = hf.reshape(n, d, 2)[:, 0, 0].long().tolist()
    assert heads == [2 * (j % (n // 2)) + j // (n // 2) for j in range(n)] == [0, 2, 4, 1, 3, 5]
    assert torch.equal(interleave_heads(hf, n), w)


def test_subln_eps_constant_is_the_models(tok):
    model = build_model(tok, "diff")
    assert model.model.layers[0].self_attn.subln.eps == SUBLN_EPS


# ----- export: same logits, same greedy tokens ---------------------------------------------------
CASES = [
    ("baseline", 4, 4, False),
    ("baseline", 8, 4, True),  # GQA (2 query heads per kv head), tied
    ("baseline", 8, 2, False),  # GQA 4:1
    ("diff", 4, 4, False),
    ("diff", 4, 4, True),
    ("diff", 8, 4, False),  # GQA: differential heads 0,1 share key pair 0; the k/v permutation is not trivial
    ("diff", 8, 4, True),
    ("diff", 8, 2, False),
]


@pytest.mark.parametrize(("arch", "n_heads", "n_kv", "tied"), CASES)
def test_exported_model_gives_our_logits_and_greedy_tokens(tmp_path, tok, arch, n_heads, n_kv, tied):
    model = build_model(tok, arch, n_heads, n_kv, tied)
    run = write_run(tmp_path / "run", model, tok)
    res = export_hf(run, tmp_path / "hf")
    assert res.hf_class == {"baseline": "LlamaForCausalLM", "diff": "DiffLlamaForCausalLM"}[arch]
    hf = load_hf(tmp_path / "hf")
    assert type(hf).__name__ == res.hf_class
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(ids).logits
    assert ours.abs().max() > 1.0  # the comparison is not between near-zero numbers
    assert (ours - theirs).abs().max().item() <= 1e-4
    prompt = ids[:1, :8]
    out = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32, eos_token_id=None
    )
    assert out.shape[1] == 8 + 32
    assert torch.equal(out, greedy(model, prompt, 32))


def test_export_counts_the_models_parameters_as_pretrain_does(tmp_path, tok):
    """A diff export folds subln into o_proj (fewer tensors in the file): it still reports the
    model's own parameter count, the one pretrain and import print."""
    model = build_model(tok, "diff", tied=True)
    run = write_run(tmp_path / "run", model, tok)
    res = export_hf(run, tmp_path / "hf")
    assert res.num_params == sum(p.numel() for p in model.parameters())  # (a tied head counted once)


def test_diff_export_is_exact_when_norm_eps_is_not_subln_eps(tmp_path, tok):
    """DiffLlama's groupnorm uses rms_norm_eps; the export rescales V so that it acts like ε=1e-5."""
    model = build_model(tok, "diff", 8, 4, norm_eps=1e-6)
    run = write_run(tmp_path / "run", model, tok)
    res = export_hf(run, tmp_path / "hf")
    assert any("V scaled" in n for n in res.notes)
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert (model(ids).logits - load_hf(tmp_path / "hf")(ids).logits).abs().max().item() <= 1e-4
    import_hf(tmp_path / "hf", tmp_path / "back")
    assert_same_tensors(sd_of(run), sd_of(tmp_path / "back"))


def test_bfloat16_export_loads_and_stays_close(tmp_path, tok):
    model = build_model(tok, "diff", 8, 4)
    run = write_run(tmp_path / "run", model, tok)
    export_hf(run, tmp_path / "hf", dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in sd_of(tmp_path / "hf").values())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids).logits, load_hf(tmp_path / "hf")(ids).logits
    assert (ours - theirs).abs().max().item() / ours.abs().max().item() < 0.05


# ----- tokenizer and generation config ---------------------------------------------------------
def test_exported_tokenizer_encodes_and_decodes_like_ours(tmp_path, tok):
    run = write_run(tmp_path / "run", build_model(tok, "baseline"), tok)
    export_hf(run, tmp_path / "hf")
    ht = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok.encode(TEXT)
    assert len(ids) > 10
    assert ht(TEXT)["input_ids"] == ids  # no special tokens added, as in pretraining
    assert ht.decode(ids) == TEXT == tok.decode(ids)
    assert (ht.bos_token_id, ht.eos_token_id, ht.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert ht.convert_tokens_to_ids("<|assistant|>") == tok.token_to_id("<|assistant|>")
    assert ht.model_max_length == 64
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    hf = load_hf(tmp_path / "hf")
    assert (hf.generation_config.eos_token_id, hf.config.pad_token_id) == (tok.eos_id, tok.pad_id)


# ----- round trips ------------------------------------------------------------------------------
def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    ("arch", "n_heads", "n_kv", "tied"),
    [("baseline", 8, 4, True), ("diff", 8, 4, False), ("diff", 4, 4, True)],
)
def test_export_then_import_gives_bit_identical_run(tmp_path, tok, arch, n_heads, n_kv, tied):
    model = build_model(tok, arch, n_heads, n_kv, tied, attn_impl="eager", lambda_std=0.05)
    run = write_run(tmp_path / "run", model, tok)
    export_hf(run, tmp_path / "hf")
    res = import_hf(tmp_path / "hf", tmp_path / "back")
    back = tmp_path / "back"
    assert_same_tensors(sd_of(run), sd_of(back))
    assert json.loads((back / "config.json").read_text()) == json.loads((run / "config.json").read_text())
    assert (back / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert res.exact_sidecar == (arch == "diff")  # baseline needs no extra tensors
    loaded = load_run(back)
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)


def test_recipe_of_an_imported_run_loads_and_points_at_its_tokenizer(tmp_path, tok):
    from difftrain.recipe import load_recipe

    run = write_run(tmp_path / "run", build_model(tok, "diff"), tok)
    export_hf(run, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "runs" / "imported")
    r = load_recipe(tmp_path / "runs" / "imported" / "recipe.yaml")
    assert r.name == "imported" and r.run_dir.resolve() == (tmp_path / "runs" / "imported").resolve()
    assert r.model == ModelConfig.from_json(tmp_path / "runs" / "imported" / "config.json")
    assert (r.recipe_dir / r.tokenizer.path).resolve() == (
        tmp_path / "runs" / "imported" / "tokenizer.json"
    ).resolve()


def test_an_import_from_a_relative_path_records_where_it_came_from_absolute(tmp_path, tok, monkeypatch):
    from difftrain.rundir import imported_from

    run = write_run(tmp_path / "run", build_model(tok, "baseline"), tok)
    export_hf(run, tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    import_hf("hf", "imported")
    assert imported_from(tmp_path / "imported") == str((tmp_path / "hf").resolve())
    text = (tmp_path / "imported" / "recipe.yaml").read_text()
    assert f"imported from {(tmp_path / 'hf').resolve()} (" in text
    assert f"finetune.base: {(tmp_path / 'imported').resolve()}`" in text


def test_pretraining_into_an_imported_run_is_refused_before_torch_with_what_to_do_instead(
    tmp_path, tok, cli_probe
):
    from difftrain.rundir import imported_from

    run = write_run(tmp_path / "run", build_model(tok, "diff"), tok)
    export_hf(run, tmp_path / "hf")
    dst = tmp_path / "runs" / "imported"
    import_hf(tmp_path / "hf", dst)
    assert imported_from(dst) == str(tmp_path / "hf") and imported_from(run) is None
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    # the run folder as a recipe, resumed or not: "a different run … resume it with this very command" before
    done = cli_probe(
        [["pretrain", str(dst), "--resume"], ["pretrain", str(dst)], ["pretrain", str(dst), "--dry-run"]],
        tmp_path,
    )
    assert done.codes == [2, 2, 2] and done.loaded == [], done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1, lines
    assert f"holds a model imported from {tmp_path / 'hf'} by `difftrain import`" in lines[0]
    assert f"fine-tune it (finetune.base: {dst})" in lines[0] and "--resume" not in lines[0]
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


def test_import_without_the_sidecar_computes_the_same_function_with_unit_subln(tmp_path, tok):
    model = build_model(tok, "diff", 8, 4)
    run = write_run(tmp_path / "run", model, tok)
    export_hf(run, tmp_path / "hf")
    (tmp_path / "hf" / SIDECAR).unlink()
    res = import_hf(tmp_path / "hf", tmp_path / "back")
    assert not res.exact_sidecar and any("set to ones" in n for n in res.notes)
    sd = sd_of(tmp_path / "back")
    assert torch.equal(sd["model.layers.1.self_attn.subln.weight"], torch.ones(2 * 8))
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert (load_run(tmp_path / "back").model(ids).logits - model(ids).logits).abs().max().item() <= 1e-4


def test_sidecar_is_ignored_when_the_weights_changed_after_export(tmp_path, tok):
    model = build_model(tok, "diff", 8, 4)
    run = write_run(tmp_path / "run", model, tok)
    export_hf(run, tmp_path / "hf")
    sd = sd_of(tmp_path / "hf")
    sd["model.layers.0.self_attn.o_proj.weight"] *= 1.5  # "fine-tuned elsewhere"
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    res = import_hf(tmp_path / "hf", tmp_path / "back")
    assert not res.exact_sidecar and any("changed after the export" in n for n in res.notes)
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        ours, theirs = load_run(tmp_path / "back").model(ids).logits, load_hf(tmp_path / "hf")(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


# ----- import of checkpoints made by transformers ------------------------------------------------
def hf_checkpoint(tok: Tokenizer, kind: str, **kw) -> torch.nn.Module:
    torch.manual_seed(3)
    common = dict(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **kw))
    else:
        model = transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**common, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "lambda" in name or "norm" in name else 0.1))
    model.eval()
    return model


@pytest.mark.parametrize("kind", ["llama", "diffllama"])
def test_imports_a_sharded_transformers_checkpoint_and_computes_the_same_logits(tmp_path, tok, kind):
    hf = hf_checkpoint(tok, kind, rms_norm_eps=1e-6)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    tok.save(tmp_path / "hf" / "tokenizer.json")
    res = import_hf(tmp_path / "hf", tmp_path / "run")
    assert res.config.arch == {"llama": "baseline", "diffllama": "diff"}[kind]
    assert res.config.norm_eps == 1e-6 and res.config.n_kv_heads == 4
    ids = tokens(tok.vocab_size)
    with torch.no_grad():
        ours, theirs = load_run(tmp_path / "run").model(ids).logits, hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_an_export_over_a_sharded_checkpoint_replaces_its_shards_and_imports_as_itself(tmp_path, tok):
    """A folder holding another model's shards, exported into with --overwrite: the shards and
    their index go (they would shadow the new weights), and importing it back gives this run."""
    other = hf_checkpoint(tok, "diffllama")
    other.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1
    run = write_run(tmp_path / "run", build_model(tok, "diff", 8, 4), tok)
    res = export_hf(run, tmp_path / "hf", overwrite=True)
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert not any(p.exists() for p in shards)
    assert any("earlier sharded weights" in n for n in res.notes)
    # a damaged index: the shards are found by the names transformers gives them
    other.save_pretrained(tmp_path / "hf2", max_shard_size="40KB")
    (tmp_path / "hf2" / "model.safetensors.index.json").write_text("{damaged")
    shards2 = sorted((tmp_path / "hf2").glob("model-*.safetensors"))
    export_hf(run, tmp_path / "hf2", overwrite=True)
    assert (
        not any(p.exists() for p in shards2)
        and not (tmp_path / "hf2" / "model.safetensors.index.json").exists()
    )
    import_hf(tmp_path / "hf", tmp_path / "back")
    ids = tokens(tok.vocab_size)
    with torch.no_grad():
        assert torch.equal(load_run(tmp_path / "back").model(ids).logits, load_run(run).model(ids).logits)
    # a folder that holds both (e.g. written by hand): read as transformers reads it, the single file
    other.save_pretrained(tmp_path / "both", max_shard_size="40KB")
    for f in ("model.safetensors", "difftrain.safetensors", "tokenizer.json", "config.json"):
        shutil.copy(tmp_path / "hf" / f, tmp_path / "both" / f)
    import_hf(tmp_path / "both", tmp_path / "back2")
    with torch.no_grad():
        assert torch.equal(load_run(tmp_path / "back2").model(ids).logits, load_run(run).model(ids).logits)


def test_bfloat16_checkpoint_imports_as_exact_float32(tmp_path, tok):
    hf = hf_checkpoint(tok, "llama", tie_word_embeddings=True).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    tok.save(tmp_path / "hf" / "tokenizer.json")
    res = import_hf(tmp_path / "hf", tmp_path / "run")
    assert any("bfloat16" in n for n in res.notes) and res.config.tie_embeddings
    sd = sd_of(tmp_path / "run")
    assert "lm_head.weight" not in sd
    for name, p in hf.state_dict().items():
        if name != "lm_head.weight":
            assert sd[name].dtype == torch.float32 and torch.equal(sd[name], p.float()), name


def test_diffllama_checkpoint_carrying_subln_weights_keeps_them(tmp_path, tok):
    hf = hf_checkpoint(tok, "diffllama")
    hf.save_pretrained(tmp_path / "hf")
    tok.save(tmp_path / "hf" / "tokenizer.json")
    sd = sd_of(tmp_path / "hf")
    w = torch.linspace(0.5, 1.5, 16)
    sd["model.layers.1.self_attn.subln.weight"] = w  # e.g. converted from Microsoft's code
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "run")
    got = sd_of(tmp_path / "run")
    assert torch.equal(got["model.layers.1.self_attn.subln.weight"], w)
    assert torch.equal(got["model.layers.0.self_attn.subln.weight"], torch.ones(16))


# ----- bad input ---------------------------------------------------------------------------------
def test_exporting_a_run_without_weights_is_a_clear_error(tmp_path, tok):
    run = write_run(tmp_path / "run", build_model(tok, "baseline"), tok)
    (run / "model.safetensors").unlink()
    with pytest.raises(RunDirError, match="no model.safetensors"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert main(["export", str(run), "--format", "hf", str(tmp_path / "hf")]) == 2


def test_diff2_export_is_refused_before_anything_is_written(tmp_path, tok):
    run = write_run(tmp_path / "run", build_model(tok, "diff2"), tok)
    with pytest.raises(
        InteropError, match=r"arch=diff2 has no transformers class.*baseline → LlamaForCausalLM"
    ):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def exported(tmp_path: Path, tok: Tokenizer, arch: str = "diff") -> Path:
    run = write_run(tmp_path / "run", build_model(tok, arch, 8, 4), tok)
    export_hf(run, tmp_path / "hf")
    return tmp_path / "hf"


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path, tok):
    hf = exported(tmp_path, tok, "baseline")
    edit_config(hf, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(
        InteropError, match=r"MistralForCausalLM is not supported.*LlamaForCausalLM.*DiffLlamaForCausalLM"
    ):
        import_hf(hf, tmp_path / "back")
    assert main(["import", str(hf), str(tmp_path / "back")]) == 2
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"intermediate_size": 160},
            r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\) but .* implies .*intermediate_size",
        ),
        ({"num_key_value_heads": 2}, r"k_proj.weight has shape \(32, 64\) but .* implies \(16, 64\)"),
        ({"num_hidden_layers": 3}, r"model.layers.2.* is missing"),
        (
            {"num_hidden_layers": 1},
            r"weights hold layers up to model.layers.1 but .*config.json says num_hidden_layers=1; set "
            r"num_hidden_layers=2 there",
        ),
        (
            {"vocab_size": 400},
            r"has shape \(\d+, 64\) but .* implies \(400, 64\) \(vocab_size × hidden_size\)",
        ),
        (
            {"num_attention_heads": 6, "head_dim": None},
            r"hidden_size=64 is not divisible by num_attention_heads=6",
        ),
        ({"num_attention_heads": 6}, r"num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
        ({"num_attention_heads": 12, "num_key_value_heads": 3}, r"DiffLlama needs even"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
            r"rope_type='llama3' is not supported",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"attention_bias": True}, r"attention_bias=true is not supported"),
        ({"hidden_size": "64"}, r"`hidden_size`='64' must be a positive integer"),
    ],
)
def test_hand_edited_config_is_a_clear_error(tmp_path, tok, changes, message):
    hf = exported(tmp_path, tok)
    edit_config(hf, **changes)
    with pytest.raises(InteropError, match=message):
        import_hf(hf, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_import_errors_name_the_file_at_fault_and_a_fix_for_import(tmp_path, tok):
    hf = exported(tmp_path, tok, "baseline")  # untied: lm_head differs from the embedding
    edit_config(hf, tie_word_embeddings=True)
    with pytest.raises(
        InteropError, match=rf"^{re.escape(str(hf / 'config.json'))} has tie_word_embeddings=true"
    ):
        import_hf(hf, tmp_path / "back")
    edit_config(hf, tie_word_embeddings=False)
    (hf / "tokenizer.json").write_text("{not json")
    with pytest.raises(InteropError, match="not a valid tokenizer.json .*save_pretrained") as e:
        import_hf(hf, tmp_path / "back")
    assert "tokenizer.path" not in str(e.value)  # a recipe key, which import has none of
    assert not (tmp_path / "back").exists()


def test_pickle_only_and_incomplete_checkpoints_are_clear_errors(tmp_path, tok):
    hf = exported(tmp_path, tok, "baseline")
    (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
    with pytest.raises(InteropError, match="only pytorch_model.bin .* safetensors only"):
        import_hf(hf, tmp_path / "back")
    (hf / "pytorch_model.bin").unlink()
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(
        InteropError, match="lists shard model-00001-of-00002.safetensors but .* does not exist"
    ):
        import_hf(hf, tmp_path / "back")
    with pytest.raises(InteropError, match="no checkpoint folder"):
        import_hf(tmp_path / "nowhere", tmp_path / "back")
    # a file of the checkpoint, not "download one first" into a path that is a file
    with pytest.raises(
        InteropError, match=r"config.json is a file; import takes the checkpoint's folder .*import \S*hf "
    ):
        import_hf(hf / "config.json", tmp_path / "back")
    (hf / "tokenizer.json").unlink()
    with pytest.raises(InteropError, match="has no tokenizer.json"):
        import_hf(hf, tmp_path / "back")


def test_a_non_empty_destination_is_refused_unless_overwrite(tmp_path, tok):
    hf = exported(tmp_path, tok)
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "notes.txt").write_text("mine")
    with pytest.raises(InteropError, match="not empty; .* --overwrite"):
        import_hf(hf, tmp_path / "back")
    r = import_hf(hf, tmp_path / "back", overwrite=True)
    assert (tmp_path / "back" / "notes.txt").read_text() == "mine"
    assert "notes.txt" not in r.files  # kept, not written: not listed as written
    with pytest.raises(InteropError, match="not empty"):
        export_hf(tmp_path / "run", hf)
    (hf / "mine.txt").write_text("mine")
    r = export_hf(tmp_path / "run", hf, overwrite=True)
    assert "mine.txt" not in r.files and {"config.json", "model.safetensors", "tokenizer.json"} <= set(
        r.files
    )
    assert all((hf / f).is_file() for f in r.files)
    import_hf(hf, tmp_path / "back", overwrite=True)  # an import may be imported over


def test_overwrite_never_writes_over_a_difftrain_run(tmp_path, tok):
    hf = exported(tmp_path, tok)
    other = write_run(tmp_path / "other", build_model(tok, "baseline", 8, 4), tok)
    (other / "checkpoints").mkdir()
    (other / "recipe.yaml").write_text("name: other\n")
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    with pytest.raises(InteropError, match="holds a difftrain run .* never over a run"):
        export_hf(tmp_path / "run", other, overwrite=True)  # would replace its config and weights
    for flag in (True, False):  # without the flag too: no advice to pass it, only to be refused
        with pytest.raises(InteropError, match="holds a difftrain run \\(checkpoints\\)"):
            import_hf(hf, other, overwrite=flag)
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before
    with pytest.raises(InteropError, match="is a difftrain run directory, not a transformers checkpoint"):
        import_hf(other, tmp_path / "elsewhere")


def test_cli_exports_and_imports_and_rejects_unknown_formats(tmp_path, tok, capsys):
    run = write_run(tmp_path / "run", build_model(tok, "diff", 8, 4), tok)
    assert main(["export", str(run), "--format", "onnx", str(tmp_path / "x")]) == 2
    assert "--format 'onnx' is not supported" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "hf", str(tmp_path / "hf")]) == 0
    assert "DiffLlamaForCausalLM" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert "difftrain generate" in capsys.readouterr().out
    assert_same_tensors(sd_of(run), sd_of(tmp_path / "back"))


def test_config_from_hf_reads_legacy_rope_theta_and_model_type_only_configs(tmp_path):
    cfg, cls = config_from_hf(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "vocab_size": 50,
            "intermediate_size": 96,
            "rope_theta": 500000.0,
            "rope_scaling": None,
        },
        tmp_path / "config.json",
    )
    assert (
        cls == "LlamaForCausalLM"
        and cfg.rope_theta == 500000.0
        and cfg.head_dim == 16
        and cfg.n_kv_heads == 4
    )


def test_export_errors_are_difftrain_errors_for_a_missing_run(tmp_path):
    with pytest.raises(DifftrainError, match="no run directory"):
        export_hf(tmp_path / "missing", tmp_path / "hf")


def with_bos_first(tok: Tokenizer) -> Tokenizer:
    """`tok` with a post-processor that puts its bos before every text, as Llama's tokenizers do."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import processors

    raw = RawTokenizer.from_str(tok.tk.to_str())
    bos = raw.id_to_token(tok.bos_id)
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_id)])
    return Tokenizer(raw)


def test_a_document_starts_after_eos_or_after_the_bos_an_imported_tokenizer_puts_first(tok):
    from difftrain.infer.generate import prompt_ids

    assert tok.document_start_id == tok.eos_id != tok.bos_id
    llama_like = with_bos_first(tok)
    assert llama_like.document_start_id == tok.bos_id
    assert prompt_ids(llama_like, "def f") == [tok.bos_id, *tok.encode("def f")]
    assert prompt_ids(tok, "def f") == [tok.eos_id, *tok.encode("def f")]


@pytest.mark.parametrize("bos_first", [False, True])
def test_the_exported_readme_snippet_samples_what_difftrain_generate_samples(
    tmp_path, tok, monkeypatch, capsys, bos_first
):
    from difftrain.infer.generate import prompt_ids

    if bos_first:  # an imported Llama's tokenizer: the card must not put eos before its <s>
        tok = with_bos_first(tok)
    model = build_model(tok, "diff")
    run = write_run(tmp_path / "run", model, tok)
    export_hf(run, tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path / "run")  # the snippet names the folder as the export was given it
    exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - our own generated snippet
    printed = capsys.readouterr().out
    ids = torch.tensor([prompt_ids(tok, "def fibonacci(n):")])  # what `difftrain generate` feeds the model
    ours = greedy(model, ids, 64)[0, 1:]
    assert printed.rstrip("\n") == tok.decode(ours.tolist())


@pytest.mark.parametrize(
    "roles",
    [
        None,  # the default template: <|user|>\n{content}<|end|>\n ...
        {"user": "\nQ {{x}}: {content}\n", "assistant": "A ÿ😀: {content}\n\n", "system": "{content}\n"},
    ],
)
def test_a_chat_fine_tune_exports_its_template_as_transformers_chat_template(tmp_path, tok, roles):
    """apply_chat_template gives the text `difftrain chat` gives the model, whatever the formats
    hold (newlines that Jinja's trim_blocks would eat, its own delimiters, non-ASCII)."""
    import yaml

    from difftrain.infer.chat import Chat
    from difftrain.recipe import ChatTemplateConfig

    run = write_run(tmp_path / "run", build_model(tok, "baseline"), tok)
    template = {} if roles is None else {"roles": roles}
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "run", "finetune": {"chat_template": template}}))
    (run / "summary.json").write_text(json.dumps({"record_kinds": ["messages"]}))
    res = export_hf(run, tmp_path / "hf")
    assert any("chat template is written" in n for n in res.notes)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and {{ you }}?"},
    ]
    chat = Chat(ChatTemplateConfig.model_validate(template), "be brief")
    chat.messages = messages
    theirs = hf_tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, *messages], tokenize=False, add_generation_prompt=True
    )
    assert theirs == chat.render()
    # transformers' generate stops a reply where `difftrain chat` does: at the end-of-turn token
    stops = transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id
    if roles is None:
        assert stops == [tok.eos_id, tok.token_to_id("<|end|>")]
        card = (tmp_path / "hf" / "README.md").read_text()
        blocks = [b.split("```", 1)[0] for b in card.split("```python\n")[1:]]
        assert len(blocks) == 2 and "messages, add_generation_prompt=True" in blocks[1]
        names: dict = {}
        for block in blocks:  # the card's snippets run as written (the chat one after the first)
            exec(
                compile(
                    block.replace(f'"{tmp_path / "hf"}"', repr(str(tmp_path / "hf"))), "README.md", "exec"
                ),
                names,
            )  # noqa: S102
    else:  # no end-of-turn text after {content}: the document's eos alone
        assert stops == tok.eos_id
    # a run tuned on prompt/response records (or pretrained) has no chat template to write
    (run / "summary.json").write_text(json.dumps({"record_kinds": ["prompt/response"]}))
    export_hf(run, tmp_path / "hf2")
    assert "chat_template" not in json.loads((tmp_path / "hf2" / "tokenizer_config.json").read_text())


def test_folder_mistakes_of_import_and_export_are_answered_before_torch_loads(tmp_path, cli_probe):
    # a missing or wrong folder is the usual slip: one line at once, not after 3-4 s of torch
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: mine\n")
    (run / "config.json").write_text("{}")
    (tmp_path / "hf").mkdir()
    (tmp_path / "loop").symlink_to("loop")  # a symbolic link loop: resolving it raised RuntimeError
    commands = [
        ["import", "nowhere", "runs/back"],
        ["import", "runs/mine", "runs/back"],
        ["import", "runs/mine", "runs/mine"],
        ["export", "runs/mine", "runs/mine"],
        ["export", "runs/mine", "out", "--dtype", "int8"],
        ["export", "runs/mine", "loop"],
        ["import", "hf", "loop/back"],
    ]
    done = cli_probe(commands, tmp_path)
    assert done.codes == [2] * len(commands) and done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == len(commands), errors
    assert errors[0].startswith("error: no checkpoint folder nowhere; download one first")
    assert "runs/mine is a difftrain run directory, not a transformers checkpoint" in errors[1]
    assert "the run directory runs/mine is the checkpoint folder itself" in errors[2]
    assert "the export folder runs/mine is the run directory itself" in errors[3]
    assert "dtype 'int8' is not supported for export; choose one of float32, bfloat16, float16" in errors[4]
    assert (
        errors[5].startswith("error: cannot write the export folder loop: ") and "leads nowhere" in errors[5]
    )
    assert errors[6].startswith("error: cannot write the run directory loop/back: ")
    assert not (tmp_path / "runs" / "back").exists() and not (tmp_path / "out").exists()


def test_an_export_over_a_chat_models_folder_removes_its_chat_template_file(tmp_path, tok):
    # transformers reads chat_template.jinja before tokenizer_config.json's chat_template: left
    # there, a plain run exported over a chat model's folder still rendered chats with the old one
    from transformers import AutoTokenizer

    folder = tmp_path / "hf"
    hf_checkpoint(tok, "diffllama").save_pretrained(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}OLD {{ m['content'] }}{% endfor %}")
    (folder / "added_tokens.json").write_text('{"<|old|>": 9999}')
    (folder / "additional_chat_templates").mkdir()  # named templates, read too
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("X")
    run = write_run(tmp_path / "run", build_model(tok, "diff", 8, 4), tok)
    res = export_hf(run, folder, overwrite=True)
    assert not (folder / "chat_template.jinja").exists() and not (folder / "added_tokens.json").exists()
    assert not (folder / "additional_chat_templates").exists()
    assert any("chat_template.jinja, added_tokens.json" in n for n in res.notes)
    assert AutoTokenizer.from_pretrained(folder).chat_template is None


@pytest.mark.parametrize("bos_first", [False, True])
def test_the_card_snippets_of_a_fine_tune_feed_the_tokens_difftrain_chat_and_generate_feed(
    tmp_path, tok, bos_first, capsys
):
    # a fine-tuning example starts with its own text (difftrain's tokenizers) or after the <s> an
    # imported tokenizer puts first: the card prepended eos to the first and nothing to the second,
    # so transformers sampled other tokens than `difftrain chat` / `generate`
    import yaml

    from difftrain.infer.chat import Chat
    from difftrain.infer.generate import prompt_ids
    from difftrain.recipe import ChatTemplateConfig

    if bos_first:
        tok = with_bos_first(tok)
    run = write_run(tmp_path / "run", build_model(tok, "diff"), tok)
    folder = tmp_path / "hf"

    def card_ids(out: Path) -> list[list[int]]:
        card = (out / "README.md").read_text()
        names: dict = {}
        fed = []
        for block in [b.split("```", 1)[0] for b in card.split("```python\n")[1:]]:
            block = block.replace(f'"{out}"', repr(str(out))).replace(
                "max_new_tokens=", "max_new_tokens=1 or "
            )
            exec(compile(block, "README.md", "exec"), names)  # noqa: S102 - our own generated snippet
            fed.append(names["ids"][0].tolist())
        return fed

    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "run", "finetune": {"chat_template": {}}}))
    (run / "summary.json").write_text(json.dumps({"record_kinds": ["messages"]}))
    export_hf(run, folder)
    chat = Chat(ChatTemplateConfig(), None)
    chat.messages = [{"role": "user", "content": "Hello!"}]
    assert card_ids(folder)[1] == prompt_ids(tok, chat.render(), document_start=False)
    fmt = "Q: {prompt}\nA:"
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "run", "finetune": {"prompt_format": fmt}}))
    (run / "summary.json").write_text(json.dumps({"record_kinds": ["prompt/response"]}))
    export_hf(run, tmp_path / "hf2")
    expected = prompt_ids(tok, fmt.format(prompt="def fibonacci(n):"), document_start=False)
    capsys.readouterr()
    assert card_ids(tmp_path / "hf2") == [expected]
    # and it prints the whole prompt: its first token is text, not a start token to skip
    assert capsys.readouterr().out.startswith(fmt.format(prompt="def fibonacci(n):"))


def test_import_says_what_of_the_tokenizer_settings_it_does_not_keep(tmp_path, tok):
    # SmolLM2-Instruct's layout: eos declared as the end of turn, and a chat template; the run
    # ended at the end-of-text token found by name and rendered chats its own way, saying nothing
    hf_dir = tmp_path / "hf"
    hf_checkpoint(tok, "llama").save_pretrained(hf_dir)
    tok.save(hf_dir / "tokenizer.json")
    cfg = json.loads((hf_dir / "config.json").read_text())  # the eos ids transformers' defaults set
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "eos_token_id": tok.eos_id}))
    (hf_dir / "generation_config.json").unlink()
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|end|>"}, "chat_template": "{{ messages }}"})
    )
    notes = import_hf(hf_dir, tmp_path / "run").notes
    end = tok.token_to_id("<|end|>")
    assert (
        f"the checkpoint declares <|end|> (id {end}, tokenizer_config.json) as an end of text; difftrain ends "
        "documents and generations at <|eos|>" in " ".join(notes)
    )
    assert any(n.startswith("the checkpoint's chat template is not imported") for n in notes)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    assert import_hf(hf_dir, tmp_path / "run2").notes == []
    # declared elsewhere: in special_tokens_map.json, or generation_config.json's stop ids
    (hf_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    notes = import_hf(hf_dir, tmp_path / "run3").notes
    assert any("<|end|> (id" in n and "special_tokens_map.json" in n for n in notes)
    (hf_dir / "special_tokens_map.json").unlink()
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, end]}))
    assert any("generation_config.json" in n for n in import_hf(hf_dir, tmp_path / "run4").notes)


def test_the_card_of_a_fine_tune_reads_the_runs_recipe_and_survives_any_prompt_format(tmp_path, tok):
    # a whole run recipe (the card test above writes a partial one, read through the fallback), and
    # formats training accepts that the card's example could not fill: export crashed with a
    # traceback after writing the weights, leaving a folder without config.json
    import yaml

    from difftrain.rundir import prompt_settings

    run = write_run(tmp_path / "run", build_model(tok, "diff"), tok)
    recipe = {
        "name": "run",
        "finetune": {"base": "runs/base", "prompt_format": "{meta[lang]} Q{id:03d}: {prompt}\n"},
        "data": {"sources": ["qa.jsonl"]},
        "train": {"max_steps": 1},
    }
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    st = prompt_settings(run)
    assert st.instruction and st.prompt_format == recipe["finetune"]["prompt_format"]
    (run / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "data": {"sources": ["notes.txt"]}}))
    assert not prompt_settings(run).instruction  # continued pretraining on text reads documents
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    export_hf(run, tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "{meta[lang]} Q{id:03d}" in card and (tmp_path / "hf" / "config.json").is_file()
