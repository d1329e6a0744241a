"""What the benchmark scripts share: the machine's description, round-robin timing, paired ratios,
models at a shape, a training step, transformers' twin of a model, and writing a result.

How the scripts measure: candidates run round-robin (A B C A B C …) after a warm-up, so that a
change of load on a shared machine hits all of them alike; each figure is the median over
repetitions and each ratio the median of per-repetition ratios. The results keep every
repetition's wall and CPU milliseconds. CPU time (all threads of the process) is the steadier
clock on a machine other jobs share.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` from a checkout
    sys.path.insert(0, str(ROOT))

ARCHS = ("baseline", "diff", "diff2")


@dataclass(frozen=True)
class Shape:
    """A model and batch shape: the model's fields plus micro-batch B and sequence length T."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    vocab_size: int
    tie_embeddings: bool = True

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def config(self, arch: str) -> Any:
        from difftrain.model import ModelConfig

        return ModelConfig(
            arch=arch,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            max_seq_len=self.seq_len,
            tie_embeddings=self.tie_embeddings,
        )


TINY = Shape("tiny", 64, 2, 4, 64, 4, 512)
QUICKSTART = Shape("quickstart", 256, 4, 8, 256, 16, 4096)
D512 = Shape("d512-seq512", 512, 4, 8, 512, 8, 4096)
SHAPES = {s.name: s for s in (TINY, QUICKSTART, D512)}


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, Any]:
    """Where the figures come from: device, versions, threads, load, date."""
    from importlib import metadata

    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "type": device.type,
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for pkg in ("difftrain", "transformers", "bitsandbytes", "lightning"):  # nothing imported
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(
    fns: dict[str, Callable[[], Any]], *, warmup: int, reps: int, device: torch.device
) -> dict[str, dict[str, list[float]]]:
    """Warm every function up, then run them round-robin `reps` times; per name, the wall and
    process-CPU seconds of each repetition."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            times[name]["wall"].append(time.perf_counter() - t0)
            times[name]["cpu"].append(time.process_time() - c0)
    return times


def paired_ratio(ref: list[float], other: list[float]) -> float:
    """Median over repetitions of ref_r / other_r: other's speed relative to ref (>1 = faster)."""
    return statistics.median(a / b for a, b in zip(ref, other, strict=True) if b > 0)


def summary(t: dict[str, list[float]]) -> dict[str, Any]:
    """Median wall and CPU milliseconds, and every repetition's (so each figure can be recomputed)."""
    return {
        "ms": 1e3 * statistics.median(t["wall"]),
        "cpu_ms": 1e3 * statistics.median(t["cpu"]),
        "wall_ms_reps": [1e3 * x for x in t["wall"]],
        "cpu_ms_reps": [1e3 * x for x in t["cpu"]],
    }


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def batch(shape: Shape, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len + 1), generator=g).to(device)
    return ids[:, :-1], ids[:, 1:]


def build(cfg: Any, device: torch.device, seed: int = 0) -> Any:
    from difftrain.model import Transformer

    torch.manual_seed(seed)
    return Transformer(cfg).to(device)


def optimizer(model: Any, name: str, device: torch.device) -> Any:
    from difftrain.recipe import OptimConfig
    from difftrain.train.optim import build_optimizer

    return build_optimizer(model, OptimConfig(name=name, lr=1e-4, warmup_steps=0), device.type)


def train_step_fn(
    model: Any,
    opt: Any,
    xy: tuple[torch.Tensor, torch.Tensor],
    precision: str = "32-true",
    forward: Any = None,
) -> Callable[[], None]:
    """One training step as a closure: forward, backward, clip the gradient norm to 1, optimizer."""
    x, y = xy
    fwd = model if forward is None else forward
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        with autocast(x.device, precision):
            loss = fwd(x, y, return_logits=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hf_model_for(model: Any) -> Any:
    """The same weights as a transformers model (Llama for baseline, DiffLlama for diff), or None
    when transformers is missing or has no class for the arch (diff2)."""
    try:
        import transformers

        from difftrain.errors import InteropError
        from difftrain.interop.hf import hf_config_dict, to_hf_state_dict
    except ImportError:
        return None
    c = model.config
    try:
        cfg = hf_config_dict(c, bos_id=0, eos_id=1, pad_id=2)
    except InteropError:
        return None
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    sd = {k: v.float().cpu() for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(sd, c), strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise RuntimeError(f"HF weights do not line up: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None  # exactly the asked tokens, no eos stop
    return hf.to(model.lm_head.weight.device)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def write_result(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        from difftrain.io import atomic_write_json

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, result)
        print(f"wrote {path}")


def command(script: str, argv: list[str] | None) -> str:
    return " ".join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])
