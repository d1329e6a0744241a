"""SIGKILL at any instant loses at most the work since the last checkpoint, and never a file.

One driver process (driver.py killchain) forks a chain of training processes on the same run,
checkpointing every step, each killed with SIGKILL at a planned point: in the middle of writing
(torn temporary file), just before and just after each rename of the save sequence (checkpoint,
last.ckpt, pruning, index.json, model.safetensors, metrics.csv), during the first writes of a
fresh run, and at random instants. After every kill the run directory is snapshotted; the test
checks each snapshot against an uninterrupted reference run of the same recipe:

- every checkpoint the index lists matches its checksum, last.ckpt loads;
- the checkpoint `--resume` picks holds exactly the reference's weights, optimizer position and
  data position at its step, and the next process resumed from that very step;
- model.safetensors, whenever present, holds exactly the reference's weights at its step;
- the chain's final weights, loss curve and validations equal the uninterrupted run's bit for
  bit, and no temporary file is left behind.

The same is done for `difftrain prepare`: a kill while the tokenizer or the token shards are
being built never leaves a cache entry that looks valid but is not.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_checkpoints_verify,
    driver_command,
    driver_env,
    make_corpus,
    model_weights,
    read_json,
    resume_point,
    safetensors_step,
    tmp_leftovers,
    write_recipe,
)

from difftrain.data.shards import _valid_entry
from difftrain.train.checkpoint import load_checkpoint_file, step_file
from difftrain.train.metrics import read_metrics

STEPS = 80  # room for 11 event kills (≤ 2 steps each) and 4 random ones (≤ 10 steps each)

# (label, op, file pattern, phase, nth): the nth matching call of the op dies at phase.
EVENT_KILLS = [
    ("torn-recipe-yaml", "replace", "recipe.yaml", "torn", 1),
    ("after-tokenizer-json", "replace", "tokenizer.json", "after", 1),
    ("torn-first-checkpoint", "replace", "step-*.ckpt", "torn", 1),
    ("first-checkpoint-no-index", "replace", "step-*.ckpt", "after", 1),
    ("torn-checkpoint", "replace", "step-*.ckpt", "torn", 2),
    ("before-checkpoint-rename", "replace", "step-*.ckpt", "before", 2),
    ("after-last-ckpt-link", "replace", "last.ckpt", "after", 2),
    ("mid-prune", "unlink", "step-*.ckpt", "after", 1),
    ("torn-index", "replace", "index.json", "torn", 2),
    ("after-index", "replace", "index.json", "after", 2),
    ("torn-safetensors", "replace", "model.safetensors", "torn", 2),
    ("after-safetensors", "replace", "model.safetensors", "after", 1),
    ("torn-metrics", "replace", "metrics.csv", "torn", 2),
]
# kill points that come before the training loop starts (the child never reports a start step)
BEFORE_TRAINING = {"torn-recipe-yaml", "after-tokenizer-json"}
RANDOM_KILLS = 4  # SIGKILL from outside at seeded random instants of the training loop

PREPARE_KILLS = [
    ("tokenizer-before-rename", "rename", "*", "before", 1),
    ("mid-shard-write", "shard", "", "", 2),
    ("torn-shard-index", "replace", "index.json", "torn", 1),
    ("shards-before-rename", "rename", "*", "before", 1),
    ("shards-after-rename", "rename", "*", "after", 1),
]


def _event(label, op, pattern, phase, nth, args, **extra):
    return {"label": label, "op": op, "pattern": pattern, "phase": phase, "nth": nth, "args": args, **extra}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Run the reference, the prepare kills and the training kill chain once for this module."""
    root = tmp_path_factory.mktemp("killchain")
    make_corpus(root)
    kw = dict(steps=STEPS, save_every=1, val_every=5, cache=root / "cacheA")
    ref = write_recipe(root, "ref", keep=STEPS + 1, **kw)
    rec = write_recipe(root, "chain", keep=2, resume="auto", **kw)
    prep = write_recipe(root, "prep", steps=STEPS, cache=root / "cacheB")
    run = root / "runs" / "chain"
    runs: list[dict] = [{"label": "reference", "args": ["pretrain", str(ref), "--no-progress"]}]
    for label, op, pattern, phase, nth in PREPARE_KILLS:
        runs.append(
            _event(
                f"prepare-{label}",
                op,
                pattern,
                phase,
                nth,
                ["prepare", str(prep)],
                snapshot=[str(root / "cacheB")],
            )
        )
    runs.append(
        {"label": "prepare-complete", "args": ["prepare", str(prep)], "snapshot": [str(root / "cacheB")]}
    )
    train_args = ["pretrain", str(rec), "--no-progress"]
    common = {"snapshot": [str(run)], "resume_if_checkpoint": str(run)}
    for label, op, pattern, phase, nth in EVENT_KILLS:
        runs.append(_event(label, op, pattern, phase, nth, train_args, **common))
    rng = random.Random(1234)
    for i in range(RANDOM_KILLS):
        delay = round(rng.uniform(0.05, 0.4), 3)  # ≤ 10 steps: 2 micro-batches of ≥ 0.02 s each
        runs.append(
            {"label": f"random-{i}", "delay": delay, "batch_sleep": 0.02, "args": train_args, **common}
        )
    runs.append({"label": "complete", "args": train_args, **common})
    (root / "plan.json").write_text(json.dumps({"work": str(root), "runs": runs}))
    proc = subprocess.run(
        driver_command("killchain", str(root / "plan.json")),
        env=driver_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_json(root / "log.json")
    assert len(log) == len(runs), proc.stderr[-3000:]
    return root, log


def _child_log(rec) -> str:
    return Path(rec["log"]).read_text()[-3000:]


def _ref_checkpoint(root: Path, step: int) -> dict:
    return load_checkpoint_file(root / "runs" / "ref" / "checkpoints" / step_file(step))


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_every_kill_point_is_hit(chain):
    root, log = chain
    assert log[0]["rc"] == 0, _child_log(log[0])
    kills = [
        r for r in log if r["label"].split("-", 1)[1] not in ("reference", "prepare-complete", "complete")
    ]
    assert len(kills) == len(PREPARE_KILLS) + len(EVENT_KILLS) + RANDOM_KILLS
    for r in kills:  # each process ran until its kill point: it did not fail or finish first
        assert r["rc"] == -9, f"{r['label']}: exit {r['rc']}\n{_child_log(r)}"


def _complete(folder: Path) -> list[str]:
    return [p.name for p in folder.glob("*") if not p.name.startswith(".tmp-")] if folder.is_dir() else []


def test_a_killed_prepare_never_leaves_a_cache_entry_that_looks_valid(chain):
    root, log = chain
    ref_shards = {p.name: p for p in (root / "cacheA" / "shards").iterdir()}
    ref_toks = {p.name: p for p in (root / "cacheA" / "tokenizers").iterdir()}
    prep = [r for r in log if r["label"].split("-", 1)[1].startswith("prepare")]
    assert len(prep) == len(PREPARE_KILLS) + 1
    for r in prep:
        cache = Path(r["snapshot"]) / "cacheB"
        for entry in (cache / "shards").glob("*") if (cache / "shards").is_dir() else []:
            if entry.name.startswith(".tmp-"):
                continue  # a build in progress: never read
            assert _valid_entry(entry) is not None, (
                f"{r['label']}: {entry.name} looks like an entry but is not one"
            )
            for f in ("train.bin", "val.bin"):
                assert (entry / f).read_bytes() == (ref_shards[entry.name] / f).read_bytes(), r["label"]
        for entry in (cache / "tokenizers").glob("*") if (cache / "tokenizers").is_dir() else []:
            if entry.name.startswith(".tmp-"):
                continue
            want = (ref_toks[entry.name] / "tokenizer.json").read_text()
            assert (entry / "tokenizer.json").read_text() == want, r["label"]
        label = r["label"].split("-", 1)[1].removeprefix("prepare-")
        if label in (
            "tokenizer-before-rename",
            "mid-shard-write",
            "torn-shard-index",
            "shards-before-rename",
        ):
            assert _complete(cache / "shards") == [], f"{label}: an unfinished shard entry is in place"
        if label == "tokenizer-before-rename":
            assert _complete(cache / "tokenizers") == [], label
    final = Path(prep[-1]["snapshot"]) / "cacheB"
    assert prep[-1]["rc"] == 0, _child_log(prep[-1])
    assert sorted(p.name for p in (final / "shards").iterdir()) == sorted(ref_shards)  # stale temps cleaned
    assert sorted(p.name for p in (final / "tokenizers").iterdir()) == sorted(ref_toks)


def test_after_every_kill_resume_loads_exactly_what_was_saved(chain):
    root, log = chain
    train = [r for r in log if "snapshot" in r and "prepare" not in r["label"]]
    assert len(train) == len(EVENT_KILLS) + RANDOM_KILLS + 1
    best = 0  # the newest step a snapshot could resume from so far: never goes back
    for prev, nxt in zip(train[:-1], train[1:], strict=True):
        run = Path(prev["snapshot"]) / "chain"
        assert_checkpoints_verify(run)
        point = resume_point(run) if run.is_dir() else None
        step = point.step if point else 0
        assert step >= best, f"{prev['label']}: resume point went back from {best} to {step}"
        best = step
        if point is not None:
            ckpt = load_checkpoint_file(point.path)
            ref = _ref_checkpoint(root, point.step)
            assert ckpt["global_step"] == point.step
            _assert_same_tensors(ckpt["state_dict"], ref["state_dict"], f"{prev['label']} step {step}")
            assert ckpt["difftrain"]["micro_batches_seen"] == ref["difftrain"]["micro_batches_seen"]
        weights = run / "model.safetensors"
        if weights.is_file():
            s = safetensors_step(weights)
            assert s <= STEPS
            want = {k: v for k, v in _ref_checkpoint(root, s)["state_dict"].items()}
            _assert_same_tensors(
                model_weights(weights), {k: want[k] for k in model_weights(weights)}, prev["label"]
            )
        # the next process resumed from exactly that checkpoint (or started fresh when none)
        if nxt["label"].split("-", 1)[1] in BEFORE_TRAINING:
            assert nxt["resumed_from"] is None
            continue
        assert nxt["resumed_from"] == step, (
            f"after {prev['label']}: resumed from {nxt['resumed_from']}, not {step}"
        )
        assert ("--resume" in nxt["args"]) == any((run / "checkpoints").glob("step-*.ckpt"))


def test_the_killed_chain_ends_exactly_where_an_uninterrupted_run_does(chain):
    root, log = chain
    last = log[-1]
    assert last["rc"] == 0, _child_log(last)
    run = Path(last["snapshot"]) / "chain"
    ref = root / "runs" / "ref"
    _assert_same_tensors(
        model_weights(run / "model.safetensors"), model_weights(ref / "model.safetensors"), "final"
    )
    curve = {r["step"]: r["train/loss"] for r in read_metrics(run / "metrics.csv") if "train/loss" in r}
    ref_curve = {r["step"]: r["train/loss"] for r in read_metrics(ref / "metrics.csv") if "train/loss" in r}
    assert curve == ref_curve and sorted(curve) == list(range(1, STEPS + 1))
    # and every validation of it: a checkpoint at a val_every step is written after its validation
    val = {r["step"]: r["val/loss"] for r in read_metrics(run / "metrics.csv") if "val/loss" in r}
    ref_val = {r["step"]: r["val/loss"] for r in read_metrics(ref / "metrics.csv") if "val/loss" in r}
    assert val == ref_val and sorted(val) == list(range(5, STEPS + 1, 5))
    assert read_json(run / "summary.json")["steps"] == STEPS
    assert len(list((run / "checkpoints").glob("step-*.ckpt"))) == 2  # keep_checkpoints
    assert tmp_leftovers(run) == []  # torn temporary files of the killed writes were cleaned up
