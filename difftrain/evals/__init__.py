"""Evaluations that check the paper's claims on any run (`difftrain eval`, `difftrain compare`).

Each suite of `SUITES` is a module with `run(run, opts, progress) -> SuiteOutput`; its docstring
says what it measures. `evaluate(run, suite, opts)` runs one suite and returns its result
document; `save_result` writes it to RUN_DIR/eval/<suite>.json (<suite>@<label>.json for a suite
run on `--data`).
"""

from __future__ import annotations

import difflib
import importlib
import time
from typing import Any

from difftrain.errors import ConfigError
from difftrain.evals.common import (
    DATA_SUITES,
    EvalOptions,
    Progress,
    SuiteOutput,
    _no_progress,
    data_label,
    finish,
    load_result,
    save_result,
)

SUITES = ("ppl", "needle", "attention", "outliers", "quant", "icl-order", "recall")
"""The suites, each a module of difftrain.evals (icl-order: `icl`)."""


def check_suite(name: str) -> str:
    """The suite called `name`, or a ConfigError with a did-you-mean and the list of suites."""
    key = name.strip().lower()
    if key in SUITES:
        return key
    close = difflib.get_close_matches(key, SUITES, n=1, cutoff=0.5)
    hint = f"did you mean `{close[0]}`? " if close else ""
    raise ConfigError(f"unknown suite `{name}`; {hint}suites: {', '.join(SUITES)}")


def preflight(run: Any, suite: str, opts: EvalOptions) -> None:
    """Check a suite's options against the loaded run (grid fits the context, ...) without
    running it, so that `eval --suite ppl,needle` fails before ppl runs."""
    suite = check_suite(suite)
    tok, max_len = run.tokenizer, run.config.max_seq_len
    if suite in DATA_SUITES and opts.data is None:
        from difftrain.evals.windows import require_own_split

        require_own_split(run.path, suite)
    if suite == "needle" or (suite == "quant" and opts.with_needle):
        from difftrain.evals.needle import default_grid

        default_grid(tok, max_len, opts)
    elif suite == "recall":
        from difftrain.evals import recall

        recall.default_grid(tok, max_len, opts, recall.run_task(run))
    elif suite == "attention":
        from difftrain.evals.attention import attention_grid

        attention_grid(tok, max_len, opts)
    elif suite == "icl-order":
        from difftrain.evals.icl import prompts

        prompts(tok, max_len, opts)


def evaluate(
    run: Any,
    suite: str,
    opts: EvalOptions | None = None,
    *,
    progress: Progress = _no_progress,
) -> dict[str, Any]:
    """Run one suite on a loaded run (`difftrain.rundir.load_run`) and return its result document."""
    import torch

    suite = check_suite(suite)
    opts = opts or EvalOptions()
    module = importlib.import_module(f"difftrain.evals.{'icl' if suite == 'icl-order' else suite}")
    t0 = time.perf_counter()
    torch.manual_seed(opts.seed)
    out: SuiteOutput = module.run(run, opts, progress)
    if opts.data is not None and suite in DATA_SUITES:
        out.label = opts.data_label or data_label(opts.data)
    return finish(run, suite, out, time.perf_counter() - t0)


__all__ = ["SUITES", "EvalOptions", "check_suite", "evaluate", "load_result", "preflight", "save_result"]
