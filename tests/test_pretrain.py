"""`difftrain pretrain`: run directory, exact resume, checkpoints, refusals, CLI."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shlex
import shutil
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from safetensors.torch import load_file

from difftrain.cli.app import main
from difftrain.errors import DeviceError, RecipeError, RunDirError, StopRequested
from difftrain.recipe import load_recipe
from difftrain.train.callbacks import CallbackSettings, RunCallback
from difftrain.train.checkpoint import find_resume_checkpoint, load_checkpoint_file
from difftrain.train.metrics import read_metrics
from difftrain.train.run import pretrain

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def make_corpus(root: Path, n_docs: int = 40) -> Path:
    """A small deterministic corpus of Python-ish text files."""
    corpus = root / "corpus"
    corpus.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(n_docs):
        lines = []
        for j in range(12):
            w = [WORDS[int(k)] for k in torch.randint(len(WORDS), (4,), generator=g)]
            lines.append(f"def {w[0]}_{i}_{j}({w[1]}, {w[2]}):\n    return {w[3]} + {j}\n")
        (corpus / f"doc{i:03d}.py").write_text("".join(lines))
    return corpus


RECIPE = """\
name: {name}
seed: 7
out_dir: {out}
model:
  arch: {arch}
  d_model: 32
  n_layers: 2
  n_heads: 4
  max_seq_len: 32
data:
  sources: [{corpus}]
  val_fraction: 0.1
  val_windows: 4
  cache_dir: {cache}
tokenizer:
  train: {{vocab_size: 320}}
train:
  max_steps: {steps}
  micro_batch_size: 2
  global_batch_size: 4
  log_every: 1
  val_every: 4
  save_every: {save_every}
optim:
  lr: 3.0e-3
  warmup_steps: 2
logging:
  progress: false
  tensorboard: false
"""


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = make_corpus(tmp_path)

    def recipe(name="r", arch="diff", steps=6, save_every=3) -> Path:
        p = tmp_path / f"{name}.yaml"
        p.write_text(
            RECIPE.format(
                name=name,
                arch=arch,
                steps=steps,
                save_every=save_every,
                corpus=corpus,
                out=tmp_path / "runs",
                cache=tmp_path / "cache",
            )
        )
        return p

    return recipe


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {
            int(float(r["step"])): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")
        }


def test_pretrain_writes_a_complete_run_directory(workspace):
    result = pretrain(load_recipe(workspace(steps=4, save_every=2)))
    run = result.run_dir
    for f in (
        "recipe.yaml",
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "metrics.csv",
        "summary.json",
    ):
        assert (run / f).is_file(), f
    assert (run / "checkpoints" / "last.ckpt").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 4 * 32
    assert summary["final_val_loss"] is not None and summary["tokens_per_s"] > 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["vocab_size"] % 64 == 0 and cfg["arch"] == "diff"
    # model.safetensors holds exactly the final weights of the last checkpoint
    ckpt = load_checkpoint_file(run / "checkpoints" / "last.ckpt")
    weights = load_file(run / "model.safetensors")
    for k, v in weights.items():
        assert torch.equal(ckpt["state_dict"][f"model.{k}"], v), k
    # λ of every diff layer is logged
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert "lambda/layer0" in header and "lambda/layer1" in header
    # one validation row per evaluated step: the last step (4, a val_every step) is not validated
    # a second time after training
    with open(run / "metrics.csv", newline="") as f:
        val_steps = [int(float(r["step"])) for r in csv.DictReader(f) if r.get("val/loss")]
    assert val_steps == [4] and summary["final_val_loss"] is not None


class StopAt(L.Callback):
    """Ask the run to stop gracefully (as SIGTERM would) after optimizer step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and pl_module.stepped:
            run_cb = next(c for c in trainer.callbacks if isinstance(c, RunCallback))
            run_cb._stop_signal = signal.SIGTERM


@pytest.mark.parametrize("arch", ["diff", "baseline"])
def test_resume_continues_the_exact_loss_curve(workspace, arch):
    full = pretrain(load_recipe(workspace(name="full", arch=arch, steps=6, save_every=4)))
    with pytest.raises(StopRequested) as stop:
        pretrain(
            load_recipe(workspace(name="split", arch=arch, steps=6, save_every=4)),
            extra_callbacks=[StopAt(3)],
        )
    assert stop.value.step == 3
    stopped = json.loads((full.run_dir.parent / "split" / "summary.json").read_text())
    assert stopped["steps"] == 3 and stopped["finished"] is False  # where the run stands
    resumed = pretrain(load_recipe(workspace(name="split", arch=arch, steps=6, save_every=4)), resume=True)
    assert resumed.resumed_from == 3
    assert resumed.summary["steps"] == 6 and resumed.summary["finished"] is True
    a, b = losses(full.run_dir), losses(resumed.run_dir)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b  # bit-identical fp32 losses: data position, optimizer, schedule all restored
    wa, wb = load_file(full.run_dir / "model.safetensors"), load_file(resumed.run_dir / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    if arch == "diff":  # extended by a resume: the folder's recipe says so, and resuming from it goes on
        more = pretrain(load_recipe(resumed.run_dir, ["train.max_steps=8"]), resume=True)
        assert more.resumed_from == 6 and more.summary["steps"] == 8
        assert yaml.safe_load((resumed.run_dir / "recipe.yaml").read_text())["train"]["max_steps"] == 8
        assert pretrain(load_recipe(resumed.run_dir), resume=True).finished_before
        assert sorted(losses(resumed.run_dir)) == [1, 2, 3, 4, 5, 6, 7, 8]


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val/loss"] for r in read_metrics(run_dir / "metrics.csv") if "val/loss" in r}


class CopyAtValidation(L.Callback):
    """Copy the run directory as it is on disk when the validation of step `step` starts: what a
    SIGKILL at that instant would leave."""

    def __init__(self, step: int, dest: Path) -> None:
        self.step, self.dest = step, dest

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "fit" and trainer.global_step == self.step:
            run_cb = next(c for c in trainer.callbacks if isinstance(c, RunCallback))
            shutil.copytree(run_cb.run_dir, self.dest)


def test_a_checkpoint_keeps_the_validation_of_its_step_through_a_kill_or_a_stop(workspace, tmp_path):
    """A save_every step that is also a val_every step is saved after its validation: a kill
    during a later validation, or a graceful stop at that step, resumes with every validation of
    the uninterrupted run (a resume does not validate the step it starts from again)."""
    full = pretrain(load_recipe(workspace(name="full", steps=12, save_every=4)))
    want = val_losses(full.run_dir)
    assert sorted(want) == [4, 8, 12]
    killed = tmp_path / "runs" / "killed"
    pretrain(
        load_recipe(workspace(name="live", steps=12, save_every=4)),
        extra_callbacks=[CopyAtValidation(8, killed)],
    )
    assert find_resume_checkpoint(killed / "checkpoints").step == 4
    assert val_losses(killed) == {4: want[4]}  # the checkpoint's metrics hold its validation
    resumed = pretrain(load_recipe(killed), resume=True)
    assert resumed.resumed_from == 4 and val_losses(killed) == want
    p = workspace(name="stopped", steps=12, save_every=4)
    with pytest.raises(StopRequested):
        pretrain(load_recipe(p), extra_callbacks=[StopAt(4)])  # a SIGTERM at a val_every step
    assert val_losses(full.run_dir.parent / "stopped") == {4: want[4]}
    again = pretrain(load_recipe(p), resume=True)
    assert again.resumed_from == 4
    assert val_losses(full.run_dir.parent / "stopped") == want
    # the summary counts the validations before the resume: the best is the uninterrupted run's
    assert (
        again.summary["best_val_loss"] == pytest.approx(min(want.values())) == full.summary["best_val_loss"]
    )
    assert resumed.summary["best_val_loss"] == pytest.approx(full.summary["best_val_loss"])


def test_the_run_callback_carries_the_validations_through_a_checkpoint(tmp_path):
    """best/last validation loss are saved with a checkpoint: a resumed run's summary would
    otherwise forget a best validation measured before the resume."""
    kw = CallbackSettings(
        save_every=1, keep=1, log_every=1, tokens_per_step=1, flops_per_token=1.0, progress=False
    )
    cb = RunCallback(tmp_path, kw)
    cb.state.best_val, cb.state.last_val, cb.state.last_val_step = 3.25, 3.5, 8
    other = RunCallback(tmp_path, kw)
    other.load_state_dict(cb.state_dict())
    assert (other.state.best_val, other.state.last_val, other.state.last_val_step) == (3.25, 3.5, 8)
    other.load_state_dict({})  # a checkpoint of an older version: no validations known
    assert other.state.best_val == math.inf and other.state.last_val_step == -1


def test_a_resume_may_split_the_global_batch_differently_but_not_change_it(workspace, capsys):
    """Micro-batch and activation checkpointing only change memory: the steps that follow see the
    same samples (the data position counts samples) and give the same losses up to summation order."""
    full = pretrain(load_recipe(workspace(name="full", steps=6, save_every=3)))
    p = workspace(name="split", steps=6, save_every=3)
    with pytest.raises(StopRequested):
        pretrain(load_recipe(p), extra_callbacks=[StopAt(3)])
    resumed = pretrain(
        load_recipe(p, ["train.micro_batch_size=1", "train.activation_checkpointing=true"]), resume=True
    )
    assert resumed.resumed_from == 3
    a, b = losses(full.run_dir), losses(resumed.run_dir)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(abs(a[s] - b[s]) <= 1e-5 * abs(a[s]) for s in a), (
        a,
        b,
    )  # 4 micro-batches of 1 sum in another order
    # validations stay on the val_every steps, though the run has taken 4 micro-batches per step
    # since the resume instead of 2
    more = pretrain(
        load_recipe(resumed.run_dir, ["train.max_steps=12", "train.micro_batch_size=4"]), resume=True
    )
    assert more.resumed_from == 6 and sorted(val_losses(more.run_dir)) == [
        4,
        6,
        8,
        12,
    ]  # 6: the end of the first run
    # a global batch of 2 instead of 4 is another run (each step would see other samples)
    assert (
        main(["pretrain", str(p), "--resume", "--dry-run", "train.max_steps=8", "train.global_batch_size=2"])
        == 2
    )
    err = capsys.readouterr().err
    assert "trains with a global batch of 4 sequences per step, this recipe makes 2" in err
    assert "set train.global_batch_size=4" in err


def test_the_run_folder_records_the_global_batch_so_a_resume_may_change_the_micro_batch(workspace):
    """A recipe without train.global_batch_size trains with micro_batch_size × devices: the run's
    recipe.yaml writes that number out, so resuming from the run folder with a smaller micro-batch
    accumulates to the same global batch instead of being refused as another run."""
    p = workspace(name="nogb", steps=4, save_every=2)
    p.write_text(p.read_text().replace("  global_batch_size: 4\n", ""))
    with pytest.raises(StopRequested):
        pretrain(load_recipe(p), extra_callbacks=[StopAt(2)])
    run = p.parent / "runs" / "nogb"
    assert yaml.safe_load((run / "recipe.yaml").read_text())["train"]["global_batch_size"] == 2
    resumed = pretrain(load_recipe(run, ["train.micro_batch_size=1"]), resume=True)
    assert resumed.resumed_from == 2 and resumed.summary["tokens"] == 4 * 2 * 32


def test_a_longer_resume_follows_the_new_schedule_from_its_first_step_and_says_so(workspace):
    """Extending a finished cosine run recomputes the schedule over the new length: the first
    resumed step already runs at the new schedule's lr (not the restored one), with a warning."""
    from difftrain.train.optim import lr_multiplier

    p = workspace(name="longer", steps=6, save_every=3)
    first = pretrain(load_recipe(p))
    assert first.summary["steps"] == 6
    r = load_recipe(first.run_dir, ["train.max_steps=10"])
    more = pretrain(r, resume=True)
    assert more.resumed_from == 6
    (note,) = [w for w in more.warnings if "schedule" in w]
    assert "changed from 6 to 10 steps" in note and "step 7 runs at lr" in note
    lrs = {x["step"]: x["train/lr"] for x in read_metrics(first.run_dir / "metrics.csv") if "train/lr" in x}
    f_old, f_new = lr_multiplier(r.optim, 6), lr_multiplier(r.optim, 10)
    assert lrs[6] == pytest.approx(r.optim.lr * f_old(5), rel=1e-6)
    for step in range(7, 11):
        assert lrs[step] == pytest.approx(r.optim.lr * f_new(step - 1), rel=1e-6), step
    assert f_new(6) > 2 * f_old(6)  # the warm-up again that the note announces
    # another number of validation windows: the val curve changes its yardstick, and says so
    again = pretrain(load_recipe(first.run_dir, ["train.max_steps=11", "data.val_windows=2"]), resume=True)
    assert any(
        "data.val_windows changed from 4 to 2: validation losses after step 10" in w for w in again.warnings
    )


def test_sigterm_during_start_up_ends_with_one_line_and_exit_143(workspace, capsys, monkeypatch):
    """Before training installs its own handlers, a SIGTERM (a job scheduler's stop) is reported
    like a Ctrl-C, not a silent death; Python's handlers are back afterwards."""
    from difftrain.train import run as run_module

    resolve = run_module.resolve

    def terminated(recipe):
        os.kill(os.getpid(), signal.SIGTERM)
        return resolve(recipe)

    monkeypatch.setattr(run_module, "resolve", terminated)
    assert main(["pretrain", str(workspace(name="term")), "--no-progress"]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: interrupted (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_checkpoints_are_pruned_to_keep_and_indexed(workspace):
    r = load_recipe(workspace(steps=8, save_every=2), ["train.keep_checkpoints=2"])
    run = pretrain(r).run_dir
    files = sorted(p.name for p in (run / "checkpoints").glob("step-*.ckpt"))
    assert files == ["step-00000006.ckpt", "step-00000008.ckpt"]
    point = find_resume_checkpoint(run / "checkpoints")
    assert point is not None and point.step == 8 and point.warnings == []


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(workspace):
    run = pretrain(load_recipe(workspace(steps=4, save_every=2))).run_dir
    newest = run / "checkpoints" / "step-00000004.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the middle
    newest.write_bytes(bytes(data))
    point = find_resume_checkpoint(run / "checkpoints")
    assert point.step == 2 and "damaged" in point.warnings[0]


def test_a_different_run_in_the_directory_is_refused(workspace):
    pretrain(load_recipe(workspace(steps=2, save_every=2)))
    with pytest.raises(RunDirError, match="already holds a run"):
        pretrain(load_recipe(workspace(steps=2, save_every=2)))
    with pytest.raises(RunDirError, match="different run.*model.d_model"):
        pretrain(load_recipe(workspace(steps=4, save_every=2), ["model.d_model=64"]), resume=True)


def test_the_command_named_to_continue_a_run_trained_with_overrides_works(workspace, capsys):
    # trained with an override, started again without it: `--resume` with the recipe would be
    # refused as another run, so the message names the run directory, which stands for its recipe
    p = workspace(steps=4, save_every=2)
    assert main(["pretrain", str(p), "--no-progress", "train.max_steps=2", "optim.warmup_steps=1"]) == 0
    run = p.parent / "runs" / "r"
    capsys.readouterr()
    for flags in ([], ["--resume"]):
        assert main(["pretrain", str(p), "--dry-run", *flags]) == 2
        err = capsys.readouterr().err
        assert "holds a different run (optim.warmup_steps differs)" in err, err
        assert f"continue it as it was with `difftrain pretrain {run} --resume`" in err, err
    assert main(["pretrain", str(run), "--resume", "--dry-run", "train.max_steps=4"]) == 0
    assert "resum" in capsys.readouterr().out
    # compiling is how a step runs, not which run it is: a resume may switch it on or off
    assert (
        main(["pretrain", str(run), "--resume", "--dry-run", "train.max_steps=4", "train.compile=true"]) == 0
    )
    assert "resum" in capsys.readouterr().out
    # the optimizer row names weight decay and clipping (what most often differs between recipes)
    assert main(["pretrain", str(run), "--resume", "--dry-run", "train.max_steps=4"]) == 0
    assert re.search(r"optimizer +adamw · lr [\d.e-]+ · wd [\d.]+ · clip 1 · ", capsys.readouterr().out)
    # resuming asked for in the recipe, not on the command line: the message says where
    assert main(["pretrain", str(p), "--dry-run", "--overwrite", "train.resume=true"]) == 2
    assert "--overwrite and --resume (or train.resume: true) contradict each other" in capsys.readouterr().err


def test_batch_arithmetic_is_checked_before_training(workspace):
    with pytest.raises(RecipeError, match="not divisible"):
        pretrain(load_recipe(workspace(), ["train.global_batch_size=5"]))
    with pytest.raises(RecipeError, match="global_batch_size=2 is smaller than one step of micro-batches"):
        pretrain(load_recipe(workspace(), ["train.micro_batch_size=4", "train.global_batch_size=2"]))
    with pytest.raises(RecipeError, match="longer than model.max_seq_len"):
        pretrain(load_recipe(workspace(), ["train.seq_len=64"]))


def test_cli_pretrain_and_errors_exit_2(workspace, capsys):
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "done" in out and "difftrain generate" in out
    # the recipe's 2 warm-up steps fill this 2-step run
    assert "optim.warmup_steps=2 is not below train.max_steps=2: warm-up is cut to 1 step and" in " ".join(
        err.split()
    )
    # metrics.csv logs the lr each step used: step 1 of the 1-step warm-up at half the peak, the
    # last at the peak (it logged the next step's lr, after the scheduler moved: 0.5 then 0.1)
    rows = [r for r in read_metrics(p.parent / "runs" / "r" / "metrics.csv") if "train/lr" in r]
    peak = load_recipe(p).optim.lr
    assert [r["train/lr"] for r in rows] == pytest.approx([peak / 2, peak])
    assert main(["pretrain", str(p)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["pretrain", str(p), "train.micro_batch_size=3"]) == 2
    capsys.readouterr()
    assert main(["pretrain", str(p), "--dry-run", "train.max_steps=9", "--overwrite"]) == 0
    # the dry run shows what the start table would: tokens per step, optimizer, lr, schedule, warm-up
    out = " ".join(capsys.readouterr().out.split())
    o = load_recipe(p).optim
    assert "tok/step (micro " in out and "steps 9 (" in out
    assert (
        f"optimizer adamw · lr {o.lr:g} · wd {o.weight_decay:g} · clip 1 · {o.schedule} · warmup {o.warmup_steps}"
        in out
    )  # (auto resolved)


def test_a_logger_whose_package_is_missing_is_refused_before_anything_is_written(
    workspace, capsys, monkeypatch
):
    # TensorBoard failed with a traceback after the first step; wandb after the run folder was made
    import importlib.util

    from difftrain.spec import resolve

    real = importlib.util.find_spec
    gone = {"tensorboard", "tensorboardX", "wandb"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a)
    )
    p = workspace(steps=2, save_every=2)
    for override, message in (
        (
            "logging.tensorboard=true",
            "logging.tensorboard=true but tensorboard is not installed; `pip install tensorboard`",
        ),
        (
            "logging.wandb_project=proj",
            "logging.wandb_project is set but wandb is not installed; `pip install wandb`",
        ),
    ):
        for dry in ([], ["--dry-run"]):
            assert main(["pretrain", str(p), override, *dry]) == 2
            assert f"error: {message}" in capsys.readouterr().err
        with pytest.raises(DeviceError, match=re.escape(message)):  # the check every start makes
            resolve(load_recipe(p, [override]))
    assert not (p.parent / "runs" / "r").exists()
    assert main(["pretrain", str(p), "--dry-run"]) == 0  # tensorboard: auto logs only where it is installed


def test_a_damaged_metrics_csv_does_not_stop_a_resume(workspace, tmp_path):
    # binary bytes in metrics.csv: --resume (and compare --plot) ended in a UnicodeDecodeError
    p = workspace(steps=4, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    good = read_metrics(run / "metrics.csv")
    assert [r["step"] for r in good if "train/loss" in r][-1] == 4
    text = (run / "metrics.csv").read_text()
    (run / "metrics.csv").write_bytes(text.encode() + bytes(range(256)) * 4 + b"\nx,y\n")
    assert read_metrics(run / "metrics.csv") == good  # the rows that can be read
    (run / "metrics.csv").write_bytes(os.urandom(3000))
    assert all(isinstance(r["step"], int) for r in read_metrics(run / "metrics.csv"))
    assert main(["pretrain", str(p), "--resume", "train.max_steps=6", "--no-progress"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.csv") if "train/loss" in r][-1] == 6


def test_a_damaged_run_tokenizer_names_a_fix_that_works(workspace, capsys):
    # it said "... or unset tokenizer.path to train one", a recipe key: no fix for a run folder
    p = workspace(steps=2, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    good = (run / "tokenizer.json").read_bytes()
    (run / "tokenizer.json").write_text("garbage")
    assert main(["generate", str(run), "-p", "x", "-n", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not a valid tokenizer.json" in err and "tokenizer.path" not in err
    command = err.split("by resuming: `")[1].split("`")[0]
    assert main(shlex.split(command)[1:]) == 0
    assert (run / "tokenizer.json").read_bytes() == good
    assert main(["generate", str(run), "-p", "x", "-n", "2"]) == 0


def test_overwrite_keeps_the_old_run_until_every_check_has_passed(workspace, capsys):
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    run = p.parent / "runs" / "r"
    before = sorted((q.relative_to(run), q.stat().st_mtime_ns) for q in run.rglob("*"))
    capsys.readouterr()
    mistakes = {  # each found after the run directory was decided on, before training
        "tokenizer.path=nope/tokenizer.json": "nope/tokenizer.json does not exist",
        "data.sources=[missing.txt]": "missing.txt does not exist",
        "model.attn_impl=flex": "model.attn_impl=flex has no backward pass on CPU",
        "optim.betas=[1.5,0.9]": "must be less than 1",
    }
    for override, message in mistakes.items():
        assert main(["pretrain", str(p), "--no-progress", "--overwrite", override]) == 2, override
        assert message in capsys.readouterr().err, override
        assert sorted((q.relative_to(run), q.stat().st_mtime_ns) for q in run.rglob("*")) == before
    # a good --overwrite replaces it: the old checkpoint of step 2 is gone, the new run has 3 steps
    assert (
        main(["pretrain", str(p), "--no-progress", "--overwrite", "train.max_steps=3", "train.save_every=3"])
        == 0
    )
    assert sorted(losses(run)) == [1, 2, 3]
    assert [q.name for q in (run / "checkpoints").iterdir() if q.name == "step-00000002.ckpt"] == []


def test_overwrite_never_removes_a_folder_that_is_not_a_run(workspace, capsys):
    p = workspace(steps=2, save_every=2)
    mine = p.parent / "runs" / "r"  # where the recipe's run would go: a folder of the user's
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("important")
    for flags in ([], ["--overwrite"], ["--overwrite", "--dry-run"]):
        assert main(["pretrain", str(p), "--no-progress", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert "exists and is not a difftrain run directory" in err and len(err.strip().splitlines()) == 1
    assert [q.name for q in mine.iterdir()] == ["notes.txt"]


def test_train_compile_without_a_cpu_compiler_exits_2_before_anything_is_written(
    workspace, capsys, monkeypatch
):
    p = workspace(steps=2, save_every=2)
    monkeypatch.setenv("CXX", "/nonexistent/bin/g++")
    assert main(["pretrain", str(p), "--no-progress", "train.compile=true"]) == 2
    err = capsys.readouterr().err
    assert "train.compile=true on CPU needs a C++ compiler (/nonexistent/bin/g++ on PATH)" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (p.parent / "runs").exists()


def test_a_compiled_run_gives_no_eta_from_its_compiling_first_step_and_reports_its_steady_rate(
    workspace, capsys, monkeypatch
):
    # the first step of a compiled run holds the compilation: its ETA said 2h for a 30 s run, and
    # the run's throughput mixed the compilation in with nothing to say so
    import time

    import torch

    def slow_compile(model, **kwargs):  # a compilation of 2 s, paid at the first call
        state = {"first": True}

        def forward(*args, **kw):
            if state["first"]:
                state["first"] = False
                time.sleep(2.0)
            return model(*args, **kw)

        return forward

    monkeypatch.setattr(torch, "compile", slow_compile)
    p = workspace(steps=4, save_every=4)
    assert main(["pretrain", str(p), "--no-progress", "train.compile=true", "train.log_every=1"]) == 0
    out = capsys.readouterr().out
    lines = {n: next(line for line in out.splitlines() if line.startswith(f"step {n}/4")) for n in (1, 2)}
    assert "eta" not in lines[1] and "eta" in lines[2]
    summary = json.loads((p.parent / "runs" / "r" / "summary.json").read_text())
    assert summary["steady_tokens_per_s"] > 2 * summary["tokens_per_s"]
    assert "once compiled; the run's includes the compilation" in " ".join(out.split())


def test_resuming_a_finished_run_trains_nothing_and_keeps_its_summary(workspace, capsys):
    p = workspace(steps=4, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    summary = (run / "summary.json").read_bytes()
    weights = (run / "model.safetensors").read_bytes()
    metrics = (run / "metrics.csv").read_bytes()
    again = pretrain(load_recipe(p), resume=True)
    assert again.finished_before and again.resumed_from == 4 and again.notes == []
    # nothing rewritten: the figures of the run that trained stay as they were
    assert (run / "summary.json").read_bytes() == summary
    assert (run / "model.safetensors").read_bytes() == weights
    assert (run / "metrics.csv").read_bytes() == metrics
    assert main(["pretrain", str(p), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "had finished at step 4: nothing to train" in out and "train.max_steps=8" in out


def test_resuming_a_finished_run_rewrites_damaged_weights_from_its_last_checkpoint(workspace, capsys):
    p = workspace(steps=4, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    # copies: load_file maps the file, and truncating a mapped file faults its readers
    good = {k: v.clone() for k, v in load_file(run / "model.safetensors").items()}
    summary = (run / "summary.json").read_bytes()
    with open(run / "model.safetensors", "r+b") as f:  # truncated, as a copy cut short leaves it
        f.truncate(1000)
    assert main(["pretrain", str(p), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "model.safetensors is damaged" in err and "rewrote it from checkpoints/step-00000004.ckpt" in err
    restored = {k: v.clone() for k, v in load_file(run / "model.safetensors").items()}
    assert restored.keys() == good.keys() and all(torch.equal(good[k], restored[k]) for k in good)
    assert (run / "summary.json").read_bytes() == summary
    # weights of an older step (a kill between the checkpoint and the weights) are rewritten too
    from safetensors.torch import save_file

    save_file(good, str(run / "model.safetensors"), metadata={"format": "pt", "step": "2"})
    again = pretrain(load_recipe(p), resume=True)
    assert again.notes and "holds the weights of step 2, not of step 4" in again.notes[0]
    assert load_file(run / "model.safetensors").keys() == good.keys()


def test_a_run_stopped_before_its_first_save_names_a_command_that_starts_it_again(workspace, capsys):
    # the command it named (the recipe without --overwrite) was refused: the folder holds the
    # logs of the steps taken, and --resume had nothing to continue
    p = workspace(steps=4, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    shutil.rmtree(run / "checkpoints")
    for name in ("model.safetensors", "summary.json"):
        (run / name).unlink()
    other = pretrain(load_recipe(workspace(name="other", steps=2, save_every=2))).run_dir
    assert main(["eval", str(run), "--suite", "ppl"]) == 2
    err = capsys.readouterr().err
    command = err.split("start it again with `")[1].split("`")[0]
    assert command.startswith("difftrain pretrain ")
    # the commands that read results name it too, not an eval that cannot run
    assert main(["eval", str(run), "--show"]) == 2
    assert f"start it again with `{command}`" in capsys.readouterr().err
    assert main(["compare", str(run), str(other)]) == 0
    assert f"start it again with `{command}`" in " ".join(capsys.readouterr().err.split())
    assert main(shlex.split(command)[1:]) == 0
    assert (run / "model.safetensors").is_file()


def test_resume_past_train_max_steps_is_refused_and_a_lost_summary_is_rebuilt(workspace):
    p = workspace(steps=4, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    before = json.loads((run / "summary.json").read_text())
    recipe_text = (run / "recipe.yaml").read_text()
    with pytest.raises(
        RecipeError, match="at step 4 .*past train.max_steps=2.*raise train.max_steps above 4"
    ):
        pretrain(load_recipe(p, ["train.max_steps=2"]), resume=True)
    assert json.loads((run / "summary.json").read_text()) == before
    assert (run / "recipe.yaml").read_text() == recipe_text
    (run / "summary.json").unlink()  # killed after the last checkpoint, before the summary
    rebuilt = pretrain(load_recipe(p), resume=True)
    text = (run / "summary.json").read_text()
    assert "NaN" not in text  # valid JSON: figures not measured are null
    s = json.loads(text)
    assert s["steps"] == 4 and s["final_train_loss"] == before["final_train_loss"]
    assert s["final_val_loss"] == pytest.approx(before["final_val_loss"], rel=1e-6)
    assert rebuilt.summary["steps"] == 4


def test_resume_auto_never_starts_over_a_trained_run_whose_checkpoints_are_gone(workspace, capsys):
    """train.resume: auto resumes a run or starts a folder that trained nothing; a run that saved
    weights but lost its checkpoints (deleted to free disk) is refused, not replaced."""
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    run = p.parent / "runs" / "r"
    shutil.rmtree(run / "checkpoints")
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    capsys.readouterr()
    for args in (["train.resume=auto"], ["train.resume=auto", "train.max_steps=1"]):
        assert main(["pretrain", str(p), "--no-progress", *args]) == 2
        err = capsys.readouterr().err
        assert "holds a trained run (model.safetensors) but no checkpoint to resume it from" in err
        assert "--overwrite" in err
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before


def test_a_run_whose_stdout_reader_goes_away_trains_on_and_saves(workspace):
    """`difftrain pretrain ... | head`, or a log collector that dies: training goes on without
    printing (rich would exit 1 at once, with no word and no checkpoint)."""
    import subprocess
    import sys

    p = workspace(steps=24, save_every=24)
    proc = subprocess.Popen(
        [sys.executable, "-m", "difftrain", "pretrain", str(p), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while "step 2/24" not in proc.stdout.readline():  # the run is printing its steps: hang up
        pass
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, err
    assert "standard output was closed (its reader ended); going on without printing to it" in err
    run = p.parent / "runs" / "r"
    assert json.loads((run / "summary.json").read_text())["steps"] == 24
    assert (run / "checkpoints" / "step-00000024.ckpt").is_file()


def test_a_start_that_failed_before_its_first_step_does_not_block_the_next(workspace, capsys):
    p = workspace(steps=2, save_every=2)
    # a window longer than the training split: refused before anything is written
    assert (
        main(["pretrain", str(p), "--no-progress", "model.max_seq_len=100000", "train.seq_len=100000"]) == 2
    )
    assert "fewer than one window" in capsys.readouterr().err
    assert not (p.parent / "runs" / "r").exists()
    # a folder that holds only what a start writes (a start killed before its first step): the
    # next start takes it over without --overwrite
    run = p.parent / "runs" / "r"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: r\n")
    (run / "config.json").write_text("{}")
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    assert (run / "model.safetensors").is_file()
    assert json.loads((run / "config.json").read_text())["arch"] == "diff"


def test_a_run_resumes_from_its_own_recipe_from_any_folder_and_a_copy_resumes_itself(
    workspace, tmp_path, monkeypatch, capsys
):
    # a user's recipe with relative paths: data next to the recipe, runs under the current folder
    text = workspace(steps=4, save_every=2).read_text()
    text = text.replace(f"sources: [{tmp_path / 'corpus'}]", "sources: [corpus]")
    text = text.replace(f"out_dir: {tmp_path / 'runs'}", "out_dir: runs")
    rel = tmp_path / "rel.yaml"
    rel.write_text(text)
    with pytest.raises(StopRequested):
        pretrain(load_recipe(rel), extra_callbacks=[StopAt(2)])
    run = tmp_path / "runs" / "r"
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert saved["data"]["sources"][0]["source"] == str(tmp_path / "corpus")  # absolute in the run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # the run directory stands for its recipe.yaml, and that recipe for that directory
    assert main(["pretrain", str(run), "--resume", "--no-progress"]) == 0
    assert sorted(losses(run)) == [1, 2, 3, 4] and not (elsewhere / "runs").exists()
    monkeypatch.chdir(tmp_path)
    assert pretrain(load_recipe(rel), resume=True).finished_before  # the user's recipe: the same run
    # out_dir written another way names the same folder: the same run, not "out_dir differs"
    (tmp_path / "runs_link").symlink_to(tmp_path / "runs")
    for out_dir in (str(tmp_path / "runs"), "./runs", "runs_link"):
        assert pretrain(load_recipe(rel, [f"out_dir={out_dir}"]), resume=True).finished_before, out_dir
    # a copied run directory resumes (here: repairs) the copy, not the run it was copied from
    copy = tmp_path / "runs" / "copy"
    shutil.copytree(run, copy)
    original = (run / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(b"not weights")
    capsys.readouterr()
    assert main(["pretrain", str(copy / "recipe.yaml"), "--resume"]) == 0
    assert f"{copy}/model.safetensors is damaged" in capsys.readouterr().err
    assert (run / "model.safetensors").read_bytes() == original  # the original is not touched
    a, b = load_file(run / "model.safetensors"), load_file(copy / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_copy_missing_config_or_tokenizer_resumes_itself_and_gets_them_back(workspace, tmp_path, capsys):
    p = workspace(steps=4, save_every=2)
    with pytest.raises(StopRequested):
        pretrain(load_recipe(p), extra_callbacks=[StopAt(2)])
    run = tmp_path / "runs" / "r"
    config, tok = (run / "config.json").read_bytes(), (run / "tokenizer.json").read_bytes()
    before = sorted((q.relative_to(run), q.stat().st_mtime_ns) for q in run.rglob("*"))
    copy = tmp_path / "runs" / "copy"
    shutil.copytree(run, copy)
    (copy / "config.json").unlink()  # a run folder still: its recipe.yaml names the copy, not runs/r
    (copy / "tokenizer.json").write_text("garbage")
    capsys.readouterr()
    assert main(["pretrain", str(copy / "recipe.yaml"), "--resume", "--no-progress"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{copy}/config.json was missing or damaged: written again" in err
    assert f"{copy}/tokenizer.json was missing or damaged" in err
    assert sorted(losses(copy)) == [1, 2, 3, 4]
    assert (copy / "config.json").read_bytes() == config and (copy / "tokenizer.json").read_bytes() == tok
    assert sorted((q.relative_to(run), q.stat().st_mtime_ns) for q in run.rglob("*")) == before
    # a readable tokenizer that is not the one training goes on with is refused, nothing written
    other = shutil.copytree(run, tmp_path / "runs" / "other")
    from difftrain.data.tokenizer import load_tokenizer

    t = load_tokenizer(other / "tokenizer.json")
    t.tk.add_tokens(["<|new|>"])
    t.save(other / "tokenizer.json")
    mtimes = sorted((q.relative_to(other), q.stat().st_mtime_ns) for q in other.rglob("*"))
    assert main(["pretrain", str(other), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        "tokenizer.json is not the tokenizer this recipe trains with" in err
        and len(err.strip().splitlines()) == 1
    )
    assert sorted((q.relative_to(other), q.stat().st_mtime_ns) for q in other.rglob("*")) == mtimes


def test_a_recipe_without_a_data_section_trains_on_the_documented_default(workspace):
    r = load_recipe(workspace())
    text = workspace().read_text()
    start, end = text.index("data:\n"), text.index("tokenizer:\n")
    p = Path("nodata.yaml")
    p.write_text(text[:start] + text[end:])
    assert [s.source for s in load_recipe(p).data.sources] == ["builtin:python-stdlib"]
    assert r.data.sources[0].source != "builtin:python-stdlib"


def test_dry_run_refuses_what_the_run_would_refuse_and_writes_nothing(workspace, capsys):
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--dry-run"]) == 0
    assert "a new run" in capsys.readouterr().out
    assert not (p.parent / "runs").exists()
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    run = p.parent / "runs" / "r"
    before = sorted((q.relative_to(run), q.stat().st_mtime_ns) for q in run.rglob("*"))
    capsys.readouterr()
    assert main(["pretrain", str(p), "--dry-run"]) == 2
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err
    assert main(["pretrain", str(p), "--dry-run", "--resume", "model.n_layers=3"]) == 2
    assert "holds a different run (model.n_layers differs)" in capsys.readouterr().err
    assert main(["pretrain", str(p), "--dry-run", "--overwrite", "model.vocab_size=100"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size is 100 but the tokenizer this recipe trains has at least 263 tokens" in err
    assert "320" in err
    # above the least it can have, below what it asks for: the run may work (a small corpus gives
    # fewer tokens), so the dry run warns where it refused a run that trains
    assert main(["pretrain", str(p), "--dry-run", "--overwrite", "model.vocab_size=300"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "may have up to 320 tokens" in err and "stops if it has more than 300" in err
    assert main(["pretrain", str(p), "--dry-run", "--resume", "train.max_steps=4"]) == 0
    assert "resumes from step 2" in capsys.readouterr().out
    assert main(["pretrain", str(p), "--dry-run", "--overwrite"]) == 0
    assert "replaces the run there" in capsys.readouterr().out
    assert sorted((q.relative_to(run), q.stat().st_mtime_ns) for q in run.rglob("*")) == before


def test_dry_run_checks_the_files_the_run_reads_and_the_folder_it_writes(workspace, capsys, tmp_path):
    p = workspace(steps=2, save_every=2)
    (tmp_path / "blocker").write_text("a file where a folder should be")
    cases = {
        "tokenizer.path=nope/tokenizer.json": "nope/tokenizer.json does not exist",
        f"tokenizer.path={p}": "not a valid tokenizer.json",
        "data.sources=[missing.txt]": "missing.txt does not exist",
        "data.sources=[hf:./no-such-folder]": "local dataset folder",
        "model.attn_impl=flex": "model.attn_impl=flex has no backward pass on CPU",
        f"out_dir={tmp_path / 'blocker' / 'runs'}": "blocker is not a folder; set out_dir",
        f"out_dir={tmp_path / 'loop' / 'runs'}": "loop is a symbolic link that leads nowhere",
        # a folder name longer than the filesystem allows (a traceback: File name too long)
        f"out_dir={tmp_path / ('d' * 260)}": "is 260 bytes long, more than a folder name may be (255); set out_dir",
    }
    (tmp_path / "loop").symlink_to("loop")
    for override, message in cases.items():
        assert main(["pretrain", str(p), "--dry-run", override]) == 2, override
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (override, err)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


@pytest.mark.skipif(not Path("/proc/self/mountinfo").is_file(), reason="Linux /proc only")
def test_a_run_or_cache_folder_on_a_kernel_filesystem_is_refused_by_the_dry_run(
    workspace, capsys, monkeypatch
):
    # os.access says /proc is writable to root: the dry run passed and the run failed 11 s later
    from difftrain.io import pseudo_filesystem

    assert pseudo_filesystem(Path("/proc/self")) == "proc" and pseudo_filesystem(Path("/tmp")) is None
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--dry-run", "out_dir=/proc/difftrain-runs"]) == 2
    err = capsys.readouterr().err
    assert (
        "cannot create the run directory /proc/difftrain-runs/r: /proc is on a kernel filesystem (proc)"
        in err
    )
    assert main(["pretrain", str(p), "--dry-run", "data.cache_dir=/proc/difftrain-cache"]) == 2
    assert "/proc is on a kernel filesystem (proc) where no folder can be made" in capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_a_missing_data_file_is_refused_before_torch_loads(tmp_path, dry_run, cli_probe):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel: {arch: diff, d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 32}\n"
        "data: {sources: [missing.txt]}\ntrain: {max_steps: 2, micro_batch_size: 2}\n"
    )
    done = cli_probe([["pretrain", str(recipe), *(["--dry-run"] if dry_run else [])]], tmp_path)
    assert done.codes == [2] and done.loaded == [], done.stderr
    assert "missing.txt does not exist; fix the path" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()
    # and so is a missing tokenizer.path, resolved against the recipe's folder as training does
    (tmp_path / "corpus.txt").write_text("some text\n" * 50)
    (tmp_path / "sub").mkdir()
    moved = tmp_path / "sub" / "r.yaml"
    moved.write_text(
        recipe.read_text().replace("missing.txt", "../corpus.txt") + "tokenizer: {path: tok.json}\n"
    )
    done = cli_probe([["pretrain", str(moved), *(["--dry-run"] if dry_run else [])]], tmp_path)
    assert done.codes == [2] and done.loaded == [], done.stderr
    assert f"tokenizer file {tmp_path / 'sub' / 'tok.json'} does not exist" in done.stderr


def test_dry_run_warns_as_the_run_would_of_memory_and_warm_up(workspace, capsys):
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--dry-run", "optim.warmup_steps=1"]) == 0
    assert "warning:" not in capsys.readouterr().err
    # a micro-batch no machine holds, and a warm-up longer than the run: warned, not refused
    assert (
        main(
            [
                "pretrain",
                str(p),
                "--dry-run",
                "train.micro_batch_size=4000000",
                "train.global_batch_size=null",
                "optim.warmup_steps=5",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "warning: this run needs ≈" in err and f"difftrain plan {p}" in err
    assert "warning: optim.warmup_steps=5 is not below train.max_steps=2" in err
    assert "[yellow]" not in err and "[/]" not in err and "data.sources" not in err
    assert not (p.parent / "runs").exists()


def test_a_resuming_dry_run_gives_the_resumes_warnings(workspace, capsys):
    p = workspace(steps=4, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    newest = run / "checkpoints" / "step-00000004.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["pretrain", str(p), "--dry-run", "--resume", "train.max_steps=6"]) == 0
    out, err = capsys.readouterr()
    assert "resumes from step 2" in out
    assert (
        "warning: checkpoint step-00000004.ckpt is damaged (checksum mismatch); resuming from the older step-00000002.ckpt"
        in err
    )
    assert newest.read_bytes() == bytes(data)  # the dry run writes nothing
    # resumed from the run's own recipe (its vocab_size resolved to the trained tokenizer's):
    # no warning about the size a tokenizer still to be trained might reach
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["model"]["vocab_size"] = 300  # (as a run whose tokenizer came out smaller than asked)
    recipe["tokenizer"]["train"]["vocab_size"] = 4096
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    code = main(["pretrain", str(run), "--dry-run", "--resume", "train.max_steps=6"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "may have up to" not in err


def test_a_run_directory_another_process_trains_into_is_refused_and_left_alone(workspace, capsys):
    from difftrain.io import RunLock

    p = workspace(steps=2, save_every=2)
    run = pretrain(load_recipe(p)).run_dir
    lock = RunLock(run)
    assert lock.acquire() is None  # as the process training into the folder holds it
    try:
        for args in (["--resume", "train.max_steps=4"], ["--overwrite"], ["--dry-run", "--overwrite"]):
            assert main(["pretrain", str(p), "--no-progress", *args]) == 2
            assert f"is in use: process {os.getpid()} is training into it" in capsys.readouterr().err
        assert (run / "model.safetensors").is_file() and (run / "summary.json").is_file()  # nothing removed
    finally:
        lock.release()
    assert main(["pretrain", str(p), "--no-progress", "--resume", "train.max_steps=4"]) == 0
    assert sorted(losses(run)) == [1, 2, 3, 4]


@pytest.mark.parametrize("steps", [8, 6], ids=["ends-on-a-val-step", "final-val-after-the-bar"])
def test_the_progress_bar_shows_the_newest_val_loss_with_its_step(workspace, steps):
    import io

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=250, force_terminal=True, color_system=None)
    result = pretrain(load_recipe(workspace(steps=steps)), progress=True, console=console)
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "\n", out.getvalue())  # the live display's redraws
    bar = [line for line in frames.splitlines() if line.startswith("step ")][-1]
    assert f"step {steps}/{steps}" in bar
    if steps == 8:  # validated at step 8 after the bar's update for the step: the bar shows it
        assert f"val {result.summary['final_val_loss']:.4f} (step 8)" in bar
    else:  # the final validation (step 6) runs after training; the bar names its step 4 value
        assert "(step 4)" in bar and f"val {result.summary['final_val_loss']:.4f}" not in bar


@pytest.mark.parametrize("progress", [True, False], ids=["log-file", "no-progress"])
def test_without_a_live_bar_each_log_step_prints_a_plain_line(workspace, progress):
    import io

    from rich.console import Console

    out = io.StringIO()  # not a terminal: a log file, a pipe, a batch job's output
    result = pretrain(
        load_recipe(workspace(steps=6), ["train.log_every=2", "train.val_every=3"]),
        progress=progress,
        console=Console(file=out, width=250),
    )
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    train = [line.split(" · ")[0] for line in lines if " · loss " in line]
    assert train == ["step 1/6", "step 2/6", "step 4/6", "step 6/6"]
    assert all(" tok/s · lr " in line and " · eta " in line for line in lines if " · loss " in line)
    vals = [line for line in lines if " · val " in line]
    assert [v.split(" · ")[0] for v in vals] == ["step 3/6", "step 6/6"]
    assert vals[-1].endswith(f"val {result.summary['final_val_loss']:.4f}")
    assert "━" not in out.getvalue()  # no frame of a bar


def test_the_dry_run_vocabulary_check_names_the_tokenizer_and_its_size():
    from types import SimpleNamespace

    from difftrain.data.config import TokenizerTrainConfig
    from difftrain.errors import TokenizerError
    from difftrain.train.preflight import check_vocab_early as _check_vocab

    model = SimpleNamespace(vocab_size=100)
    given = SimpleNamespace(model=model, tokenizer=SimpleNamespace(path="runs/a/tokenizer.json"))
    with pytest.raises(
        TokenizerError, match=r"the tokenizer runs/a/tokenizer.json has 512 tokens: ids past 99"
    ):
        _check_vocab(given, 512)
    trained = SimpleNamespace(
        model=model,
        tokenizer=SimpleNamespace(path=None, train=TokenizerTrainConfig(extra_special_tokens=["<x>"])),
    )
    with pytest.raises(TokenizerError, match=r"trains has at least 264 tokens .*up to 512.*: ids past 99"):
        _check_vocab(trained, 512)
    model.vocab_size = 264  # the least it can have: the run may fit, so a warning
    assert "may have up to 512 tokens" in _check_vocab(trained, 512)
    assert (
        _check_vocab(
            SimpleNamespace(model=SimpleNamespace(vocab_size="auto"), tokenizer=given.tokenizer), 512
        )
        is None
    )


def test_records_skipped_under_skip_are_counted_in_the_start_table(workspace, tmp_path, capsys):
    p = workspace(steps=1, save_every=1)
    text = tmp_path / "docs.jsonl"
    doc = {"text": "def add(a, b):\n    return a + b\n" * 20}
    text.write_text("\n".join([json.dumps(doc)] * 30 + ["not json"] + [json.dumps(doc)] * 30) + "\n")
    assert (
        main(["pretrain", str(p), "--no-progress", f"data.sources=[{text}]", "data.on_bad_record=skip"]) == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "skipped records" in out and "1 malformed (data.on_bad_record: skip); the first:" in out


def test_json_configs_read_as_text_are_counted_in_prepare_and_the_start_table(workspace, tmp_path, capsys):
    p = workspace(steps=1, save_every=1)
    folder = tmp_path / "repo"
    folder.mkdir()
    for i in range(12):
        (folder / f"m{i}.py").write_text(f"def f{i}(a, b):\n    return a + b\n" * 20)
    (folder / "settings.json").write_text(json.dumps({"lr": 0.1, "layers": [1, 2]}))  # no records
    data = f"data.sources=[{folder}]"
    assert main(["prepare", str(p), "--no-progress", data]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "json as text 1 .json files in folders hold no records (configs): read as text" in out
    assert main(["pretrain", str(p), "--no-progress", data]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "json as text 1 .json files in folders hold no records (configs): read as text" in out
    assert main(["pretrain", str(p), "--no-progress", "--overwrite"]) == 0  # the recipe's own corpus
    assert "json as text" not in capsys.readouterr().out


def test_a_run_that_lost_its_recipe_is_named_a_run_not_a_folder_to_remove(workspace, capsys):
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    run = p.parent / "runs" / "r"
    saved = (run / "recipe.yaml").read_text()
    (run / "recipe.yaml").unlink()
    capsys.readouterr()
    assert main(["pretrain", str(p), "--resume", "train.max_steps=4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds a run (config.json) whose recipe.yaml is missing; restore it" in err
    assert "remove it" not in err and (run / "checkpoints").is_dir()
    (run / "recipe.yaml").write_text(saved)  # restored as told: the run resumes
    assert main(["pretrain", str(p), "--resume", "train.max_steps=4", "--no-progress"]) == 0


def test_a_warm_up_as_long_as_the_run_is_noted_as_what_the_schedule_does(workspace):
    from difftrain.spec import resolve
    from difftrain.train.preflight import _warmup_notes

    for steps, note in (
        (1, "optim.warmup_steps=2 with train.max_steps=1: the one step runs at the peak optim.lr"),
        (2, "optim.warmup_steps=2 is not below train.max_steps=2: warm-up is cut to 1 step and"),
        (3, "optim.warmup_steps=3 is not below train.max_steps=3: warm-up is cut to 2 steps and"),
    ):
        r = load_recipe(workspace(name=f"w{steps}", steps=steps), [f"optim.warmup_steps={max(2, steps)}"])
        (got,) = _warmup_notes(resolve(r))
        assert got.startswith(note), got
    r = load_recipe(workspace(name="w6", steps=6))
    assert _warmup_notes(resolve(r)) == []


def test_the_early_run_directory_check_refuses_what_the_full_one_refuses_in_its_words(workspace, monkeypatch):
    # `early_check` answers before torch loads; it must never refuse what the run would accept,
    # nor say anything else than the run would (here both see a machine without CUDA)
    from difftrain import devicecheck
    from difftrain.spec import Machine, resolve
    from difftrain.train import runcheck
    from difftrain.train.preflight import preflight

    monkeypatch.setattr(devicecheck, "no_cuda_here", lambda: True)
    monkeypatch.setattr("difftrain.spec.Machine.detect", lambda: Machine(threads=1, here=True))
    p = workspace(steps=2, save_every=2)
    pretrain(load_recipe(p))
    cases = [  # overrides, --resume, --overwrite, accepted
        ([], None, False, False),  # the run's own command again
        (["optim.lr=1e-2"], None, False, False),  # another run
        (["optim.lr=1e-2"], True, False, False),
        ([], True, True, False),  # --resume --overwrite
        (["train.resume=true"], None, True, False),
        (["train.devices=2"], None, False, False),  # another global batch
        (["name=fresh"], True, False, False),  # nothing to resume
        (["train.max_steps=4"], True, False, True),  # a resume
        (["optim.lr=1e-2"], None, True, True),  # replaced
        (["name=fresh"], None, False, True),  # a new run
    ]

    def outcome(check, *args):
        try:
            check(*args)
        except (RecipeError, RunDirError) as e:
            return type(e), str(e)
        return None

    def early(r, resume, overwrite):
        runcheck.early_check(r, resume=resume, overwrite=overwrite)

    def full(r, resume, overwrite):
        spec = resolve(r)
        flag = spec.recipe.train.resume if resume is None else resume
        preflight(spec, resume=flag, overwrite=overwrite, dry_run=True)

    for overrides, resume, overwrite, accepted in cases:
        r = load_recipe(p, overrides)
        said = outcome(early, r, resume, overwrite)
        assert said == outcome(full, r, resume, overwrite), (overrides, resume, overwrite, said)
        assert (said is None) == accepted, (overrides, resume, overwrite, said)


def test_running_a_runs_command_again_is_refused_before_torch_loads(workspace, cli_probe):
    from difftrain.devicecheck import no_cuda_here

    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    commands = [
        ["pretrain", str(p)],
        ["pretrain", str(p), "--dry-run"],
        ["pretrain", str(p), "optim.lr=1e-2"],
        ["pretrain", str(p), "--resume", "--overwrite"],
    ]
    done = cli_probe(commands, p.parent)
    assert done.codes == [2, 2, 2, 2], done.stderr
    if no_cuda_here():  # (with a GPU driver present, torch decides what `auto` resolves to)
        assert done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert "already holds a run; continue it with --resume" in errors[0] and errors[0] == errors[1]
    assert "holds a different run (optim.lr differs)" in errors[2]
    assert "--overwrite and --resume contradict each other" in errors[3]


def test_a_resume_restates_lightnings_micro_batch_count_in_this_runs_accumulation():
    """Lightning validates every val_every × accumulate micro-batches counted since the run
    began; a resume with another accumulation restates the count it restores (the end-to-end
    promise: test_a_resume_may_split_the_global_batch_differently_but_not_change_it)."""
    import copy

    from difftrain.recipe import OptimConfig
    from difftrain.train.lit import LitLM

    lit = LitLM(torch.nn.Linear(2, 2), OptimConfig(), total_steps=10, accumulate=4, grad_clip=None)
    counts = {"ready": 6, "started": 6, "processed": 6, "completed": 6}
    progress = {"total": dict(counts), "current": dict(counts), "is_last_batch": False}
    ckpt = {"global_step": 3, "loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}
    lit._count_micro_batches_in_steps(ckpt)  # 3 steps of 2 micro-batches, resumed with 4 per step
    assert progress["total"] == progress["current"] == dict.fromkeys(counts, 12)
    bare = {"global_step": 3, "loops": {}}
    before = copy.deepcopy(bare)
    lit._count_micro_batches_in_steps(bare)  # a checkpoint without the loops' progress: as it is
    assert bare == before


GPU_ONLY = [  # overrides a machine without CUDA cannot train, each refused as a DeviceError
    ["train.accelerator=cuda"],
    ["train.precision=16-mixed"],
    ["optim.name=paged_adamw8bit"],
    ["train.strategy=fsdp"],
    ["model.attn_impl=flex"],
    ["train.strategy=fsdp", "optim.name=paged_adamw8bit"],  # the first refusal of several
]


def test_gpu_only_options_on_a_machine_without_cuda_are_refused_early_as_the_run_refuses_them(
    workspace, monkeypatch
):
    from difftrain import devicecheck
    from difftrain.errors import DeviceError
    from difftrain.spec import Machine, resolve
    from difftrain.train import runcheck

    monkeypatch.setattr(devicecheck, "no_cuda_here", lambda: True)
    monkeypatch.setattr("difftrain.spec.Machine.detect", lambda: Machine(threads=1, here=True))
    p = workspace(steps=2)

    def said(check, r):
        try:
            check(r)
        except DeviceError as e:
            return str(e)
        return None

    for overrides in GPU_ONLY:
        r = load_recipe(p, overrides)
        early = said(lambda r: runcheck.early_check(r, resume=None, overwrite=False), r)
        assert early is not None and early == said(resolve, r), (overrides, early)
    for overrides in ([], ["train.precision=bf16-mixed"], ["optim.name=adamw8bit"], ["train.devices=2"]):
        r = load_recipe(p, overrides)  # what the CPU can train passes both
        assert said(lambda r: runcheck.early_check(r, resume=None, overwrite=False), r) is None, overrides
        assert said(resolve, r) is None, overrides


def test_gpu_only_options_are_refused_before_torch_loads_where_no_gpu_driver_is(workspace, cli_probe):
    p = workspace(steps=2)
    done = cli_probe(
        [["pretrain", str(p), *o] for o in GPU_ONLY] + [["pretrain", str(p), "--dry-run", *GPU_ONLY[3]]],
        p.parent,
        # a machine without a GPU driver, also where this one has one
        prelude="import difftrain.devicecheck as dc; dc.no_cuda_here = lambda: True",
    )
    assert done.codes == [2] * (len(GPU_ONLY) + 1) and done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == len(GPU_ONLY) + 1 and all(e.startswith("error: ") for e in errors), errors
    assert "fsdp needs CUDA GPUs" in errors[3] and "fsdp needs CUDA GPUs" in errors[-1]
    assert not (p.parent / "runs").exists()  # nothing written


def train_rows(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(run_dir / "metrics.csv") if "train/loss" in r]


@pytest.mark.parametrize(
    "length", [[], ["train.max_steps=null", "train.max_tokens=860"]], ids=["steps", "tokens"]
)
def test_the_last_step_is_logged_whatever_log_every_and_a_longer_resume_repeats_no_row(workspace, length):
    """metrics.csv's curve ends at the loss summary.json reports, also when max_steps (given, or
    ceil(max_tokens / 128 tokens per step) = 7) is not a multiple of log_every."""
    first = pretrain(load_recipe(workspace(name="r", steps=7), ["train.log_every=10", *length]))
    rows = train_rows(first.run_dir)
    assert [s for s, _ in rows] == [1, 7]
    assert rows[-1][1] == first.summary["final_train_loss"]
    more = pretrain(load_recipe(first.run_dir, ["train.max_steps=12", "train.max_tokens=null"]), resume=True)
    rows = train_rows(first.run_dir)
    assert [s for s, _ in rows] == [1, 7, 10, 12]  # in order, step 7 once
    assert rows[-1][1] == more.summary["final_train_loss"]


class StopAtValidation(L.Callback):
    """A SIGTERM that arrives during the validation of step `step`, after its train row was due."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "fit" and trainer.global_step == self.step:
            run_cb = next(c for c in trainer.callbacks if isinstance(c, RunCallback))
            run_cb._stop_signal = signal.SIGTERM


@pytest.mark.parametrize(
    ("stop", "step"), [(StopAt, 3), (StopAtValidation, 4)], ids=["after-a-step", "during-its-validation"]
)
def test_a_stopped_run_logs_the_step_it_stops_at_and_its_resume_goes_on_from_there(workspace, stop, step):
    p = workspace(name="s", steps=12, save_every=4)
    with pytest.raises(StopRequested) as stopped:
        pretrain(load_recipe(p, ["train.log_every=10"]), extra_callbacks=[stop(step)])
    assert stopped.value.step == step
    run_dir = p.parent / "runs" / "s"
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = train_rows(run_dir)
    assert [s for s, _ in rows] == [1, step] and rows[-1][1] == summary["final_train_loss"]
    resumed = pretrain(load_recipe(run_dir), resume=True)
    assert resumed.resumed_from == step
    assert [s for s, _ in train_rows(run_dir)] == [1, step, 10, 12]
    assert sorted(val_losses(run_dir)) == [4, 8, 12]


def test_the_device_named_for_several_processes_says_how_many():
    from difftrain.spec import Machine, device_name

    one, two = device_name("cpu", Machine.detect()), device_name("cpu", Machine.detect(), 2)
    assert one.startswith("cpu (") and "each" not in one
    assert two.startswith("cpu × 2 (") and two.endswith(" each)")  # threads are per process


def test_a_missing_or_damaged_config_json_says_how_to_write_it_again(workspace, capsys):
    # it said only "not a complete run directory" / "invalid JSON", with no way out
    run = pretrain(load_recipe(workspace(steps=2, save_every=2))).run_dir
    good = (run / "config.json").read_text()
    (run / "config.json").write_text("")
    assert main(["generate", str(run), "-p", "x", "-n", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "invalid JSON in model config" in err
        and f"by resuming: `difftrain pretrain {run / 'recipe.yaml'} --resume`" in err
    )
    (run / "config.json").unlink()
    assert main(["generate", str(run), "-p", "x", "-n", "2"]) == 2
    assert "has no config.json; it is not a complete run directory; write it again" in " ".join(
        capsys.readouterr().err.split()
    )
    assert main(["pretrain", str(run / "recipe.yaml"), "--resume", "--no-progress"]) == 0  # the advice works
    assert json.loads((run / "config.json").read_text()) == json.loads(good)


def test_a_runs_damaged_recipe_is_named_as_such_not_as_a_different_run(workspace, capsys):
    # a recipe.yaml cut short: valid YAML without `train`, and a line cut mid-mapping
    p = workspace(steps=2, save_every=2)
    assert main(["pretrain", str(p), "--no-progress"]) == 0
    saved = p.parent / "runs" / "r" / "recipe.yaml"
    whole = saved.read_text()
    before = sorted((q.name, q.stat().st_mtime_ns) for q in saved.parent.rglob("*") if q != saved)
    capsys.readouterr()
    cut_at_section = whole[: whole.index("\ntrain:")] + "\n"
    for cut, says in (
        (cut_at_section, "the run's recipe is damaged ("),
        (whole[:200], "invalid YAML: "),
        ("name: r\n\xff\n", "not UTF-8 text"),  # one line, no traceback
    ):
        saved.write_bytes(cut.encode("latin-1") if "\xff" in cut else cut.encode())
        assert main(["pretrain", str(p), "--resume", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert says in err and "restore the recipe the run was started with" in err, err
        assert "holds a different run" not in err and len(err.strip().splitlines()) == 1
    assert sorted((q.name, q.stat().st_mtime_ns) for q in saved.parent.rglob("*") if q != saved) == before


SPEC_LABELS = ("model", "batch", "steps", "optimizer", "precision", "device", "auto")


def spec_lines(out: str) -> dict[str, str]:
    """The resolved-settings rows (`cli.common.spec_rows`) of a command's tables."""
    rows = {}
    for line in out.splitlines():
        label, _, value = line.strip().partition(" ")
        if label in SPEC_LABELS and value.strip():
            rows.setdefault(label, value.strip())
    return rows


def test_plan_dry_run_and_the_start_table_show_the_same_resolved_settings(workspace, capsys):
    # overrides that `auto` and the batch arithmetic resolve: accumulation, precision, optimizer
    p = workspace(steps=2, save_every=2)
    over = [
        "train.precision=auto",
        "optim.name=auto",
        "train.compile=auto",
        "train.activation_checkpointing=true",
    ]
    shown = []
    for args in (
        ["plan", str(p), *over],
        ["pretrain", str(p), "--dry-run", *over],
        ["pretrain", str(p), *over],
    ):
        assert main(args) == 0, args
        shown.append(spec_lines(capsys.readouterr().out))
    plan, dry, start = shown
    assert set(start) == set(SPEC_LABELS), start  # every setting, and why each auto chose its value
    assert plan == dry == start
    assert "accum 2" in start["batch"] and "activation checkpointing" in start["precision"]
    assert all(f"{k} " in start["auto"] for k in ("accelerator", "precision", "compile", "optimizer"))
