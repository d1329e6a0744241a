"""The torch-free half of `difftrain bench`: its options and their checks, and what it makes of a
result document — the targets met or not (`evaluate_targets`), the schema (`validate_result`),
the tables (`tables`) and their markdown (`bench_markdown`). `difftrain bench` checks its
options and `--markdown` renders a result without loading torch; `difftrain.bench` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from difftrain.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    import torch

SCHEMA = 1
SECTIONS = ("attention", "train_step", "lightning", "hf", "optimizer", "decode", "memory")
MODES = ("quick", "default", "full")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")


@dataclass
class BenchOptions:
    """What `run_bench` measures. None means "the mode's default"."""

    mode: str = "default"
    sections: tuple[str, ...] = SECTIONS
    device: str = "auto"
    threads: int | None = None
    reps: int | None = None
    warmup: int | None = None
    compile: bool | None = None
    precision: str | None = None
    command: str = ""

    def check(self) -> None:
        """ConfigError for an option out of range (before anything is set or measured)."""
        if self.mode not in MODES:
            raise ConfigError(f"bench mode {self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        unknown = [s for s in self.sections if s not in SECTIONS]
        if unknown:
            raise ConfigError(
                f"unknown bench section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(
                f"--precision {self.precision} is unknown; choose one of {' | '.join(PRECISIONS)}"
            )
        for flag, value, least in (
            ("--threads", self.threads, 1),
            ("--reps", self.reps, 1),
            ("--warmup", self.warmup, 0),
        ):
            if value is not None and value < least:
                raise ConfigError(f"{flag} {value} must be ≥ {least}")

    def default_out(self, device: torch.device) -> str:
        """bench-<device>-<mode>.json, with the sections appended for a run of some (`--only`), so
        that it never replaces the result of a whole run."""
        stem = f"bench-{device.type}-{self.mode}"
        if set(self.sections) != set(SECTIONS):
            stem += "-" + "-".join(s for s in SECTIONS if s in self.sections)
        return stem + ".json"

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise DeviceError("--device cuda but no CUDA GPU is visible here; use --device cpu (or auto)")
        return torch.device(self.device)


HF_VARIANT_LABELS = {
    "compiled": "ours compiled",
    "both_compiled": "both compiled",
}
"""Variant rows of `bench_hf` (their keys' prefix in a row) and their labels in the tables."""
HF_TARGETS = {
    "train": ("diff training tokens/s vs transformers DiffLlama", "diff training tokens/s vs DiffLlama", 1.0),
    "decode": ("diff greedy decode vs DiffLlama generate", "diff greedy decode vs DiffLlama generate", 1.0),
}
"""The targets per section of `bench_hf`: the plain row's name, its variants' stem, the goal.
Every variant is held to the goal as well."""


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The performance targets that this result measures, each with its value."""
    out: list[dict[str, Any]] = []
    sec = result.get("sections", {})
    dev = result.get("device", {})
    cuda = dev.get("type") == "cuda"
    # On a CPU with more runnable jobs than cores the wall clock measures the scheduler; CPU time
    # (the work this process did) decides then.
    load = dev.get("load_average") or [0.0]
    basis = "cpu" if not cuda and load[0] > (dev.get("cpu_count") or 1) else "wall"
    for row in sec.get("train_step", {}).get("rows", []):
        if row["variant"] == "diff":
            goal = 0.95 if cuda else 0.90
            out.append(
                _target(
                    f"diff/baseline training tokens/s ({row['shape']})",
                    row["vs_baseline"],
                    goal,
                    cpu_value=row["vs_baseline_cpu"],
                    basis=basis,
                )
            )
    for key, (plain, stem, goal) in HF_TARGETS.items():
        for row in sec.get("hf", {}).get(key, []):
            if row["arch"] != "diff":
                continue
            names = {"": plain} | {f"{p}_": f"{stem}, {lab}" for p, lab in HF_VARIANT_LABELS.items()}
            for prefix, name in names.items():
                if f"{prefix}speedup" in row:
                    value, cpu_value = row[f"{prefix}speedup"], row[f"{prefix}speedup_cpu"]
                    out.append(_target(name, value, goal, cpu_value=cpu_value, basis=basis))
    light = sec.get("lightning", {})
    if "overhead" in light:
        out.append(
            {
                "name": "Lightning overhead per step",
                "value": light["overhead"],
                "goal": "≤ 0.05",
                "met": light["overhead"] <= 0.05,
            }
        )
    for row in sec.get("optimizer", {}).get("rows", []):
        if row.get("available") and row["optimizer"] in ("adamw8bit", "paged_adamw8bit"):
            out.append(
                {
                    "name": f"{row['optimizer']} state bytes/param",
                    "value": row["bytes_per_param"],
                    "goal": "≤ 2.1",
                    "met": row["bytes_per_param"] <= 2.1,
                }
            )
    return out


def _target(
    name: str, value: float, goal: float, cpu_value: float | None = None, basis: str = "wall"
) -> dict[str, Any]:
    decisive = cpu_value if basis == "cpu" and cpu_value is not None else value
    return {
        "name": name,
        "value": value,
        "cpu_value": cpu_value,
        "goal": f"≥ {goal:.2f}",
        "basis": basis,
        "met": decisive >= goal,
    }


# ----- validation and rendering --------------------------------------------------------------------
REQUIRED = {
    "attention": {"B", "T", "H", "d", "arch", "impl", "mode", "ms", "cpu_ms", "vs_baseline"},
    "train_step": {
        "shape",
        "variant",
        "arch",
        "compile",
        "params",
        "ms",
        "cpu_ms",
        "tokens_per_s",
        "vs_baseline",
    },
    "decode": {"arch", "new_tokens", "tokens_per_s", "vs_baseline"},
    "optimizer": {"optimizer", "available"},
    "memory": {"shape", "arch"},
}


def validate_result(result: dict[str, Any]) -> None:
    """Raise ValueError unless `result` has the shape `run_bench` promises (schema 1)."""
    for key in ("schema", "created", "mode", "device", "setup", "sections", "targets"):
        if key not in result:
            raise ValueError(f"bench result has no `{key}`")
    if result["schema"] != SCHEMA:
        raise ValueError(f"bench result has schema {result['schema']}, expected {SCHEMA}")
    for key in ("type", "name", "threads", "torch"):
        if key not in result["device"]:
            raise ValueError(f"bench result's device has no `{key}`")
    for name, section in result["sections"].items():
        if name not in SECTIONS:
            raise ValueError(f"bench result has an unknown section `{name}`")
        if "error" in section or "skipped" in section:
            continue
        rows = section.get("rows", [])
        for row in rows:
            missing = REQUIRED.get(name, set()) - set(row)
            if missing:
                raise ValueError(f"bench section {name}: a row lacks {sorted(missing)}")


def _f(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not math.isfinite(v):
        return "—"
    return format(v, spec)


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The result as (title, header, rows) tables, shared by the rich and markdown renderers."""
    out: list[tuple[str, list[str], list[list[str]]]] = []
    sec = result["sections"]
    if result.get("targets"):
        quick = result.get("mode") == "quick"  # tiny shapes: a smoke test, not the targets' shapes
        out.append(
            (
                "Targets (--quick runs tiny shapes: these are no verdicts; run without --quick)"
                if quick
                else "Targets",
                ["target", "measured (wall)", "measured (CPU time)", "goal", "met"],
                [
                    [
                        t["name"],
                        _f(t["value"]),
                        _f(t.get("cpu_value")),
                        t["goal"],
                        "— (quick)"
                        if quick
                        else ("yes" if t["met"] else "no")
                        + (" (on CPU time)" if t.get("basis") == "cpu" else ""),
                    ]
                    for t in result["targets"]
                ],
            )
        )
    s = sec.get("train_step", {})
    if s.get("rows"):
        out.append(
            (
                f"Training step ({s['precision']}; tokens/s, ratio to baseline)",
                [
                    "shape",
                    "variant",
                    "params",
                    "ms",
                    "CPU ms",
                    "tokens/s",
                    "MFU",
                    "vs baseline",
                    "vs baseline (CPU)",
                ],
                [
                    [
                        r["shape"],
                        r["variant"],
                        f"{r['params'] / 1e6:.2f}M",
                        _f(r["ms"], ".0f"),
                        _f(r["cpu_ms"], ".0f"),
                        _f(r["tokens_per_s"], ",.0f"),
                        _f(r.get("mfu"), ".1%"),
                        _f(r["vs_baseline"]),
                        _f(r["vs_baseline_cpu"]),
                    ]
                    for r in s["rows"]
                ],
            )
        )
    s = sec.get("attention", {})
    if s.get("rows"):
        out.append(
            (
                f"Attention core ({s['dtype']}; ms per call, ratio of baseline's time to it)",
                ["B×T×H×d", "arch", "impl", "mode", "ms", "CPU ms", "speed vs baseline", "(CPU)"],
                [
                    [
                        f"{r['B']}×{r['T']}×{r['H']}×{r['d']}",
                        r["arch"],
                        r["impl"],
                        r["mode"],
                        _f(r["ms"], ".1f"),
                        _f(r["cpu_ms"], ".1f"),
                        _f(r["vs_baseline"]),
                        _f(r["vs_baseline_cpu"]),
                    ]
                    for r in s["rows"]
                ],
            )
        )
    s = sec.get("hf", {})
    if s.get("train"):
        out.append(
            (
                f"Against transformers {s['transformers']} ({s['shape']}, same weights)",
                [
                    "arch",
                    "class",
                    "what",
                    "ours tok/s",
                    "transformers tok/s",
                    "speedup",
                    "(CPU)",
                    "agreement",
                ],
                _hf_rows(s),
            )
        )
    s = sec.get("lightning", {})
    if "overhead" in s:
        out.append(
            (
                f"Lightning Trainer vs a hand-written loop ({s['shape']}, {s['arch']})",
                ["hand loop ms/step", "Lightning ms/step", "overhead (median of rounds)", "rounds"],
                [
                    [
                        _f(s["hand_ms"], ".1f"),
                        _f(s["lightning_ms"], ".1f"),
                        f"{100 * s['overhead']:+.1f}%",
                        " ".join(f"{100 * r:+.0f}%" for r in s.get("overhead_per_round", [])) or "—",
                    ]
                ],
            )
        )
    s = sec.get("optimizer", {})
    if s.get("rows"):
        out.append(
            (
                f"Optimizer step ({s['shape']}, {s['params'] / 1e6:.2f}M params)",
                ["optimizer", "step ms", "speed vs adamw", "state bytes/param", "planned bytes/param"],
                [
                    [
                        r["optimizer"],
                        _f(r.get("ms"), ".1f"),
                        _f(r.get("vs_adamw")),
                        _f(r.get("bytes_per_param"), ".3f"),
                        _f(r["planned_state_bytes"] / s["params"], ".3f")
                        if r.get("available")
                        else "n/a: " + r["reason"].split(";")[0],
                    ]
                    for r in s["rows"]
                ],
            )
        )
    s = sec.get("decode", {})
    if s.get("rows"):
        out.append(
            (
                f"Cached greedy decode ({s['shape']}, {s['rows'][0]['new_tokens']} new tokens)",
                ["variant", "tokens/s", "CPU ms/token", "vs baseline", "vs baseline (CPU)", "= eager"],
                [
                    [
                        r.get("variant", r["arch"]),
                        _f(r["tokens_per_s"], ",.1f"),
                        _f(r["cpu_ms_per_token"]),
                        _f(r["vs_baseline"]),
                        _f(r.get("vs_baseline_cpu")),
                        "—"
                        if r["variant"] == r["arch"]
                        else f"{r.get('agreeing_tokens', '?')}/{r['new_tokens']} tokens",
                    ]
                    for r in s["rows"]
                ],
            )
        )
    s = sec.get("memory", {})
    if s.get("rows"):
        out.append(
            (
                "Memory plan vs measured peaks",
                [
                    "shape",
                    "arch",
                    "optimizer",
                    "ckpt",
                    "estimate",
                    s["measured_by"],
                    "error",
                    "tensors (profiler)",
                    "error",
                ],
                [_memory_row(r) for r in s["rows"]],
            )
        )
    for name, sec_ in sec.items():
        if "error" in sec_ or "skipped" in sec_:
            out.append((f"{name}: not measured", ["reason"], [[sec_.get("error") or sec_.get("skipped")]]))
    return out


def _mib(v: Any) -> str:
    return f"{v / 2**20:,.0f} MiB" if isinstance(v, (int, float)) else "—"


def _pct(v: Any) -> str:
    return f"{100 * v:+.0f}%" if isinstance(v, float) else "—"


def _hf_note(prefix: str, key: str, r: dict[str, Any]) -> str:
    """The agreement column of a variant row of the transformers table."""
    if key == "train":
        return "vs transformers eager" if prefix == "compiled" else "transformers compiled too"
    if prefix == "compiled":
        return f"vs transformers eager; ours compiled = eager: {'same' if r['compiled_equals_eager'] else 'other'} tokens"
    same = "same" if r["hf_compiled_equals_eager"] else "other"
    return f"transformers compiled too (static cache; = its eager: {same} tokens)"


def _hf_rows(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for kind, key in (("training step", "train"), ("greedy decode", "decode")):
        for r in s.get(key, []):
            fmt = ",.0f" if key == "train" else ",.1f"
            agree = (
                f"max |Δlogit| {r['max_logit_diff']:.1e}"
                if key == "train"
                else f"{r['agreeing_tokens']}/{r['new_tokens']} tokens equal"
            )
            what = kind if key == "train" else f"{kind}, {r['new_tokens']} tokens"
            rows.append(
                [
                    r["arch"],
                    r.get("hf_class", ""),
                    what,
                    _f(r["ours_tokens_per_s"], fmt),
                    _f(r["hf_tokens_per_s"], fmt),
                    _f(r["speedup"]),
                    _f(r["speedup_cpu"]),
                    agree,
                ]
            )
            for prefix, label in HF_VARIANT_LABELS.items():
                if f"{prefix}_speedup" not in r:
                    continue
                note = _hf_note(prefix, key, r)
                rows.append(
                    [
                        r["arch"],
                        "",
                        f"{what}, {label}",
                        _f(r[f"{prefix}_tokens_per_s"], fmt),
                        _f(r.get(f"{prefix}_hf_tokens_per_s", r["hf_tokens_per_s"]), fmt),
                        _f(r[f"{prefix}_speedup"]),
                        _f(r[f"{prefix}_speedup_cpu"]),
                        note,
                    ]
                )
    return rows


def _memory_row(r: dict[str, Any]) -> list[str]:
    if "estimated_peak" not in r:
        return [r["shape"], r["arch"], "", "", "—", "—", str(r.get("error")), "—", "—"]
    return [
        r["shape"],
        r["arch"],
        r["optimizer"],
        "yes" if r["checkpointing"] else "no",
        _mib(r["estimated_peak"]),
        _mib(r["measured_peak"]),
        _pct(r["error"]),
        _mib(r.get("tensor_peak")),
        _pct(r.get("tensor_error")),
    ]


def describe(result: dict[str, Any]) -> str:
    """One line saying where and how the figures were measured."""
    d = result["device"]
    load = d.get("load_average")
    return (
        f"{d['name']} ({d['type']}, {d['threads']} threads"
        + (f", load {load[0]:.1f}" if load else "")
        + f"), torch {d['torch']}, {result['setup']['precision']}, mode {result['mode']}, "
        f"median of {result['setup']['reps']}, {result['created'][:10]}"
    )


def bench_markdown(result: dict[str, Any]) -> str:
    """The performance tables as markdown, regenerated from a result document."""
    validate_result(result)
    lines = [f"Measured on {describe(result)}."]
    if result.get("command"):
        lines.append(f"Command: `{result['command']}`.")
    for title, header, rows in tables(result):
        lines += ["", f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
