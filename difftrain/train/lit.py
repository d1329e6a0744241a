"""The LightningModule: next-token loss, validation, and an explicit optimizer step.

Optimization is manual (`automatic_optimization = False`):

    for each micro-batch:   loss_m = CE(model(x_m), y_m);  backward(loss_m / accumulate)
    every `accumulate`:     ok = loss and ‖g‖ are finite   (on the device)
                            clip ‖g‖ to grad_clip, optimizer.step() unless not ok, scheduler.step()

Loss, ‖g‖, token count and `ok` stay on the device until `settle` reads them, so the host never
waits for a step. A step that is not ok applies no update (a fused torch optimizer skips it
through `found_inf`; any other gets a zero gradient) but still counts; more than
`nan_skip_limit` in a row raise a TrainingError. Over several processes, loss and token counts
are reduced each step, so every rank decides alike. `save_frozen=False` keeps only trainable
parameters in checkpoints (LoRA); `step_seed` reseeds the RNG per micro-batch (dropout on resume).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import lightning as L
import torch

from difftrain.errors import CheckpointError, TrainingError
from difftrain.model.loss import IGNORE_INDEX
from difftrain.recipe import OptimConfig
from difftrain.train.distributed import clean_name, full_params, is_fsdp
from difftrain.train.optim import build_optimizer, lr_multiplier

TOKEN_UNIT = 1024.0
"""A token-mean step's backward is of Σ loss / TOKEN_UNIT, rescaled once the step's tokens are
known: a constant (a resume computes alike) and a power of two (it divides exactly)."""

RESUME_STATE = {"micro_batches_seen": 0, "tokens_seen": 0, "skipped_steps": 0, "train_time": 0.0}
"""Counters a checkpoint keeps (`checkpoint["difftrain"]`), with their values at the start."""


class LitLM(L.LightningModule):
    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        *,
        total_steps: int,
        accumulate: int,
        grad_clip: float | None,
        nan_skip_limit: int = 3,
        compile: bool = False,
        tokens_per_micro_batch: int = 0,
        check_grads: bool = True,
        save_frozen: bool = True,
        step_seed: int | None = None,
        token_mean: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.optim_cfg = optim
        self.total_steps = total_steps
        self.accumulate = accumulate
        self.grad_clip = grad_clip
        self.nan_skip_limit = nan_skip_limit
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.check_grads = check_grads  # False under 16-mixed: the grad scaler handles inf/nan grads
        self.automatic_optimization = False
        self.save_frozen = save_frozen
        self.strict_loading = save_frozen
        self.step_seed = step_seed
        # the step's loss as the mean over every trained token of all its micro-batches and ranks
        # (SFT), not a mean of per-micro-batch means, which a resume's batch split would change
        self.token_mean = token_mean
        self._count_sum: float | torch.Tensor = 0.0  # trained tokens of the step's micro-batches here
        self._compile = compile
        # not a submodule (object.__setattr__): the checkpoint holds each tensor once, unprefixed
        object.__setattr__(self, "_forward", torch.compile(model) if compile else model)
        # dimensions of the parameters before any sharding (FSDP flattens them to 1-D shards)
        self._param_ndims = {n: p.ndim for n, p in model.named_parameters()}
        self._micro, self._loss_sum, self._tokens_pending = 0, 0.0, 0
        self._val_stats: torch.Tensor | None = None
        self._bad_steps = 0
        # steps whose figures are still on the device: (step, lr, grad names, figures)
        self._pending: list[tuple[int, float, list[str], torch.Tensor]] = []
        # micro_batches_seen (the data position for exact resume), tokens_seen, skipped_steps and
        # train_time (seconds spent in training steps: resumed runs add to it)
        self.__dict__.update(RESUME_STATE)
        self.stepped = False  # True right after an optimizer step, skipped or not (read by the run callback)
        self.last_loss = self.last_grad_norm = float("nan")
        self.last_lr = float("nan")  # the lr of the last optimizer step (the scheduler has moved on)
        self._t0: float | None = None
        self.fault_hook = None  # callable(step, loss) -> loss: the reliability tests' faults
        self.resume_path = None  # the checkpoint being resumed (named in load errors)

    def configure_model(self) -> None:
        """Under FSDP, make the Transformer the FSDP root (inside Lightning's wrapping context):
        with the LightningModule as root, the manual backward would run inside its forward."""
        from lightning.pytorch.strategies import FSDPStrategy

        if not isinstance(self.trainer.strategy, FSDPStrategy) or is_fsdp(self.model):
            return
        from torch.distributed.fsdp.wrap import wrap

        self.model = wrap(self.model)
        object.__setattr__(self, "_forward", torch.compile(self.model) if self._compile else self.model)

    def _world(self) -> int:
        return self._trainer.world_size if self._trainer is not None else 1

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place); a no-op in a single process."""
        if self._world() > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        return t

    def configure_optimizers(self):
        device_type = self.device.type if isinstance(self.device, torch.device) else "cpu"
        opt = build_optimizer(self.model, self.optim_cfg, device_type, ndims=self._param_ndims)
        for g in opt.param_groups:
            g["initial_lr"] = self.optim_cfg.lr
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(self.optim_cfg, self.total_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        # the next step's lr from this run's schedule (a resume that changed train.max_steps
        # restored the saved schedule's lr)
        sched, opt = self.lr_schedulers(), self.optimizers()
        for g, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            g["lr"] = base * fn(sched.last_epoch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self.stepped = False
        opt = self.optimizers()
        if self.step_seed is not None:
            seq = (self.step_seed * 1_000_003 + self.micro_batches_seen) * 65_537 + self.global_rank
            torch.manual_seed(seq % 2**63)
        out = self._forward(batch["input_ids"], batch["targets"], return_logits=False)
        loss = out.loss
        if self.fault_hook is not None:
            loss = self.fault_hook(self.global_step, loss)
        if self.token_mean:  # rescaled by `_to_token_mean` once the step's tokens are known
            n = (batch["targets"] != IGNORE_INDEX).sum()
            part = loss * n
            backward_loss = part / TOKEN_UNIT
            self._count_sum = self._count_sum + n.float()  # (a tensor: no device sync per micro-batch)
        else:
            part, backward_loss = loss, loss / self.accumulate
        # DDP: only the last micro-batch's backward averages the gradients over ranks
        last = self._micro + 1 == self.accumulate
        block_sync = getattr(self.trainer.strategy, "block_backward_sync", None)
        with nullcontext() if last or block_sync is None else block_sync():
            self.manual_backward(backward_loss)
        self._loss_sum += part.detach().float()
        self._micro += 1
        self.micro_batches_seen += 1
        self._tokens_pending += self.tokens_per_micro_batch or batch["input_ids"].numel()
        if self._micro < self.accumulate:
            return
        self._micro = 0
        # loss and tokens of this step over all ranks: every rank sees the same figures
        sums = (self._loss_sum, float(self._tokens_pending), self._count_sum)
        stats = self._all_reduce(
            torch.stack([torch.as_tensor(x, dtype=torch.float32, device=self.device) for x in sums])
        )
        if self.token_mean:
            trained = stats[2]
            loss_mean = torch.where(trained > 0, stats[0] / trained.clamp(min=1.0), 0.0)
            self._to_token_mean(trained)
        else:
            loss_mean = stats[0] / (self.accumulate * self._world())
        self._loss_sum, self._tokens_pending, self._count_sum = 0.0, 0, 0.0
        named = [(clean_name(n), p) for n, p in self.model.named_parameters() if p.grad is not None]
        names, params = [n for n, _ in named], [p for _, p in named]
        grads = [p.grad for p in params]
        if self.check_grads:
            grad_norm, bad = self._grad_norm(grads)
        else:  # 16-mixed: the grad scaler skips steps with inf/nan gradients itself
            grad_norm, bad = torch.zeros((), device=self.device), torch.full((), -1.0, device=self.device)
        ok = torch.isfinite(loss_mean) & torch.isfinite(grad_norm)
        if self.grad_clip is not None:
            if self.check_grads:  # reuse the norm computed above (of all shards under FSDP)
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, grad_norm)
            else:
                self.clip_gradients(opt, gradient_clip_val=self.grad_clip, gradient_clip_algorithm="norm")
        inner = getattr(opt, "optimizer", opt)
        held = self.check_grads and getattr(inner, "_step_supports_amp_scaling", False)
        if held:  # a fused torch optimizer skips the update on the device when found_inf is 1
            inner.found_inf = (~ok).float()
        elif self.check_grads:
            for g in grads:  # (a 0-dim mask on the device: no sync)
                g.masked_fill_(~ok, 0.0)
        self.last_lr = opt.param_groups[0]["lr"]
        opt.step()
        if held:
            del inner.found_inf
        opt.zero_grad(set_to_none=True)
        self.lr_schedulers().step()
        now = time.perf_counter()
        self.train_time += now - self._t0
        self._t0 = now
        self.stepped = True
        figures = torch.stack([loss_mean.float(), grad_norm.float(), stats[1], bad.float(), ok.float()])
        self._pending.append((self.global_step, self.last_lr, names, figures.detach()))

    def settle(self) -> list[tuple[int, float]]:
        """Read the figures of the steps taken since the last call from the device (one copy) and
        return their (step, loss); updates last_loss, last_grad_norm, tokens_seen, skipped_steps.
        TrainingError once more than `nan_skip_limit` steps in a row were skipped."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        rows = torch.stack([f for *_, f in pending]).tolist()  # the one host sync
        out = []
        for (step, lr, names, _), (loss, norm, tokens, bad, ok) in zip(pending, rows, strict=True):
            self.tokens_seen += int(tokens)
            self.last_loss, self.last_grad_norm = loss, norm
            out.append((step, loss))
            if ok:
                self._bad_steps = 0
                continue
            self._bad_steps += 1
            self.skipped_steps += 1
            what = f"loss={loss:.4g}, grad norm={norm:.4g}"
            if 0 <= bad < len(names):
                what += f", first non-finite grad in {names[int(bad)]}"
            self.last_skip = f"step {step}: {what}, lr={lr:.3g}"
            if self._bad_steps > self.nan_skip_limit:
                raise TrainingError(
                    f"training diverged: {self._bad_steps} steps in a row had a non-finite loss or gradient "
                    f"(last at {self.last_skip}); the last good checkpoint is kept — lower optim.lr, raise "
                    "optim.warmup_steps, or set train.grad_clip, then resume with --resume"
                )
        return out

    def _to_token_mean(self, trained: torch.Tensor) -> None:
        """Scale the step's gradient (of Σ loss / TOKEN_UNIT, averaged over ranks) to that of the
        mean over its `trained` tokens; a step that trained none keeps its (zero) gradient."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            scale = torch.where(trained > 0, self._world() * TOKEN_UNIT / trained.clamp(min=1.0), 1.0)
            torch._foreach_mul_(grads, scale)  # one fused pass, the scale a tensor: no sync

    def _grad_norm(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """‖g‖₂ over all parameters (under FSDP, √(Σ over ranks of each shard's Σg²)) and the
        index in `grads` of the first non-finite one (-1: none, or not known under FSDP), both
        on the device."""
        none = torch.full((), -1.0, device=self.device)
        if not grads:
            return torch.zeros((), device=self.device), none
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        if is_fsdp(self.model):
            return self._all_reduce(norms.square().sum()).sqrt(), none
        total = torch.linalg.vector_norm(norms)
        first = (~torch.isfinite(norms)).int().argmax().float()
        return total, torch.where(torch.isfinite(total), none, first)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self._forward(batch["input_ids"], batch["targets"], return_logits=False)
        # weighed by the batch's trained tokens: the mean over every token of the split
        n = (batch["targets"] != IGNORE_INDEX).sum().float()
        if self._val_stats is None:
            self._val_stats = torch.zeros(2, device=self.device)
        self._val_stats += torch.stack([out.loss.detach().float() * n, n])

    def on_validation_epoch_end(self) -> None:
        """val/loss = Σ loss·n / Σ n over the batches of every rank (n: trained tokens per batch)."""
        stats = self._val_stats if self._val_stats is not None else torch.zeros(2, device=self.device)
        stats = self._all_reduce(stats)
        self._val_stats = None
        if stats[1] > 0:
            self.log("val/loss", stats[0] / stats[1], on_epoch=True, logger=False, sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.settle()  # the step counts below include every step taken
        if not self.save_frozen:
            keep = self._trainable_keys()
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["difftrain"] = {k: getattr(self, k) for k in RESUME_STATE}

    def _trainable_keys(self) -> set[str]:
        return {clean_name(n) for n, p in self.named_parameters() if p.requires_grad}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if not self.save_frozen:
            missing = sorted(self._trainable_keys() - set(checkpoint.get("state_dict", {})))
            if missing:
                raise CheckpointError(
                    f"the checkpoint lacks {len(missing)} trained tensors (e.g. {missing[0]}): it was written "
                    "by a different fine-tune; start again with --overwrite"
                )
        if not is_fsdp(self.model):
            # a checkpoint copied from another run: name the tensor, not a wall of size mismatches
            own = self.state_dict()
            wrong = [
                (k, tuple(v.shape), tuple(own[k].shape))
                for k, v in checkpoint.get("state_dict", {}).items()
                if k in own and hasattr(v, "shape") and tuple(v.shape) != tuple(own[k].shape)
            ]
            if wrong:
                k, got, want = wrong[0]
                raise CheckpointError(
                    f"{self.resume_path or 'the checkpoint'} holds a different model: {k} has shape {got} "
                    f"but this run's config implies {want} ({len(wrong)} tensors differ); it was copied "
                    "from another run — remove it and resume again, or start again with --overwrite"
                )
        self._count_micro_batches_in_steps(checkpoint)
        state = checkpoint.get("difftrain", {})
        for k, default in RESUME_STATE.items():
            setattr(self, k, type(default)(state.get(k, default)))

    def _count_micro_batches_in_steps(self, checkpoint: dict) -> None:
        """Restate the loops' saved micro-batch count as global_step × this run's accumulation:
        Lightning validates every val_every × accumulate micro-batches, so a resume that splits
        the global batch differently would otherwise validate off the val_every steps."""
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = loop.get("epoch_loop.batch_progress")
        if not isinstance(progress, dict) or not isinstance(progress.get("total"), dict):
            return
        want = int(checkpoint.get("global_step", 0)) * self.accumulate
        shift = want - int(progress["total"].get("ready", want))
        for part in ("total", "current"):
            counts = progress.get(part)
            if isinstance(counts, dict):
                for key in ("ready", "started", "processed", "completed"):
                    if isinstance(counts.get(key), int):
                        counts[key] = max(0, counts[key] + shift)

    def lambda_values(self) -> dict[str, float]:
        """λ of every `diff` layer (the scalar the paper's Figure plots), for logging."""
        out = {}
        for i, layer in enumerate(getattr(self.model.model, "layers", [])):
            if hasattr(layer.self_attn, "lam"):
                with full_params(layer):
                    out[f"lambda/layer{i}"] = float(layer.self_attn.lam().detach())
        return out
