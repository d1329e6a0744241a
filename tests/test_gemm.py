"""CPU matrix products by oneDNN (model/gemm.py): the same numbers as torch's, forward and
backward, in every place the model uses them; exactly torch's path wherever they do not apply;
and the backend choice (DIFFTRAIN_CPU_GEMM, CPU vendor)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from difftrain.cli.app import main
from difftrain.errors import ConfigError
from difftrain.model import ModelConfig, Transformer, gemm
from difftrain.model.loss import linear_cross_entropy

needs_onednn = pytest.mark.skipif(
    gemm._onednn_op() is None, reason="this torch build has no oneDNN linear on this CPU (not x86-64)"
)


@pytest.fixture(autouse=True)
def small_products_too(monkeypatch):
    """oneDNN for products of any size (tests use small ones; `large_enough` has its own test)."""
    monkeypatch.setattr(gemm, "MIN_ROWS", 1)
    monkeypatch.setattr(gemm, "MIN_MACS", 0)


@pytest.fixture
def fresh_backend():
    """Resolve DIFFTRAIN_CPU_GEMM again in this test (the process caches it), and after it."""
    gemm.forget_configured_backend()
    yield
    gemm.forget_configured_backend()


def _grads(fn, *tensors):
    out = fn()
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    grads = [None if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    _grads.last_node = type(out.grad_fn).__name__  # which autograd node made the output
    return out.detach(), grads


BACKENDS = [pytest.param("onednn", marks=needs_onednn), "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(7, 12), (2, 5, 12), (3, 9, 12)])
def test_linear_matches_torch_forward_and_backward(shape, bias, backend):
    """gemm._Linear by either backend: the layer's output and gradients (autograd through
    F.linear the reference), ∂W in both operand orders (9 outputs of 12 inputs, and 12 of 9)."""
    for n_in, n_out in ((12, 9), (9, 12)):
        torch.manual_seed(0)
        layer = nn.Linear(n_in, n_out, bias=bias)
        x = torch.randn(*shape[:-1], n_in, requires_grad=True)
        params = [x, *layer.parameters()]
        ref, ref_g = _grads(lambda layer=layer, x=x: layer(x), *params)
        with gemm.use_backend(backend):
            got, got_g = _grads(lambda layer=layer, x=x: gemm.linear(layer, x), *params)
            assert "_LinearBackward" in _grads.last_node  # gemm._Linear ran, not F.linear
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(got_g, ref_g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linears_match_the_layers_and_accumulate_one_input_gradient(backend):
    """gemm.linears (q, k, v) and gemm.gated_up (SwiGLU's input side): the layers' outputs and
    every gradient, also when only some outputs reach the loss (the others' gradient is None)."""
    torch.manual_seed(11)
    layers = (nn.Linear(12, 8, bias=False), nn.Linear(12, 4, bias=False), nn.Linear(12, 20, bias=False))
    x = torch.randn(2, 5, 12, requires_grad=True)
    params = [x, *(layer.weight for layer in layers)]
    for used in ((0, 1, 2), (1,), (0, 2)):

        def ref_fn(used=used):
            outs = tuple(layer(x) for layer in layers)
            return torch.cat([outs[i].flatten() for i in used])

        def got_fn(used=used):
            outs = gemm.linears(layers, x)
            assert all(type(o.grad_fn).__name__ == "_LinearsBackward" for o in outs)
            return torch.cat([outs[i].flatten() for i in used])

        ref, ref_g = _grads(ref_fn, *params)
        with gemm.use_backend(backend):
            got, got_g = _grads(got_fn, *params)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        for i, (a, b) in enumerate(zip(got_g, ref_g, strict=True)):
            if i > 0 and i - 1 not in used:
                assert a is None or torch.count_nonzero(a) == 0
                continue
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    gate, up = nn.Linear(12, 16, bias=False), nn.Linear(12, 16, bias=False)
    params = [x, gate.weight, up.weight]
    ref, ref_g = _grads(lambda: F.silu(gate(x)) * up(x), *params)
    with gemm.use_backend(backend):
        got, got_g = _grads(lambda: gemm.gated_up(gate, up, x), *params)
        assert _grads.last_node == "_GatedUpBackward"
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_linear_takes_strided_inputs():
    """A transposed view as input and a gradient that is not contiguous (the attention output is
    a view; backward hands over views): same numbers as on contiguous copies."""
    torch.manual_seed(1)
    layer = nn.Linear(6, 4, bias=False)
    base = torch.randn(6, 20, requires_grad=True)
    with gemm.use_backend("onednn"):
        y = gemm.linear(layer, base.t())  # (20, 6) view with strides (1, 20)
        assert type(y.grad_fn).__name__ == "_LinearBackward"
        g = torch.randn(4, 20).t()  # non-contiguous incoming gradient
        y.backward(g)
    torch.testing.assert_close(y, base.detach().t() @ layer.weight.detach().t())
    torch.testing.assert_close(base.grad, (g @ layer.weight.detach()).t())
    torch.testing.assert_close(layer.weight.grad, g.t() @ base.detach().t())


@needs_onednn
def test_linear_is_exactly_the_layer_where_onednn_does_not_apply():
    """Half precision, autocast, hooks, a subclass (e.g. LoRA's or bitsandbytes' layers), the
    column-major decode layout all run the layer itself (its own autograd node, not
    gemm._Linear's), bit for bit; so does the torch backend under torch.compile."""
    torch.manual_seed(2)
    layer = nn.Linear(8, 5, bias=False)
    x = torch.randn(16, 8, requires_grad=True)

    def runs_layer_itself(lin, inp):
        out = gemm.linear(lin, inp)
        return type(out.grad_fn).__name__ != "_LinearBackward" and torch.equal(out, F.linear(inp, lin.weight))

    with gemm.use_backend("onednn"):
        assert not runs_layer_itself(layer, x)  # the control: here oneDNN runs
        assert not gemm.uses_onednn(x.bfloat16(), layer.weight)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not gemm.uses_onednn(x, layer.weight)
            out = gemm.linear(layer, x)
            assert out.dtype == torch.bfloat16 and torch.equal(out, layer(x))
        seen = []
        handle = layer.register_forward_hook(lambda m, i, o: seen.append(o))
        assert runs_layer_itself(layer, x)
        handle.remove()
        assert len(seen) == 1  # the hook ran: the layer was called, not bypassed

        column_major = nn.Linear(8, 5, bias=False)  # as model/fused.py lays weights out for decoding
        column_major.weight.data = layer.weight.data.t().contiguous().t()
        assert runs_layer_itself(column_major, x)

        class Wrapped(nn.Linear):
            pass

        wrapped = Wrapped(8, 5, bias=False)
        wrapped.weight = layer.weight
        assert runs_layer_itself(wrapped, x)
    with gemm.use_backend("torch"):
        assert not gemm.uses_onednn(x, layer.weight)
        out = gemm.linear(layer, x)  # torch's products, run by gemm._Linear: the same forward bits
        assert type(out.grad_fn).__name__ == "_LinearBackward" and torch.equal(out, F.linear(x, layer.weight))
        compiled = torch.compile(lambda inp: gemm.linear(layer, inp), backend="eager", fullgraph=True)
        out = compiled(x)  # under torch.compile the plain layer, for inductor to see
        assert type(out.grad_fn).__name__ != "_LinearBackward" and torch.equal(out, F.linear(x, layer.weight))


@needs_onednn
def test_mm_matches_and_refuses_autograd_inputs():
    torch.manual_seed(3)
    a, b = torch.randn(19, 7), torch.randn(7, 21)
    with gemm.use_backend("onednn"):
        torch.testing.assert_close(gemm.mm(a, b), a @ b)
        torch.testing.assert_close(gemm.mm(b.t(), a.t()), b.t() @ a.t())  # strided operands
        a.requires_grad_(True)
        out = gemm.mm(a, b)  # would lose the gradient through oneDNN: torch's product instead
        assert out.grad_fn is not None


@needs_onednn
@pytest.mark.parametrize("arch", ["baseline", "diff", "diff2"])
def test_model_loss_and_gradients_match_between_backends(arch):
    """Every product of a training step (projections, MLP, the fused LM-head loss) by oneDNN:
    the loss and every parameter's gradient as with torch's products."""
    cfg = ModelConfig(arch=arch, vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    torch.manual_seed(4)
    model = Transformer(cfg)
    x = torch.randint(0, 97, (2, 16))
    y = torch.randint(0, 97, (2, 16))
    y[0, :3] = -100
    results = {}
    for name in ("torch", "onednn"):
        with gemm.use_backend(name):
            loss = model(x, y, return_logits=False).loss
            loss.backward()
            logits = model(x).logits
        results[name] = (
            loss.detach(),
            logits.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters()},
        )
        model.zero_grad(set_to_none=True)
    (l_t, z_t, g_t), (l_o, z_o, g_o) = results["torch"], results["onednn"]
    torch.testing.assert_close(l_o, l_t, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z_o, z_t, rtol=1e-5, atol=1e-5)
    assert g_o.keys() == g_t.keys()
    for n in g_t:
        torch.testing.assert_close(g_o[n], g_t[n], rtol=1e-4, atol=1e-6, msg=n)


@needs_onednn
def test_fused_loss_matches_between_backends():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (40,), generator=g)
    t[:4] = -100
    out = {}
    for name in ("torch", "onednn"):
        with gemm.use_backend(name):
            loss = linear_cross_entropy(h, w, t, rows=16)  # three chunks, the last one short
        out[name] = (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    for a, b in zip(out["onednn"], out["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_linear_under_torch_compile_matches_eager():
    torch.manual_seed(6)
    layer = nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with gemm.use_backend("onednn"):
        eager, eager_g = _grads(lambda: gemm.linear(layer, x), x, layer.weight)
        compiled_fn = torch.compile(lambda inp: gemm.linear(layer, inp), backend="inductor", fullgraph=True)
        got, got_g = _grads(lambda: compiled_fn(x), x, layer.weight)
    torch.testing.assert_close(got, eager)
    for a, b in zip(got_g, eager_g, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("setting", "vendor", "expected"),
    [
        ("", "AuthenticAMD", "onednn"),  # MKL's generic path there: oneDNN
        ("auto", "GenuineIntel", "torch"),  # MKL's own fast path
        ("", "", "torch"),  # unknown vendor: leave torch's choice alone
        ("torch", "AuthenticAMD", "torch"),
        ("onednn", "GenuineIntel", "onednn"),
        (" OneDNN ", "GenuineIntel", "onednn"),
    ],
)
def test_backend_choice(setting, vendor, expected, monkeypatch, fresh_backend):
    monkeypatch.setattr(gemm, "_onednn_op", lambda: object())  # as on any x86-64 torch build
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setenv("DIFFTRAIN_CPU_GEMM", setting)
    assert gemm.backend() == expected
    with gemm.use_backend("torch"):  # an explicit choice wins inside its block
        assert gemm.backend() == "torch"
    assert gemm.backend() == expected


def test_backend_without_onednn(monkeypatch, fresh_backend):
    monkeypatch.setattr(gemm, "_onednn_op", lambda: None)  # e.g. an ARM build
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setenv("DIFFTRAIN_CPU_GEMM", "auto")
    assert gemm.backend() == "torch"
    gemm.forget_configured_backend()
    monkeypatch.setenv("DIFFTRAIN_CPU_GEMM", "onednn")
    with pytest.raises(ConfigError, match="no oneDNN"):
        gemm.backend()
    with pytest.raises(ConfigError, match="no oneDNN"):
        with gemm.use_backend("onednn"):
            pass


def test_bad_setting_is_a_one_line_error_before_any_work(monkeypatch, capsys, tmp_path, fresh_backend):
    monkeypatch.setenv("DIFFTRAIN_CPU_GEMM", "fastest")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "quickstart"]) == 2
    err = capsys.readouterr().err
    assert "DIFFTRAIN_CPU_GEMM='fastest'" in err and "auto, onednn, torch" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_a_bad_setting_is_refused_before_torch_loads(tmp_path, cli_probe):
    # it was checked after importing torch (about 3 s on a small CPU)
    done = cli_probe(
        [["plan", "quickstart"], ["recipes", "list"]],
        tmp_path,
        prelude="import os; os.environ['DIFFTRAIN_CPU_GEMM'] = 'fastest'",
    )
    assert done.codes == [2, 2] and done.loaded == []
    assert done.stderr.count("DIFFTRAIN_CPU_GEMM='fastest' is not a CPU matrix-product backend") == 2


def test_cpu_vendor_reads_proc_cpuinfo(monkeypatch, tmp_path):
    import builtins

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda f, *a, **k: real_open(fake if f == "/proc/cpuinfo" else f, *a, **k)
    )
    assert gemm.cpu_vendor() == "AuthenticAMD"


@needs_onednn
def test_lora_base_product_by_onednn_matches_torch():
    """A LoRA layer's frozen base runs through oneDNN (∂x only: no weight gradient is formed) and
    gives the adapter and the input the gradients torch's product gives."""
    from difftrain.model.lora import LoRALinear

    torch.manual_seed(7)
    base = nn.Linear(12, 10, bias=False).requires_grad_(False)
    lora = LoRALinear(base, rank=4, alpha=8.0)
    nn.init.normal_(lora.lora_B)  # non-zero B, so both factors get gradients
    x = torch.randn(20, 12, requires_grad=True)
    res = {}
    for name in ("torch", "onednn"):
        with gemm.use_backend(name):
            res[name] = _grads(lambda: lora(x), x, lora.lora_A, lora.lora_B)
        assert base.weight.grad is None
    torch.testing.assert_close(res["onednn"][0], res["torch"][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(res["onednn"][1], res["torch"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_small_products_stay_with_torch(monkeypatch):
    """Below MIN_ROWS rows or MIN_MACS multiply-adds oneDNN's call cost loses: the layer (and the
    loss's products) run as torch's; at the default thresholds and above them, oneDNN's."""
    monkeypatch.setattr(gemm, "MIN_ROWS", 16)
    monkeypatch.setattr(gemm, "MIN_MACS", 1 << 22)
    assert not gemm.large_enough(1, 256, 1 << 20)  # one row: decoding
    assert not gemm.large_enough(256, 64, 64)  # 1M multiply-adds
    assert gemm.large_enough(4096, 256, 256)
    torch.manual_seed(8)
    small, big = nn.Linear(64, 64, bias=False), nn.Linear(256, 256, bias=False)
    with gemm.use_backend("onednn"):
        out = gemm.linear(small, torch.randn(256, 64, requires_grad=True))
        assert type(out.grad_fn).__name__ != "_LinearBackward"
        out = gemm.linear(big, torch.randn(64, 256, requires_grad=True))  # 4.2M multiply-adds
        assert type(out.grad_fn).__name__ == "_LinearBackward"
        a, b = torch.randn(8, 1024), torch.randn(1024, 1024)  # 8M multiply-adds but 8 rows
        assert torch.equal(gemm.mm(a, b), a @ b)
