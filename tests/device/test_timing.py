"""The instruction-level timing model: its per-instruction formulas, its scheduler (engines
concurrent, in order each, loops in steady state), and the calibration rows it must reproduce."""
import importlib.util
import pathlib

import pytest
import torch

import tilewise
from tilewise.device import timing
from tilewise.device.cost import compute_rate, kernel_seconds
from tilewise.device.spec import TRN1, TRN2, TRN3

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _calibration():
    spec = importlib.util.spec_from_file_location("calibration", ROOT / "benchmarks" / "calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


calibration = _calibration()


def test_matmul_instruction_follows_the_isa_formula():
    bf16 = timing.matmul_instr(TRN2, 128, 512, 128, torch.bfloat16)
    assert bf16.seconds == pytest.approx((512 + 64) / 2.4e9)  # max(min(64, 128), 512) + start-up
    assert timing.matmul_instr(TRN2, 128, 512, 128, torch.float32).seconds == pytest.approx((4 * 512 + 64) / 2.4e9)
    assert timing.matmul_instr(TRN2, 128, 16, 128, torch.bfloat16).seconds == pytest.approx((64 + 64) / 2.4e9)
    assert bf16.flops == 2 * 128 * 128 * 512
    # fp8: 256 contraction rows per pass on trn2 (double-row), 128 on trn1, 512 on trn3
    rows256 = {spec.name: timing.matmul_instr(spec, 128, 512, 256, torch.float8_e4m3fn).seconds * spec.tensor_hz
               for spec in (TRN1, TRN2, TRN3)}
    assert rows256 == pytest.approx({"trn1": 2 * 512 + 64, "trn2": 512 + 64, "trn3": 512 + 64})


def test_vector_scalar_gpsimd_and_dma_costs():
    one = timing.engine_instr(TRN1, timing.VECTOR, 1000, torch.float32).seconds * TRN1.vector_hz
    two = timing.engine_instr(TRN1, timing.VECTOR, 1000, torch.float32, two_input=True).seconds * TRN1.vector_hz
    small = timing.engine_instr(TRN1, timing.VECTOR, 1, torch.float32).seconds * TRN1.vector_hz
    assert (one, two, small) == pytest.approx((1000 + 100, 2000 + 100, 64 + 100))
    bf16 = timing.engine_instr(TRN2, timing.VECTOR, 1024, torch.bfloat16, two_input=True).seconds * TRN2.vector_hz
    assert bf16 == pytest.approx(1024 / 4 + 100)  # 512 bf16 lanes, no two-input factor for 16-bit
    gpsimd = timing.engine_instr(TRN2, timing.GPSIMD, 512, torch.float32).seconds * TRN2.vector_hz
    assert gpsimd == pytest.approx(150 + 512 + 100)
    assert timing.dma_efficiency(TRN2, 256) == pytest.approx(0.2)
    assert timing.dma_efficiency(TRN2, 2048) == pytest.approx(2 / 3) and timing.dma_efficiency(TRN2, 4096) == 0.8
    dma = timing.dma_instr(TRN1, 128 * 4096, 128)
    assert dma.seconds == pytest.approx(0.6e-6 + 128 * 4096 / (17e9 * 0.8)) and dma.latency == 1.3e-6


def test_engines_run_concurrently_each_in_order_and_wait_for_what_they_read():
    add = timing.engine_instr(TRN2, timing.VECTOR, 4096, torch.float32, writes=("a",))
    act = timing.engine_instr(TRN2, timing.SCALAR, 4096, torch.float32, writes=("b",))
    alone = timing.schedule((add,), TRN2).seconds
    assert timing.schedule((add, act), TRN2).seconds == pytest.approx(max(alone, act.seconds))  # concurrent
    assert timing.schedule((add, add), TRN2).seconds == pytest.approx(2 * alone)  # one engine: in turn
    dependent = timing.engine_instr(TRN2, timing.SCALAR, 4096, torch.float32, reads=("a",))
    assert timing.schedule((add, dependent), TRN2).seconds == pytest.approx(alone + dependent.seconds)


def test_sixteen_dma_queues_share_the_transfers():
    load = timing.dma_instr(TRN2, 128 * 2048, 128)
    sixteen = timing.schedule((timing.Loop(16, (load,)),), TRN2).seconds
    seventeen = timing.schedule((timing.Loop(17, (load,)),), TRN2).seconds
    assert sixteen == pytest.approx(load.seconds + load.latency)
    assert seventeen == pytest.approx(2 * load.seconds + load.latency)


@pytest.mark.parametrize("make,device", [(calibration.matmul_tiled, "trn1"), (calibration.matmul_block_all, "trn1"),
                                         (calibration.double_row_matmul, "trn2")])
def test_steady_state_loops_give_what_playing_every_iteration_gives(make, device, monkeypatch):
    from tilewise.compiler.passes.timing import kernel_program

    spec = tilewise.device.PRESETS[device]
    program = kernel_program(make(), spec)
    steady = timing.schedule(program, spec)
    monkeypatch.setattr(timing, "PLAY_WHOLE", 10**9)
    whole = timing.schedule(program, spec)
    assert steady.seconds == pytest.approx(whole.seconds, rel=0.01)
    assert steady.busy == pytest.approx(whole.busy, rel=0.01)
    assert timing.schedule(program, spec).seconds == whole.seconds  # deterministic


def test_a_launch_costs_no_more_than_its_kernels_one_after_another():
    """GPT-2's lm-head backward: a matmul's loop over the vocabulary, played after kernels whose
    transfers still held some DMA queues, took the idle queues in its first windows; extrapolated
    from there, the launch cost 146 ms, its kernels one after another 11. A launch plays its
    kernels back to back, overlapping where no value flows: never longer than in turn."""
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx
    from tilewise.compiler import compile_graph
    from tilewise.compiler.passes.timing import kernel_program

    def head(x, w, y):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss = F.cross_entropy(x @ w.t(), y)
        return (loss, *torch.autograd.grad(loss, [x, w]))

    inputs = [torch.randn(128, 768), torch.randn(50257, 768) * 0.02, torch.randint(0, 50257, (128,))]
    compiled = compile_graph(make_fx(head)(*inputs), inputs, spec=TRN2)
    costs = {cost.name: cost.seconds for cost in compiled.cost}
    tiled = [launch for launch in compiled.launches if launch.kernels[0].kind != "opaque"]
    assert any(len(launch.kernels) > 1 for launch in tiled)
    for launch in tiled:
        in_turn = sum(timing.schedule(kernel_program(k, TRN2, launch), TRN2).seconds for k in launch.kernels)
        assert costs[launch.name] <= (in_turn + TRN2.launch_overhead_s) * 1.01, (launch.name, costs[launch.name], in_turn)


def test_calibration_rows_within_25_percent_of_the_published_figures():
    rows = calibration.rows()
    for row in rows:
        assert 0.75 <= row["predicted"] / row["published"] <= 1.25, row
    matmuls = [row["predicted"] for row in rows[:4]]
    assert matmuls == sorted(matmuls, reverse=True)  # tiled > hoisted > M/N blocked > M/N/K blocked
    assert calibration.peak_share(matmuls[-1]) > 0.75


def test_eager_matmul_and_add_fall_below_peak_for_the_modelled_reasons():
    n = 2048
    matmul = kernel_seconds(TRN2, "TensorEngine", 2 * n * n * 4, n * n * 4, 2 * n**3, torch.float32, (n, n))
    peak = 2 * n**3 / compute_rate(TRN2, "TensorEngine", torch.float32)
    assert peak < matmul < 4 * peak  # DMA-bound: a 512 B/partition lhsT tile per contraction step
    elements = n * n
    add = kernel_seconds(TRN2, "VectorEngine", 2 * elements * 4, elements * 4, elements, torch.float32)
    roofline = 3 * elements * 4 / TRN2.hbm_bandwidth
    assert roofline < add < 2 * roofline  # per-transfer DMA costs and efficiency below 100%


def test_a_compiled_launch_shows_where_its_time_went():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilewise.compiler import compile_graph

    a, w = torch.empty(1024, 1024, device="meta"), torch.empty(1024, 1024, device="meta")
    compiled = compile_graph(make_fx(lambda a, w: a @ w)(a, w), [a, w], spec=TRN2)
    text = compiled.passes_text[-1]
    assert "busiest DMA; active: TensorEngine" in text  # the loop nest reloads its operand tiles
    (launch,) = compiled.cost
    assert f"{2 * 1024**3 / launch.seconds / 1e12:.2f} TFLOP/s" in text
    share = 2 * 1024**3 / launch.seconds / TRN2.tensor_flops_fp32
    assert 0 < share < 1 and f"({share:.0%} of peak)" in text


def test_combined_profile_weighs_each_launch_by_its_time():
    spec = TRN2
    a = timing.profile(timing.Schedule(1e-6, {"TensorEngine": 1e-6, "DMA": 8e-6}, queues=16), 3e-6, 300, 6000,
                       1e9 * 1e3, spec)
    b = timing.profile(timing.Schedule(3e-6, {"VectorEngine": 3e-6, "DMA": 48e-6}, queues=16), 5e-6, 500, 0,
                       1e9 * 1e3, spec)
    both = timing.combined([a, None, b])
    assert both.seconds == pytest.approx(8e-6) and both.makespan == pytest.approx(4e-6)
    shares = dict(both.shares)
    assert abs(shares["TensorEngine"] - 0.25) < 1e-12 and abs(shares["VectorEngine"] - 0.75) < 1e-12
    assert abs(shares["DMA"] - (0.5 + 3 * 1.0) / 4) < 1e-12 and both.busiest == "DMA"
    assert abs(both.flops_per_s - 6000 / 8e-6) < 1e-3 and abs(both.bytes_per_s - 800 / 8e-6) < 1e-3
    assert timing.combined([None]) is None


def test_a_trace_plays_as_schedule_does_and_keeps_its_first_spans_in_engine_order():
    program = timing.matmul_program(TRN2, 4096, 4096, 4096, torch.float32)
    played = timing.trace(program, TRN2, limit=50)
    assert played.schedule == timing.schedule(program, TRN2)
    assert len(played.spans) == 50 and played.instructions == 8 * 32 * (32 * 3 + 2)
    assert played.played < played.instructions  # its contraction loops played in steady state
    assert [span.name for span in played.spans[:3]] == ["load", "load", "matmul"]
    by_unit = {}
    for span in played.spans:
        assert span.end > span.start >= 0 and span.end <= played.schedule.seconds
        assert span.unit in timing.ENGINES or span.unit.removeprefix("DMA").isdigit()
        by_unit.setdefault(span.unit, []).append(span)
    for spans in by_unit.values():  # each engine and queue runs one instruction at a time, in order
        assert all(a.end <= b.start + 1e-15 for a, b in zip(spans, spans[1:]))
    assert {span.unit for span in played.spans} > {timing.TENSOR, "DMA0", "DMA15"}
