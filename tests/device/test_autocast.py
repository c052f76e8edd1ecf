"""Mixed precision on neuron: torch.autocast with CUDA's cast policy, GradScaler, bf16 models.

References are independent of tilewise: per op, the same op on CPU with the inputs cast as CUDA's
policy says (aten/src/ATen/autocast_mode.h); per model, the model on CPU under
`torch.autocast("cpu")` where CPU's policy equals CUDA's for its ops, else CUDA's dtypes checked
and values compared with bf16 tolerance.
"""
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import tilewise
from tilewise.device.amp import CastPolicy, policy_of

MODES = ["eager", "adaptive", "compiled"]
aten = torch.ops.aten
bf16, f32 = torch.bfloat16, torch.float32


def test_autocast_on_neuron_is_accepted_and_reports_its_state():
    assert torch.amp.is_autocast_available("neuron")
    assert not torch.is_autocast_enabled("neuron")
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast(device_type="neuron", dtype=dtype):
            assert torch.is_autocast_enabled("neuron") and torch.get_autocast_dtype("neuron") == dtype
            assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("neuron")
    assert torch.neuron.is_bf16_supported()


def test_an_unsupported_autocast_dtype_warns_and_disables_autocast_as_on_cuda():
    with pytest.warns(UserWarning, match="neuron Autocast only supports dtypes of torch.float16, torch.bfloat16"):
        with torch.autocast(device_type="neuron", dtype=torch.float64):
            assert not torch.is_autocast_enabled("neuron")


def _randn(*shape, dtype=f32, seed=0):
    torch.manual_seed(seed + len(shape))
    return torch.randn(*shape).to(dtype)


# name -> (op on the inputs, inputs, the dtype CUDA's policy gives, the reference computation on CPU)
CASES = {
    "mm_lower_precision": (torch.mm, (_randn(4, 5), _randn(5, 3)), bf16,
                           lambda a, b: torch.mm(a.to(bf16), b.to(bf16))),
    "linear_lower_precision": (F.linear, (_randn(4, 5), _randn(3, 5), _randn(3)), bf16,
                               lambda x, w, b: F.linear(x.to(bf16), w.to(bf16), b.to(bf16))),
    "conv2d_lower_precision": (F.conv2d, (_randn(2, 3, 6, 6), _randn(4, 3, 3, 3)), bf16,
                               lambda x, w: F.conv2d(x.to(bf16), w.to(bf16))),
    "baddbmm_lower_precision": (torch.baddbmm, (_randn(2, 3, 4), _randn(2, 3, 5), _randn(2, 5, 4)), bf16,
                                lambda c, a, b: torch.baddbmm(c.to(bf16), a.to(bf16), b.to(bf16))),
    "matmul_lower_precision": (torch.matmul, (_randn(2, 3, 5), _randn(5, 4)), bf16,
                               lambda a, b: torch.matmul(a.to(bf16), b.to(bf16))),
    "softmax_fp32_set_opt_dtype": (lambda x: torch.softmax(x, -1), (_randn(4, 6, dtype=bf16),), f32,
                                   lambda x: torch.softmax(x, -1, dtype=f32)),
    "log_softmax_fp32_set_opt_dtype": (lambda x: F.log_softmax(x, -1), (_randn(4, 6, dtype=bf16),), f32,
                                       lambda x: F.log_softmax(x, -1, dtype=f32)),
    "sum_fp32_set_opt_dtype": (lambda x: x.sum(0), (_randn(4, 6, dtype=bf16),), f32,
                               lambda x: x.sum(0, dtype=f32)),
    "softmax_keeps_a_given_dtype": (lambda x: torch.softmax(x, -1, dtype=bf16), (_randn(4, 6),), bf16,
                                    lambda x: torch.softmax(x, -1, dtype=bf16)),
    "layer_norm_fp32": (lambda x, w, b: F.layer_norm(x, (6,), w, b), (_randn(4, 6, dtype=bf16), _randn(6), _randn(6)),
                        f32, lambda x, w, b: F.layer_norm(x.float(), (6,), w, b)),
    "mse_loss_fp32": (F.mse_loss, (_randn(4, 6, dtype=bf16), _randn(4, 6)), f32,
                      lambda a, b: F.mse_loss(a.float(), b)),
    "exp_fp32": (torch.exp, (_randn(4, 6, dtype=bf16),), f32, lambda x: torch.exp(x.float())),
    "pow_fp32": (lambda x: x.pow(3), (_randn(4, 6, dtype=bf16),), f32, lambda x: x.float().pow(3)),
    "norm_fp32_append_dtype": (torch.norm, (_randn(4, 6, dtype=bf16),), f32, lambda x: torch.norm(x.float())),
    "norm_dim_fp32_append_dtype": (lambda x: torch.norm(x, dim=1), (_randn(4, 6, dtype=bf16),), f32,
                                   lambda x: torch.norm(x.float(), dim=1)),
    "cumsum_fp32_set_opt_dtype": (lambda x: torch.cumsum(x, 0), (_randn(4, 6, dtype=bf16),), f32,
                                  lambda x: torch.cumsum(x, 0, dtype=f32)),
    "addcmul_promotes_to_fp32": (torch.addcmul, (_randn(4, 6), _randn(4, 6, dtype=bf16), _randn(4, 6, dtype=bf16)),
                                 f32, lambda a, b, c: torch.addcmul(a, b.float(), c.float())),
    "addcmul_stays_in_bf16": (torch.addcmul, tuple(_randn(4, 6, dtype=bf16, seed=s) for s in range(3)), bf16,
                              torch.addcmul),
    # cross_entropy passes log_softmax its input's dtype, so only nll_loss runs in float32
    "cross_entropy_log_softmax_keeps_bf16": (
        F.cross_entropy, (_randn(4, 5, dtype=bf16), torch.tensor([0, 3, 1, 4])), f32,
        lambda x, y: F.nll_loss(F.log_softmax(x, 1, dtype=bf16).float(), y)),
    "relu_has_no_policy": (torch.relu, (_randn(4, 6),), f32, torch.relu),
    "mm_leaves_float64_alone": (torch.mm, (_randn(4, 5, dtype=torch.float64), _randn(5, 3, dtype=torch.float64)),
                                torch.float64, torch.mm),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_policy_gives_cuda_dtype_and_cpu_values(name):
    op, inputs, dtype, reference = CASES[name]
    expected = reference(*inputs)
    with torch.autocast(device_type="neuron", dtype=torch.bfloat16):
        got = op(*(x.to("neuron") for x in inputs))
    assert got.dtype == expected.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected)


def test_float16_autocast_casts_to_float16():
    a, b = _randn(4, 5), _randn(5, 3)
    with torch.autocast(device_type="neuron", dtype=torch.float16):
        got = a.to("neuron") @ b.to("neuron")
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu(), a.half() @ b.half())


def test_binary_cross_entropy_is_refused_as_on_cuda():
    p, t = torch.rand(4).to("neuron"), torch.rand(4).to("neuron")
    with torch.autocast(device_type="neuron", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, t)


def test_policy_table_follows_cuda_lists():
    assert policy_of(aten.addmm.default) is CastPolicy.LOWER_PRECISION_FP
    assert policy_of(aten.conv_transpose2d.input) is CastPolicy.LOWER_PRECISION_FP
    assert policy_of(aten.native_layer_norm.default) is CastPolicy.FP32
    assert policy_of(aten.softmax.int) is CastPolicy.FP32_SET_OPT_DTYPE
    assert policy_of(aten.index_put.default) is CastPolicy.PROMOTE
    assert policy_of(aten.add.Tensor) is None and policy_of(aten.conv1d.padding) is None


def test_autocast_outside_its_block_casts_nothing():
    a = _randn(4, 5).to("neuron")
    with torch.autocast(device_type="neuron", dtype=torch.bfloat16):
        assert (a @ a.t()).dtype == bf16
    assert (a @ a.t()).dtype == f32


# -- training under autocast, in every mode ----------------------------------------------------------
D = 16


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, D), torch.nn.ReLU(), torch.nn.Linear(D, 4))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x, y):
        return F.mse_loss(self.head(torch.relu(self.conv(x)).flatten(1)), y)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def forward(self, x, y):
        q, k, v = self.qkv(x).chunk(3, -1)
        self.probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), -1)
        return F.mse_loss(self.out(self.probs @ v), y)


def _batch(name):
    torch.manual_seed(1)
    if name == "mlp":
        return torch.randn(32, 8), torch.randn(32, 4)
    if name == "conv":
        return torch.randn(4, 3, 8, 8), torch.randn(4, 5)
    return torch.randn(2, 6, D), torch.randn(2, 6, D)


MODELS = {"mlp": Mlp, "conv": ConvNet, "attention": Attention}


def _train(name, device, mode, steps=5, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = [t.to(device) for t in _batch(name)]
    losses = []
    with tilewise.engine(mode=mode):
        for _ in range(steps):
            with torch.autocast(device_type=device, dtype=dtype):
                loss = model(*batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()], model


def _assert_compiled(mode):
    stats = tilewise.stats()
    if mode == "eager":
        assert stats.compiles == 0
    else:
        assert stats.compiles >= 1 and stats.ops_compiled > 0, stats.report()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_training_under_autocast_matches_cpu_autocast(name, mode):
    """linear, conv2d and mse_loss: CPU's policy equals CUDA's for these (not for cross_entropy,
    which CPU computes in float32 and CUDA in the autocast dtype, see CASES)."""
    cpu_losses, cpu_params, _ = _train(name, "cpu", "eager")
    losses, params, _ = _train(name, "neuron", mode)
    torch.testing.assert_close(losses, cpu_losses, atol=1e-4, rtol=1e-4)
    for p, e in zip(params, cpu_params):
        torch.testing.assert_close(p, e, atol=1e-4, rtol=1e-4)
    _assert_compiled(mode)


@pytest.mark.parametrize("mode", MODES)
def test_attention_under_autocast_follows_cuda_policy(mode):
    """CUDA's policy runs softmax in float32 (CPU's keeps bf16): its dtype is CUDA's, values agree
    with CPU's to bf16 precision."""
    cpu_losses, cpu_params, cpu_model = _train("attention", "cpu", "eager")
    losses, params, model = _train("attention", "neuron", mode)
    assert model.probs.dtype == f32 and cpu_model.probs.dtype == bf16
    torch.testing.assert_close(losses, cpu_losses, atol=1e-2, rtol=1.6e-2)
    for p, e in zip(params, cpu_params):
        torch.testing.assert_close(p, e, atol=1e-2, rtol=1.6e-2)
    _assert_compiled(mode)


def _train_scaled(device, mode, steps=4, poison_step=None):
    torch.manual_seed(0)
    model = Mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    x, y = (t.to(device) for t in _batch("mlp"))
    scales = []
    with tilewise.engine(mode=mode):
        for step in range(steps):
            with torch.autocast(device_type=device, dtype=torch.float16):
                loss = model(x, y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if step == poison_step:
                model.net[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return scales, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_with_float16_matches_cpu(mode):
    cpu_scales, cpu_params = _train_scaled("cpu", "eager", poison_step=2)
    scales, params = _train_scaled("neuron", mode, poison_step=2)
    assert scales == cpu_scales and scales[2] == scales[1] / 2  # the poisoned step backs off
    for p, e in zip(params, cpu_params):
        torch.testing.assert_close(p, e, atol=1e-4, rtol=1e-4)


def _recurrent(device, mode, autocast):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, num_layers=2, bidirectional=True).to(device)
    cell = torch.nn.GRUCell(4, 6).to(device)
    x = torch.randn(5, 3, 4).to(device)
    with tilewise.engine(mode=mode):
        with torch.autocast(device_type="neuron", dtype=torch.bfloat16, enabled=autocast):
            out, (h, c) = lstm(x)
            hidden = cell(x[0])
        (out.float().pow(2).mean() + hidden.float().sum()).backward()
        return [t.dtype for t in (out, c, hidden)], [out.float().cpu(), hidden.float().cpu(),
                                                    lstm.weight_ih_l0.grad.cpu(), cell.weight_hh.grad.cpu()]


@pytest.mark.parametrize("mode", MODES)
def test_recurrent_layers_under_autocast_run_their_cells_in_bf16(mode):
    """CUDA's policy casts the fused cells' inputs to the autocast dtype (CPU's has no such entry):
    bf16 results, within bf16 precision of the float32 model on CPU."""
    _, expected = _recurrent("cpu", "eager", autocast=False)
    dtypes, got = _recurrent("neuron", mode, autocast=True)
    assert dtypes == [bf16, bf16, bf16]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-2 * e.abs().max().item(), rtol=1.6e-2)


# -- a whole model in bfloat16 ------------------------------------------------------------------------
_BF16_LAYER_NORM = textwrap.dedent("""
    import sys, torch, tilewise
    def train(device, mode, steps=5):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4)).to(device).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(32, 8).to(device).bfloat16(), torch.randn(32, 4).to(device).bfloat16()
        losses = []
        with tilewise.engine(mode=mode):
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]
    mode = sys.argv[1]
    cpu_losses, cpu_params = train("cpu", "eager")
    losses, params = train("neuron", mode)
    torch.testing.assert_close(losses, cpu_losses, atol=1e-2, rtol=1.6e-2)
    for p, e in zip(params, cpu_params):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, e, atol=1e-2, rtol=1.6e-2)
    stats = tilewise.stats()
    assert (stats.compiles >= 1 and stats.ops_compiled > 0) == (mode != "eager"), stats.report()
    print("ok")
""")


def _bf16_layer_norm_in_subprocess(mode):
    # A process of its own: adaptive mode aborted the whole process on this model while the meta
    # kernel's float32 mean/rstd of a bf16 native_layer_norm stood for CPU's bf16 ones.
    return subprocess.run([sys.executable, "-c", _BF16_LAYER_NORM, mode], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_model_with_layer_norm_trains_like_cpu(mode):
    result = _bf16_layer_norm_in_subprocess(mode)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), \
        f"exit {result.returncode}\n{result.stderr[-3000:]}"
