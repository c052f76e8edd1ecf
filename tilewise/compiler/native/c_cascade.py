"""CPU's float row sum as C: the order in which PyTorch adds a contiguous row, so a C kernel's sums
and means round exactly as CPU's kernel (and the tile interpreter, which runs it on the tile) do.

PyTorch sums floats with `cascade_sum` (aten/src/ATen/native/cpu/SumKernel.cpp): a row of at least
one vector is read as vectors of `Vectorized<T>::size()` lanes (32 bytes, 64 with AVX-512), four
vectors side by side, each of the four added into a cascade of four levels (a level of 2^level_power
additions carries into the next, so only partial sums of similar size meet); the levels and the four
are then added in order, the scalar tail into a fresh accumulator, the lanes after it, and the result
added to the zero the output was filled with. A row shorter than a vector takes the same cascade
over single elements. Every step is a lane-wise IEEE add, so C that does them in this order is
bitwise CPU's; the vector width is the one ATen dispatches to on this machine, and the order is
checked once per process against this PyTorch's own sums (where it differs, sums keep CPU's kernel).
"""
from __future__ import annotations

import functools
import platform

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

# ATen's vector widths per CPU capability (vec_base.h: VECTOR_WIDTH), widest first; other machines
# keep CPU's kernel. An AVX-512 machine may run the sum kernel at AVX2's width: PyTorch builds most
# kernels for AVX-512 only where it registers them so (seen here: 32-byte vectors under "AVX512").
_VECTOR_BYTES = {"DEFAULT": (32,), "AVX2": (32,), "AVX512": (64, 32)}
CASCADE_DTYPES = {torch.float32: "float", torch.float64: "double"}


@functools.lru_cache(maxsize=1)
def vector_bytes() -> int | None:
    """Bytes of one vector of this PyTorch's float sums on this CPU: the first width of its
    capability whose order below gives those sums bitwise, checked once on rows of every shape the
    cascade distinguishes (the C follows the same steps, and tests/compiler/test_native.py holds it to it);
    None where no width does, or the capability is not known here."""
    widths = _VECTOR_BYTES.get(torch.backends.cpu.get_cpu_capability(), ()) \
        if platform.machine() in ("x86_64", "AMD64") else ()
    # on CPU's kernels, whatever mode the first compile runs under (a torch.compile backend's:
    # AOTAutograd's fake tensors, which have no .numpy())
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return next((width for width in widths if _gives_cpus_sums(width)), None)


def _gives_cpus_sums(width: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    for dtype in CASCADE_DTYPES:
        lanes = width // dtype.itemsize
        for n in (5, lanes, 37, 1000, 4099):
            row = torch.randn(n, generator=generator, dtype=dtype) * 1e3 + 0.3
            if _cascade_sum(row.numpy(), lanes) != row.sum().item():
                return False
    return True


def _cascade_sum(row: np.ndarray, lanes: int):
    """The order the C adds in, in numpy (lane-wise IEEE adds in the row's dtype)."""
    n, zero = len(row), row.dtype.type(0)
    if n < lanes:
        return zero + _row_sum(row.reshape(n, 1))[0]
    vectors = n // lanes
    partial = _row_sum(row[:vectors * lanes].reshape(vectors, lanes))
    total = zero
    for value in row[vectors * lanes:]:
        total += value
    for value in partial:
        total += value
    return zero + total


def _row_sum(elements: np.ndarray) -> np.ndarray:
    """row_sum of SumKernel.cpp over `elements` (one row of lanes each), four at a time in a cascade."""
    size = len(elements)
    groups = size // 4
    level_power = max(4, (1 if groups <= 2 else int(groups - 1).bit_length()) // 4)
    step, mask = 1 << level_power, (1 << level_power) - 1
    acc = np.zeros((4, 4, elements.shape[1]), dtype=elements.dtype)
    i = 0
    while i + step <= groups:
        for _ in range(step):
            acc[0] += elements[i * 4:i * 4 + 4]
            i += 1
        for j in range(1, 4):
            acc[j] += acc[j - 1]
            acc[j - 1] = 0
            if i & (mask << (j * level_power)):
                break
    for i in range(i, groups):
        acc[0] += elements[i * 4:i * 4 + 4]
    for j in range(1, 4):
        acc[0] += acc[j]
    for e in range(groups * 4, size):
        acc[0][0] += elements[e]
    for k in range(1, 4):
        acc[0][0] += acc[0][k]
    return acc[0][0]


def function(dtype: torch.dtype) -> str:
    return f"tw_cascade_sum_{CASCADE_DTYPES[dtype]}"


def _row_sum_c(ctype: str, width: int) -> str:
    """row_sum + multi_row_sum over `size` elements of `width` lanes (element i at in[i * width])."""
    name = f"tw_row_sum_{ctype}_{width}"
    lanes = "for (int l = 0; l < W; l++)"
    return f"""
static void {name}(const {ctype} *in, int64_t size, {ctype} out[{width}]) {{
  enum {{ W = {width} }};
  const int64_t groups = size / 4, level_power = tw_max64(4, tw_ceil_log2(groups) / 4);
  const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
  {ctype} acc[4][4][W] = {{{{{{0}}}}}};
  int64_t i = 0;
  for (; i + level_step <= groups;) {{
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; k++) {lanes} acc[0][k][l] += in[(i * 4 + k) * W + l];
    for (int j = 1; j < 4; ++j) {{
      for (int k = 0; k < 4; k++) {lanes} {{ acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0; }}
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }}
  }}
  for (; i < groups; ++i) for (int k = 0; k < 4; k++) {lanes} acc[0][k][l] += in[(i * 4 + k) * W + l];
  for (int j = 1; j < 4; ++j) for (int k = 0; k < 4; k++) {lanes} acc[0][k][l] += acc[j][k][l];
  for (int64_t e = groups * 4; e < size; ++e) {lanes} acc[0][0][l] += in[e * W + l];
  for (int k = 1; k < 4; k++) {lanes} acc[0][0][l] += acc[0][k][l];
  {lanes} out[l] = acc[0][0][l];
}}"""


def _cascade(ctype: str, lanes: int) -> str:
    return _row_sum_c(ctype, lanes) + _row_sum_c(ctype, 1) + f"""
static {ctype} tw_cascade_sum_{ctype}(const {ctype} *row, int64_t n) {{
  {ctype} partial[{lanes}];
  if (n < {lanes}) {{ tw_row_sum_{ctype}_1(row, n, partial); return ({ctype})0 + partial[0]; }}
  const int64_t vectors = n / {lanes};
  tw_row_sum_{ctype}_{lanes}(row, vectors, partial);
  {ctype} total = 0;
  for (int64_t k = vectors * {lanes}; k < n; k++) total += row[k];
  for (int l = 0; l < {lanes}; l++) total += partial[l];
  return ({ctype})0 + total;
}}"""


@functools.lru_cache(maxsize=1)
def helpers() -> str:
    """The C of the cascade for float and double at this machine's vector width ("" where unknown)."""
    width = vector_bytes()
    if width is None:
        return ""
    return ("""
static inline int64_t tw_max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t tw_ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)x - 1); }"""
            + "".join(_cascade(ctype, width // dtype.itemsize)
                      for dtype, ctype in CASCADE_DTYPES.items()) + "\n")
