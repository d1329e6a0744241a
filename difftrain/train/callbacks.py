"""`RunCallback`: saving, graceful stops, progress, metrics, throughput/MFU and loss spikes.

It saves and draws progress itself instead of through Lightning's ModelCheckpoint and progress
bar: each save (every `save_every` steps and at the end) writes the checkpoint and then the
inference weights of the same step atomically and records them; a SIGINT/SIGTERM finishes the
step and saves before the process ends (`StopRequested`: the CLI exits 130 / 143; a second signal
exits at once); and the progress degrades to a plain line per log step without a terminal.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from difftrain.errors import CheckpointError, StopRequested
from difftrain.io import fsync_dir
from difftrain.rundir import save_weights
from difftrain.train import checkpoint
from difftrain.train.distributed import compute_dtype, gather_full_weights, is_fsdp


def peak_flops(device: torch.device, precision: str = "bf16-mixed") -> float | None:
    """Peak dense FLOP/s of a CUDA `device` in the compute dtype of `precision`, for MFU, from
    Lightning's table; None off CUDA, and for a GPU it does not know (it warns once)."""
    if device.type != "cuda":
        return None
    flops = get_available_flops(device, compute_dtype(precision))
    return float(flops) if flops else None


def flops_per_token(n_params_no_embedding: int, n_layers: int, d_attn: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (matmuls, fwd + bwd) + 12·L·d_attn·T (attention scores and
    values); `diff` counts as `baseline` (QKᵀ over H heads of width d, AV over H/2 of width 2d)."""
    return 6 * n_params_no_embedding + 12 * n_layers * d_attn * seq_len


@dataclass
class RunState:
    """Figures gathered while training, for the summary."""

    peak_rss_mb: float = 0.0
    best_val: float = math.inf
    last_val: float = math.nan
    last_val_step: int = -1  # the global step `last_val` was measured at
    # the step of the newest complete checkpoint: saved by this process or resumed from (none: -1)
    saved_step: int = -1


def save_inference_weights(
    run_dir: Path,
    model: torch.nn.Module,
    step: int,
    export: Callable[[Path, torch.nn.Module, int], None] | None,
) -> None:
    """The weights of step `step` that generate, eval and export load: model.safetensors, or what
    `export` writes instead (a LoRA fine-tune: its adapter files)."""
    if export is not None:
        export(run_dir, model, step)
    else:
        save_weights(run_dir / "model.safetensors", model, {"step": str(step)})


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _duration(seconds: float) -> str:
    """3725.0 → '1h02m', 125.0 → '2m05s', 9.4 → '9s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


@dataclass
class CallbackSettings:
    """What `RunCallback` does: save every `save_every` steps keeping `keep` checkpoints, log every
    `log_every`, validate every `val_every` (0: never), MFU from `flops_per_token`, the progress
    bar on `console`, the `resume_command` a stop prints, `export` for the inference weights (see
    `save_inference_weights`), and the loss-spike guard (see `RunCallback._check_spike`)."""

    save_every: int
    keep: int
    log_every: int
    tokens_per_step: int
    flops_per_token: float
    progress: bool = True
    console: Any = None
    resume_command: str = ""
    export: Callable[[Path, torch.nn.Module, int], None] | None = None
    spike_factor: float | None = None
    spike_rollback: bool = False
    spike_lr_factor: float = 0.5
    warmup_steps: int = 0
    val_every: int = 0


_VAL_STATE = ("best_val", "last_val", "last_val_step")
_SPIKE_STATE = {"loss_ema": None, "ema_updates": 0, "spikes": 0, "rollbacks": 0}
"""The loss-spike guard's state (saved in checkpoints, so a resumed run decides alike)."""


class RunCallback(L.Callback):
    def __init__(self, run_dir: Path, settings: CallbackSettings) -> None:
        self.cfg = settings
        self.flops_per_token = settings.flops_per_token
        self.console = settings.console
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.state = RunState()
        self.__dict__.update(_SPIKE_STATE)  # loss_ema, ema_updates, spikes, rollbacks
        self._stop_signal: int | None = None
        self._speaks = True  # rank 0 (of several processes: the others print nothing)
        self._old_handlers: dict[int, Any] = {}
        self._progress: Any = None
        self._task = None
        self._window_t = time.perf_counter()
        self._window_step = self._window_tokens = self._start_step = 0
        self.tokens_per_s = 0.0
        self.steady_tokens_per_s: float | None = None  # the last window's rate, compilation excluded
        self.peak_flops: float | None = None
        self._sec_per_step: float | None = None
        self._lines = False
        self._logged_step = 0  # the newest step with a train row (a resume: the step it starts from)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None:  # second signal: leave now (all writes are atomic)
            saved = self.state.saved_step
            where = (
                f"resume from its last checkpoint (step {saved})" if saved > 0 else "it has no checkpoint yet"
            )
            how = f" with: {self.cfg.resume_command}" if saved > 0 and self.cfg.resume_command else ""
            with contextlib.suppress(OSError):  # os.write: safe in a signal handler, unlike print
                os.write(2, f"\nquit at once ({signal.Signals(signum).name} again): {where}{how}\n".encode())
            os._exit(128 + signum)
        self._stop_signal = signum
        self._say(
            f"[yellow]received {signal.Signals(signum).name}: finishing this step and saving… "
            "(press Ctrl-C again to quit at once)[/]"
        )

    def _say(self, text: str) -> None:  # on the console of rank 0
        if self.console is not None and self._speaks:
            self.console.print(text)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def _agree_on_stop(self, trainer: L.Trainer) -> None:
        """Of several processes, all stop at the same step when any of them got a signal (which
        may reach one process alone, or each at a different step): one all-reduce of the signal
        number, at the same points on every process."""
        if trainer.world_size <= 1:
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return
        flag = torch.tensor([self._stop_signal or 0], device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if self._stop_signal is None and int(flag.item()):
            self._stop_signal = int(flag.item())
            self._say(
                f"[yellow]{signal.Signals(self._stop_signal).name} reached another process of this run: "
                "finishing this step and saving…[/]"
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._speaks = trainer.is_global_zero
        self._install_signals()
        self._window_t = time.perf_counter()
        self._window_step = self._start_step = self._logged_step = trainer.global_step
        self._window_tokens = pl_module.tokens_seen
        self.state.saved_step = trainer.global_step if trainer.global_step > 0 else -1
        self.peak_flops = peak_flops(pl_module.device, str(trainer.precision))
        self._sec_per_step = None
        # a live bar on a terminal; elsewhere (or with the bar off) a plain line per log step
        bar = self.cfg.progress and (self.console is None or self.console.is_terminal)
        self._lines = self.console is not None and trainer.is_global_zero and not bar
        if bar and trainer.is_global_zero:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
                refresh_per_second=4,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=trainer.max_steps, completed=trainer.global_step, info="starting…"
            )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not getattr(pl_module, "stepped", False):  # a micro-batch before the step's last
            return
        self._agree_on_stop(trainer)
        step = trainer.global_step
        # step 1, every log_every-th, the last and the one a signal stops at: the curve in
        # metrics.csv always reaches the loss the summary reports
        logs = (
            step % self.cfg.log_every == 0
            or step == 1
            or 0 < trainer.max_steps <= step
            or self._stop_signal is not None
        )
        # the step's figures stay on the device until a step that logs, saves or validates (a
        # rollback acts on the step's own loss: every step)
        c = self.cfg
        if logs or c.spike_rollback or self.validates(trainer, pl_module) or step % c.save_every == 0:
            for s, loss in pl_module.settle():
                self._check_spike(trainer, pl_module, s, loss)
            if logs:
                self._log_step(trainer, pl_module, step)
            self._show(trainer, pl_module)
        elif self._progress is not None:
            self._progress.update(self._task, completed=step)
        if not self.validates(trainer, pl_module):  # else after the validation (on_validation_end)
            self._save_or_stop(trainer, pl_module)

    def validates(self, trainer: L.Trainer, pl_module: Any) -> bool:
        """Whether the optimizer step just taken is followed by a validation."""
        return (
            self.cfg.val_every > 0
            and getattr(pl_module, "stepped", False)
            and trainer.global_step % self.cfg.val_every == 0
        )

    def _save_or_stop(self, trainer: L.Trainer, pl_module: Any) -> None:
        """The checkpoint of a save_every step, and the stop a signal asked for: after the step's
        validation where it has one, so that the checkpoint's metrics include it."""
        step = trainer.global_step
        if step % self.cfg.save_every == 0 and step < trainer.max_steps:
            self.save(trainer, pl_module)
        if self._stop_signal is not None:
            self._stop(trainer, pl_module)

    def _figures(self, trainer: L.Trainer, pl_module: Any) -> list[str]:
        """The last step's loss, throughput (once a log step measured one) and lr."""
        rate = [f"{self.tokens_per_s:,.0f} tok/s"] if self.tokens_per_s else []
        return [f"loss {pl_module.last_loss:.4f}", *rate, f"lr {_step_lr(trainer, pl_module):.2e}"]

    def _show(self, trainer: L.Trainer, pl_module: Any) -> None:
        """The progress bar at the current step, with the newest val loss and its step."""
        if self._progress is None:
            return
        parts, val = self._figures(trainer, pl_module), self.state.last_val
        if math.isfinite(val):
            parts.append(f"val {val:.4f} (step {self.state.last_val_step})")
        self._progress.update(self._task, completed=trainer.global_step, info=" · ".join(parts))

    def _line(self, trainer: L.Trainer, pl_module: Any, step: int, val: float | None = None) -> None:
        """The plain log line of a step (or of a validation), printed where no bar is shown."""
        if not self._lines:
            return
        head = f"step {step}/{trainer.max_steps}"
        if val is not None:
            self.console.print(f"{head} · val {val:.4f}", highlight=False, soft_wrap=True)
            return
        parts = [head, *self._figures(trainer, pl_module)]
        if self._sec_per_step:
            parts.append(f"eta {_duration(self._sec_per_step * (trainer.max_steps - step))}")
        self.console.print(" · ".join(parts), highlight=False, soft_wrap=True)

    def state_dict(self) -> dict[str, Any]:
        """The loss-spike state, and the validations so far (a resumed run's summary counts them)."""
        return {
            **{k: getattr(self, k) for k in _SPIKE_STATE},
            **{k: getattr(self.state, k) for k in _VAL_STATE},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fresh = RunState()
        for k, default in _SPIKE_STATE.items():
            setattr(self, k, state.get(k, default))
        for k in _VAL_STATE:
            setattr(self.state, k, state.get(k, getattr(fresh, k)))

    def _check_spike(self, trainer: L.Trainer, pl_module: Any, step: int, loss: float) -> None:
        """A spike: loss > spike_factor · m, with m ← 0.9·m + 0.1·loss over the non-spike steps
        after `warmup_steps`, checked once m has seen 10 steps. Logged; optionally rolled back."""
        c = self.cfg
        if c.spike_factor is None or not math.isfinite(loss):
            return
        ema = self.loss_ema
        if ema is not None and self.ema_updates >= 10 and loss > c.spike_factor * ema:
            self.spikes += 1
            for logger in trainer.loggers:
                logger.log_metrics({"train/spike": loss, "train/loss_mean": ema}, step=step)
            note = self._rollback(trainer, pl_module) if c.spike_rollback else ""
            self._say(
                f"[yellow]loss spike at step {step}: {loss:.4f} vs a running mean of {ema:.4f}[/]{note}"
            )
            return
        if step > c.warmup_steps:
            self.loss_ema = loss if ema is None else 0.9 * ema + 0.1 * loss
            self.ema_updates += 1

    def _rollback(self, trainer: L.Trainer, pl_module: Any) -> str:
        """Restore weights and optimizer state of the newest good checkpoint; scale the lr."""
        if is_fsdp(pl_module.model):
            return " (no rollback under FSDP: its optimizer state is sharded)"
        try:
            point = checkpoint.find_resume_checkpoint(self.ckpt_dir)
            ckpt = checkpoint.load_checkpoint_file(point.path) if point is not None else None
        except CheckpointError as e:
            return f" (no rollback: {e})"
        if ckpt is None:
            return " (no checkpoint yet to roll back to)"
        opt, sched = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
        factor = self.cfg.spike_lr_factor
        next_lrs = [g["lr"] * factor for g in opt.param_groups]
        pl_module.load_state_dict(ckpt["state_dict"], strict=pl_module.strict_loading)
        opt.load_state_dict(ckpt["optimizer_states"][0])
        for g, lr in zip(opt.param_groups, next_lrs, strict=True):
            g["lr"] = lr  # the next step's lr, scaled (load_state_dict restored the old one)
        sched.base_lrs = [b * factor for b in sched.base_lrs]  # and every later one
        self.rollbacks += 1
        return f"; rolled back to the weights of step {point.step}, learning rate × {factor:g} from here on"

    def _log_step(self, trainer: L.Trainer, pl_module: Any, step: int) -> None:
        """The train row of optimizer step `step` in the metrics, and its plain log line."""
        for s, loss in pl_module.settle():  # (none left when the step's report settled them)
            self._check_spike(trainer, pl_module, s, loss)
        self._log(trainer, pl_module, step)
        self._line(trainer, pl_module, step)
        self._logged_step = step

    def _log(self, trainer: L.Trainer, pl_module: Any, step: int) -> None:
        now = time.perf_counter()
        steps = step - self._window_step
        if steps > 0 and now > self._window_t:
            # tokens seen on all ranks (SFT batches vary in length)
            seen = pl_module.tokens_seen - self._window_tokens
            self.tokens_per_s = seen / (now - self._window_t)
            # the first window of a compiled run holds the compilation: no ETA nor steady rate
            compiling = getattr(pl_module, "_compile", False) and self._window_step == self._start_step
            self._sec_per_step = None if compiling else (now - self._window_t) / steps
            if not compiling:
                self.steady_tokens_per_s = self.tokens_per_s
        self._window_t, self._window_step, self._window_tokens = now, step, pl_module.tokens_seen
        metrics = {
            "train/loss": pl_module.last_loss,
            "train/lr": _step_lr(trainer, pl_module),
            "train/grad_norm": pl_module.last_grad_norm,
            "train/tokens": float(pl_module.tokens_seen),
            "train/tokens_per_s": self.tokens_per_s,
            "train/time_s": pl_module.train_time,
        }
        if self.peak_flops:
            metrics["train/mfu"] = self.tokens_per_s * self.flops_per_token / self.peak_flops
        metrics.update(pl_module.lambda_values())
        self.state.peak_rss_mb = max(self.state.peak_rss_mb, peak_rss_mb())
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        val = trainer.callback_metrics.get("val/loss")
        if val is not None:
            v = self.state.last_val = float(val)
            self.state.last_val_step = trainer.global_step
            self.state.best_val = min(self.state.best_val, v)
            metrics = {
                "val/loss": v,
                "val/ppl": math.exp(min(v, 50.0)),
                "train/tokens": float(pl_module.tokens_seen),
            }
            for logger in trainer.loggers:
                logger.log_metrics(
                    {**metrics, "train/time_s": pl_module.train_time}, step=trainer.global_step
                )
            self._show(trainer, pl_module)  # validation runs after the step's update of the bar
            if trainer.global_step > 0:  # not Lightning's sanity check
                self._line(trainer, pl_module, trainer.global_step, val=v)
        if trainer.state.fn == "fit" and self.validates(trainer, pl_module):
            self._agree_on_stop(trainer)  # (a signal during the step's validation: once more)
            self._save_or_stop(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.settle()
        if self.state.saved_step != trainer.global_step and trainer.global_step > 0:
            self.save(trainer, pl_module)
        self._finish()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._finish()

    def _finish(self) -> None:
        self.state.peak_rss_mb = max(self.state.peak_rss_mb, peak_rss_mb())
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._restore_signals()

    def save(self, trainer: L.Trainer, pl_module: Any) -> None:
        step = trainer.global_step
        path = self.ckpt_dir / checkpoint.step_file(step)
        if trainer.is_global_zero:
            # metrics first: a kill between the two leaves extra rows (a resume drops them), never
            # a checkpoint whose rows are lost
            for logger in trainer.loggers:
                logger.save()
        fsdp = is_fsdp(pl_module.model)  # may write a folder of shards: into a temporary name first
        target = self.ckpt_dir / f".{path.name}.partial" if fsdp else path
        if fsdp:
            if trainer.is_global_zero:
                for stale in self.ckpt_dir.glob(".*.partial"):  # left by a kill while saving
                    checkpoint.remove_checkpoint_path(stale)
            trainer.strategy.barrier()
        trainer.save_checkpoint(target)
        full = gather_full_weights(pl_module.model)  # FSDP: every rank sends its shards to rank 0
        if trainer.is_global_zero:
            if fsdp:
                checkpoint.remove_checkpoint_path(path)
                os.replace(target, path)
                fsync_dir(self.ckpt_dir)
            checkpoint.record_checkpoint(self.ckpt_dir, path, step, self.cfg.keep)
            if full is not None and self.cfg.export is None:
                if pl_module.model.config.tie_embeddings:
                    full.pop("lm_head.weight", None)  # saved once, as the embedding
                save_weights(self.run_dir / "model.safetensors", full, {"step": str(step)})
            else:
                save_inference_weights(self.run_dir, pl_module.model, step, self.cfg.export)
        trainer.strategy.barrier()
        self.state.saved_step = step

    def _stop(self, trainer: L.Trainer, pl_module: Any) -> None:
        signum = self._stop_signal or signal.SIGINT
        step = trainer.global_step
        # a signal after the step's own row still ends the curve at the step the run stops at
        logged = step > self._logged_step
        if logged:
            self._log_step(trainer, pl_module, step)
        if self.state.saved_step != step:
            self.save(trainer, pl_module)  # writes the metrics first
        elif logged and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
        self._finish()
        raise StopRequested(signum, trainer.global_step, trainer.is_global_zero)


def _step_lr(trainer: L.Trainer, pl_module: Any) -> float:
    """The learning rate the last step used: logged with that step's loss (the optimizer's own
    is already the next step's, after the scheduler moved)."""
    lr = getattr(pl_module, "last_lr", math.nan)
    return lr if math.isfinite(lr) else trainer.optimizers[0].param_groups[0]["lr"]
