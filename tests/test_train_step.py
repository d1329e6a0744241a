"""The training step as the GPU runs it: no host sync outside the steps that report, validation
through the compiled module, and one activation-checkpointing mechanism under FSDP."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch

from difftrain.recipe import OptimConfig, load_recipe
from difftrain.train.lit import LitLM
from difftrain.train.run import pretrain

WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()


def tiny_recipe(tmp_path: Path, steps: int, extra: str = "") -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(24):
        lines = [
            f"def {WORDS[int(a)]}_{i}_{j}({WORDS[int(b)]}):\n    return {j}\n"
            for j, (a, b) in enumerate(torch.randint(len(WORDS), (30, 2), generator=g).tolist())
        ]
        (corpus / f"d{i:02d}.py").write_text("".join(lines))
    p = tmp_path / "r.yaml"
    p.write_text(
        f"""name: r
seed: 7
out_dir: {tmp_path / "runs"}
model: {{arch: diff, d_model: 32, n_layers: 2, n_heads: 4, max_seq_len: 32}}
data: {{sources: [{corpus}], val_fraction: 0.1, val_windows: 4, cache_dir: {tmp_path / "cache"}}}
tokenizer: {{train: {{vocab_size: 320}}}}
train: {{max_steps: {steps}, micro_batch_size: 2, global_batch_size: 4, log_every: 4, val_every: 100,
         save_every: 100{extra}}}
optim: {{lr: 3.0e-3, warmup_steps: 2}}
logging: {{progress: false, tensorboard: false}}
"""
    )
    return p


class SyncsPerStep(L.Callback):
    """Counts the reads of a tensor's value on the host (`.item()`, `.tolist()`, `bool()`,
    `float()`, `int()`: each one waits for the device) per optimizer step, from the start of its
    first micro-batch to the start of the next step (the run callback's work included)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = 0
        self.counts: Counter[int] = Counter()
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(real))

    def _counted(self, real):
        def read(t, *a, **kw):
            if self.step:
                self.counts[self.step] += 1
            return real(t, *a, **kw)

        return read

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step + 1

    def on_train_end(self, trainer, pl_module):
        self.step = 0


def test_a_step_reads_nothing_from_the_device_unless_it_reports(tmp_path, monkeypatch):
    syncs = SyncsPerStep(monkeypatch)
    result = pretrain(load_recipe(tiny_recipe(tmp_path, steps=8)), extra_callbacks=[syncs])
    assert result.summary["steps"] == 8 and result.summary["final_train_loss"] is not None
    reporting = {1, 4, 8}  # step 1, every log_every (4), the last
    quiet = {s: n for s, n in syncs.counts.items() if s not in reporting}
    assert quiet == {}, f"host reads of device values on steps that report nothing: {quiet}"
    assert all(syncs.counts[s] > 0 for s in reporting)  # (the counter sees the reports' reads)


def test_a_skipped_step_is_settled_at_the_next_report_with_its_own_step_and_loss(tmp_path):
    def hook(step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step == 5 else loss  # the forward of step 6

    result = pretrain(load_recipe(tiny_recipe(tmp_path, steps=8)), fault_hook=hook)
    assert result.summary["skipped_steps"] == 1 and result.summary["steps"] == 8


def test_validation_runs_through_the_compiled_module():
    from difftrain.model import ModelConfig, Transformer

    model = Transformer(
        ModelConfig(arch="diff", vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)
    )
    lit = LitLM(model, OptimConfig(), total_steps=1, accumulate=1, grad_clip=None, compile=True)
    assert isinstance(lit._forward, torch._dynamo.eval_frame.OptimizedModule)
    assert lit._forward._orig_mod is model
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return model(*args, **kwargs)

    object.__setattr__(lit, "_forward", spy)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        lit.validation_step({"input_ids": ids, "targets": ids}, 0)
    assert calls == [ids.shape]
    assert lit._val_stats is not None and lit._val_stats[1] == ids.numel()


def test_fsdp_checkpoints_activations_once_with_the_models_own_mechanism(tmp_path, monkeypatch):
    import lightning.pytorch.strategies as strategies

    from difftrain.train.distributed import build_strategy

    seen = {}

    class Recorder:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(strategies, "FSDPStrategy", Recorder)
    recipe = load_recipe(
        tiny_recipe(tmp_path, steps=1), ["train.strategy=fsdp", "train.activation_checkpointing=true"]
    )
    assert isinstance(build_strategy(recipe, world_size=2), Recorder)
    assert seen["auto_wrap_policy"] and seen.get("activation_checkpointing_policy") is None


class GradNormAtStep(L.Callback):
    """‖g‖ as the optimizer receives it (after clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


def test_gradients_reach_the_optimizer_clipped_to_grad_clip(tmp_path):
    seen = GradNormAtStep()
    recipe = load_recipe(tiny_recipe(tmp_path, steps=3), ["train.grad_clip=0.01"])
    pretrain(recipe, extra_callbacks=[seen])
    assert len(seen.norms) == 3 and all(0 < n <= 0.01 * (1 + 1e-4) for n in seen.norms), seen.norms


def test_mfu_peak_comes_from_lightnings_table_which_tells_card_variants_apart(monkeypatch):
    """An H100 PCIe is not an SXM (756 vs 989 dense bf16 TFLOP/s) and an L4 is not an L40 (121 vs
    181)."""
    from difftrain.train.callbacks import peak_flops

    cuda = torch.device("cuda")
    names = iter(["NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA L4"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert [peak_flops(cuda) for _ in range(3)] == [756e12, 989.4e12, 121e12]
    assert peak_flops(torch.device("cpu")) is None
