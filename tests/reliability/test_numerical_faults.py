"""Non-finite losses and gradients are skipped (no update; the step still counts), then stop the
run with a diagnosis; the last good checkpoint is kept. Faults are injected through `pretrain(..., fault_hook=)` (LitLM's test hook,
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


class WeightsAt(L.Callback):
    """The weights at the start of the given optimizer steps (1-based: before step s runs)."""

    def __init__(self, *steps: int) -> None:
        self.steps, self.weights = steps, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        s = trainer.global_step + 1
        if s in self.steps and s not in self.weights:
            self.weights[s] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_a_few_nan_losses_are_skipped_counted_and_apply_no_update(workspace):
    def hook(step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step in (3, 4) else loss  # the forwards of steps 4 and 5

    watch = WeightsAt(4, 6)
    result = pretrain(load_recipe(workspace(steps=6, save_every=2)), fault_hook=hook, extra_callbacks=[watch])
    assert result.summary["steps"] == 6 and result.summary["skipped_steps"] == 2
    assert math.isfinite(result.summary["final_train_loss"])
    rows = {
        r["step"]: r["train/loss"] for r in read_metrics(result.run_dir / "metrics.csv") if "train/loss" in r
    }
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert [s for s, v in rows.items() if not math.isfinite(v)] == [4, 5]  # a skipped step's own loss
    # the fused AdamW skipped both updates on the device: step 6 starts from step 3's weights
    before, after = watch.weights[4], watch.weights[6]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_persistent_nan_gradients_stop_with_step_lr_and_parameter(workspace):
    recipe = load_recipe(workspace(steps=10, save_every=1), ["train.nan_skip_limit=2"])
    with pytest.raises(TrainingError) as err:
        pretrain(recipe, fault_hook=nan_grad_from(3), extra_callbacks=[Grab()])
    msg = str(err.value)
    # steps 4, 5 and 6 had NaN gradients: the third in a row stops the run, at its report
    lr = recipe.optim.lr * lr_multiplier(recipe.optim, 10)(5)  # the scheduler's lr at step 6
    assert "3 steps in a row" in msg and "step 6:" in msg and f"lr={lr:.3g}" in msg
    assert f"first non-finite grad in {BAD_PARAM}" in msg
    assert "loss=" in msg and "grad norm=nan" in msg
    # the last checkpoint (step 5, before the third skip) is complete, finite, and holds the
    # weights of step 3: the skipped steps applied no update; nothing of step 6 was written
    run = recipe.run_dir
    assert_checkpoints_verify(run)
    point = resume_point(run)
    assert point.step == 5 and point.warnings == []
    ckpt = load_checkpoint_file(point.path)
    good = load_checkpoint_file(run / "checkpoints" / "step-00000003.ckpt")
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert all(torch.equal(v, good["state_dict"][k]) for k, v in ckpt["state_dict"].items())
    assert safetensors_step(run / "model.safetensors") == 5
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
    assert "resuming from step 5" in flat(capsys.readouterr().out)  # steps 3-5 skipped, 6 stopped it


def test_an_absurd_learning_rate_ends_in_a_training_error_not_garbage(workspace, capsys):
    recipe = workspace(steps=20, save_every=2)
    assert main(["pretrain", str(recipe), "optim.lr=1e30", "optim.warmup_steps=0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "training diverged" in err and "lower optim.lr" in err
    run = load_recipe(recipe).run_dir
    assert_checkpoints_verify(run)
    assert not (run / "summary.json").exists()  # the run did not claim to have finished


# -- loss spikes -----------------------------------------------------------------------------

SPIKE_AT = 14  # the forward of optimizer step 14 sees a loss 20x too high


def spike_hook(step: int, loss: torch.Tensor) -> torch.Tensor:
    return loss * 20.0 if step == SPIKE_AT - 1 else loss


class Watch(L.Callback):
    """Weights and lr at the start of the step after the spike (after the run callback acted)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] | None = None
        self.lr: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SPIKE_AT and self.weights is None:
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.lr = trainer.optimizers[0].param_groups[0]["lr"]


def _spiky_run(workspace, name: str, *overrides: str):
    recipe = load_recipe(workspace(name, steps=18, save_every=4), ["train.keep_checkpoints=5", *overrides])
    watch = Watch()
    result = pretrain(recipe, fault_hook=spike_hook, extra_callbacks=[watch])
    return recipe, result, watch


def test_a_loss_spike_is_logged_and_counted_but_not_acted_on_by_default(workspace, capsys):
    recipe, result, watch = _spiky_run(workspace, "spike")
    assert recipe.train.spike_rollback is False  # off by default
    spikes = [r for r in read_metrics(result.run_dir / "metrics.csv") if "train/spike" in r]
    assert [r["step"] for r in spikes] == [SPIKE_AT]
    assert spikes[0]["train/spike"] > 2 * spikes[0]["train/loss_mean"]
    assert result.summary["loss_spikes"] == 1 and result.summary["spike_rollbacks"] == 0
    assert result.summary["steps"] == 18
    ckpt12 = load_checkpoint_file(result.run_dir / "checkpoints" / "step-00000012.ckpt")
    assert not all(torch.equal(watch.weights[k], v) for k, v in ckpt12["state_dict"].items())


def test_spike_rollback_restores_the_last_checkpoint_and_lowers_the_lr(workspace):
    _, plain, plain_watch = _spiky_run(workspace, "plain")
    recipe, result, watch = _spiky_run(workspace, "rollback", "train.spike_rollback=true")
    assert result.summary["loss_spikes"] == 1 and result.summary["spike_rollbacks"] == 1
    # the step after the spike starts from exactly the weights of the last checkpoint (step 12)
    ckpt12 = load_checkpoint_file(result.run_dir / "checkpoints" / "step-00000012.ckpt")
    for k, v in ckpt12["state_dict"].items():
        assert torch.equal(watch.weights[k], v), k
    # ... with the learning rate the schedule gives there, halved (spike_lr_factor 0.5)
    assert watch.lr == pytest.approx(plain_watch.lr * 0.5, rel=1e-12)
    lr = {r["step"]: r["train/lr"] for r in read_metrics(result.run_dir / "metrics.csv") if "train/lr" in r}
    lr0 = {r["step"]: r["train/lr"] for r in read_metrics(plain.run_dir / "metrics.csv") if "train/lr" in r}
    assert all(lr[s] == pytest.approx(lr0[s]) for s in range(1, SPIKE_AT + 1))
    assert all(lr[s] == pytest.approx(lr0[s] * 0.5) for s in range(SPIKE_AT + 1, 19))
    assert math.isfinite(result.summary["final_train_loss"])
