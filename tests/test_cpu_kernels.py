"""The fused fp32 CPU kernels (model/cpu_kernels.c through model/ckernels.py): their results
against float64 formulas, their independence from the thread count, the autograd functions that
use them against the torch operations they replace, and how they load, fail and fall back."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from difftrain.errors import ConfigError
from difftrain.model import ModelConfig, Transformer, ckernels
from difftrain.model.attention import _RMSNormCPU


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """ckernels loaded afresh, compiled into an empty cache folder."""
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ckernels.ENV, raising=False)
    ckernels.forget()
    yield tmp_path / "cache" / "kernels"
    ckernels.forget()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_kernels_compile_and_load_on_this_machine(fresh):
    assert ckernels.library() is not None, ckernels.status()
    assert ckernels.status() == "compiled"
    (so,) = fresh.iterdir()
    assert so.name.startswith("cpu_kernels-")
    mtime = so.stat().st_mtime_ns
    ckernels.forget()
    assert ckernels.library() is not None
    assert [p.stat().st_mtime_ns for p in fresh.iterdir()] == [mtime]  # cached: not compiled again


def _silu64(x: torch.Tensor) -> torch.Tensor:
    return x.double() * torch.sigmoid(x.double())


def test_swiglu_matches_the_formula_in_float64_over_the_whole_range(fresh):
    g = torch.cat([torch.linspace(-120, 120, 200_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.7, -87.4])])
    u = torch.randn(g.shape, generator=torch.Generator().manual_seed(0))
    h = ckernels.swiglu(g, u)
    ref = _silu64(g) * u.double()
    err = (h.double() - ref).abs()
    # within a few float ulps of the exact value, and subnormal where it is (x below about -87)
    assert (err <= 4 * torch.finfo(torch.float32).eps * ref.abs() + 1e-40).all(), (err / ref.abs()).max()
    assert h[g == 0].eq(0).all() and torch.isfinite(h).all()


def test_swiglu_backward_matches_the_formula_in_float64(fresh):
    gen = torch.Generator().manual_seed(1)
    g, u, gh = (torch.randn(3, 7, 101, generator=gen) * s for s in (6, 2, 1))
    gg, gu = ckernels.swiglu_backward(gh, g, u)
    g64 = g.double().requires_grad_()
    u64 = u.double().requires_grad_()
    (F.silu(g64) * u64).backward(gh.double())
    torch.testing.assert_close(gg.double(), g64.grad, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(gu.double(), u64.grad, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(5, 16), (3, 37, 13), (1, 1, 256), (300, 64)])
def test_rms_norm_forward_and_backward_match_float64(fresh, shape):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=gen) * 3
    w = torch.rand(shape[-1], generator=gen) + 0.5
    g = torch.randn(*shape, generator=gen)
    y, r = ckernels.rms_norm(x, w, 1e-5)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = F.rms_norm(x64, (shape[-1],), w64, 1e-5)
    torch.testing.assert_close(y.double(), ref.detach(), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(
        r.double(), torch.rsqrt(x64.detach().pow(2).mean(-1) + 1e-5), rtol=2e-6, atol=0
    )
    ref.backward(g.double())
    gx, gw = ckernels.rms_norm_backward(g, x, w, r, need_x=True, need_w=True)
    torch.testing.assert_close(gx.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw.double(), w64.grad, rtol=1e-5, atol=1e-5)
    assert ckernels.rms_norm_backward(g, x, w, r, need_x=False, need_w=True)[0] is None
    gx_only, none = ckernels.rms_norm_backward(g, x, w, r, need_x=True, need_w=False)
    assert none is None and torch.equal(gx_only, gx)


def test_results_do_not_depend_on_the_number_of_threads(fresh, threads):
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(1000, 96, generator=gen), torch.randn(1000, 96, generator=gen)
    w = torch.rand(96, generator=gen)
    a, b = torch.randn(1000, 96, generator=gen), torch.randn(1000, 96, generator=gen)
    t = torch.randint(0, 96, (1000,), generator=gen)

    def everything():
        y, r = ckernels.rms_norm(x, w, 1e-5)
        z = a.clone()
        return (y, r, *ckernels.rms_norm_backward(g, x, w, r, True, True), ckernels.swiglu(a, b),
                *ckernels.swiglu_backward(g, a, b), ckernels.cross_entropy_rows(z, t, -100, True), z)  # fmt: skip

    threads(1)
    one = everything()
    threads(2)
    two = everything()
    threads(5)  # more threads than cores
    five = everything()
    for t1, t2, t5 in zip(one, two, five, strict=True):
        assert torch.equal(t1, t2) and torch.equal(t1, t5)


def test_rms_norm_function_takes_the_kernels_and_keeps_its_input(fresh):
    gen = torch.Generator().manual_seed(4)
    x0, w0 = torch.randn(4, 9, 32, generator=gen), torch.rand(32, generator=gen) + 0.5
    grad = torch.randn(4, 9, 32, generator=gen)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = _RMSNormCPU.apply(x, w, 1e-5)
    assert y.grad_fn.saved_tensors[0] is x  # x, not x̂: the kernel recomputes x̂
    y.backward(grad)
    rx, rw = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    F.rms_norm(rx, (32,), rw, 1e-5).backward(grad)
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, rw.grad, rtol=1e-5, atol=1e-5)


def _step(arch: str, seed: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = ModelConfig(arch=arch, vocab_size=128, d_model=128, n_layers=2, n_heads=4, max_seq_len=64)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 128, (4, 64), generator=gen), torch.randint(0, 128, (4, 64), generator=gen)
    loss = model(x, y, return_logits=False).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_a_training_step_with_the_kernels_matches_one_without(fresh, monkeypatch, arch):
    assert ckernels.library() is not None
    fused_loss, fused_grads = _step(arch)
    monkeypatch.setenv(ckernels.ENV, "off")
    ckernels.forget()
    assert ckernels.library() is None and ckernels.status() == "off (DIFFTRAIN_CPU_KERNELS)"
    loss, grads = _step(arch)
    assert fused_loss == pytest.approx(loss, rel=1e-6)
    assert fused_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_turned_off_the_norm_keeps_f_rms_norms_bits(fresh, monkeypatch):
    monkeypatch.setenv(ckernels.ENV, "0")
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.rand(40, requires_grad=True)
    assert torch.equal(_RMSNormCPU.apply(x, w, 1e-5), F.rms_norm(x, (40,), w, 1e-5))


def test_a_setting_it_does_not_know_is_an_error(fresh, monkeypatch):
    monkeypatch.setenv(ckernels.ENV, "fast")
    with pytest.raises(ConfigError, match="DIFFTRAIN_CPU_KERNELS='fast' is not a setting; set it to off"):
        ckernels.library()


def test_without_a_compiler_training_falls_back_to_torch(fresh, monkeypatch):
    monkeypatch.setenv("CC", str(fresh.parent / "no-such-cc"))
    assert ckernels.library() is None
    assert (
        ckernels.status()
        == f"unavailable ($CC={fresh.parent / 'no-such-cc'} is not a program found here; set $CC to a C compiler)"
    )
    ckernels.forget()
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(fresh.parent))  # no cc on it
    assert ckernels.library() is None
    assert ckernels.status() == "unavailable (no C compiler: install gcc or set $CC)"
    loss, _ = _step("diff")
    assert loss > 0


def test_a_compiler_that_fails_is_reported_and_nothing_is_left_behind(fresh, monkeypatch, tmp_path):
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'fatal: cannot do it' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    assert ckernels.library() is None
    assert ckernels.status() == "unavailable (badcc failed: fatal: cannot do it)"
    assert list(fresh.iterdir()) == []  # no half-written library in the cache


def test_a_damaged_cached_library_is_compiled_again(fresh):
    so = ckernels.library_path(ckernels._compiler())
    so.parent.mkdir(parents=True)
    so.write_bytes(b"not a shared library")
    assert ckernels.library() is not None, ckernels.status()
    assert so.read_bytes()[:4] == b"\x7fELF"


def test_an_unwritable_cache_folder_is_reported(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(blocker))
    assert ckernels.library() is None
    assert ckernels.status().startswith(f"unavailable (cannot write the cache folder {blocker / 'kernels'}")


def test_the_source_ships_with_the_package():
    # a wheel carries package data only where pyproject names it; the kernels compile from it
    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"difftrain.model" = ["*.c"]' in section
    assert ckernels.SOURCE.is_file() and ckernels.SOURCE.parent == root / "difftrain" / "model"


def test_a_bad_setting_is_refused_by_every_command_before_torch_loads(tmp_path, cli_probe):
    done = cli_probe(
        [["plan", "quickstart"], ["recipes", "list"]],
        tmp_path,
        prelude="import os; os.environ['DIFFTRAIN_CPU_KERNELS'] = 'fast'",
    )
    assert done.codes == [2, 2] and done.loaded == []
    assert done.stderr.count("DIFFTRAIN_CPU_KERNELS='fast' is not a setting; set it to off") == 2
    assert "Traceback" not in done.stderr


def test_cross_entropy_rows_match_float64_with_the_gradient_in_place(fresh):
    gen = torch.Generator().manual_seed(6)
    z0 = torch.randn(37, 1000, generator=gen) * 4
    z0[3] += 1e4  # large logits: the row's maximum is taken out before exp
    t = torch.randint(0, 1000, (37,), generator=gen)
    t[5] = t[30] = -100
    z = z0.clone()
    loss = ckernels.cross_entropy_rows(z, t, -100, grad=True)
    z64 = z0.double().requires_grad_()
    ref = F.cross_entropy(z64, t, ignore_index=-100, reduction="none")
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-5)
    ref.sum().backward()
    torch.testing.assert_close(z.double(), z64.grad, rtol=1e-5, atol=1e-7)
    assert loss[5] == 0 and z[5].eq(0).all() and z[30].eq(0).all()
    untouched = z0.clone()
    assert torch.equal(ckernels.cross_entropy_rows(untouched, t, -100, grad=False), loss)
    assert torch.equal(untouched, z0)  # without the gradient the logits are left as they were


def test_a_target_outside_the_vocabulary_is_an_index_error(fresh):
    z, t = torch.randn(4, 10), torch.tensor([1, 10, 2, -100])
    with pytest.raises(IndexError, match="outside the vocabulary of 10 tokens"):
        ckernels.cross_entropy_rows(z, t, -100, grad=True)
    with pytest.raises(IndexError):
        ckernels.cross_entropy_rows(z, torch.tensor([1, -3, 2, 0]), -100, grad=False)


def test_paused_runs_torchs_operations_inside_the_block_only(fresh):
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.rand(40, requires_grad=True)
    with ckernels.paused():
        assert not ckernels.usable(x.detach(), w.detach())
        assert torch.equal(_RMSNormCPU.apply(x, w, 1e-5), F.rms_norm(x, (40,), w, 1e-5))
    assert ckernels.usable(x.detach(), w.detach())
    assert _RMSNormCPU.apply(x, w, 1e-5).grad_fn.saved_tensors[0] is x  # the kernel again


def test_the_bench_times_our_step_without_the_kernels_as_well(fresh):
    from difftrain.bench import BenchOptions, _torch_ops_variant, make_plan
    from difftrain.bench_report import HF_VARIANT_LABELS, evaluate_targets

    assert _torch_ops_variant(make_plan(BenchOptions(device="cpu", mode="quick")))
    assert not _torch_ops_variant(make_plan(BenchOptions(device="cpu", mode="quick", precision="bf16-mixed")))
    row = {
        "arch": "diff",
        "speedup": 1.3,
        "speedup_cpu": 1.3,
        "torch_ops_speedup": 1.2,
        "torch_ops_speedup_cpu": 1.2,
    }
    names = [
        t["name"] for t in evaluate_targets({"sections": {"hf": {"train": [row]}}, "device": {"type": "cpu"}})
    ]
    assert f"diff training tokens/s vs DiffLlama, {HF_VARIANT_LABELS['torch_ops']}" in names


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_compiler_with_arguments_or_bytes_that_are_not_utf8_still_works(fresh, monkeypatch, tmp_path):
    import shutil

    gcc = shutil.which("cc")
    monkeypatch.setenv("CC", f"env {gcc}")  # $CC may carry arguments (`ccache gcc`)
    assert ckernels.library() is not None, ckernels.status()
    ckernels.forget()
    odd = _script(
        tmp_path / "oddcc", f'[ "$1" = --version ] && {{ printf "cc \\377\\n"; exit 0; }}\nexec {gcc} "$@"\n'
    )
    monkeypatch.setenv("CC", odd)
    assert ckernels.library() is not None, ckernels.status()
    ckernels.forget()
    monkeypatch.setenv(
        "CC", _script(tmp_path / "frcc", 'printf "note: x\\nerreur \\351 fatale\\n" >&2; exit 1\n')
    )
    assert ckernels.library() is None
    assert (
        ckernels.status() == "unavailable (frcc failed: erreur \ufffd fatale)"
    )  # the error line, not the first


def test_a_compiler_that_writes_nothing_leaves_nothing_in_the_cache(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", _script(tmp_path / "lazycc", "exit 0\n"))
    assert ckernels.library() is None and ckernels.status() == "unavailable (lazycc wrote nothing)"
    assert list(fresh.iterdir()) == []


def test_the_cached_library_can_be_loaded_by_others_sharing_the_cache(fresh):
    assert ckernels.library() is not None
    (so,) = fresh.iterdir()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(so.stat().st_mode) == 0o755 & ~umask


def test_backward_reads_saved_tensors_a_hook_gave_back_in_another_layout(fresh):
    gen = torch.Generator().manual_seed(7)
    x0, w0 = torch.randn(4, 6, generator=gen), torch.rand(6, generator=gen) + 0.5
    g0, u0 = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)

    def grads():
        x, w, g, u = (t.clone().requires_grad_() for t in (x0, w0, g0, u0))
        (_RMSNormCPU.apply(x, w, 1e-5).sum() + ckernels.SwiGLU.apply(g, u).square().sum()).backward()
        return [t.grad for t in (x, w, g, u)]

    want = grads()
    transposed = {
        "pack": lambda t: t.t().contiguous() if t.dim() == 2 else t,
        "unpack": lambda t: t.t() if t.dim() == 2 else t,
    }
    with torch.autograd.graph.saved_tensors_hooks(transposed["pack"], transposed["unpack"]):
        got = grads()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_a_second_derivative_is_refused_not_wrong(fresh):
    # the norm's and SwiGLU's backward passes compute without a graph, with the kernels or not
    # (torch's operations on saved x̂ gave a second derivative that missed terms)
    x, w = torch.randn(3, 5, requires_grad=True), torch.rand(5, requires_grad=True)
    g, u = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    for paused in (False, True):
        with ckernels.paused() if paused else contextlib.nullcontext():
            for out, leaf in ((_RMSNormCPU.apply(x, w, 1e-5), x), (ckernels.SwiGLU.apply(g, u), g)):
                (d,) = torch.autograd.grad(out.square().sum(), leaf, create_graph=True)
                with pytest.raises(RuntimeError, match="once_differentiable|not have been used in the graph"):
                    torch.autograd.grad(d.sum(), leaf)


def test_the_loss_takes_the_kernel_with_onednn_products_too(fresh, monkeypatch):
    from difftrain.model import gemm
    from difftrain.model.loss import linear_cross_entropy

    calls = []
    real = ckernels.cross_entropy_rows
    monkeypatch.setattr(ckernels, "cross_entropy_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(300, 64, generator=gen, requires_grad=True)
    w = torch.randn(512, 64, generator=gen, requires_grad=True)
    t = torch.randint(0, 512, (300,), generator=gen)
    with gemm.use_backend("onednn"):
        loss = linear_cross_entropy(h, w, t, rows=128)
        gh, gw = torch.autograd.grad(loss, (h, w))
    assert len(calls) == 3  # one per chunk
    ref = F.cross_entropy(h.double() @ w.double().t(), t)
    rh, rw = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, rh.float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, rw.float(), rtol=1e-4, atol=1e-6)


def test_masked_logits_get_exactly_zero_probability(fresh):
    z = torch.tensor([[0.0, float("-inf"), -200.0, 1.0], [5.0, 5.0, float("-inf"), -1e30]])
    got = z.clone()
    ckernels.cross_entropy_rows(got, torch.tensor([0, 1]), -100, grad=True)
    want = torch.softmax(z, -1) - F.one_hot(torch.tensor([0, 1]), 4)
    assert torch.equal(got == 0, want == 0) and got[0, 1] == 0 and got[0, 2] == 0
    torch.testing.assert_close(got, want)


def test_another_library_at_the_caches_name_is_replaced_and_the_new_one_loaded(fresh, tmp_path):
    import subprocess

    cc = ckernels._compiler()
    so = ckernels.library_path(cc)
    so.parent.mkdir(parents=True)
    (tmp_path / "other.c").write_text("int other(void) { return 1; }\n")
    subprocess.run([*cc, "-shared", "-fPIC", "-o", str(so), str(tmp_path / "other.c")], check=True)
    assert ckernels.library() is not None, ckernels.status()  # dlopen of the same path gave the old one
    assert ckernels.swiglu(torch.ones(3), torch.ones(3)).allclose(torch.full((3,), 0.7310586))
    assert sorted(p.name for p in fresh.iterdir()) == [so.name]  # the name it was loaded under is gone


def test_the_runs_device_row_and_summary_say_whether_the_kernels_ran(fresh, monkeypatch):
    from difftrain.train.run import _cpu_kernels_note, cpu_kernels_status

    assert cpu_kernels_status("cpu", "32-true", compiled=False) == "compiled"
    assert cpu_kernels_status("cpu", "bf16-mixed", compiled=False) == "compiled"  # its fp32 norms
    assert cpu_kernels_status("cpu", "bf16-true", compiled=False) is None
    assert cpu_kernels_status("cpu", "32-true", compiled=True) is None  # the compiler fuses instead
    assert cpu_kernels_status("cuda", "32-true", compiled=False) is None
    assert _cpu_kernels_note("cpu", "32-true", False) == " · fused CPU kernels"
    monkeypatch.setenv(ckernels.ENV, "off")
    ckernels.forget()
    assert _cpu_kernels_note("cpu", "32-true", False) == " · fused CPU kernels off (DIFFTRAIN_CPU_KERNELS)"
