"""The sections of benchmarks/gpu_check.py, one per process:

    python benchmarks/gpu_sections.py SECTION OUT.json SECONDS CONTEXT_JSON

Each writes OUT.json after every check and figure (so a section stopped at its timeout leaves what
it finished) and plans its own work to end within SECONDS. Under the dry run (CONTEXT's dry_run)
every section runs on the CPU at tiny sizes, and the GPU-scale targets are recorded, not judged.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


class Section:
    """The record of one section: checks and figures, rewritten to OUT.json as each one lands."""

    def __init__(self, name: str, out: Path, seconds: float, ctx: dict) -> None:
        self.out, self.t0, self.seconds = out, time.monotonic(), seconds
        self.dry = bool(ctx["dry_run"])
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.work = Path(ctx["work"]) / name  # removed by gpu_check.py at its exit
        self.work.mkdir(parents=True, exist_ok=True)
        self.data: dict = {
            "section": name,
            "status": "running",
            "ok": False,
            "device": ctx["device"]["name"] if not self.dry else f"cpu ({platform.machine()}, dry run)",
            "date": ctx["date"],
            "command": ctx["command"],
            "torch": torch.__version__,
            "checks": {},
            "figures": {},
        }
        self.write()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def write(self) -> None:
        tmp = self.out.with_name(f".{self.out.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.out)

    def check(self, name: str, ok: bool, detail: str, judged: bool = True) -> None:
        """A pass/fail; one not judged (a GPU-scale target in the dry run) is recorded only."""
        self.data["checks"][name] = {
            "ok": bool(ok),
            "detail": detail,
            **({} if judged else {"judged": False}),
        }
        mark = ("ok  " if ok else "FAIL") if judged else "info"
        print(f"  {mark} {name}: {detail}", flush=True)
        self.write()

    def figure(self, name: str, value: object, unit: str = "", target: str = "") -> None:
        self.data["figures"][name] = {"value": value, "unit": unit, **({"target": target} if target else {})}
        print(f"  .... {name}: {value} {unit}", flush=True)
        self.write()

    def skip(self, reason: str) -> None:
        self.data.update(status="skipped", ok=True, skipped=reason)
        print(f"  skipped: {reason}", flush=True)
        self.write()

    def finish(self) -> None:
        if self.data["status"] == "skipped":
            return
        judged = [c["ok"] for c in self.data["checks"].values() if c.get("judged", True)]
        self.data["ok"] = all(judged)
        self.data["status"] = "ok" if self.data["ok"] else "failed"
        self.write()

    def fail(self, e: BaseException) -> None:
        self.data.update(status="error", ok=False, error=f"{type(e).__name__}: {e}")
        self.data["traceback"] = traceback.format_exc()[-4000:]
        print(self.data["traceback"], file=sys.stderr, flush=True)
        self.write()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp32."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def timed(fn: Callable[[], object], dev: torch.device, reps: int, warmup: int = 2) -> float:
    """Milliseconds per call of `fn` after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) * 1e3 / reps


# ---- kernels -------------------------------------------------------------------------------
def kernels(sec: Section) -> None:
    """Each arch's attention cores against eager through the whole model: logits and every
    gradient, fp32 and bf16 (autocast, as bf16-mixed trains), MHA and GQA; flex also under
    torch.compile of the model.

    Everything is compared with eager in fp32. In fp32 a core must agree to 2e-3 (relative, per
    tensor); in bf16 it must be as close as eager is in bf16 (within twice eager's own error, or
    5e-2): some gradients (λ's: a small difference of large sums) carry tens of percent of bf16
    rounding whatever the core."""
    from difftrain.model import ModelConfig, Transformer

    dev = sec.dev
    D, H, L, T, V = (64, 4, 1, 32, 128) if sec.dry else (512, 8, 2, 256, 1024)
    impls = ["sdpa"] if sec.dry else ["sdpa", "flex"]  # flex is the CUDA core
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 compared in fp32
    torch.backends.cudnn.allow_tf32 = False

    def run(model, ids, bf16, fn=None):
        model.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            out = (fn or model)(ids[:, :-1], ids[:, 1:])
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return {"logits": out.logits.detach().float(), **grads}

    def errors(got, ref32):
        return {n: rel(got[n], t) for n, t in ref32.items() if n in got}

    def compare(name, got, ref32, bound):
        errs = errors(got, ref32)
        worst = max(errs, key=lambda n: errs[n] / bound[n])
        ok = set(got) == set(ref32) and all(errs[n] <= bound[n] for n in errs)
        sec.check(name, ok, f"worst {worst}: relative error {errs[worst]:.1e} (≤ {bound[worst]:.1e})")

    def model_of(cfg):
        torch.manual_seed(0)
        ids = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(1)).to(dev)
        return Transformer(cfg).to(dev), ids

    compiled_todo = []
    for arch in ("diff", "baseline", "diff2"):
        for n_kv in (H, H // 2):
            cfg = ModelConfig(
                arch=arch, vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=n_kv, max_seq_len=T
            )
            model, ids = model_of(cfg)
            model.attn_impl = "eager"
            ref32 = run(model, ids, False)
            bounds = {
                "float32": dict.fromkeys(ref32, 2e-3),
                "bfloat16": {n: max(5e-2, 2 * e) for n, e in errors(run(model, ids, True), ref32).items()},
            }
            for impl in impls:
                model.attn_impl = impl
                for dtype, bound in bounds.items():
                    got = run(model, ids, dtype == "bfloat16")
                    compare(f"{arch}/kv{n_kv}/{impl}/{dtype}", got, ref32, bound)
            if not sec.dry and n_kv == H:
                compiled_todo.append((arch, cfg, ref32, bounds["bfloat16"]))
            del model
            free(dev)
    # flex under torch.compile of the whole model (the training path), bf16, MHA
    for arch, cfg, ref32, bound in compiled_todo:
        if sec.left() < 30:
            sec.check(f"{arch}/flex/compiled/bfloat16", False, "not run: too little time left", judged=False)
            continue
        model, ids = model_of(cfg)
        model.attn_impl = "flex"
        t0 = time.perf_counter()
        got = run(model, ids, True, torch.compile(model))
        sec.figure(f"{arch}_compile_fwd_bwd_s", round(time.perf_counter() - t0, 1), "s")
        compare(f"{arch}/flex/compiled/bfloat16", got, ref32, bound)
        del model
        free(dev)


# ---- train ---------------------------------------------------------------------------------
def plan_json(recipe: str, overrides: list[str], gpu_mem: int | None) -> dict:
    """`difftrain plan RECIPE --json` as a user runs it."""
    where = ["--gpu-mem", f"{gpu_mem // 2**20}MB"] if gpu_mem else ["--device", "cpu"]
    cmd = [sys.executable, "-m", "difftrain", "plan", recipe, *where, "--json", *overrides]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"difftrain plan failed: {(out.stdout + out.stderr).strip()[-500:]}")
    return json.loads(out.stdout)


def train(sec: Section) -> None:
    """diff-124m and baseline-124m at seq 2048 as a GPU trains them (bf16 autocast, compiled
    model, bitsandbytes AdamW8bit), on random tokens (throughput does not depend on the data)."""
    T = 64 if sec.dry else 2048
    tiny = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "tokenizer.train.vocab_size=512"]
    shape = [f"model.max_seq_len={T}", *(tiny if sec.dry else [])]
    rates = {arch: train_one(sec, arch, shape, T) for arch in ("diff", "baseline")}
    ratio = rates["diff"] / rates["baseline"]
    sec.figure("diff_vs_baseline_tokens_per_s", round(ratio, 3), "", "≥ 0.95 (paper: 0.91)")
    sec.check("diff_vs_baseline_95_percent", ratio >= 0.95, f"{ratio:.3f}", judged=not sec.dry)


def train_one(sec: Section, arch: str, shape: list[str], T: int) -> float:
    """Train `arch`'s 124M recipe for its share of the section's time; its tokens/s."""
    from difftrain.model import ModelConfig, Transformer
    from difftrain.recipe import OptimConfig
    from difftrain.train.callbacks import flops_per_token, peak_flops
    from difftrain.train.optim import build_optimizer, optimizer_state_bytes

    dev, recipe = sec.dev, f"{arch}-124m"
    gpu_mem = None if sec.dry else torch.cuda.get_device_properties(0).total_memory
    # the largest micro-batch the planner says fits on the device
    for micro in (2,) if sec.dry else (16, 8, 4, 2, 1):
        overrides = [*shape, f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}"]
        plan = plan_json(recipe, [*overrides, "optim.name=adamw8bit"], gpu_mem)
        if sec.dry or plan["fits"]:
            break
    cfg = ModelConfig(**plan["model"])
    torch.manual_seed(0)
    model = Transformer(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_body = n_params - model.model.embed_tokens.weight.numel()
    opt = build_optimizer(model, OptimConfig(name="adamw8bit", lr=3e-4), dev.type)
    step_fn = model if sec.dry else torch.compile(model)  # (the dry run: no compiler on the CPU)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step() -> torch.Tensor:
        ids = torch.randint(0, cfg.vocab_size, (micro, T + 1), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = step_fn(ids[:, :-1], ids[:, 1:], return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # half of what is left for diff (which keeps 30 s back for the cores), the rest for baseline
    share = (sec.left() - 30) / 2 - 5 if arch == "diff" else sec.left() - 5
    end = time.monotonic() + (0.0 if sec.dry else max(share, 1.0))  # the dry run: 2 steps
    t0 = time.perf_counter()
    for _ in range(3):  # compilation and the optimizer's state
        loss = step()
    sync(dev)
    sec.figure(f"{arch}_warmup_s", round(time.perf_counter() - t0, 1), "s")
    steps, t0 = 0, time.perf_counter()
    while steps < 2 or time.monotonic() < end:
        loss = step()
        steps += 1
    sync(dev)
    tps = steps * micro * T / (time.perf_counter() - t0)
    last = loss.item()
    sec.check(f"{arch}_loss_finite", math.isfinite(last), f"loss {last:.3f} after {steps + 3} steps")
    sec.figure(f"{arch}_tokens_per_s", round(tps), "tok/s")
    sec.figure(f"{arch}_shape", f"micro {micro} x seq {T}, {n_params / 1e6:.1f}M params, {steps} timed steps")
    peak = peak_flops(dev)
    if peak:
        mfu = tps * flops_per_token(n_body, cfg.n_layers, cfg.n_heads * cfg.head_dim, T) / peak
        sec.figure(f"{arch}_mfu", round(mfu, 3), "", "≥ 0.40 on H100-class" if arch == "diff" else "")
        if arch == "diff":
            name = torch.cuda.get_device_name(0)
            h100 = any(k in name for k in ("H100", "H200", "H800"))
            sec.check("diff_mfu_40_percent", mfu >= 0.40, f"MFU {mfu:.1%} on {name}", judged=h100)
    if dev.type == "cuda":
        measured = torch.cuda.max_memory_allocated()
        err = plan["peak"] / measured - 1
        sec.figure(f"{arch}_peak_memory_mib", round(measured / 2**20), "MiB")
        sec.figure(f"{arch}_planned_peak_mib", round(plan["peak"] / 2**20), "MiB", "within 15 % of measured")
        sec.check(f"{arch}_plan_within_15_percent", abs(err) <= 0.15, f"plan/measured − 1 = {err:+.1%}")
    bpp = optimizer_state_bytes(opt) / n_params
    sec.figure(f"{arch}_8bit_bytes_per_param", round(bpp, 3), "B/param", "≤ 2.1")
    sec.check(f"{arch}_8bit_state_bytes_per_param", bpp <= 2.1, f"{bpp:.3f} bytes/param", judged=not sec.dry)
    step_fn = opt = None  # (the model stays for the cores; its compiled wrapper and state go)
    free(dev)
    if arch == "diff":
        time_diff_cores(sec, model, micro, T)
    del model
    free(dev)
    return tps


def time_diff_cores(sec: Section, model: torch.nn.Module, micro: int, T: int) -> None:
    """The diff cores at the training sequence length, bf16, forward + backward, on up to 4
    sequences (the uncompiled model keeps more activations than the compiled one): the package's
    own through the model, and the flash-friendly candidates of benchmarks/diff_cores.py alone.
    A core that fails is a failed check; the others are still timed."""
    import diff_cores as cands

    dev, cfg, B = sec.dev, model.config, min(micro, 4)
    reps = 2 if sec.dry else 5
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), device=dev)

    def model_step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            model(ids[:, :-1], ids[:, 1:], return_logits=False).loss.backward()

    def attempt(name: str, fn: Callable[[], object]) -> float | None:
        try:
            ms = timed(fn, dev, reps)
        except Exception as e:  # (an OOM or a kernel the device lacks: a result too)
            sec.check(f"{name}_runs", False, f"{type(e).__name__}: {str(e)[:200]}")
            return None
        finally:
            model.zero_grad(set_to_none=True)
            free(dev)
        sec.figure(f"{name}_ms", round(ms, 3), "ms", f"{B} x {T}, forward + backward")
        return ms

    model_ms = {}
    for impl in ["sdpa"] if sec.dry else ["flex", "sdpa"]:
        model.attn_impl = impl
        ms = attempt(f"diff_model_step_{impl}", model_step)
        if ms is not None:
            model_ms[impl] = ms
    model.attn_impl = "auto"
    if model_ms:
        best = min(model_ms, key=model_ms.get)
        cap = "cpu" if sec.dry else "sm_{}{}".format(*torch.cuda.get_device_capability(0))
        sec.figure(
            "auto_choice_measured", f"{cap}: {best}", "", "the `auto` table's entry for this capability"
        )
    H, d, kv = cfg.n_heads, cfg.head_dim, cfg.n_kv_heads
    g = torch.Generator(device=dev).manual_seed(0)
    bf16 = dict(device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (
        torch.randn(B, H, T, d, **bf16),
        torch.randn(B, kv, T, d, **bf16),
        torch.randn(B, kv // 2, T, 2 * d, **bf16),
    )
    lam = torch.tensor(0.3, device=dev)
    for name, fn in cands.CANDIDATES.items():

        def core(fn=fn):
            fn(q, k, v, lam).sum().backward()

        attempt(f"diff_core_{name}", core)


# ---- qlora ---------------------------------------------------------------------------------
def corpus(folder: Path, files: int) -> Path:
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(files):
        lines = []
        for j in range(30):
            a, b, c = (WORDS[int(k)] for k in torch.randint(len(WORDS), (3,), generator=g))
            lines.append(
                f'def {a}_{j}({b}, {c}):\n    """Return {b} with {c}."""\n    return {b} + {c} * {j}\n\n'
            )
        (folder / f"m{i:03d}.py").write_text("".join(lines))
    return folder


def qlora(sec: Section) -> None:
    """The Lightning path on the device: a pretrain with the CUDA defaults (bf16-mixed, compile,
    adamw8bit, the CUDA core), then a QLoRA fine-tune checked from inside its step and, after it,
    on the device (Lightning's teardown moves the module back to the CPU after fit)."""
    import lightning as L

    from difftrain.adapters import merge_run, read_adapter_spec
    from difftrain.recipe import load_recipe
    from difftrain.rundir import load_run
    from difftrain.train.finetune import finetune
    from difftrain.train.run import pretrain

    work = sec.work
    os.environ["DIFFTRAIN_CACHE"] = str(work / "cache")
    torch.backends.cuda.matmul.allow_tf32 = False  # the logits compared in fp32
    data = corpus(work / "corpus", 60)
    dev = sec.dev
    D, layers, seq, steps = (64, 2, 64, 8) if sec.dry else (256, 4, 256, 40)
    base_yaml = work / "base.yaml"
    base_yaml.write_text(
        f"""name: base
out_dir: {work / "runs"}
model: {{arch: diff, d_model: {D}, n_layers: {layers}, n_heads: 4, max_seq_len: {seq}, tie_embeddings: false}}
data: {{sources: [{data}], val_windows: 8}}
tokenizer: {{train: {{vocab_size: 1024}}}}
train: {{max_steps: {steps}, micro_batch_size: 8, log_every: 10, val_every: {steps // 2}, save_every: 1000}}
optim: {{lr: 3.0e-3, warmup_steps: 5}}
logging: {{progress: false, tensorboard: false}}
"""
    )
    t0 = time.perf_counter()
    base = pretrain(load_recipe(base_yaml))
    s = base.summary
    sec.figure("pretrain_s", round(time.perf_counter() - t0, 1), "s")
    resolved = load_recipe(base.run_dir / "recipe.yaml").train
    sec.check(
        "pretrain_with_the_defaults",
        s.get("final_val_loss") is not None and math.isfinite(s["final_val_loss"]),
        f"{s.get('precision')}, {s.get('optimizer')}, compile={resolved.compile}, {s.get('device')}: "
        f"val loss {s.get('final_val_loss')}",
    )

    class OnDevice(L.Callback):
        """Looks at the model during the second step, and keeps the trained model's logits from
        the end of fit, before Lightning's teardown moves the module to the CPU."""

        seen: dict = {}
        ids = torch.empty(0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and not self.seen:
                four = [m for m in pl_module.model.modules() if type(m).__name__ == "Linear4bit"]
                self.seen = {
                    "layers": len(four),
                    "on_device": all(
                        m.weight.dtype == torch.uint8 and m.weight.device.type == dev.type for m in four
                    ),
                }

        def on_train_end(self, trainer, pl_module):
            model = pl_module.model.eval()
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=g)
            for m in model.modules():
                if type(m).__name__ == "Linear4bit":
                    m.compute_dtype = torch.float32
            with torch.no_grad():
                self.seen["trained_device"] = next(model.parameters()).device.type
                self.seen["trained"] = model(self.ids.to(pl_module.device)).logits.float().cpu()

    ft_yaml = work / "ft.yaml"
    ft_yaml.write_text(
        f"""name: ft
out_dir: {work / "runs"}
finetune: {{base: {base.run_dir}, method: qlora, lora: {{rank: 8, alpha: 16, dropout: 0.0}}}}
data: {{sources: [{{source: builtin:python-docstrings, max_documents: {80 if sec.dry else 400}}}], val_fraction: 0.1}}
train: {{max_steps: {6 if sec.dry else 30}, micro_batch_size: 8, compile: false, log_every: 5, val_every: 1000, save_every: 1000}}
optim: {{lr: 2.0e-3, warmup_steps: 3, weight_decay: 0.0}}
logging: {{progress: false, tensorboard: false}}
"""
    )
    watch = OnDevice()
    t0 = time.perf_counter()
    result = finetune(load_recipe(ft_yaml), extra_callbacks=[watch])
    sec.figure("qlora_finetune_s", round(time.perf_counter() - t0, 1), "s")
    spec = read_adapter_spec(result.run_dir)
    n = len(spec.quantized)
    sec.check(
        "4bit_layers_on_device_during_the_step",
        watch.seen.get("on_device") is True and watch.seen.get("layers") == n > 0,
        f"{watch.seen.get('layers')} Linear4bit layers (of {n} quantized), uint8 on {dev.type}: {watch.seen.get('on_device')}",
    )
    iv, fv = result.summary.get("initial_val_loss"), result.summary.get("final_val_loss")
    sec.check("val_loss_improves", iv is not None and fv is not None and fv < iv, f"val loss {iv} -> {fv}")
    sec.check(
        "trained_logits_from_the_device",
        watch.seen.get("trained_device") == dev.type,
        f"the trained model's logits computed on {watch.seen.get('trained_device')}",
    )
    merged = load_run(merge_run(result.run_dir)).model.to(dev).eval()
    with torch.no_grad():
        m = merged(watch.ids.to(dev)).logits.float().cpu()
    trained = watch.seen["trained"]
    diff, scale = (m - trained).abs().max().item(), trained.abs().max().item()
    sec.check(
        "merged_equals_trained_on_the_device",
        diff <= 2e-3 * max(1.0, scale),
        f"max |logit diff| {diff:.2e} (logits up to {scale:.1f}), both on {dev.type}",
    )


# ---- generate ------------------------------------------------------------------------------
def generate(sec: Section) -> None:
    """Decoding with the KV cache at the 124M shape (random weights), eager and compiled."""
    from difftrain.infer.generate import generate_all
    from difftrain.infer.settings import GenerationConfig, SamplingConfig
    from difftrain.model import ModelConfig, Transformer

    dev = sec.dev
    shape = dict(d_model=64, n_layers=2, n_heads=4) if sec.dry else dict(d_model=768, n_layers=12, n_heads=12)
    cfg = ModelConfig(arch="diff", vocab_size=32768, max_seq_len=512, **shape)
    torch.manual_seed(0)
    model = Transformer(cfg).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    prompt = [torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(2)).tolist()]
    new = 32 if sec.dry else 256
    runs = {"eager": False} if sec.dry else {"eager": False, "compiled": True}
    tokens = {}
    for name, compiled in runs.items():
        config = GenerationConfig(
            max_new_tokens=new, sampling=SamplingConfig(greedy=True), stop_at_eos=False, compile=compiled
        )
        t0 = time.perf_counter()
        generate_all(model, prompt, config)  # the first: the compilation, the cache's first allocation
        sec.figure(f"{name}_first_generation_s", round(time.perf_counter() - t0, 1), "s")
        sync(dev)
        t0 = time.perf_counter()
        out = generate_all(model, prompt, config)[0]
        sync(dev)
        tokens[name] = out.token_ids
        sec.figure(
            f"{name}_decode_tokens_per_s", round(len(out.token_ids) / (time.perf_counter() - t0), 1), "tok/s"
        )
        sec.check(f"{name}_generates", len(out.token_ids) == new, f"{len(out.token_ids)} of {new} tokens")
    if "compiled" in tokens:
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens["eager"], tokens["compiled"], strict=True)) if a != b),
            new,
        )
        sec.figure("compiled_tokens_agreeing_with_eager", same, f"of {new}", "bf16: greedy paths may part")


# ---- fsdp ----------------------------------------------------------------------------------
def fsdp(sec: Section) -> None:
    """FSDP on every GPU (up to 8) against DDP: the same recipe through `difftrain pretrain`."""
    n = 0 if sec.dry else min(torch.cuda.device_count(), 8)
    if n < 2:
        sec.skip(f"needs 2 or more GPUs; {n} visible" if not sec.dry else "the dry run has no GPUs")
        return
    from difftrain.train.metrics import read_metrics

    work = sec.work
    data = corpus(work / "corpus", 60)
    recipe = work / "r.yaml"
    recipe.write_text(
        f"""name: r
out_dir: {work / "runs"}
seed: 7
model: {{arch: diff, d_model: 256, n_layers: 4, n_heads: 8, max_seq_len: 256}}
data: {{sources: [{data}], val_windows: 16, cache_dir: {work / "cache"}}}
tokenizer: {{train: {{vocab_size: 1024}}}}
train: {{max_steps: 20, micro_batch_size: 4, devices: {n}, log_every: 1, val_every: 1000, save_every: 1000}}
optim: {{name: adamw, lr: 2.0e-3, warmup_steps: 4}}
logging: {{progress: false, tensorboard: false}}
"""
    )
    curves = {}
    for name, args in (
        ("ddp", ["train.strategy=ddp"]),
        ("fsdp", ["train.strategy=fsdp", "train.activation_checkpointing=true"]),
    ):
        cmd = [
            sys.executable,
            "-m",
            "difftrain",
            "pretrain",
            str(recipe),
            f"name={name}",
            *args,
            "--no-progress",
        ]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(sec.left() - 5, 10))
        sec.figure(f"{name}_s", round(time.perf_counter() - t0, 1), "s")
        sec.check(
            f"{name}_runs",
            p.returncode == 0,
            (p.stdout + p.stderr).strip().splitlines()[-1][:200] if p.returncode else "exit 0",
        )
        rows = read_metrics(work / "runs" / name / "metrics.csv") if p.returncode == 0 else []
        curves[name] = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    if all(curves.values()):
        worst = max(abs(curves["fsdp"][s] - curves["ddp"][s]) / abs(curves["ddp"][s]) for s in curves["ddp"])
        sec.check("fsdp_follows_ddp", worst < 2e-2, f"max relative loss difference over 20 steps {worst:.1e}")


SECTIONS = {"kernels": kernels, "train": train, "qlora": qlora, "generate": generate, "fsdp": fsdp}


def main() -> None:
    name, out, seconds, ctx = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
    sec = Section(name, out, seconds, ctx)
    try:
        SECTIONS[name](sec)
        sec.finish()
    except Exception as e:  # a failure is a result too
        sec.fail(e)
    sys.exit(0 if sec.data["ok"] else 1)


if __name__ == "__main__":
    main()
