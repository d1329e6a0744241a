"""`difftrain bench`: the result document's schema on a tiny grid, its markdown rendering, the
targets it evaluates, parameter-matched configs, and the CLI's exit codes. No timing assertions:
these machines are shared, the figures are whatever they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from difftrain.bench import QUICKSTART, make_plan, matched_config, paired_ratio, run_bench
from difftrain.bench_report import SECTIONS, BenchOptions, bench_markdown, evaluate_targets, validate_result
from difftrain.cli.app import main
from difftrain.errors import ConfigError
from difftrain.model.config import num_params

FAST = ("attention", "train_step", "optimizer", "decode")


@pytest.fixture(scope="module")
def quick_result():
    opts = BenchOptions(mode="quick", sections=FAST, device="cpu", reps=1, warmup=0, command="pytest")
    return run_bench(opts)


def test_quick_bench_result_has_the_promised_schema(quick_result):
    r = quick_result
    validate_result(r)
    assert r["mode"] == "quick" and r["device"]["type"] == "cpu" and r["device"]["threads"] >= 1
    assert set(r["sections"]) == set(FAST)
    att = r["sections"]["attention"]["rows"]
    impls = {(x["arch"], x["impl"]) for x in att}
    for arch in ("baseline", "diff", "diff2"):
        assert {(arch, "eager"), (arch, "sdpa")} <= impls
    assert all(x["vs_baseline"] > 0 for x in att)
    step = {x["variant"]: x for x in r["sections"]["train_step"]["rows"]}
    assert {"baseline", "diff", "diff2"} <= set(step)
    assert step["baseline"]["vs_baseline"] == 1.0
    assert step["diff"]["tokens_per_s"] > 0
    opt = {x["optimizer"]: x for x in r["sections"]["optimizer"]["rows"]}
    assert opt["paged_adamw8bit"]["available"] is False and "CUDA" in opt["paged_adamw8bit"]["reason"]
    for name in ("adamw", "adamw8bit", "lion8bit"):
        assert opt[name]["state_bytes"] == opt[name]["planned_state_bytes"], name
    decode = [x["variant"] for x in r["sections"]["decode"]["rows"]]
    assert decode == ["baseline", "diff", "diff2"]
    for x in r["sections"]["decode"]["rows"]:  # an eager row agrees with itself on every token
        assert x["compiled"] is False and 0 <= x["agreeing_tokens"] <= x["new_tokens"]
        assert x["variant"] != x["arch"] or x["agreeing_tokens"] == x["new_tokens"]
    assert json.loads(json.dumps(r)) == r  # plain JSON, nothing lost


def test_markdown_is_regenerated_from_the_json_alone(quick_result):
    md = bench_markdown(json.loads(json.dumps(quick_result)))
    assert md.startswith("Measured on ")
    for title in ("**Training step", "**Attention core", "**Optimizer step", "**Cached greedy decode"):
        assert title in md
    assert "| diff | sdpa |" in md.replace("2×64×4×16 | ", "")
    assert bench_markdown(quick_result) == md  # deterministic
    # a --quick run's targets are shown without a verdict (its shapes are not the targets')
    assert "Targets (--quick runs tiny shapes" in md and "| no |" not in md and "— (quick)" in md
    full = {**json.loads(json.dumps(quick_result)), "mode": "default"}
    assert "— (quick)" not in bench_markdown(full)


def test_validation_rejects_a_result_that_lost_its_fields(quick_result):
    broken = json.loads(json.dumps(quick_result))
    del broken["device"]["torch"]
    with pytest.raises(ValueError, match="torch"):
        validate_result(broken)
    broken = json.loads(json.dumps(quick_result))
    del broken["sections"]["train_step"]["rows"][0]["tokens_per_s"]
    with pytest.raises(ValueError, match="tokens_per_s"):
        validate_result(broken)


def test_targets_compare_measured_ratios_with_the_issue_goals():
    result = {
        "device": {"type": "cpu"},
        "sections": {
            "train_step": {
                "rows": [{"variant": "diff", "shape": "q", "vs_baseline": 0.93, "vs_baseline_cpu": 0.9}]
            },
            "hf": {
                "train": [
                    {"arch": "diff", "speedup": 0.95, "speedup_cpu": 0.97, "compiled_speedup": 1.35}
                    | {
                        "compiled_speedup_cpu": 1.3,
                        "both_compiled_speedup": 0.9,
                        "both_compiled_speedup_cpu": 0.9,
                    }
                ],
                "decode": [
                    {"arch": "diff", "speedup": 1.6, "speedup_cpu": 1.5, "compiled_speedup": 2.4}
                    | {
                        "compiled_speedup_cpu": 2.4,
                        "both_compiled_speedup": 0.97,
                        "both_compiled_speedup_cpu": 0.97,
                    }
                ],
            },
            "lightning": {"overhead": 0.07},
            "optimizer": {"rows": [{"optimizer": "adamw8bit", "available": True, "bytes_per_param": 2.03}]},
        },
    }
    met = {t["name"]: t["met"] for t in evaluate_targets(result)}
    assert met == {
        "diff/baseline training tokens/s (q)": True,
        "diff training tokens/s vs transformers DiffLlama": False,
        "diff training tokens/s vs DiffLlama, ours compiled": True,
        "diff training tokens/s vs DiffLlama, both compiled": False,
        "diff greedy decode vs DiffLlama generate, ours compiled": True,
        "diff greedy decode vs DiffLlama generate, both compiled": False,
        "diff greedy decode vs DiffLlama generate": True,
        "Lightning overhead per step": False,
        "adamw8bit state bytes/param": True,
    }


def test_transformers_table_shows_each_compiled_variant_against_its_own_reference():
    from difftrain.bench_report import _hf_rows

    decode = {"arch": "diff", "new_tokens": 8, "agreeing_tokens": 8, "ours_tokens_per_s": 500.0}
    decode |= {"hf_tokens_per_s": 300.0, "speedup": 1.6, "speedup_cpu": 1.6}
    decode |= {"compiled_tokens_per_s": 800.0, "compiled_speedup": 2.6, "compiled_speedup_cpu": 2.6}
    decode |= {"both_compiled_tokens_per_s": 800.0, "both_compiled_hf_tokens_per_s": 560.0}
    decode |= {"both_compiled_speedup": 1.4, "both_compiled_speedup_cpu": 1.4}
    decode |= {"compiled_equals_eager": True, "hf_compiled_equals_eager": False}
    rows = {r[2]: r for r in _hf_rows({"decode": [decode]})}
    eager, ours_c, both = (
        rows[f"greedy decode, 8 tokens{v}"] for v in ("", ", ours compiled", ", both compiled")
    )
    assert eager[3:7] == ["500.0", "300.0", "1.60", "1.60"] and eager[7] == "8/8 tokens equal"
    assert ours_c[3:6] == ["800.0", "300.0", "2.60"] and "same tokens" in ours_c[7]
    assert both[3:6] == ["800.0", "560.0", "1.40"] and "other tokens" in both[7]


def test_archs_are_compared_at_matched_parameter_counts():
    base = QUICKSTART.config("baseline")
    n = num_params(base)["total"]
    for arch in ("diff", "diff2"):
        cfg = QUICKSTART.config(arch)
        assert cfg.arch == arch
        assert abs(num_params(cfg)["total"] / n - 1) < 0.005, arch
    assert matched_config(base, "diff2").ffn_hidden < base.ffn_hidden


def test_unknown_mode_or_section_is_a_config_error():
    with pytest.raises(ConfigError, match="mode"):
        make_plan(BenchOptions(mode="huge"))
    with pytest.raises(ConfigError, match="section"):
        make_plan(BenchOptions(sections=("attention", "speed")))
    assert set(SECTIONS) >= set(FAST)


def bench_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_cli_renders_markdown_and_refuses_bad_arguments(quick_result, tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(quick_result))
    code, out, _ = bench_cli(capsys, "--markdown", str(path))
    assert code == 0 and out == bench_markdown(quick_result)
    code, _, err = bench_cli(capsys, "--markdown", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in err
    (tmp_path / "bad.json").write_text('{"schema": 1}')
    code, _, err = bench_cli(capsys, "--markdown", str(tmp_path / "bad.json"))
    assert code == 2 and "not a difftrain bench result" in err
    code, _, err = bench_cli(capsys, "--quick", "--full")
    assert code == 2 and "contradict" in err
    code, _, err = bench_cli(capsys, "--quick", "--only", "nonsense")
    assert code == 2 and "unknown bench section" in err
    for args, says in (
        (("--threads", "-1"), "--threads -1 must be ≥ 1"),
        (("--threads", "0"), "--threads 0 must be ≥ 1"),
        (("--reps", "0"), "--reps 0 must be ≥ 1"),
        (("--precision", "fp8"), "--precision fp8 is unknown"),
        (("--precision", "16-mixed", "--device", "cpu"), "--precision 16-mixed needs a CUDA GPU"),
        (("--out", str(tmp_path)), f"cannot write the result there ({tmp_path} is a folder)"),
    ):
        code, _, err = bench_cli(capsys, "--quick", "--only", "memory", *args)
        assert code == 2 and says in err and "Traceback" not in err, (args, err)


def test_bench_option_mistakes_and_markdown_need_no_torch(quick_result, tmp_path, cli_probe):
    # a typo is answered at once and --markdown renders a result without loading torch (3.7 s)
    (tmp_path / "r.json").write_text(json.dumps(quick_result))
    commands = [
        ["bench", "--only", "nothing"],
        ["bench", "--threads", "0"],
        ["bench", "--quick", "--full"],
        ["bench", "--markdown", "missing.json"],
        ["bench", "--markdown", "r.json"],
    ]
    done = cli_probe(commands, tmp_path)
    assert done.codes == [2, 2, 2, 2, 0] and done.loaded == [], done.stderr
    assert len(done.stderr.strip().splitlines()) == 4
    assert bench_markdown(quick_result) in done.stdout


def test_a_partial_run_does_not_take_the_whole_runs_file_name():
    cpu = torch.device("cpu")
    assert BenchOptions(mode="quick").default_out(cpu) == "bench-cpu-quick.json"
    assert BenchOptions(sections=tuple(reversed(SECTIONS))).default_out(cpu) == "bench-cpu-default.json"
    assert BenchOptions(sections=("memory", "hf")).default_out(cpu) == "bench-cpu-default-hf-memory.json"


@pytest.mark.slow
def test_quick_bench_cli_runs_the_other_sections_and_writes_json(tmp_path, capsys):
    out_path = tmp_path / "b.json"
    code, out, _ = bench_cli(
        capsys, "--quick", "--reps", "1", "--only", "lightning", "--only", "hf", "--only", "memory",
        "--out", str(out_path),
    )  # fmt: skip
    assert code == 0
    r = json.loads(out_path.read_text())
    validate_result(r)
    light, hf, mem = (r["sections"][k] for k in ("lightning", "hf", "memory"))
    assert "error" not in light and light["hand_ms"] > 0 and light["lightning_ms"] > 0
    assert [x["hf_class"] for x in hf["train"]] == ["LlamaForCausalLM", "DiffLlamaForCausalLM"]
    assert all(x["max_logit_diff"] < 1e-4 for x in hf["train"])  # same weights, same function
    assert all(x["agreeing_tokens"] >= 1 for x in hf["decode"])
    for x in hf["train"] + hf["decode"]:  # the kept repetitions give back the paired speed-up
        ours, theirs = x["reps"]["ours"], x["reps"]["hf"]
        assert paired_ratio(theirs["wall_ms_reps"], ours["wall_ms_reps"]) == pytest.approx(x["speedup"])
    row = mem["rows"][0]
    assert row["measured_peak"] > 0 and row["estimated_peak"] > 0
    assert "Lightning Trainer vs a hand-written loop" in out


def test_the_environment_record_reads_package_versions_without_importing_them():
    # importing bitsandbytes logs a hint on some CPUs and takes seconds: the versions come from
    # the installed packages' metadata
    import subprocess
    import sys

    script = (
        "import json, sys, torch\nfrom difftrain.bench import environment\n"
        "env = environment(torch.device('cpu'))\n"
        "print(json.dumps([env['bitsandbytes'], env['lightning'], 'bitsandbytes' in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    bnb, lightning, imported = json.loads(done.stdout.strip().splitlines()[-1])
    from importlib import metadata

    assert (bnb, lightning) == (metadata.version("bitsandbytes"), metadata.version("lightning"))
    assert not imported and "kernels-community" not in done.stderr


def test_run_all_names_a_partial_result_apart_from_a_whole_runs(tmp_path):
    """`make bench`'s script with --only must not replace the committed whole-run result."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "run_all", Path(__file__).parents[1] / "benchmarks" / "run_all.py"
    )
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    assert run_all.main(["--quick", "--threads", "1", "--only", "optimizer", "--out-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bench-cpu-quick-optimizer.json",
        "bench-cpu-quick-optimizer.md",
    ]


def test_every_median_and_paired_ratio_is_recomputable_from_the_kept_repetitions(quick_result):
    from statistics import median

    sec = quick_result["sections"]
    for name in ("attention", "train_step", "optimizer"):
        for row in sec[name]["rows"]:
            if row.get("available") is False:
                continue
            assert len(row["wall_ms_reps"]) == len(row["cpu_ms_reps"]) >= 1, name
            assert median(row["wall_ms_reps"]) == pytest.approx(row["ms"], rel=1e-12), name
            assert median(row["cpu_ms_reps"]) == pytest.approx(row["cpu_ms"], rel=1e-12), name
    att = {(r["B"], r["T"], r["H"], r["d"], r["impl"], r["arch"]): r for r in sec["attention"]["rows"]}
    for (B, T, H, d, impl, _), r in att.items():
        ref = att[(B, T, H, d, impl.split(":")[0], "baseline")]
        assert paired_ratio(ref["wall_ms_reps"], r["wall_ms_reps"]) == pytest.approx(r["vs_baseline"])
    step = {r["variant"]: r for r in sec["train_step"]["rows"]}
    for r in step.values():
        ref = step[r["reference"]]
        assert paired_ratio(ref["wall_ms_reps"], r["wall_ms_reps"]) == pytest.approx(r["vs_baseline"])
        assert paired_ratio(ref["cpu_ms_reps"], r["cpu_ms_reps"]) == pytest.approx(r["vs_baseline_cpu"])
    dec = {r["variant"]: r for r in sec["decode"]["rows"]}
    for r in dec.values():
        n = r["new_tokens"]
        assert n / (median(r["wall_ms_reps"]) / 1e3) == pytest.approx(r["tokens_per_s"])
        assert paired_ratio(dec["baseline"]["wall_ms_reps"], r["wall_ms_reps"]) == pytest.approx(
            r["vs_baseline"]
        )
