"""`difftrain finetune` (full, LoRA, QLoRA) and `difftrain merge`, end to end on a tiny base run."""

from __future__ import annotations

import csv
import json
import shutil
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from difftrain.adapters import load_adapter_run, merge_run, read_adapter_spec, resolve_base
from difftrain.cli.app import main
from difftrain.errors import CheckpointError, ConfigError, DataError, RecipeError, RunDirError, StopRequested
from difftrain.model.lora import LoRALinear
from difftrain.recipe import load_recipe, shipped_recipes
from difftrain.rundir import load_run
from difftrain.train.callbacks import RunCallback
from difftrain.train.finetune import finetune
from difftrain.train.run import pretrain

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

BASE_RECIPE = """\
name: base
seed: 3
out_dir: {out}
model: {{arch: diff, d_model: 32, n_layers: 2, n_heads: 4, max_seq_len: 48, tie_embeddings: true}}
data: {{sources: [{corpus}], val_fraction: 0.1, val_windows: 2, cache_dir: {cache}}}
tokenizer: {{train: {{vocab_size: 320}}}}
train: {{max_steps: 2, micro_batch_size: 4, log_every: 1, save_every: 2}}
optim: {{lr: 3.0e-3, warmup_steps: 1}}
logging: {{progress: false, tensorboard: false}}
"""

FT_RECIPE = """\
name: {name}
seed: 5
out_dir: {out}
finetune:
  base: {base}
  method: {method}
  lora: {{rank: 4, alpha: 8, dropout: {dropout}}}
data:
  sources: [{data}]
  val_fraction: 0.2
  cache_dir: {cache}
train: {{max_steps: {steps}, micro_batch_size: 2, global_batch_size: 4, log_every: 1, val_every: 2, save_every: {save_every}}}
optim: {{lr: 1.0e-2, warmup_steps: 1, weight_decay: 0.0}}
logging: {{progress: false, tensorboard: false}}
"""


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A tiny pretrained `diff` run (2 steps) and the folder holding it."""
    root = tmp_path_factory.mktemp("base")
    corpus = root / "corpus"
    corpus.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        lines = []
        for j in range(10):
            w = [WORDS[int(k)] for k in torch.randint(len(WORDS), (3,), generator=g)]
            lines.append(
                f'def {w[0]}_{j}({w[1]}, {w[2]}):\n    """Return {w[1]} plus {w[2]}."""\n    return {w[1]} + {w[2]}\n'
            )
        (corpus / f"doc{i:02d}.py").write_text("".join(lines))
    p = root / "base.yaml"
    p.write_text(BASE_RECIPE.format(out=root / "runs", corpus=corpus, cache=root / "cache"))
    return pretrain(load_recipe(p)).run_dir


@pytest.fixture()
def ws(tmp_path, base_run, monkeypatch):
    """Writes fine-tune recipes (and their data) into tmp_path; returns a recipe factory."""
    monkeypatch.chdir(tmp_path)
    records = tmp_path / "sft.jsonl"
    with open(records, "w") as f:
        for i in range(20):
            w = WORDS[i % len(WORDS)]
            f.write(
                json.dumps(
                    {
                        "prompt": f'def {w}_{i}(a, b):\n    """Return a plus b."""\n',
                        "response": "    return a + b\n",
                    }
                )
                + "\n"
            )

    def recipe(
        name="ft", method="lora", steps=3, save_every=3, dropout=0.0, data=None, extra="", base=None
    ) -> Path:
        p = tmp_path / f"{name}.yaml"
        p.write_text(
            FT_RECIPE.format(
                name=name,
                out=tmp_path / "runs",
                base=base or base_run,
                method=method,
                dropout=dropout,
                data=data or records,
                cache=base_run.parent.parent / "cache",
                steps=steps,
                save_every=save_every,
            )
            + extra
        )
        return p

    return recipe


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {
            int(float(r["step"])): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")
        }


class Grab(L.Callback):
    """Keeps the trained model and the first training batch."""

    def __init__(self) -> None:
        self.model = None
        self.batch = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.batch is None:
            self.batch = {k: v.clone() for k, v in batch.items()}

    def on_train_end(self, trainer, pl_module):
        self.model = pl_module.model


def test_lora_trains_only_the_adapters_and_leaves_the_base_bit_identical(ws, base_run):
    grab = Grab()
    result = finetune(load_recipe(ws(steps=3)), extra_callbacks=[grab])
    run = result.run_dir
    model = grab.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lambdas = {f"model.layers.{i}.self_attn.lambda_{v}" for i in range(2) for v in ("q1", "k1", "q2", "k2")}
    loras = {
        f"model.layers.{i}.{m}.{ab}"
        for i in range(2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
        for ab in ("lora_A", "lora_B")
    }
    assert trainable == loras | lambdas
    # every frozen tensor is bit-identical to the base run's weights
    base = load_file(base_run / "model.safetensors")
    for name, p in model.named_parameters():
        if not p.requires_grad:
            key = name.replace(".base.weight", ".weight")
            assert torch.equal(p.detach(), base[key]), name
    # the trainable ones moved: B away from 0, λ away from the base
    adapter = load_file(run / "adapter.safetensors")
    assert set(adapter) == trainable
    assert all(adapter[n].abs().sum() > 0 for n in loras if n.endswith("lora_B"))
    assert any(not torch.equal(adapter[n], base[n]) for n in lambdas)
    # the count in the summary is r·(in + out) per adapted layer + 4·head_dim λ values per layer
    d, f = 32, model.config.ffn_hidden
    per_layer = 4 * (4 * (d + d)) + 4 * 2 * (d + f) + 4 * (d + f) + 4 * 8
    assert result.summary["trainable_params"] == 2 * per_layer
    spec = read_adapter_spec(run)
    assert spec.method == "lora" and spec.step == 3 and len(spec.targets) == 14
    assert Path(spec.base["abs_path"]) == base_run.resolve()
    assert not (run / "model.safetensors").exists()
    assert (run / "adapter.safetensors").stat().st_size < (base_run / "model.safetensors").stat().st_size / 2
    assert result.summary["initial_val_loss"] is not None and result.summary["final_val_loss"] is not None


def test_merged_run_gives_the_logits_of_base_plus_adapter(ws, tmp_path):
    run = finetune(load_recipe(ws(steps=2, save_every=2))).run_dir
    unmerged = load_adapter_run(run, merge=False).model
    assert any(isinstance(m, LoRALinear) for m in unmerged.modules())
    merged_dir = merge_run(run)
    assert merged_dir == run.parent / "ft-merged"
    merged = load_run(merged_dir)
    assert not any(isinstance(m, LoRALinear) for m in merged.model.modules())
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = unmerged(ids).logits, merged.model(ids).logits
        c = load_run(run).model(ids).logits  # an adapter run loads as base + adapter
    assert (a - b).abs().max() <= 1e-5 and (a - c).abs().max() <= 1e-5
    for f in ("config.json", "tokenizer.json", "recipe.yaml", "summary.json"):
        assert (merged_dir / f).is_file()
    assert json.loads((merged_dir / "summary.json").read_text())["merged_from"]["method"] == "lora"
    with pytest.raises(RunDirError, match="holds a run already; choose another OUT_DIR or pass --overwrite"):
        merge_run(run)
    # --overwrite never removes what the merge reads: the base, or a folder that holds it or the adapter
    base = resolve_base(run, read_adapter_spec(run))
    for out in (base, base.parent, run.parent):
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        with pytest.raises(RunDirError, match="that the merge reads"):
            merge_run(run, out, overwrite=True)
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert merge_run(run, overwrite=True) == merged_dir  # a merged run is replaced
    # ... but never a run that training wrote (its checkpoints), with or without --overwrite
    for flag in (True, False):
        before = sorted(p.relative_to(base) for p in base.rglob("*"))
        trained = base.parent / "trained-copy"
        shutil.copytree(base, trained)
        with pytest.raises(
            RunDirError, match=r"holds a trained run \(checkpoints\); merge writes a new run"
        ) as e:
            merge_run(run, trained, overwrite=flag)
        assert ("--overwrite replaces an earlier merge" in str(e.value)) == flag
        assert sorted(p.relative_to(trained) for p in trained.rglob("*")) == before
        shutil.rmtree(trained)
    mine = tmp_path / "my-folder"  # ... but not a folder of the user's that is no run
    mine.mkdir()
    (mine / "notes.txt").write_text("important")
    with pytest.raises(
        RunDirError, match=r"is not a difftrain run directory \(--overwrite replaces only runs\)"
    ):
        merge_run(run, mine, overwrite=True)
    with pytest.raises(RunDirError, match="is not a difftrain run directory; choose another") as e:
        merge_run(run, mine)  # no advice to pass --overwrite, which would be refused
    assert "--overwrite" not in str(e.value)
    assert (mine / "notes.txt").read_text() == "important"
    with pytest.raises(RunDirError, match="nothing to merge"):
        merge_run(merged_dir, tmp_path / "again")
    # `export` takes the adapter run as it is (base + adapter, merged on load): the merged run's export
    from difftrain.interop.hf import export_hf

    assert any("adapter merged in" in n for n in export_hf(run, tmp_path / "hf-adapter").notes)
    assert not any("adapter" in n for n in export_hf(merged_dir, tmp_path / "hf-merged").notes)
    ea, em = (
        load_file(tmp_path / "hf-adapter" / "model.safetensors"),
        load_file(tmp_path / "hf-merged" / "model.safetensors"),
    )
    assert ea.keys() == em.keys() and all(torch.equal(ea[k], em[k]) for k in ea)


class StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and pl_module.stepped:
            next(c for c in trainer.callbacks if isinstance(c, RunCallback))._stop_signal = signal.SIGTERM


def test_lora_resume_continues_the_exact_loss_curve(ws):
    """With LoRA dropout on: the masks come from (seed, micro-batch index), so they resume too."""
    full = finetune(load_recipe(ws(name="full", steps=5, save_every=2, dropout=0.2)))
    with pytest.raises(StopRequested):
        finetune(
            load_recipe(ws(name="split", steps=5, save_every=2, dropout=0.2)), extra_callbacks=[StopAt(3)]
        )
    ckpt = torch.load(
        next((full.run_dir / "checkpoints").glob("step-*.ckpt")), map_location="cpu", weights_only=True
    )
    assert all("lora_" in k or "lambda_" in k for k in ckpt["state_dict"])  # frozen base not copied
    resumed = finetune(load_recipe(ws(name="split", steps=5, save_every=2, dropout=0.2)), resume=True)
    assert resumed.resumed_from == 3
    a, b = losses(full.run_dir), losses(resumed.run_dir)
    assert sorted(a) == [1, 2, 3, 4, 5] and a == b
    wa, wb = (
        load_file(full.run_dir / "adapter.safetensors"),
        load_file(resumed.run_dir / "adapter.safetensors"),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert resumed.summary["initial_val_loss"] == full.summary["initial_val_loss"]


def test_resuming_a_finished_lora_run_keeps_it_and_rewrites_a_damaged_adapter(ws, base_run, tmp_path):
    p = ws(name="done", steps=2, save_every=2)
    run = finetune(load_recipe(p)).run_dir
    good = {k: v.clone() for k, v in load_file(run / "adapter.safetensors").items()}
    summary = (run / "summary.json").read_bytes()
    again = finetune(load_recipe(p), resume=True)
    assert again.finished_before and again.notes == [] and again.summary["steps"] == 2
    with open(run / "adapter.safetensors", "r+b") as f:
        f.truncate(100)
    again = finetune(load_recipe(p), resume=True)
    assert "adapter.safetensors is damaged" in again.notes[0]
    restored = {k: v.clone() for k, v in load_file(run / "adapter.safetensors").items()}
    assert restored.keys() == good.keys() and all(torch.equal(good[k], restored[k]) for k in good)
    assert (run / "summary.json").read_bytes() == summary
    # its own recipe.yaml with another base: named as a different base, not as tokenizer.path
    other = shutil.copytree(base_run, tmp_path / "other-base")
    with pytest.raises(
        RunDirError, match=rf"was fine-tuned from {base_run}, not finetune.base={other}: a different"
    ):
        finetune(load_recipe(run, [f"finetune.base={other}"]), resume=True)
    # the same base written another way (a trailing /, .., a symbolic link) is the same base
    (tmp_path / "link-to-base").symlink_to(base_run)
    for same in (f"{base_run}/", f"{base_run}/../{base_run.name}", str(tmp_path / "link-to-base")):
        again = finetune(load_recipe(run, [f"finetune.base={same}"]), resume=True)
        assert again.finished_before, same


def test_full_finetune_trains_every_weight_and_writes_model_safetensors(ws, base_run):
    result = finetune(load_recipe(ws(name="fullft", method="full", steps=2, save_every=2)))
    run = result.run_dir
    assert (run / "model.safetensors").is_file() and not (run / "adapter.json").exists()
    before, after = load_file(base_run / "model.safetensors"), load_file(run / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(not torch.equal(before[k], after[k]) for k in before if "lambda" not in k and "norm" not in k)
    assert result.summary["trainable_params"] == load_run(base_run).model.num_params()["total"]


def test_sft_batches_train_only_on_responses_end_to_end(ws, tmp_path, base_run):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "def f(a):\n", "response": "    return a\n"}) + "\n")
    grab = Grab()
    r = load_recipe(ws(name="mask", steps=1, save_every=1, data=data), ["data.val_fraction=0"])
    assert finetune(r, extra_callbacks=[grab]).summary["record_kinds"] == ["prompt/response"]  # for `chat`
    tok = load_run(base_run).tokenizer
    p, resp = tok.encode("def f(a):\n"), tok.encode("    return a\n")
    ids = p + resp + [tok.eos_id]
    expected_targets = [-100] * (len(p) - 1) + resp + [tok.eos_id]
    assert grab.batch["input_ids"][0].tolist() == ids[:-1]
    assert grab.batch["targets"][0].tolist() == expected_targets
    r2 = load_recipe(
        ws(name="mask2", steps=1, save_every=1, data=data),
        ["data.val_fraction=0", "finetune.train_on_prompt=true"],
    )
    grab2 = Grab()
    finetune(r2, extra_callbacks=[grab2])
    assert grab2.batch["targets"][0].tolist() == ids[1:]


def test_messages_are_rendered_with_the_chat_template_and_only_replies_trained(ws, tmp_path, base_run):
    data = tmp_path / "chat.jsonl"
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add a b"},
        {"role": "assistant", "content": "a + b"},
    ]
    data.write_text(json.dumps({"messages": msgs}) + "\n")
    grab = Grab()
    result = finetune(
        load_recipe(ws(name="chat", steps=1, save_every=1, data=data), ["data.val_fraction=0"]),
        extra_callbacks=[grab],
    )
    assert json.loads((result.run_dir / "summary.json").read_text())["record_kinds"] == ["messages"]
    tok = load_run(base_run).tokenizer
    prompt = tok.encode("<|system|>\nBe brief.<|end|>\n<|user|>\nadd a b<|end|>\n<|assistant|>\n")
    reply = tok.encode("a + b<|end|>\n") + [tok.eos_id]
    assert tok.token_to_id("<|assistant|>") in prompt  # a special token, not split
    assert grab.batch["targets"][0].tolist() == [-100] * (len(prompt) - 1) + reply


def tool_template_recipe(ws, tmp_path: Path, name: str, records: int, base: Path | None = None) -> Path:
    """A 2-step LoRA recipe on `records` chat records with a `tool` role, whose template adds
    `<|tool|>`, a token the base's tokenizer lacks."""
    data = tmp_path / f"{name}.jsonl"
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "ok"},
    ]
    data.write_text("".join(json.dumps({"messages": msgs}) + "\n" for _ in range(records)))
    template = """\
  chat_template:
    roles: {user: "<|user|>{content}<|end|>", tool: "<|tool|>{content}<|end|>", assistant: "<|assistant|>{content}<|end|>"}
    special_tokens: ["<|user|>", "<|tool|>", "<|assistant|>", "<|end|>"]
"""
    p = ws(name=name, steps=2, save_every=2, data=data, base=base)
    p.write_text(p.read_text().replace("  lora: {rank: 4", template + "  lora: {rank: 4"))
    return p


def test_a_template_token_the_base_lacks_grows_embedding_and_head(ws, tmp_path, base_run):
    p = tool_template_recipe(ws, tmp_path, "grow", records=1)
    result = finetune(load_recipe(p, ["data.val_fraction=0"]))
    run = result.run_dir
    base_cfg = json.loads((base_run / "config.json").read_text())
    cfg = json.loads((run / "config.json").read_text())
    assert base_cfg["vocab_size"] == 320 and cfg["vocab_size"] == 384
    loaded = load_run(run)
    new_id = loaded.tokenizer.token_to_id("<|tool|>")
    assert new_id == 320 and loaded.tokenizer.encode("<|tool|>") == [new_id]
    emb = loaded.model.model.embed_tokens.weight
    assert emb.shape == (384, 32) and loaded.model.lm_head.weight is emb
    base_emb = load_file(base_run / "model.safetensors")["model.embed_tokens.weight"]
    mean = base_emb[: base_cfg["vocab_size"]].mean(0)
    assert not torch.allclose(emb[new_id], mean)  # started at the mean, then trained
    assert "model.embed_tokens.weight" in load_file(run / "adapter.safetensors")
    assert read_adapter_spec(run).vocab["new_ids"] == [new_id]


def test_qlora_on_cpu_trains_adapters_over_a_4bit_base_and_merges_to_what_was_trained(ws):
    pytest.importorskip("bitsandbytes")
    grab = Grab()
    run = finetune(
        load_recipe(ws(name="q", method="qlora", steps=2, save_every=2)), extra_callbacks=[grab]
    ).run_dir
    spec = read_adapter_spec(run)
    assert spec.method == "qlora" and len(spec.quantized) == 14
    assert type(grab.model.model.layers[0].self_attn.q_proj.base).__name__ == "Linear4bit"
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    grab.model.eval()
    with torch.no_grad():
        trained = grab.model(ids).logits
        loaded = load_run(run).model(ids).logits
    assert (trained - loaded).abs().max() <= 1e-4


def test_continued_pretraining_on_plain_text(ws, base_run):
    corpus = base_run.parent.parent / "corpus"
    r = load_recipe(ws(name="text", steps=2, save_every=2, data=corpus), ["data.val_windows=2"])
    result = finetune(r)
    assert result.summary["data_format"] == "text" and result.summary["steps"] == 2


def test_bad_input_is_a_clear_error(ws, tmp_path, base_run, capsys):
    with pytest.raises(RunDirError, match="no run directory .*train it first"):
        finetune(load_recipe(ws(name="nobase", base=tmp_path / "runs" / "missing")))
    with pytest.raises(RecipeError, match="model.d_model=64 but the base run .* has d_model=32"):
        finetune(load_recipe(ws(name="incompat"), ["model.d_model=64"]))
    with pytest.raises(RecipeError, match="model.arch=baseline .* has arch=diff"):
        finetune(load_recipe(ws(name="incompat2"), ["model.arch=baseline"]))
    with pytest.raises(ConfigError, match="`qkv` matches no linear layer; available: self_attn.q_proj"):
        finetune(load_recipe(ws(name="pat"), ["finetune.lora.target_modules=[qkv]"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    with pytest.raises(
        DataError, match=rf"{bad}, line 1: message 0 .* role 'bot'.*roles: system, user, assistant"
    ):
        finetune(load_recipe(ws(name="role", data=bad)))
    with pytest.raises(RecipeError, match="fine-tuning recipe"):
        pretrain(load_recipe(ws(name="wrongcmd")))
    for args in (["finetune-quickstart"], ["finetune-quickstart", "--dry-run"]):  # named as it is typed
        assert main(["pretrain", *args]) == 2
        assert "run it with `difftrain finetune finetune-quickstart`" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="no finetune: section"):
        finetune(load_recipe(base_run / "recipe.yaml"))
    # through the CLI: one red line, exit 2
    assert main(["finetune", str(ws(name="role2", data=bad)), "--no-progress"]) == 2
    assert "role 'bot'" in capsys.readouterr().err
    assert main(["merge", str(base_run)]) == 2
    assert "nothing to merge" in capsys.readouterr().err


def test_bad_chat_records_are_skipped_under_skip_and_counted_at_start(ws, tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = [json.dumps(good)] * 12
    lines[3] = json.dumps({"messages": [{"role": "bot", "content": "x"}]})  # a role the template lacks
    lines[7] = json.dumps({"messages": [{"role": "user", "content": "only a question"}]})  # nothing trained
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    p = ws(name="skip", steps=1, save_every=1, data=data)
    # the dry run names the skipped records as the run's start does
    assert main(["finetune", str(p), "--dry-run", "data.on_bad_record=skip"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "skipped records" in out and "2 malformed (data.on_bad_record: skip); the first:" in out
    assert main(["finetune", str(p), "--no-progress", "data.on_bad_record=skip"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "skipped records" in out and "2 malformed (data.on_bad_record: skip); the first:" in out
    assert main(["finetune", str(p), "--dry-run", "--overwrite"]) == 2  # the default: refused, named
    assert f"{data}, line 4: message 0 of a `messages` record has role 'bot'" in capsys.readouterr().err


def test_records_with_an_empty_response_are_counted_in_the_data_row(ws, tmp_path, capsys):
    # they were accepted silently: such a record trains only its end-of-sequence token
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    empty_chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    lines = [good] * 10 + [{"prompt": "say", "response": ""}] * 2 + [empty_chat]
    data = tmp_path / "empty.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = ws(name="empty", steps=1, save_every=1, data=data)
    for argv in (["--dry-run"], ["--no-progress"]):
        assert main(["finetune", str(p), *argv, "data.val_fraction=0"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "· 3 with an empty response (only where a reply ends is trained)" in out
    assert (
        main(
            ["finetune", str(p), "--dry-run", "--overwrite", "data.val_fraction=0", f"data.sources=[{data}]"]
        )
        == 0
    )


def test_a_changed_base_is_detected_when_loading_the_adapter(ws, tmp_path, base_run):
    import shutil

    base_copy = tmp_path / "basecopy"
    shutil.copytree(base_run, base_copy)
    run = finetune(load_recipe(ws(name="chg", steps=1, save_every=1, base=base_copy))).run_dir
    assert load_run(run).model is not None
    sd = load_file(base_copy / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"] + 1
    from safetensors.torch import save_file

    save_file(sd, str(base_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="has changed since"):
        load_run(run)
    shutil.rmtree(base_copy)
    with pytest.raises(RunDirError, match="base run is gone") as e:
        load_run(run)
    looked = str(e.value).split("(looked in ")[1].split(")")[0]
    assert looked.split(", ") == list(dict.fromkeys(looked.split(", ")))  # each place named once
    # the advice for a base that was moved works: point adapter.json at its new folder
    assert 'set "path" under "base" in' in str(e.value)
    moved = tmp_path / "moved-base"
    shutil.copytree(base_run, moved)
    spec = json.loads((run / "adapter.json").read_text())
    spec["base"]["path"] = str(moved)
    (run / "adapter.json").write_text(json.dumps(spec))
    assert load_run(run).model is not None


def test_cli_prints_the_trainable_count_and_merges(ws, capsys):
    p = ws(name="cli", steps=1, save_every=1)
    assert main(["finetune", str(p), "--no-progress"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((Path("runs") / "cli" / "summary.json").read_text())
    assert f"{summary['trainable_params']:,} of" in out and "lora · rank 4" in out
    assert "linear layers (self_attn.q_proj" in " ".join(out.split())  # named as --dry-run names them
    assert "difftrain merge" in out
    Path("loop").symlink_to("loop")  # an OUT_DIR that cannot be made: one line, not a traceback
    capsys.readouterr()
    assert main(["merge", "runs/cli", "loop"]) == 2
    assert "cannot write OUT_DIR loop: " in capsys.readouterr().err
    (Path("runs") / "cli" / "adapter.json").rename("adapter.json.bak")  # lost: named, not "no adapter"
    assert main(["merge", "runs/cli", "runs/cli-m"]) == 2
    assert "has adapter.safetensors but no adapter.json" in capsys.readouterr().err
    Path("adapter.json.bak").rename(Path("runs") / "cli" / "adapter.json")
    assert main(["merge", "runs/cli", "runs/cli-m"]) == 0
    assert (Path("runs") / "cli-m" / "model.safetensors").is_file()
    # the merge's folder holds the LoRA run's recipe.yaml: resuming it pointed at --overwrite,
    # which would throw the merged model away
    before = {f.name: f.read_bytes() for f in (Path("runs") / "cli-m").iterdir()}
    capsys.readouterr()
    for extra in (["--resume"], []):
        assert main(["finetune", "runs/cli-m", "--no-progress", *extra]) == 2
        err = " ".join(capsys.readouterr().err.split())
        lora_run = Path("runs/cli").resolve()  # recorded absolute: the merge may be used from anywhere
        assert f"runs/cli-m holds the merge of the LoRA run {lora_run} by `difftrain merge`" in err
        assert (
            f"`difftrain finetune {lora_run} --resume`, then merge again" in err and "--overwrite" not in err
        )
    assert {f.name: f.read_bytes() for f in (Path("runs") / "cli-m").iterdir()} == before


def test_the_next_command_after_a_fine_tune_on_messages_only_is_chat():
    from difftrain.cli.finetune import next_command

    assert (
        next_command({"record_kinds": ["messages"]}, Path("runs/my chat")) == "difftrain chat 'runs/my chat'"
    )
    for summary in (
        {},
        {"record_kinds": ["prompt/response"]},
        {"record_kinds": ["messages", "prompt/response"]},
    ):
        assert next_command(summary, Path("runs/ft")) == "difftrain generate runs/ft"


def test_finetune_warns_at_start_when_the_plan_does_not_fit_the_device(ws, capsys, monkeypatch):
    import difftrain.plan as planner

    tiny_ram = planner.Target("cpu", 64 * 2**20, "a 64 MiB machine")
    monkeypatch.setattr(planner, "detect_target", lambda *a, **k: tiny_ram)
    p = ws(name="small-ram", steps=1, save_every=1)
    assert main(["finetune", str(p), "--no-progress"]) == 0  # the planner advises, never stops a run
    err = " ".join(capsys.readouterr().err.split())  # rich may wrap the line
    assert "warning: this run needs ≈" in err and "but a 64 MiB machine has 64.0 MiB" in err
    assert "shows the breakdown); no change the planner tries makes it fit" in err


def test_shipped_finetune_recipes_validate_and_quickstart_runs_on_a_stand_in_base(ws, base_run, tmp_path):
    for name in ("finetune-quickstart", "finetune-lora-124m", "finetune-qlora-350m-8gb"):
        r = load_recipe(name)
        assert r.finetune is not None and r.model is None and name in shipped_recipes()
    assert load_recipe("finetune-qlora-350m-8gb").finetune.method == "qlora"
    r = load_recipe(
        "finetune-quickstart",
        [
            f"finetune.base={base_run}",
            f"out_dir={tmp_path / 'runs'}",
            "train.max_steps=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "data.sources=[{source: builtin:python-docstrings, max_documents: 30}]",
        ],
    )
    result = finetune(r)
    assert result.summary["steps"] == 2 and result.summary["method"] == "lora"


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_dry_run_checks_base_data_and_run_folder_and_writes_nothing(ws, tmp_path, base_run, capsys):
    # a new fine-tune: the plan, the records counted, nothing written (no run folder, no cache)
    cache_before = _snapshot(base_run.parent.parent)
    assert main(["finetune", str(ws(name="dry")), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run: the fine-tune is ready" in out and "a new run" in out
    flat = " ".join(out.split())  # (the table wraps long rows)
    assert "train ·" in out and "lora · rank 4" in out and "linear layers (self_attn.q_proj" in flat
    assert not (tmp_path / "runs").exists()
    assert _snapshot(base_run.parent.parent) == cache_before
    big = ["train.micro_batch_size=4000000", "train.global_batch_size=null"]  # warned as the run warns
    assert main(["finetune", str(ws(name="dry")), "--dry-run", *big]) == 0
    assert "warning: this run needs ≈" in capsys.readouterr().err
    # refused where the run refuses, before anything is written: exit 2, one line each
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    mistakes = {
        str(ws(name="nobase", base=tmp_path / "missing")): "no run directory",
        str(ws(name="role", data=bad)): "role 'bot'",
        str(ws(name="nodata", data=tmp_path / "none.jsonl")): "none.jsonl",
    }
    cut = tmp_path / "cut-base"  # a base whose weights are cut short: the run refuses it, so must the dry run
    shutil.copytree(base_run, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    mistakes[str(ws(name="cut", base=cut))] = "model.safetensors is damaged or not a safetensors file"
    (tmp_path / "empty.txt").write_text("")  # continued pretraining on a text source with nothing in it
    mistakes[str(ws(name="empty", data=tmp_path / "empty.txt"))] = "the source yielded no documents"
    for recipe, message in mistakes.items():
        assert main(["finetune", recipe, "--dry-run"]) == 2, recipe
        assert message in capsys.readouterr().err
    assert main(["finetune", str(ws(name="dry")), "--dry-run", "model.d_model=64"]) == 2
    assert "a fine-tune keeps the base's architecture" in capsys.readouterr().err
    # a val_fraction that draws no record: the data row says there will be no validation loss
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) + "\n" for i in range(4)))
    assert main(["finetune", str(ws(name="few", data=few)), "--dry-run", "data.val_fraction=0.01"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "4 train · 0 val · no validation loss: data.val_fraction=0.01 drew no record" in out
    assert main(["finetune", str(ws(name="few", data=few)), "--dry-run", "data.val_fraction=0"]) == 0
    assert "no validation loss" not in capsys.readouterr().out  # none asked for: no note
    # a LoRA rank above the adapted layers' size: warned of (it only adds parameters)
    assert main(["finetune", str(ws(name="dry")), "--dry-run", "finetune.lora.rank=100"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "finetune.lora.rank=100 is above the size of adapted layers such as" in err
    assert main(["finetune", str(ws(name="dry")), "--dry-run"]) == 0
    assert "is above the size" not in capsys.readouterr().err
    # prompt/response records fine-tuned as plain text: the dry run reads them as the run would
    assert main(["finetune", str(ws(name="astext")), "--dry-run", "finetune.data_format=text"]) == 2
    assert (
        "sft.jsonl, line 1: record has no field 'text' (fields: prompt, response)" in capsys.readouterr().err
    )
    assert main(["finetune", str(ws(name="dry")), "--dry-run", "finetune.lora.target_modules=[qproj]"]) == 2
    assert "pattern `qproj` matches no linear layer" in capsys.readouterr().err  # as the run refuses it
    assert main(["finetune", str(ws(name="dry")), "--dry-run", "--resume"]) == 2
    assert "holds no run yet" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_a_missing_base_or_data_file_is_refused_before_torch_loads(
    ws, tmp_path, base_run, dry_run, cli_probe
):
    # the usual first mistake (no `difftrain pretrain` yet) must not wait for torch and Lightning
    from difftrain.cli.common import check_files

    blocker = tmp_path / "blocker"  # a file where the cache folder should be
    blocker.write_text("")
    bad_cache = f"data.cache_dir={blocker / 'cache'}"
    corpus = base_run.parent.parent / "corpus"
    mistakes = [
        ([str(ws(name="nobase", base=tmp_path / "runs" / "missing"))], "finetune.base: no run directory"),
        ([str(ws(name="nodata", data=tmp_path / "none.jsonl"))], "none.jsonl does not exist; fix the path"),
        ([str(ws(name="text", data=corpus)), bad_cache], "set data.cache_dir to a folder you can write"),
        (["quickstart"], "shipped:quickstart has no finetune: section; add one with at least"),
    ]
    flags = ["--dry-run"] if dry_run else []
    done = cli_probe([["finetune", *args, *flags] for args, _ in mistakes], tmp_path)
    assert done.codes == [2] * len(mistakes) and done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == len(mistakes) and all(m in e for (_, m), e in zip(mistakes, errors, strict=True)), (
        errors
    )
    assert not (tmp_path / "runs").exists()
    check_files(load_recipe(ws(name="sft"), [bad_cache]))  # instruction records use no cache: not refused


def test_dry_run_of_a_run_that_grew_its_vocabulary_resumes_it(ws, tmp_path, capsys, cli_probe):
    # the run's recipe.yaml records the grown vocabulary: the dry run must compare against that,
    # or every resume of a chat fine-tune whose template adds tokens would be "a different run"
    p = tool_template_recipe(ws, tmp_path, "chat", records=6)
    run = finetune(load_recipe(p)).run_dir
    before = _snapshot(run)
    assert main(["finetune", str(p), "--dry-run", "--resume", "train.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "resumes from step 2" in out and "<|tool|> (vocab 320 → 384)" in out
    assert main(["finetune", str(p), "--dry-run"]) == 2  # as the run: say --resume or --overwrite
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err
    assert main(["finetune", str(p), "--dry-run", "--resume", "finetune.lora.rank=8"]) == 2
    assert "holds a different run (finetune.lora.rank" in capsys.readouterr().err
    assert main(["finetune", str(p), "--dry-run", "--overwrite"]) == 0
    assert "replaces the run there" in capsys.readouterr().out
    assert _snapshot(run) == before
    # the run itself refuses the same before it reads its data or loads torch (the records took
    # 20 s to tokenize before the run folder was looked at, torch 3-8 s more), the grown
    # vocabulary not mistaken for another run
    other = tmp_path / "runs" / "other"
    other.mkdir()
    done = cli_probe(
        [
            ["finetune", str(p)],
            ["finetune", str(p), "--resume", "finetune.lora.rank=8"],
            ["finetune", str(p), "--resume", "--overwrite"],
            ["finetune", str(p), "--resume", "name=other"],
        ],
        tmp_path,
        modules=("torch", "lightning"),
    )
    assert done.codes == [2, 2, 2, 2] and done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert "already holds a run; continue it with --resume" in errors[0]
    assert "holds a different run (finetune.lora.rank differs)" in errors[1]
    assert "--overwrite and --resume contradict each other" in errors[2]
    assert "other holds no run yet; start it without resuming" in errors[3]
    assert _snapshot(run) == before


def test_eval_and_generate_on_an_adapter_run_load_neither_lightning_nor_dynamo(ws, tmp_path, cli_probe):
    # reading a run is not training: checking the base's weights hash (adapters) and spacing the
    # validation windows (evals) once imported Lightning and torch._dynamo, 6 s of an 8.6 s eval
    run = finetune(load_recipe(ws(name="light", steps=2, save_every=2))).run_dir
    commands = [
        ["eval", str(run), "--suite", "ppl"],
        ["generate", str(run), "--prompt", "def add_1(a, b):\n    return a + b\n", "--max-new-tokens", "3"],
    ]
    done = cli_probe(commands, tmp_path, modules=("lightning", "torch._dynamo"))
    assert done.codes == [0, 0] and done.loaded == [], done.stderr
    assert (run / "eval" / "ppl.json").is_file()


def test_a_resume_on_changed_data_is_refused(ws, tmp_path, capsys):
    """A fine-tune's checkpoints carry its data's fingerprint: records edited between a stop and
    the resume would continue another run (pretraining refuses it through its tokenizer)."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i} ", "response": f"r{i}"}) + "\n" for i in range(24)))
    p = ws(name="changing", steps=2, save_every=2, data=data)
    assert main(["finetune", str(p), "--no-progress"]) == 0
    run = tmp_path / "runs" / "changing"
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    with open(data, "a") as f:
        f.write(json.dumps({"prompt": "new ", "response": "record"}) + "\n")
    capsys.readouterr()
    assert main(["finetune", str(run), "--resume", "train.max_steps=4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the data of" in err and "changed since its checkpoint" in err and "--overwrite" in err
    # the dry run gives the refusal the run would give
    assert main(["finetune", str(run), "--resume", "train.max_steps=4", "--dry-run"]) == 2
    assert "changed since its checkpoint" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before
    # the records put back as they were (a new modification time): the same examples, resumed
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:-1]))
    assert main(["finetune", str(run), "--resume", "train.max_steps=4", "--no-progress"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_an_eval_result_of_a_lora_run_is_noted_stale_once_the_adapter_trains_on(ws, tmp_path):
    from difftrain.evals import EvalOptions, evaluate
    from difftrain.evals.common import stale
    from difftrain.rundir import load_run

    p = ws(name="lora-eval", steps=2, save_every=2)
    assert main(["finetune", str(p), "--no-progress"]) == 0
    run = tmp_path / "runs" / "lora-eval"
    doc = evaluate(load_run(run), "ppl", EvalOptions(windows=2))
    assert doc["weights"] is not None and doc["weights"]["step"] == 2  # the adapter's file
    assert not stale(run, doc)
    assert main(["finetune", str(run), "--resume", "train.max_steps=4", "--no-progress"]) == 0
    assert stale(run, doc)


def test_a_resume_that_names_another_base_says_so_not_that_model_arch_differs(ws, tmp_path, base_run, capsys):
    p = ws(name="rebased", steps=1, save_every=1)
    assert main(["finetune", str(p), "--no-progress"]) == 0
    other = tmp_path / "other-base"
    shutil.copytree(base_run, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["arch"] = "baseline"  # another base of another arch: the run's recipe.yaml names the old model
    (other / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    run = tmp_path / "runs" / "rebased"
    assert main(["finetune", str(run), "--resume", f"finetune.base={other}", "train.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "was fine-tuned from" in err and "a different base makes a different run" in err
    assert "remove model.arch" not in err


def test_an_instruction_step_is_the_mean_over_its_trained_tokens_whatever_the_micro_batch(ws, tmp_path):
    # responses of different lengths: a mean per micro-batch, averaged, weighed a short response's
    # tokens more, so the same run with micro_batch_size 2 × accumulation 2 and 4 × 1 (which a
    # resume may switch between) trained on another objective and reported another val loss
    records = tmp_path / "varied.jsonl"
    with open(records, "w") as f:
        for i in range(24):
            body = " + ".join(["a"] * (1 + (i * 7) % 9))
            f.write(json.dumps({"prompt": f"def f_{i}(a):\n", "response": f"    return {body}\n"}) + "\n")
    runs = {}
    for name, micro in (("m2", 2), ("m4", 4)):
        p = ws(name=name, steps=3, data=records)
        runs[name] = finetune(load_recipe(p, [f"train.micro_batch_size={micro}"])).run_dir
    a, b = (losses(runs[n]) for n in ("m2", "m4"))
    assert set(a) == set(b) == {1, 2, 3}
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5), (step, a, b)
    sa, sb = (json.loads((runs[n] / "summary.json").read_text()) for n in ("m2", "m4"))
    assert sa["initial_val_loss"] == pytest.approx(sb["initial_val_loss"], rel=1e-5)
    assert sa["final_val_loss"] == pytest.approx(sb["final_val_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def odd_base(tmp_path_factory, base_run) -> Path:
    """A base whose vocabulary is not a multiple of 64, as an imported checkpoint's may be (500)."""
    root = tmp_path_factory.mktemp("odd")
    p = root / "odd.yaml"
    corpus = base_run.parent.parent / "corpus"
    p.write_text(
        BASE_RECIPE.format(out=root / "runs", corpus=corpus, cache=root / "cache")
        .replace("320", "300")
        .replace("model: {arch: diff,", "model: {vocab_size: 300, arch: diff,")
    )
    return pretrain(load_recipe(p)).run_dir


def test_a_base_vocabulary_that_is_no_multiple_of_64_is_kept_or_grown_and_resumes(
    ws, tmp_path, odd_base, capsys
):
    base_vocab = json.loads((odd_base / "config.json").read_text())["vocab_size"]
    assert base_vocab % 64 != 0
    # no token added: the rows stay as they are (they were rounded up to a multiple of 64, and the
    # run's config said 320 over weights of 300 rows, which nothing could load)
    run = finetune(
        load_recipe(ws(name="full-odd", method="full", steps=1, save_every=1, base=odd_base))
    ).run_dir
    assert json.loads((run / "config.json").read_text())["vocab_size"] == base_vocab
    assert load_run(run).model.lm_head.weight.shape[0] == base_vocab
    # a token added: grown to a multiple of 64; resumed from the run's own recipe.yaml (which
    # records the grown vocabulary, and was refused as "model.vocab_size differs from the base")
    p = tool_template_recipe(ws, tmp_path, "grow-odd", records=4, base=odd_base)
    capsys.readouterr()
    assert main(["finetune", str(p), "--no-progress"]) == 0
    run = tmp_path / "runs" / "grow-odd"
    out = " ".join(capsys.readouterr().out.split())  # the base's vocabulary, then what it grew to
    assert f"vocab {base_vocab} " in out and f"(vocab {base_vocab} → 320)" in out
    assert json.loads((run / "config.json").read_text())["vocab_size"] == 64 * -(-(base_vocab + 1) // 64)
    resumed = finetune(load_recipe(run / "recipe.yaml", ["train.max_steps=3"]), resume=True)
    assert resumed.run_dir == run and load_run(run).model.lm_head.weight.shape[0] % 64 == 0
    assert main(["finetune", str(run / "recipe.yaml"), "--dry-run", "--resume", "train.max_steps=4"]) == 0
    # a fresh recipe may not set more rows than its base has (they would stay at the mean, untrained)
    with pytest.raises(
        RecipeError, match=f"model.vocab_size=4096 but the base run .* has vocab_size={base_vocab}"
    ):
        finetune(load_recipe(ws(name="big", base=odd_base), ["model.vocab_size=4096"]))


def test_eval_on_builtin_text_of_a_fine_tune_with_its_own_record_fields(ws, tmp_path, capsys):
    # the run's prompt_field/response_field were passed to every --data source, and a builtin
    # corpus (which has no fields) then refused them: no perplexity on the stdlib for such a run
    data = tmp_path / "qa.jsonl"
    data.write_text(
        "".join(json.dumps({"q": f"def f{i}(a):\n", "a": "    return a\n"}) + "\n" for i in range(12))
    )
    p = ws(name="qa", steps=1, save_every=1, data=data)
    p.write_text(
        p.read_text().replace(
            f"sources: [{data}]", f"sources: [{{source: {data}, prompt_field: q, response_field: a}}]"
        )
    )
    run = finetune(load_recipe(p)).run_dir
    capsys.readouterr()
    assert (
        main(["eval", str(run), "--data", "builtin:python-stdlib", "--windows", "1", "--suite", "ppl"]) == 0
    ), capsys.readouterr().err


def test_a_base_without_its_tokenizer_is_told_to_restore_it(ws, tmp_path, base_run):
    # it advised pointing tokenizer.path at a tokenizer.json, a recipe setting the user never used
    base = tmp_path / "base-copy"
    shutil.copytree(base_run, base)
    (base / "tokenizer.json").unlink()
    with pytest.raises(
        RunDirError, match=r"has no tokenizer.json; copy the tokenizer the run was trained with"
    ):
        finetune(load_recipe(ws(name="notok", base=base)))
