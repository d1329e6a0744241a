"""The memory planner: exact parameter/optimizer arithmetic, activation formulas against what
autograd really saves, suggestions that make a too-big run fit, and the `difftrain plan` CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from difftrain.cli.app import main
from difftrain.errors import ConfigError
from difftrain.model import ModelConfig, Transformer
from difftrain.model.config import num_params
from difftrain.plan import (
    GiB,
    Param,
    Settings,
    Target,
    activations,
    fit_warning,
    fmt_bytes,
    model_params,
    optimizer_bytes,
    parse_memory,
    plan_memory,
    plan_recipe,
    saved_activation_bytes,
)
from difftrain.recipe import load_recipe
from difftrain.train.optim import optimizer_state_bytes

CPU = Target("cpu", 64 * GiB, "test machine")


def tiny(arch: str = "diff", **kw) -> ModelConfig:
    fields = dict(arch=arch, vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    return ModelConfig(**{**fields, **kw})


def test_sizes_print_in_the_largest_binary_unit():
    from difftrain.plan import fmt_bytes

    assert [fmt_bytes(n) for n in (512, 3 * 2**10, 1.5 * 2**20, 3 * GiB, 5359.36 * GiB)] == [
        "512 B",
        "3.0 KiB",
        "1.5 MiB",
        "3.00 GiB",
        "5.23 TiB",
    ]


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
@pytest.mark.parametrize("tie", [True, False])
def test_model_params_built_from_one_layer_equal_the_whole_models(arch, tie):
    """The planner builds one decoder layer and repeats its tensors (a 1,000-layer dry run spent
    24 s building the model four times): the same names, shapes, order and kinds as the model."""
    from difftrain.plan import _params_of

    cfg = ModelConfig(
        arch=arch, vocab_size=500, d_model=64, n_layers=3, n_heads=4, max_seq_len=32, tie_embeddings=tie
    )
    with torch.device("meta"):
        whole = _params_of(Transformer(cfg))
    assert model_params(cfg) == whole
    assert model_params(cfg.replace(n_layers=1)) == [
        p for p in whole if not p.name.startswith(("model.layers.1.", "model.layers.2."))
    ]


def test_memory_sizes_parse_with_binary_units_and_reject_bare_numbers():
    assert parse_memory("8GB") == 8 * 2**30
    assert parse_memory("8 GiB") == 8 * 2**30
    assert parse_memory("11.5G") == int(11.5 * 2**30)
    assert parse_memory("24000MB") == 24000 * 2**20
    for bad in ("8", "eight GB", "8XB", ""):
        with pytest.raises(ConfigError, match="with a unit"):
            parse_memory(bad)
    for tiny in ("0GB", "0.5KiB"):
        with pytest.raises(ConfigError, match="less than 1 MiB"):
            parse_memory(tiny)
    assert parse_memory("4TiB") == 4 * 2**40
    for huge in ("8000GB", "8TB", "99999999999999999999GB"):  # a slip of the finger, not a GPU
        with pytest.raises(ConfigError, match="more than one GPU holds"):
            parse_memory(huge)


def test_optimizer_state_bytes_follow_adamw_and_bitsandbytes_rules_by_hand():
    params = [
        Param("a", 5000, True),
        Param("b", 100, False),
        Param("c", 4096, True),
        Param("f", 10**6, True, False),
    ]
    # adamw: 8 bytes per trained element and a 4-byte step per trained tensor (f is frozen)
    assert optimizer_bytes(params, "adamw") == 8 * (5000 + 100 + 4096) + 3 * 4
    assert optimizer_bytes(params, "adamw", param_bytes=2) == 4 * (5000 + 100 + 4096) + 3 * 4
    # adamw8bit: ≥ 4096 elements → 2 uint8 moments + 2 fp32 absmax per 256 + 2 qmaps of 256 fp32;
    # smaller tensors keep two fp32 moments
    a = 2 * 5000 + 2 * 4 * math.ceil(5000 / 256) + 2 * 1024
    c = 2 * 4096 + 2 * 4 * 16 + 2 * 1024
    assert optimizer_bytes(params, "adamw8bit") == a + 8 * 100 + c == 23376
    assert optimizer_bytes(params, "paged_adamw8bit") == 23376
    assert optimizer_bytes(params, "lion8bit") == (5000 + 4 * 20 + 1024) + 4 * 100 + (4096 + 4 * 16 + 1024)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "lion8bit"])
def test_planned_optimizer_state_equals_what_the_optimizer_allocates(name):
    from difftrain.recipe import OptimConfig
    from difftrain.train.optim import build_optimizer

    cfg = tiny(d_model=64, vocab_size=128)  # some tensors above, some below bitsandbytes' 4096
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, OptimConfig(name=name), "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert optimizer_state_bytes(opt) == optimizer_bytes(model_params(cfg), name)


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_weights_and_gradients_are_exact_parameter_bytes(arch):
    cfg = tiny(arch, tie_embeddings=arch != "diff2")
    n = num_params(cfg)["total"]
    assert sum(p.numel for p in model_params(cfg)) == n
    s = Settings(2, 16, 2, 1, "32-true", "adamw", False)
    p = plan_memory(cfg, s, CPU)
    steps = 4 * len(model_params(cfg))  # AdamW's step count per tensor
    assert (p.params, p.weights, p.gradients, p.optimizer) == (n, 4 * n, 4 * n, 8 * n + steps)
    p16 = plan_memory(cfg, Settings(2, 16, 2, 1, "bf16-true", "adamw", False), CPU)
    assert (p16.weights, p16.gradients, p16.optimizer) == (2 * n, 2 * n, 4 * n + steps)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-loss", "logits"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_activation_formula_matches_what_autograd_saves(arch, precision, checkpointing, fused):
    """The `sdpa` core's rows (CPU, and CUDA where flex does not run); exact, within 1 %."""
    cfg = tiny(arch, tie_embeddings=arch == "diff")
    torch.manual_seed(0)
    model = Transformer(cfg)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    model.set_activation_checkpointing(checkpointing)
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 96, (3, 16), generator=g), torch.randint(0, 96, (3, 16), generator=g)

    def forward():
        if precision == "bf16-mixed":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(ids, targets, return_logits=not fused)
        return model(ids, targets, return_logits=not fused)

    measured = saved_activation_bytes(forward, exclude=model.parameters())
    a = activations(
        cfg, model_params(cfg), micro_batch_size=3, seq_len=16, precision=precision,
        checkpointing=checkpointing, kernel="sdpa", fused_loss=fused,
    )  # fmt: skip
    estimated = a.layers + a.outside + a.weight_copies  # what the forward pass leaves saved
    assert abs(estimated / measured - 1) <= 0.01, (estimated, measured)


@pytest.mark.parametrize(
    "targets",
    [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), ("q_proj", "v_proj"),
     ("o_proj", "gate_proj", "down_proj")],
    ids=["all", "qv", "o-mlp"],
)  # fmt: skip
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_lora_dropout_adds_exactly_the_masks_and_dropped_inputs_autograd_saves(precision, targets):
    """LoRA dropout keeps a mask and a dropped copy of each adapted projection's input: +38 % of
    the activations at the 124M shape in fp32 that the planner did not count."""
    from difftrain.model.lora import apply_lora
    from difftrain.plan import _params_of, lora_dropout_of

    cfg = tiny("diff")
    g = torch.Generator().manual_seed(0)
    ids, tgt = torch.randint(0, 96, (3, 16), generator=g), torch.randint(0, 96, (3, 16), generator=g)
    measured, estimated = {}, {}
    for p in (0.0, 0.05):
        torch.manual_seed(0)
        model = Transformer(cfg)
        names = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in targets]
        apply_lora(model, names, rank=4, alpha=8, dropout=p)
        for n, w in model.named_parameters():
            w.requires_grad_(".lora_" in n or ".lambda_" in n)
        model = model.to(torch.bfloat16) if precision == "bf16-true" else model

        def forward(model=model):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                return model(ids, tgt)

        measured[p] = saved_activation_bytes(forward, exclude=model.parameters())
        trained = {n for n, w in model.named_parameters() if w.requires_grad}
        a = activations(cfg, _params_of(model, trained=trained), micro_batch_size=3, seq_len=16,
                        precision=precision, checkpointing=False, lora_dropout=lora_dropout_of(model))  # fmt: skip
        estimated[p] = a.layers + a.outside + a.weight_copies
        assert (lora_dropout_of(model) is None) == (p == 0)
    assert measured[0.05] > measured[0.0]
    assert estimated[0.05] - estimated[0.0] == measured[0.05] - measured[0.0]


def test_suggestions_make_a_too_big_run_fit_and_apply_as_overrides():
    gpu = Target("cuda", 8 * GiB, "8 GB GPU")
    recipe = load_recipe("diff-124m")
    rp = plan_recipe(recipe, gpu)
    assert not rp.plan.fits and rp.plan.device_need > 8 * GiB
    assert rp.suggestions, "the planner found no fix"
    costs = [s.cost for s in rp.suggestions]
    assert costs == sorted(costs)
    for sug in rp.suggestions:
        assert sug.plan.fits
        fixed = plan_recipe(load_recipe("diff-124m", sug.overrides.split()), gpu)
        assert fixed.plan.fits
        assert fixed.plan.device_need == pytest.approx(sug.plan.device_need)
    # each costlier change buys memory: none needs as much as a cheaper one listed before it
    # (sequences of 512 needed the 7.49 GiB of micro-batch 8, and change what the model learns)
    needs = [s.plan.device_need for s in rp.suggestions]
    assert needs == sorted(needs, reverse=True) and len(set(needs)) == len(needs), needs
    # the global batch is kept while the micro-batch shrinks
    cheapest = rp.suggestions[0].changes
    if "train.micro_batch_size" in cheapest:
        assert cheapest["train.global_batch_size"] == 512


def test_checkpointing_and_8bit_state_shrink_the_plan_in_the_expected_places():
    cfg = tiny("diff", d_model=64, n_layers=4)
    base = Settings(4, 16, 4, 1, "32-true", "adamw", False)
    p = plan_memory(cfg, base, CPU)
    ck = plan_memory(cfg, Settings(4, 16, 4, 1, "32-true", "adamw", True), CPU)
    q8 = plan_memory(cfg, Settings(4, 16, 4, 1, "32-true", "adamw8bit", False), CPU)
    assert ck.activations.layers < p.activations.layers and ck.weights == p.weights
    assert ck.activations.layers == 4 * 16 * 4 * 64 * 4  # each layer keeps only its fp32 input
    assert q8.optimizer < p.optimizer / 2 and q8.activations.total == p.activations.total


def test_pretrain_warning_names_the_shortfall_and_the_cheapest_fix():
    too_big = load_recipe("quickstart", ["train.micro_batch_size=65536", "train.global_batch_size=65536"])
    msg = fit_warning(too_big, "cpu")
    assert msg is not None and "needs" in msg and "cheapest fix: " in msg
    assert "train.micro_batch_size=" in msg
    # the plan command it names sees the same recipe: the overrides too (quoted for the shell)
    assert (
        "(`difftrain plan quickstart train.micro_batch_size=65536 train.global_batch_size=65536` shows the breakdown)"
        in msg
    )
    assert load_recipe("quickstart", ["description=a b"]).command_args == "quickstart 'description=a b'"
    assert fit_warning(load_recipe("quickstart"), "cpu") is None


def plan_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_cli_exit_codes_fit_does_not_fit_and_bad_input(capsys):
    code, out, _ = plan_cli(capsys, "quickstart", "--device", "cpu")
    assert code == 0 and "fits" in out and "activations of one micro-batch" in out
    flat = " ".join(out.split())
    assert "The rows are not a sum: the peak is the larger of the backward pass" in flat
    assert "+ the Python process and allocator slack" in flat
    code, out, _ = plan_cli(capsys, "diff-124m", "--gpu-mem", "8GB")
    assert code == 1 and "does not fit" in out and "train.micro_batch_size=" in out
    code, _, err = plan_cli(capsys, "diff-124m", "--gpu-mem", "8")
    assert code == 2 and "with a unit" in err
    code, _, err = plan_cli(capsys, "diff-124m", "--gpu-mem", "8GB", "--device", "cpu")
    assert code == 2 and "give one of them" in err
    code, _, err = plan_cli(capsys, "no-such-recipe")
    assert code == 2
    code, _, err = plan_cli(capsys, "quickstart", "--gpu-mem", "-8GB")
    assert code == 2 and "--gpu-mem '-8GB' is negative" in err
    # a size the CUDA context alone overflows: "a smaller model" would not help
    for size, given in (("200MB", "200.0 MiB"), ("512MB", "512.0 MiB")):  # 512: "more than" was false
        code, out, _ = plan_cli(capsys, "quickstart", "--gpu-mem", size)
        flat = " ".join(out.split())
        assert (
            code == 1
            and f"the CUDA context alone takes about 512.0 MiB, at least as much as the {given} given" in flat
        )
        assert "smaller model" not in out
    # an exponent has a unit: the message says what is wrong with it
    code, _, err = plan_cli(capsys, "quickstart", "--gpu-mem", "1e3GB")
    assert code == 2 and "exponents are not taken" in err and "with a unit" not in err


def test_plan_refuses_the_batch_and_length_pretrain_refuses_with_the_same_message(capsys):
    # a plan for a run that cannot start would answer a question nobody can act on
    for override, says in (
        ("train.micro_batch_size=7", "train.global_batch_size=512 is not divisible by micro_batch_size"),
        ("train.global_batch_size=4", "train.global_batch_size=4 is smaller than one step of micro-batches"),
        ("train.seq_len=4096", "train.seq_len=4096 is longer than model.max_seq_len=1024"),
    ):
        code, _, err = plan_cli(capsys, "diff-124m", "--gpu-mem", "8GB", override)
        capsys.readouterr()
        assert main(["pretrain", "diff-124m", override, "--dry-run"]) == 2
        assert code == 2 and says in err and err == capsys.readouterr().err, (override, err)


def test_plan_refuses_what_training_refuses_on_the_device_it_plans_for(capsys, tmp_path, monkeypatch):
    """A plan that says "fits" for a run training refuses answers a question nobody can act on."""
    from difftrain.devicecheck import NO_CUDA

    monkeypatch.chdir(tmp_path)  # no runs/ here: the dry run refuses nothing about the folder
    # the vocabulary the tokenizer cannot fit, as `pretrain --dry-run` refuses it
    code, _, err = plan_cli(capsys, "quickstart", "--device", "cpu", "model.vocab_size=100")
    assert main(["pretrain", "quickstart", "model.vocab_size=100", "--dry-run"]) == 2
    assert code == 2 and "model.vocab_size is 100 but the tokenizer" in err and err == capsys.readouterr().err
    # FSDP with an 8-bit optimizer, in check_strategy's words
    code, _, err = plan_cli(
        capsys,
        "diff-124m",
        "--gpu-mem",
        "8GB",
        "train.strategy=fsdp",
        "train.devices=4",
        "optim.name=adamw8bit",
    )
    assert code == 2 and "optim.name=adamw8bit with train.strategy=fsdp: FSDP cannot shard" in err
    # a GPU-only precision planned for the RAM
    code, _, err = plan_cli(capsys, "quickstart", "--device", "cpu", "train.precision=16-mixed")
    assert code == 2 and "train.precision=16-mixed needs a CUDA GPU" in err
    # a recipe pinned to the CPU is planned for the RAM, with what the CPU resolves auto to
    code, _, err = plan_cli(capsys, "quickstart", "train.accelerator=cpu", "--gpu-mem", "8GB")
    assert code == 2 and "train.accelerator=cpu trains on the CPU; drop --gpu-mem" in err
    code, out, _ = plan_cli(capsys, "quickstart", "train.accelerator=cpu", "--json")
    data = json.loads(out)
    assert code == 0 and data["target"]["kind"] == "cpu"
    assert (data["settings"]["precision"], data["settings"]["optimizer"]) == ("32-true", "adamw")
    # pinned to CUDA: a GPU here, or --gpu-mem for one elsewhere
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = plan_cli(capsys, "quickstart", "train.accelerator=cuda")
    assert code == 2 and NO_CUDA in err and "--gpu-mem" in err
    code, _, err = plan_cli(capsys, "quickstart", "train.accelerator=cuda", "--device", "cpu")
    assert code == 2 and "train.accelerator=cuda trains on a GPU" in err
    code, out, _ = plan_cli(capsys, "quickstart", "train.accelerator=cuda", "--gpu-mem", "8GB", "--json")
    assert code == 0 and json.loads(out)["settings"]["precision"] == "bf16-mixed"


def test_fsdp_divides_weights_gradients_and_optimizer_state_by_the_devices():
    from difftrain.plan import Sharding, suggest

    cfg = tiny("diff", d_model=64, n_layers=4)
    gpu = Target("cuda", 64 * GiB, "GPU")
    one = plan_memory(cfg, Settings(4, 16, 16, 4, "bf16-mixed", "adamw", False), gpu)
    for strategy, shards in (("full_shard", 4), ("shard_grad_op", 4), ("hybrid_shard", 2), ("no_shard", 1)):
        sh = Sharding(strategy, shards)
        p = plan_memory(cfg, Settings(4, 16, 16, 4, "bf16-mixed", "adamw", False, fsdp=sh), gpu)
        assert (p.weights, p.gradients, p.optimizer, p.optimizer_temporaries) == (
            one.weights / shards,
            one.gradients / shards,
            one.optimizer / shards,
            one.optimizer_temporaries / shards,
        ), strategy
        # bf16 weights gathered for the passes (no autocast copies then): the whole model, or
        # with one unit per block under full_shard (hybrid: within a node) the root and two blocks
        n = sum(x.numel for x in model_params(cfg))
        block = sum(x.numel for x in model_params(cfg) if x.name.startswith("model.layers.0."))
        assert p.gathered == 2 * (n - 2 * block if strategy in ("full_shard", "hybrid_shard") else n)
        assert p.activations.weight_copies == 0
    # never suggest what training refuses: no 8-bit optimizer under FSDP
    for sh in (Sharding("full_shard", 4), None):
        s = Settings(4, 16, 16, 4, "bf16-mixed", "adamw", False, fsdp=sh)
        short = Target("cuda", int(plan_memory(cfg, s, gpu).device_need) - 1024, "GPU")
        found = suggest(cfg, s, short, limit=10)
        assert found and any("optim.name" in x.changes for x in found) == (sh is None)


def test_plan_of_an_fsdp_recipe_shows_the_shards_and_suggests_only_what_fsdp_trains(capsys):
    args = ("diff-124m", "train.strategy=fsdp", "train.devices=4", "--gpu-mem", "8GB", "--json")
    code, out, _ = plan_cli(capsys, *args)
    data = json.loads(out)
    assert code == 1 and data["bytes"]["weights"] == round(4 * data["params"] / 4)
    assert data["settings"]["fsdp"]["shards"] == 4 and data["suggestions"]
    assert not any("adamw8bit" in s["overrides"] for s in data["suggestions"])


def test_plan_cli_json_reports_the_breakdown_and_suggestions(capsys):
    code, out, _ = plan_cli(capsys, "diff-124m", "--gpu-mem", "8GB", "--json", "train.micro_batch_size=16")
    data = json.loads(out)
    assert code == 1 and data["fits"] is False and data["settings"]["micro_batch_size"] == 16
    assert data["bytes"]["weights"] == 4 * data["params"]
    assert data["suggestions"] and all(s["device_need"] <= 8 * GiB for s in data["suggestions"])
    assert {r["arch"] for r in data["activation_table"]} == {"baseline", "diff", "diff2"}
    # generation as `generate --dtype auto` runs it on a GPU: bf16 weights and KV cache (logits fp32)
    assert data["generation_dtype"] == "bfloat16"
    vocab = data["model"]["vocab_size"]
    assert data["generation_bytes"] == 2 * data["params"] + data["kv_cache_bytes"] + 4 * vocab
    # the generation line names each part, and they add up to its total
    code, out, _ = plan_cli(capsys, "diff-124m", "--gpu-mem", "8GB", "train.micro_batch_size=16")
    w, kv, logits = 2 * data["params"], data["kv_cache_bytes"], 4 * vocab
    assert f"weights {fmt_bytes(w)} + KV cache {fmt_bytes(kv)} + logits {fmt_bytes(logits)} = " in " ".join(
        out.split()
    )
    code, out, _ = plan_cli(capsys, "quickstart", "--device", "cpu", "--json")
    cpu = json.loads(out)
    assert cpu["generation_dtype"] == "float32"
    assert (
        cpu["generation_bytes"] == 4 * cpu["params"] + cpu["kv_cache_bytes"] + 4 * cpu["model"]["vocab_size"]
    )


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_planned_peak_matches_the_tensor_peak_of_a_real_training_step(arch, checkpointing):
    from difftrain.bench import measure_training_peak

    cfg = tiny(arch, d_model=64, vocab_size=512, max_seq_len=64, tie_embeddings=True)
    spec = {"device": "cpu", "config": cfg.model_dump(mode="json"), "batch": 8, "seq_len": 64,
            "optimizer": "adamw", "checkpointing": checkpointing, "precision": "32-true"}  # fmt: skip
    measured = measure_training_peak(spec)
    planned = plan_memory(cfg, Settings(8, 64, 8, 1, "32-true", "adamw", checkpointing), CPU).peak
    assert abs(planned / measured["tensor_peak"] - 1) <= 0.05, (planned, measured)


def test_pretrain_adds_the_plan_warning_to_its_start_up_warnings_only_when_needed():
    from difftrain.train.preflight import memory_warnings

    too_big = load_recipe("quickstart", ["train.micro_batch_size=65536", "train.global_batch_size=65536"])
    warnings = memory_warnings(too_big, "cpu")
    assert len(warnings) == 1 and "difftrain plan" in warnings[0]
    assert memory_warnings(load_recipe("quickstart"), "cpu") == []


def test_a_finetune_is_planned_before_its_base_run_exists_with_the_model_of_the_recipe_that_writes_it(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    code, out, _ = plan_cli(capsys, "finetune-lora-124m", "--gpu-mem", "24GB", "--json")
    data = json.loads(out)
    base = load_recipe("diff-124m").model
    assert code == 0 and data["method"] == "lora"
    assert (data["model"]["d_model"], data["model"]["n_layers"]) == (base.d_model, base.n_layers)
    assert any(
        "runs/diff-124m does not exist yet" in n and "difftrain pretrain diff-124m" in n
        for n in data["notes"]
    )
    # a base that no shipped recipe writes is still the error that says to train it first
    code, _, err = plan_cli(capsys, "finetune-lora-124m", "finetune.base=runs/mine")
    assert code == 2 and "no run directory runs/mine; train it first" in err
    # and the recipe's own model keys are checked against the stand-in's architecture
    code, _, err = plan_cli(capsys, "finetune-lora-124m", f"model.d_model={base.d_model * 2}")
    assert code == 2 and "but recipe diff-124m has d_model=" in err


def test_every_shipped_recipe_fits_the_gpu_its_description_names(capsys):
    """A shipped recipe that says "for one 8 GB GPU" fits 8 GB by the plan, and the comment at its
    top quotes the plan's figures (finetune-lora-124m claimed ≈ 6 GB at micro 16; it needed 12.3)."""
    import re

    from difftrain.recipe import load_recipe, shipped_recipes

    sized = {}
    for name in shipped_recipes():
        m = re.search(r"(\d+) GB GPU", load_recipe(name).description or "")
        if m:
            sized[name] = int(m.group(1))
    assert {"diff-124m", "diff-350m-8gb", "finetune-lora-124m", "finetune-qlora-350m-8gb"} <= set(sized)
    for name, gb in sized.items():
        code, out, _ = plan_cli(capsys, name, "--gpu-mem", f"{gb}GB", "--json")
        data = json.loads(out)
        assert code == 0 and data["fits"], (name, data["device_need"] / GiB)


def test_processes_on_the_cpu_share_its_ram_and_each_needs_the_whole_step():
    # train.devices=5 on the CPU starts 5 processes, each holding a model, its optimizer and a
    # micro-batch's activations: the plan said one process fits where five do not
    one = plan_recipe(load_recipe("quickstart", ["train.devices=1"]), CPU).plan
    five = plan_recipe(load_recipe("quickstart", ["train.devices=5", "train.global_batch_size=40"]), CPU).plan
    assert (one.processes, five.processes) == (1, 5)
    assert five.process_need == pytest.approx(one.process_need)
    assert five.device_need == pytest.approx(5 * one.process_need)
    small = Target("cpu", int(3 * one.device_need), "3 processes' worth of RAM")
    assert plan_recipe(load_recipe("quickstart", ["train.devices=1"]), small).plan.fits
    assert not plan_recipe(
        load_recipe("quickstart", ["train.devices=5", "train.global_batch_size=40"]), small
    ).plan.fits
    gpu = Target("cuda", 64 * GiB, "GPU")  # on GPUs each process has its own device
    assert (
        plan_recipe(
            load_recipe("quickstart", ["train.devices=5", "train.global_batch_size=40"]), gpu
        ).plan.processes
        == 1
    )
