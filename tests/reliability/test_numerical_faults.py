"""Non-finite losses and gradients are skipped, then stop the run with a diagnosis; the last good
checkpoint is kept. Faults are injected through `pretrain(..., fault_hook=)` (LitLM's test hook,
called with (step, loss) on every micro-batch) or by an absurd learning rate."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from conftest import assert_checkpoints_verify, flat, model_weights, resume_point, safetensors_step

from difftrain.cli.app import main
from difftrain.errors import TrainingError
from difftrain.recipe import load_recipe
from difftrain.train.checkpoint import load_checkpoint_file
from difftrain.train.metrics import read_metrics
from difftrain.train.optim import lr_multiplier
from difftrain.train.run import pretrain

BAD_PARAM = "model.layers.1.mlp.down_proj.weight"


class _NanGrad(torch.autograd.Function):
    """Adds 0 to the loss (it stays finite) and NaN to one parameter's gradient."""

    @staticmethod
    def forward(ctx, p):  # type: ignore[override]
        ctx.shape = p.shape
        return p.sum() * 0.0

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return torch.full(ctx.shape, float("nan"))


class Grab(L.Callback):
    """Keeps the LightningModule so a fault hook can reach its parameters."""

    module = None

    def on_train_start(self, trainer, pl_module):
        Grab.module = pl_module


def nan_grad_from(step: int):
    def hook(s: int, loss: torch.Tensor) -> torch.Tensor:
        if s >= step:
            return loss + _NanGrad.apply(Grab.module.model.get_parameter(BAD_PARAM))
        return loss

    return hook


def test_a_few_nan_losses_are_skipped_and_training_completes(workspace):
    calls = {"n": 0}

    def hook(step: int, loss: torch.Tensor) -> torch.Tensor:
        if step == 3:  # the first micro-batch of the first two attempts at step 4 (accumulate 2)
            calls["n"] += 1
            if calls["n"] in (1, 3):
                return loss * float("nan")
        return loss

    result = pretrain(load_recipe(workspace(steps=6, save_every=2)), fault_hook=hook)
    assert result.summary["steps"] == 6 and result.summary["skipped_steps"] == 2
    assert math.isfinite(result.summary["final_train_loss"])
    rows = [r for r in read_metrics(result.run_dir / "metrics.csv") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["train/loss"]) for r in rows)


def test_persistent_nan_gradients_stop_with_step_lr_and_parameter(workspace):
    recipe = load_recipe(workspace(steps=10, save_every=1), ["train.nan_skip_limit=2"])
    with pytest.raises(TrainingError) as err:
        pretrain(recipe, fault_hook=nan_grad_from(3), extra_callbacks=[Grab()])
    msg = str(err.value)
    lr = recipe.optim.lr * lr_multiplier(recipe.optim, 10)(3)  # the scheduler's lr at step 4
    assert "3 steps in a row" in msg and "step 4:" in msg and f"lr={lr:.3g}" in msg
    assert f"first non-finite grad in {BAD_PARAM}" in msg
    assert "loss=" in msg and "grad norm=nan" in msg
    # the last good checkpoint (step 3) is kept, complete and finite; nothing after the fault
    run = recipe.run_dir
    assert_checkpoints_verify(run)
    point = resume_point(run)
    assert point.step == 3 and point.warnings == []
    ckpt = load_checkpoint_file(point.path)
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert safetensors_step(run / "model.safetensors") == 3
    weights = model_weights(run / "model.safetensors")
    assert all(torch.equal(v, ckpt["state_dict"][k]) for k, v in weights.items())


def test_the_cli_exits_2_with_the_diagnosis_and_resume_works_after_the_fault(workspace, monkeypatch, capsys):
    import difftrain.train.run as run_mod

    real = run_mod.pretrain
    monkeypatch.setattr(
        run_mod,
        "pretrain",
        lambda *a, **kw: real(*a, **kw, fault_hook=nan_grad_from(2), extra_callbacks=[Grab()]),
    )
    recipe = workspace(steps=6, save_every=1)
    assert main(["pretrain", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "training diverged" in err and BAD_PARAM in err and "Traceback" not in err
    monkeypatch.setattr(run_mod, "pretrain", real)  # the fault is gone: the run resumes and ends
    assert main(["pretrain", str(recipe), "--resume", "--no-progress"]) == 0
    assert "resuming from step 2" in flat(capsys.readouterr().out)


def test_an_absurd_learning_rate_ends_in_a_training_error_not_garbage(workspace, capsys):
    recipe = workspace(steps=20, save_every=2)
    assert main(["pretrain", str(recipe), "optim.lr=1e30", "optim.warmup_steps=0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "training diverged" in err and "lower optim.lr" in err
    run = load_recipe(recipe).run_dir
    assert_checkpoints_verify(run)
    assert not (run / "summary.json").exists()  # the run did not claim to have finished
