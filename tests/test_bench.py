"""`difftrain bench RECIPE`: a recipe's tokens/s and peak memory for both archs at its shape, the
JSON it writes, and its one-line refusals; and the benchmark scripts' shared helpers. No timing
assertions: these machines are shared, the figures are whatever they are."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from difftrain.cli.app import app, main

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["model.d_model=32", "model.n_heads=4", "model.n_layers=1", "model.max_seq_len=32"]
TINY += ["model.vocab_size=256", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    done = CliRunner().invoke(
        app,
        ["bench", "quickstart", *TINY, "--steps", "2", "--reps", "2", "--warmup", "1", "--json", str(out)],
    )
    return done, out


def test_bench_measures_the_recipe_and_the_other_arch_at_its_shape(bench_run):
    done, out = bench_run
    assert done.exit_code == 0, done.output
    r = json.loads(out.read_text())
    assert (r["arch"], r["other"]) == ("diff", "baseline")
    assert r["setup"]["micro_batch_size"] == 2 and r["setup"]["seq_len"] == 32
    assert r["setup"]["precision"] == "32-true" and r["setup"]["optimizer"] == "adamw"
    for arch in ("diff", "baseline"):
        a = r["archs"][arch]
        assert a["tokens_per_s"] > 0 and len(a["step_s_reps"]) == 2, arch
        assert a["peak_memory"] > 0 and a["params"] > 0, arch
        assert a["mfu"] is None  # no peak FLOP/s off CUDA
    assert r["ratio"] > 0
    for word in ("diff (recipe)", "baseline", "tokens/s", "diff / baseline", f"wrote {out}"):
        assert word in done.output, word


def test_bench_sizes_an_auto_vocabulary_as_training_does_and_says_so(capsys):
    args = [a for a in TINY if not a.startswith("model.vocab_size")]
    code = main(["bench", "quickstart", *args, "--steps", "1", "--reps", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "model.vocab_size is auto: 4096" in " ".join(out.split())


def test_a_baseline_recipe_is_compared_with_diff():
    import torch

    from difftrain.bench import bench_recipe
    from difftrain.recipe import load_recipe

    r = bench_recipe(load_recipe("quickstart-baseline", TINY), steps=1, reps=1, warmup=1)
    assert (r["arch"], r["other"]) == ("baseline", "diff") and r["device"]["type"] == "cpu"
    assert r["device"]["torch"] == torch.__version__


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nosuch-recipe"], "no recipe file `nosuch-recipe`"),
        (["quickstart", "model.d_model=33"], "d_model=33 is not divisible by n_heads"),
        (["finetune-quickstart"], "no model: section"),
        (["quickstart", "--json", "."], "--json .: cannot write the result there"),
        (["quickstart", "--steps", "0"], "Invalid value for '--steps'"),
    ],
)
def test_bench_refuses_a_bad_recipe_or_option_in_one_line(args, says, capsys):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_the_planner_check_measures_a_peak_in_this_process():
    import torch

    from difftrain.bench import measure_training_peak
    from difftrain.model import ModelConfig

    cfg = ModelConfig(arch="diff", vocab_size=128, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)
    spec = {"device": "cpu", "config": cfg.model_dump(mode="json"), "batch": 2, "seq_len": 16}
    spec |= {"optimizer": "adamw", "checkpointing": False, "precision": "32-true"}
    got = measure_training_peak(spec)
    weights = sum(p.numel() * 4 for p in torch.nn.Linear(1, 1).parameters())
    assert got["tensor_peak"] > weights and (got["measured_peak"] is None or got["measured_peak"] >= 0)


@pytest.fixture()
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("common", None)
    return importlib.import_module("common")


def test_paired_ratios_and_summaries_are_recomputable_from_the_kept_repetitions(common):
    from statistics import median

    import torch

    calls = []
    times = common.time_round_robin(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        warmup=1,
        reps=3,
        device=torch.device("cpu"),
    )
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]  # warm-up, then round-robin
    s = common.summary(times["a"])
    assert median(s["wall_ms_reps"]) == pytest.approx(s["ms"]) and len(s["cpu_ms_reps"]) == 3
    assert common.paired_ratio([2.0, 4.0, 6.0], [1.0, 1.0, 3.0]) == 2.0


def test_transformers_twins_compute_the_same_function(common):
    pytest.importorskip("transformers")
    import torch

    cfg = common.TINY.config("diff")
    ours = common.build(cfg, torch.device("cpu")).eval()
    hf = common.hf_model_for(ours).eval()
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        assert (ours(x).logits - hf(input_ids=x).logits).abs().max() < 1e-4
    assert common.hf_model_for(common.build(common.TINY.config("diff2"), torch.device("cpu"))) is None


def test_the_optimizer_state_script_agrees_with_the_planner(common, tmp_path):
    script = importlib.import_module("optimizer_state")
    out = tmp_path / "o.json"
    assert script.main(["--shape", "tiny", "--reps", "1", "--json", str(out)]) == 0
    rows = {r["optimizer"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["paged_adamw8bit"]["available"] is False and "CUDA" in rows["paged_adamw8bit"]["reason"]
    for name in ("adamw", "adamw8bit", "lion8bit"):
        assert rows[name]["state_bytes"] == rows[name]["planned_state_bytes"], name
