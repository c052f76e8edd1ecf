"""The timing model against published NeuronCore figures: each published kernel written as a tile
program (tilewise.compiler.ir.tile_ir) with the loop nest, tile shapes and instructions of its
source, played by the instruction-level timing model on its device preset, and printed as
predicted vs published with their ratio.

Rows (sources in docs/design/timing-model.md):
- the NKI matmul tutorial, [4096, 8192] x [8192, 8192] bf16 on trn1: tiled 51.80 ms, hoisted loads
  42.96 ms, M/N blocking 22.07 ms, M/N/K blocking 6.97 ms (aws-neuron-sdk@4eba310f,
  general/nki/tutorials/matrix_multiplication.rst);
- the NKI LayerNorm tutorial, 300 x 1000 fp32 on trn1: v2 (bn_stats/bn_aggr and one tensor_scalar)
  takes 14.9% less time than v1 (nl.mean / nl.square / two element-wise passes): the row is v2's
  time over v1's, 0.851;
- the fp8 double-row matmul of nki-samples (512 x 16384 x 1024, lhs quantised in the kernel) on
  trn2: p99 latency <= 320 us, the test's bound (nki-samples@0898a77, test/unit/).
A kernel's time is its program's makespan, without the launch overhead (the published figures are
device latencies).

    python benchmarks/calibration.py [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tilewise.compiler.ir.tile_ir import HbmRef, Kernel, Ops, TileOp  # noqa: E402
from tilewise.compiler.passes.timing import kernel_program  # noqa: E402
from tilewise.device import timing  # noqa: E402
from tilewise.device.spec import PRESETS  # noqa: E402

aten = torch.ops.aten
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
TILE_K = TILE_M = 128   # nl.tile_size.pmax, gemm_stationary_fmax
TILE_N = 512            # nl.tile_size.gemm_moving_fmax


class Program:
    """Builds a tile kernel's body: loops, loads, engine instructions, stores."""

    def __init__(self, name: str):
        self.name, self.body, self.inputs, self.outputs = name, [], {}, {}

    @contextlib.contextmanager
    def loop(self, var: str, extent: int, step: int = 1):
        start = self.emit(TileOp(Ops.RANGE, None, arg=(var, extent, step)))
        yield
        self.emit(TileOp(Ops.END, None, srcs=(start,)))

    def emit(self, op: TileOp) -> TileOp:
        self.body.append(op)
        return op

    def hbm(self, table: dict, name: str, shape: tuple, dtype) -> str:
        table[name] = HbmRef(name, shape, tuple(math.prod(shape[i + 1:]) for i in range(len(shape))), dtype,
                             rows_cols=shape)
        return name

    def load(self, name: str, hbm_shape: tuple, tile: tuple, dtype, partition_var: str | None = None) -> TileOp:
        """A [partitions x free] tile of an HBM tensor into SBUF; `partition_var` names the loop
        whose mean extent is the tile's partition count (for a last, partial row tile)."""
        self.hbm(self.inputs, name, hbm_shape, dtype)
        return self.emit(TileOp(Ops.LOAD, dtype, arg=(name, False), shape=((partition_var, tile[0]), (None, tile[1])),
                                space="sbuf", name=f"{name}_sbuf"))

    def store(self, name: str, hbm_shape: tuple, value: TileOp, packed: tuple = ()) -> TileOp:
        """Store `value`'s tile, or the [partitions x free] tile `packed` that several
        instructions (the last of them `value`) wrote."""
        self.hbm(self.outputs, name, hbm_shape, value.dtype)
        shape = ((None, packed[0]), (None, packed[1])) if packed else ()
        return self.emit(TileOp(Ops.STORE, None, srcs=(value,), arg=name, shape=shape))

    def op(self, kind: Ops, target, dtype, tile: tuple, *srcs: TileOp, space="sbuf", arg=None,
           partition_var: str | None = None) -> TileOp:
        args = (target, tuple(("$", i) for i in range(len(srcs))), {}) if target is not None else arg
        return self.emit(TileOp(kind, dtype, srcs=srcs, arg=args, shape=((partition_var, tile[0]), (None, tile[1])),
                                space=space, name=f"t{len(self.body)}_{space}"))

    def matmul(self, acc: TileOp, lhs_t: TileOp, rhs: TileOp, double_row: bool = False) -> TileOp:
        return self.emit(TileOp(Ops.MATMUL, FP32, srcs=(acc, lhs_t, rhs), arg="double_row" if double_row else None,
                                shape=acc.shape, space="psum", name=acc.name))

    def zero(self, tile: tuple, dtype=FP32, space="psum") -> TileOp:
        return self.op(Ops.ZERO if space == "psum" else Ops.FILL, None, dtype, tile, space=space,
                       arg=None if space == "psum" else 0.0)

    def kernel(self) -> Kernel:
        return Kernel(self.name, "calibration", (), dict(self.inputs), dict(self.outputs), tuple(self.body))


# -- the NKI matmul tutorial: lhsT [K, M], rhs [K, N], bf16 ----------------------------------------

K, M, N = 8192, 4096, 8192


def matmul_tiled() -> Kernel:
    p = Program("matmul tiled")
    with p.loop("m", M // TILE_M), p.loop("n", N // TILE_N):
        acc = p.zero((TILE_M, TILE_N))
        with p.loop("k", K // TILE_K):
            lhs_t = p.load("lhsT", (K, M), (TILE_K, TILE_M), BF16)
            rhs = p.load("rhs", (K, N), (TILE_K, TILE_N), BF16)
            p.matmul(acc, lhs_t, rhs)
        p.store("result", (M, N), p.op(Ops.COPY, None, BF16, (TILE_M, TILE_N), acc))
    return p.kernel()


def matmul_hoisted() -> Kernel:
    p = Program("matmul hoisted loads")
    with p.loop("m", M // TILE_M):
        with p.loop("k", K // TILE_K):
            lhs_t = p.load("lhsT", (K, M), (TILE_K, TILE_M), BF16)
        with p.loop("n", N // TILE_N):
            with p.loop("k", K // TILE_K):
                rhs = p.load("rhs", (K, N), (TILE_K, TILE_N), BF16)
            acc = p.zero((TILE_M, TILE_N))
            with p.loop("k", K // TILE_K):
                p.matmul(acc, lhs_t, rhs)
            p.store("result", (M, N), p.op(Ops.COPY, None, BF16, (TILE_M, TILE_N), acc))
    return p.kernel()


def matmul_block_free(tiles_m: int = 2, tiles_n: int = 2) -> Kernel:
    p = Program("matmul M/N blocking")
    with p.loop("m", M // (TILE_M * tiles_m)):
        with p.loop("bm", tiles_m), p.loop("k", K // TILE_K):
            lhs_t = p.load("lhsT", (K, M), (TILE_K, TILE_M), BF16)
        with p.loop("n", N // (TILE_N * tiles_n)):
            with p.loop("bn", tiles_n), p.loop("k", K // TILE_K):
                rhs = p.load("rhs", (K, N), (TILE_K, TILE_N), BF16)
            with p.loop("bm", tiles_m), p.loop("bn", tiles_n):
                acc = p.zero((TILE_M, TILE_N))
                with p.loop("k", K // TILE_K):
                    p.matmul(acc, lhs_t, rhs)
                p.store("result", (M, N), p.op(Ops.COPY, None, BF16, (TILE_M, TILE_N), acc))
    return p.kernel()


def matmul_block_all(tiles_m: int = 16, tiles_n: int = 2, tiles_k: int = 8) -> Kernel:
    """The tutorial's fully optimised kernel: rhs loaded [128 x BLOCK_N] and lhsT [128 x BLOCK_M]
    (2 and 4 KiB per partition), results accumulated in SBUF over K blocks, stored packed."""
    block_m, block_n = TILE_M * tiles_m, TILE_N * tiles_n
    p = Program("matmul M/N/K blocking")
    with p.loop("n", N // block_n):
        with p.loop("r", M // block_m * tiles_m * tiles_n):
            result = p.zero((TILE_M, TILE_N), BF16, space="sbuf")
        with p.loop("k", K // (TILE_K * tiles_k)):
            with p.loop("bk", tiles_k):
                rhs = p.load("rhs", (K, N), (TILE_K, block_n), BF16)
            with p.loop("m", M // block_m):
                with p.loop("bk", tiles_k):
                    lhs_t = p.load("lhsT", (K, M), (TILE_K, block_m), BF16)
                with p.loop("bn", tiles_n), p.loop("bm", tiles_m):
                    acc = p.zero((TILE_M, TILE_N))
                    with p.loop("bk", tiles_k):
                        p.emit(TileOp(Ops.MATMUL, FP32, srcs=(acc, lhs_t, rhs), shape=acc.shape, space="psum",
                                      name=acc.name))
                    p.op(Ops.ALU, aten.add.Tensor, BF16, (TILE_M, TILE_N), result, acc)
        with p.loop("m", M // block_m), p.loop("bm", tiles_m):
            with p.loop("bn", tiles_n):  # coalesce the result tiles into one [128 x BLOCK_N] store
                packed = p.op(Ops.COPY, None, BF16, (TILE_M, TILE_N), result)
            p.store("result", (M, N), packed, packed=(TILE_K, block_n))
    return p.kernel()


# -- the NKI LayerNorm tutorial: 300 x 1000 fp32 ---------------------------------------------------

ROWS, COLS = 300, 1000
BN_STATS_FMAX = 512  # nl.tile_size.bn_stats_fmax


def _layernorm(version: int) -> Kernel:
    p = Program(f"layernorm v{version}")
    gamma = p.load("gamma", (1, COLS), (1, COLS), FP32)
    beta = p.load("beta", (1, COLS), (1, COLS), FP32)
    tile, row = (TILE_K, COLS), (TILE_K, 1)
    with p.loop("i", ROWS, TILE_K):
        x = p.load("input", (ROWS, COLS), tile, FP32, partition_var="i")
        if version == 1:
            mean = p.op(Ops.REDUCE, aten.mean.dim, FP32, row, x)                   # nl.mean
            square = p.op(Ops.ALU, aten.square.default, FP32, tile, x)              # nl.square
            mean_sq = p.op(Ops.REDUCE, aten.mean.dim, FP32, row, square)            # nl.mean
            mean2 = p.op(Ops.ALU, aten.mul.Tensor, FP32, row, mean, mean)            # mean * mean
            var = p.op(Ops.ALU, aten.sub.Tensor, FP32, row, mean_sq, mean2)
            var_eps = p.op(Ops.ALU, aten.add.Tensor, FP32, row, var)                 # + epsilon
            rstd = p.op(Ops.ALU, aten.rsqrt.default, FP32, row, var_eps)             # ScalarE
            shifted = p.op(Ops.ALU, aten.sub.Tensor, FP32, tile, x, mean)            # tensor_scalar
            normed = p.op(Ops.ALU, aten.mul.Tensor, FP32, tile, shifted, rstd)       # tensor_scalar
        else:
            stats = [p.op(Ops.ALU, aten.var_mean.correction, FP32, (TILE_K, width), x)  # bn_stats, per 512
                     for width in (BN_STATS_FMAX, COLS - BN_STATS_FMAX)]
            mean_var = p.op(Ops.ALU, aten.mean.dim, FP32, (TILE_K, 6 * len(stats)), stats[-1])  # bn_aggr
            var_eps = p.op(Ops.ALU, aten.add.Tensor, FP32, row, mean_var)
            rstd = p.op(Ops.ALU, aten.rsqrt.default, FP32, row, var_eps)
            # nisa.tensor_scalar: (x - mean) * rstd, two ALU stages in one pass over the tile
            normed = p.op(Ops.ALU, aten.mul.Tensor, FP32, tile, x, mean_var, rstd)
        scaled = p.op(Ops.ALU, aten.mul.Tensor, FP32, tile, normed, gamma)
        out = p.op(Ops.ALU, aten.add.Tensor, FP32, tile, scaled, beta, partition_var="i")
        p.store("output", (ROWS, COLS), out)
    return p.kernel()


# -- the fp8 double-row matmul of nki-samples: lhs [M, K] bf16, rhs fp8 reshaped [K/2, 2N] ----------

def double_row_matmul(m: int = 512, k: int = 16384, n: int = 1024, tiles_m: int = 2, tiles_n: int = 2,
                      tiles_k: int = 16) -> Kernel:
    block_m, block_n, block_k = TILE_M * tiles_m, TILE_N * tiles_n, TILE_K * tiles_k
    p = Program("fp8 double-row matmul")
    with p.loop("m", m // block_m):
        result = p.zero((TILE_M, n // block_n * tiles_m * block_n), BF16, space="sbuf")
        with p.loop("k", k // block_k):
            with p.loop("bm", tiles_m):
                lhs = p.load("lhs", (m, k), (TILE_M, block_k), BF16)
                magnitude = p.op(Ops.ALU, aten.abs.default, BF16, (TILE_M, block_k), lhs)
                scale = p.op(Ops.REDUCE, aten.amax.default, BF16, (TILE_M, 1), magnitude)
                scale = p.op(Ops.ALU, aten.div.Tensor, BF16, (TILE_M, 1), scale)
                quantised = p.op(Ops.ALU, aten.div.Tensor, FP8, (TILE_M, block_k), lhs, scale)
                with p.loop("bk", tiles_k):  # nc_transpose of each [128 x 128] tile on the TensorEngine
                    lhs_t = p.emit(TileOp(Ops.MATMUL, FP8, srcs=(quantised, quantised, quantised),
                                          shape=((None, TILE_M), (None, TILE_M)), space="psum", name="lhsT_psum"))
            scoped = p.zero((TILE_M, n // block_n * tiles_m * block_n), BF16, space="sbuf")
            with p.loop("n", n // block_n):
                with p.loop("bk", tiles_k // 2):
                    rhs = p.load("rhs", (k // 2, 2 * n), (TILE_K, 2 * block_n), FP8)
                with p.loop("bm", tiles_m), p.loop("bn", tiles_n):
                    acc = p.zero((TILE_M, TILE_N))
                    with p.loop("bk", tiles_k // 2):
                        p.matmul(acc, lhs_t, rhs, double_row=True)
                    p.op(Ops.ALU, aten.add.Tensor, BF16, (TILE_M, TILE_N), scoped, acc)
            with p.loop("bm", tiles_m):
                dequantised = p.op(Ops.ALU, aten.mul.Tensor, BF16, (TILE_K, n), scoped, scale)
                p.op(Ops.ALU, aten.add.Tensor, BF16, (TILE_K, n), result, dequantised)
        rhs_scale = p.load("rhs_scale", (TILE_K, n), (TILE_K, n), BF16)
        with p.loop("bm", tiles_m):
            out = p.op(Ops.ALU, aten.mul.Tensor, BF16, (TILE_M, n), result, rhs_scale)
            p.store("result", (m, n), out)
    return p.kernel()


def seconds(kernel: Kernel, device: str) -> float:
    return timing.schedule(kernel_program(kernel, PRESETS[device]), PRESETS[device]).seconds


def rows() -> list[dict]:
    """Every calibration row: name, device, published, predicted, unit."""
    out = []
    for kernel, published in ((matmul_tiled(), 51.80), (matmul_hoisted(), 42.96), (matmul_block_free(), 22.07),
                              (matmul_block_all(), 6.97)):
        out.append({"name": kernel.name, "device": "trn1", "published": published,
                    "predicted": seconds(kernel, "trn1") * 1e3, "unit": "ms"})
    v1, v2 = seconds(_layernorm(1), "trn1"), seconds(_layernorm(2), "trn1")
    out.append({"name": "layernorm v2 / v1 time", "device": "trn1", "published": 1 - 0.149,
                "predicted": v2 / v1, "unit": "x"})
    out.append({"name": "fp8 double-row matmul (p99 bound)", "device": "trn2", "published": 320.0,
                "predicted": seconds(double_row_matmul(), "trn2") * 1e6, "unit": "us"})
    return out


def peak_share(predicted_ms: float) -> float:
    """The share of trn1's bf16 TensorEngine peak a tutorial matmul variant reaches."""
    return 2 * M * N * K / (predicted_ms * 1e-3) / PRESETS["trn1"].tensor_flops_bf16


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args(argv)
    table = rows()
    print(f"{'row':<36}{'device':<8}{'published':>12}{'predicted':>12}  unit  ratio")
    for row in table:
        print(f"{row['name']:<36}{row['device']:<8}{row['published']:>12.3f}{row['predicted']:>12.3f}  "
              f"{row['unit']:<4}  {row['predicted'] / row['published']:.3f}")
    for row in table[:4]:
        print(f"{row['name']}: {peak_share(row['predicted']):.1%} of trn1 bf16 peak")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
