"""Shared fixtures of the reliability suite: a tiny corpus, tiny recipes, and checkers that say
whether a run directory is in a state a user can resume from.

Every test here trains a model of d_model 32, 2 layers, on a corpus of 40 small .py files, for a
handful of steps: a run takes about a second on a CPU. Subprocess tests go through
`driver.py` (kill points, slow saves) or `python -m difftrain` (signals).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from difftrain.rundir import read_safetensors
from difftrain.train.checkpoint import find_resume_checkpoint, load_checkpoint_file, read_index

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DRIVER = HERE / "driver.py"

# One fixed hypothesis profile: the same examples on every machine (CI is deterministic), few
# enough to keep the fuzz tests in tens of seconds on two cores.
settings.register_profile(
    "reliability",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

RECIPE = """\
name: {name}
seed: 7
out_dir: {out}
model:
  arch: diff
  d_model: 32
  n_layers: 2
  n_heads: 4
  max_seq_len: 32
data:
  sources: [{corpus}]
  val_fraction: 0.1
  val_windows: 2
  cache_dir: {cache}
tokenizer:
  train: {{vocab_size: 320}}
train:
  max_steps: {steps}
  micro_batch_size: 2
  global_batch_size: 4
  log_every: 1
  val_every: {val_every}
  save_every: {save_every}
  keep_checkpoints: {keep}
  resume: {resume}
optim:
  lr: 3.0e-3
  warmup_steps: 2
logging:
  progress: false
  tensorboard: false
"""


def make_corpus(root: Path, n_docs: int = 40) -> Path:
    """A small deterministic corpus of Python-ish text files under root/corpus."""
    corpus = root / "corpus"
    corpus.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i in range(n_docs):
        lines = []
        for j in range(12):
            w = [WORDS[int(k)] for k in torch.randint(len(WORDS), (4,), generator=g)]
            lines.append(f"def {w[0]}_{i}_{j}({w[1]}, {w[2]}):\n    return {w[3]} + {j}\n")
        (corpus / f"doc{i:03d}.py").write_text("".join(lines))
    return corpus


def write_recipe(
    root: Path,
    name: str = "r",
    *,
    steps: int = 6,
    save_every: int = 2,
    keep: int = 3,
    val_every: int = 100,
    resume: str = "false",
    cache: Path | None = None,
    out: Path | None = None,
    corpus: Path | None = None,
) -> Path:
    """A tiny pretraining recipe at root/<name>.yaml (corpus under root/corpus, made if needed)."""
    if corpus is None:
        corpus = root / "corpus"
        if not corpus.is_dir():
            make_corpus(root)
    p = root / f"{name}.yaml"
    p.write_text(
        RECIPE.format(
            name=name,
            out=out or root / "runs",
            corpus=corpus,
            cache=cache or root / "cache",
            steps=steps,
            save_every=save_every,
            keep=keep,
            val_every=val_every,
            resume=resume,
        )
    )
    return p


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids spinning thread pools
    that slow every op by 10x under load (restored after each test of this folder)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, cache) shared by the in-process tests: the tokenizer and shards are built once
    (the cache key holds the corpus paths and mtimes, so one corpus means one entry)."""
    root = tmp_path_factory.mktemp("shared")
    return make_corpus(root), root / "cache"


@pytest.fixture()
def workspace(tmp_path, monkeypatch, shared_data):
    """tmp_path as the current folder; returns `write_recipe` bound to it, reading the shared
    corpus through the shared cache."""
    monkeypatch.chdir(tmp_path)
    corpus, cache = shared_data

    def recipe(name: str = "r", **kw) -> Path:
        kw.setdefault("cache", cache)
        kw.setdefault("corpus", corpus)
        return write_recipe(tmp_path, name, **kw)

    return recipe


# ---- checkers -----------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def assert_checkpoints_verify(run_dir: Path) -> None:
    """Every checkpoint the index lists (and still exists) matches its SHA-256, and last.ckpt,
    when present, is a complete checkpoint loadable with weights_only=True."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    for e in read_index(ckpt_dir):
        f = ckpt_dir / e["file"]
        if f.is_file():
            assert sha256(f) == e["sha256"], f"{f} does not match the index"
    last = ckpt_dir / "last.ckpt"
    if last.is_file():
        load_checkpoint_file(last)


def resume_point(run_dir: Path):
    return find_resume_checkpoint(Path(run_dir) / "checkpoints")


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors as the checkpoint's state_dict keys (`model.` prefix)."""
    return {f"model.{k}": v for k, v in read_safetensors(Path(path)).items()}


def safetensors_step(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return int(f.metadata()["step"])


def tmp_leftovers(run_dir: Path) -> list[str]:
    """Temporary files of interrupted atomic writes under a run directory."""
    return sorted(str(p.relative_to(run_dir)) for p in Path(run_dir).rglob("*.tmp"))


def driver_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def driver_command(*args: str) -> list[str]:
    return [sys.executable, str(DRIVER), *args]


def flat(text: str) -> str:
    """Console text with rich's line wrapping and table padding undone (one space between words)."""
    return " ".join(text.split())


def read_json(path: Path):
    return json.loads(Path(path).read_text())
