"""The file names of a run directory (docs/run-directory.md), and what tells a run's folder
apart. A leaf: it imports nothing from difftrain.
"""

from __future__ import annotations

from pathlib import Path

RECIPE = "recipe.yaml"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.csv"
SUMMARY = "summary.json"
ADAPTER_WEIGHTS = "adapter.safetensors"  # a LoRA fine-tune's weights (it has no WEIGHTS)
ADAPTER_CONFIG = "adapter.json"
RUN_FILES = (CONFIG, TOKENIZER, WEIGHTS, METRICS, SUMMARY, ADAPTER_CONFIG)  # files only runs write


def holds_run(folder: Path) -> bool:
    """Whether `folder` holds a difftrain run (recipe.yaml or config.json): what --overwrite may replace."""
    return (folder / RECIPE).is_file() or (folder / CONFIG).is_file()


def is_adapter_run(run_dir: Path) -> bool:
    """A directory holding an adapter and no full weights of its own (a LoRA fine-tune not merged)."""
    d = Path(run_dir)
    return (d / ADAPTER_CONFIG).is_file() and not (d / WEIGHTS).is_file()


def is_run_recipe(path: Path) -> bool:
    """Whether `path` is a run directory's recipe.yaml: next to at least two of what a run writes
    (one may be lost; a user's own recipe.yaml in a project folder is not taken for one)."""
    folder = path.parent
    if path.name != RECIPE or not path.is_file():
        return False
    return sum((folder / f).is_file() for f in RUN_FILES) + (folder / CHECKPOINTS).is_dir() >= 2
