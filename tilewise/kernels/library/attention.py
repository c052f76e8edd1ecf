"""FlashAttention forward and backward as tile kernels, and the autograd op over them.

Forward (per batch, head and q tile of 128 rows): K/V are streamed past the q tile in tiles of 512
keys (one fp32 PSUM bank of scores), from SBUF where the K/V head fits half of it (loaded once per
head: O(S * d) HBM traffic), else from HBM per q tile; with an online softmax: a running max m and sum l in fp32 SBUF, the output
accumulated in fp32 and rescaled by exp(m_old - m_new) as each K/V tile arrives. P is transposed on
the TensorEngine 128 keys at a time for the P @ V matmul. Causal attention skips the K/V tiles wholly
above the diagonal and masks the tiles it crosses with affine_select. The log-sum-exp m + log(l) is
saved for the backward.

Backward (per batch and K/V head): fp32 dK and dV accumulators for the whole head stay in SBUF (the
length they fit bounds where the kernel applies to F.scaled_dot_product_attention); K and V are
loaded once into SBUF beside them where they fit (O(S * d) HBM traffic), else streamed per q tile.
Each q tile of each query head of the group loads Q, dO, O and its log-sum-exp once, takes
D = rowsum(dO * O), and meets the K/V tiles of 128 keys: P is recomputed from the log-sum-exp,
dV += P^T dO, dP = dO V^T, dS = P * (dP - D) * scale, dK += dS^T Q, and dQ += dS K accumulates in one
PSUM bank until the q tile's last K/V tile, then is stored.

Dropout (a rate and an int32 seed tensor [128, 1]) drops P's elements by isa.dropout, a hash of
the seed, the head and each score's position: the forward after P's row sum joined l, the backward
on P for dV and on dP, regenerating the forward's mask in its own tiles.

Matmul operands are in the inputs' dtype (bf16 matmuls for bf16 inputs); statistics and accumulators
are fp32. GQA: query head h reads K/V head h // (heads / kv_heads). An additive mask (broadcastable to
[B, H, S, S_k], its size-1 dims read at 0) is added to the scaled scores of each tile, forward and
backward.
"""
import math

import torch

import tilewise.kernels as tk
from tilewise.device.runtime import DEVICE
from tilewise.reasons import Reason, Why

F32 = torch.float32
TQ = tk.tile_size.pmax              # q rows per tile
TK = tk.tile_size.gemm_moving_fmax  # keys per forward K/V tile: one fp32 PSUM bank of scores
TT = tk.tile_size.pmax              # keys per TensorEngine transpose, and per backward K/V tile
NEG = -30000.0                      # the masked score: exp(NEG * scale - max) is 0 in fp32
WORKING = 32 * 1024                 # SBUF bytes per partition a q tile's working tiles take at most


def _t_load(hbm, b: int, h: int, start: int, n: int, d: int):
    """Rows [start, start + n) of hbm[b, h] transposed: a [d, n] tile (head dim on the partitions)."""
    ip, jf = tk.mgrid[0:d, 0:n]
    return tk.load(hbm[b, h, start + jf, ip])


def _load(hbm, b: int, h: int, start: int, n: int, d: int):
    return tk.load(hbm[b, h, start:start + n, 0:d])


def _masked(scores, mask, b: int, h: int, q0: int, nq: int, k0: int, nk: int, scale: float):
    """(scores, the scale the softmax applies to them): with an additive mask, scores * scale + mask
    (its broadcast dims read at 0) and 1.0; else the scores as they are and `scale`."""
    if mask is None:
        return scores, scale
    ip, jf = tk.mgrid[0:nq, 0:nk]
    rows = q0 + ip if mask.shape[2] > 1 else 0 * ip
    cols = k0 + jf if mask.shape[3] > 1 else 0 * jf
    bias = tk.load(mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0, rows, cols])
    return tk.add(tk.multiply(scores, scale), bias, dtype=F32), 1.0


def _causal(scores, q0: int, k0: int, causal: bool):
    """The scores of keys after their query set to NEG, where the tile crosses the diagonal."""
    nq, nk = scores.shape
    if not causal or k0 + nk - 1 <= q0:
        return scores
    ip, jf = tk.mgrid[0:nq, 0:nk]
    return tk.isa.affine_select((q0 + ip) - (k0 + jf) >= 0, scores, NEG, dtype=F32)


def _sbuf_bytes() -> int:
    """SBUF bytes per partition of the device the kernel is traced for (part of its trace's key)."""
    return DEVICE.spec.sbuf_partition_bytes


def _resident(k, seq_k: int, d: int) -> bool:
    """Whether a K/V head fits the SBUF budget, to be loaded once for all its q tiles: K transposed
    takes seq_k elements per partition, V a row of d per 128 keys."""
    return (seq_k + math.ceil(seq_k / TT) * d) * k.dtype.itemsize <= _sbuf_bytes() // 2


@tk.kernel
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              causal: bool, dropout: float = 0.0, seed: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq_q, d = q.shape
    drop = _dropout(dropout, seed)
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    o_hbm = tk.ndarray(q.shape, q.dtype, buffer=tk.hbm)
    lse_hbm = tk.ndarray((batch, heads, seq_q, 1), F32, buffer=tk.hbm)
    for b in tk.affine_range(batch):
        for hk in tk.affine_range(kv_heads):
            kv = list(_kv_stream(k, v, b, hk, seq_k, d)) if _resident(k, seq_k, d) else None
            for h in range(hk * group, (hk + 1) * group):
                for q0 in range(0, seq_q, TQ):
                    nq = min(TQ, seq_q - q0)
                    o, lse = _fwd_q_tile(q, k, v, mask, kv, (b, h, hk), q0, nq, scale, causal, drop)
                    tk.store(o_hbm[b, h, q0:q0 + nq, 0:d], o)
                    tk.store(lse_hbm[b, h, q0:q0 + nq, 0:1], lse)
    return o_hbm, lse_hbm


def _fwd_q_tile(q, k, v, mask, kv, heads: tuple, q0: int, nq: int, scale: float, causal: bool, drop):
    """One q tile's output and log-sum-exp, K/V streamed past it (from SBUF when `kv` holds them);
    the softmax's sum is taken before dropout, P @ V after it."""
    (b, h, hk), d, seq_k = heads, q.shape[3], k.shape[2]
    q_t = _t_load(q, b, h, q0, nq, d)
    m = tk.full((nq, 1), -math.inf, F32)
    l_sum = tk.zeros((nq, 1), F32)
    o_acc = tk.zeros((nq, d), F32)
    for k0, nk, k_t, v_rows in kv or _kv_stream(k, v, b, hk, seq_k, d):
        if causal and k0 > q0 + nq - 1:
            break  # this K/V tile and the rest lie above the diagonal
        scores, s_scale = _masked(tk.matmul(q_t, k_t, transpose_x=True), mask, b, h, q0, nq, k0, nk, scale)
        scores = _causal(scores, q0, k0, causal)
        m_new = tk.maximum(m, tk.multiply(tk.max(scores, axis=1), s_scale))
        neg_m = tk.multiply(m_new, -1.0)
        p, row_sum = tk.isa.activation_reduce(tk.exp, scores, tk.add, bias=neg_m, scale=s_scale, dtype=q.dtype)
        alpha = tk.isa.activation(tk.exp, m, bias=neg_m)
        l_sum = tk.add(tk.multiply(l_sum, alpha), row_sum)
        p = _dropped(p, drop, (b, h, q.shape[1]), q0, k0, seq_k)
        pv = tk.zeros((nq, d), F32, buffer=tk.psum)
        for c, v_c in zip(range(0, nk, TT), v_rows):
            p_t = tk.copy(tk.transpose(p[:, c:c + v_c.shape[0]]), dtype=q.dtype)
            pv += tk.matmul(p_t, v_c, transpose_x=True)
        o_acc = tk.add(tk.isa.tensor_tensor(o_acc, alpha, tk.multiply), pv)
        m = m_new
    o = tk.isa.tensor_tensor(o_acc, tk.reciprocal(l_sum), tk.multiply, dtype=q.dtype)
    return o, tk.add(m, tk.log(l_sum))


def _dropout(rate: float, seed) -> tuple | None:
    """(rate, the seed as an int32 [128, 1] tile) where the kernel drops, else None."""
    if not rate:
        return None
    if seed is None:
        raise ValueError(f"flash attention with dropout {rate} needs a seed tensor")
    return rate, tk.load(seed[0:TQ, 0:1])


def _dropped(p, drop, heads: tuple, q0: int, k0: int, seq_k: int):
    """p with dropout at scores (q0 + row, k0 + column) of head (b, h), the same numbers for the same
    positions in forward and backward whatever their tiles; p itself without dropout."""
    if drop is None:
        return p
    (rate, seed), (b, h, heads_count) = drop, heads
    rows, cols = p.shape
    ip, jf = tk.mgrid[0:rows, 0:cols]
    return tk.isa.dropout(p, rate, seed[0:rows, 0:1], at=(q0 + ip) * seq_k + (k0 + jf), stream=b * heads_count + h,
                          dtype=p.dtype)


def _kv_stream(k, v, b: int, hk: int, seq_k: int, d: int):
    """The K/V tiles of head (b, hk) loaded one at a time, as the q tile reaches them."""
    for k0 in range(0, seq_k, TK):
        nk = min(TK, seq_k - k0)
        v_rows = [_load(v, b, hk, k0 + c, min(TT, nk - c), d) for c in range(0, nk, TT)]
        yield k0, nk, _t_load(k, b, hk, k0, nk, d), v_rows


def _bwd_accumulator_bytes(seq_k: int, d: int) -> int:
    """SBUF bytes per partition of a K/V head's dK and dV accumulators: fp32, a row of d per 128 keys."""
    return 2 * math.ceil(seq_k / TT) * d * F32.itemsize


def _bwd_fits(seq_k: int, d: int) -> bool:
    """Whether the backward's dK, dV accumulators leave a q tile's working tiles room in SBUF."""
    return _bwd_accumulator_bytes(seq_k, d) + WORKING <= _sbuf_bytes()


def _bwd_resident(k, seq_k: int, d: int) -> bool:
    """Whether a K/V head (K and V transposed, K's rows) fits SBUF beside its dK, dV accumulators and
    a q tile's working tiles, for K/V to be loaded once for all its q tiles."""
    kv = (2 * seq_k + math.ceil(seq_k / TT) * d) * k.dtype.itemsize
    return kv + _bwd_accumulator_bytes(seq_k, d) + WORKING <= _sbuf_bytes()


def _bwd_kv_tiles(k, v, b: int, hk: int, seq_k: int, d: int):
    """The backward's K/V tiles of head (b, hk), 128 keys each: K and V transposed, K's rows."""
    for k0 in range(0, seq_k, TT):
        nk = min(TT, seq_k - k0)
        yield k0, nk, _t_load(k, b, hk, k0, nk, d), _t_load(v, b, hk, k0, nk, d), _load(k, b, hk, k0, nk, d)


@tk.kernel
def flash_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, o: torch.Tensor,
              do: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, dropout: float = 0.0,
              seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, seq_q, d = q.shape
    drop = _dropout(dropout, seed)
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dq_hbm = tk.ndarray(q.shape, q.dtype, buffer=tk.hbm)
    dk_hbm = tk.ndarray(k.shape, k.dtype, buffer=tk.hbm)
    dv_hbm = tk.ndarray(v.shape, v.dtype, buffer=tk.hbm)
    for b in tk.affine_range(batch):
        for hk in tk.affine_range(kv_heads):
            kv = list(_bwd_kv_tiles(k, v, b, hk, seq_k, d)) if _bwd_resident(k, seq_k, d) else None
            dk_acc = [tk.zeros((min(TT, seq_k - k0), d), F32) for k0 in range(0, seq_k, TT)]
            dv_acc = [tk.zeros((min(TT, seq_k - k0), d), F32) for k0 in range(0, seq_k, TT)]
            for h in range(hk * group, (hk + 1) * group):
                for q0 in range(0, seq_q, TQ):
                    nq = min(TQ, seq_q - q0)
                    dq = _bwd_q_tile(q, k, v, mask, o, do, lse, kv, (b, h, hk), q0, nq, scale, causal,
                                     (dk_acc, dv_acc), drop)
                    tk.store(dq_hbm[b, h, q0:q0 + nq, 0:d], dq)
            for kt, k0 in enumerate(range(0, seq_k, TT)):
                nk = min(TT, seq_k - k0)
                tk.store(dk_hbm[b, hk, k0:k0 + nk, 0:d], tk.copy(dk_acc[kt], dtype=k.dtype))
                tk.store(dv_hbm[b, hk, k0:k0 + nk, 0:d], tk.copy(dv_acc[kt], dtype=v.dtype))
    return dq_hbm, dk_hbm, dv_hbm


def _bwd_q_tile(q, k, v, mask, o, do, lse, kv, heads: tuple, q0: int, nq: int, scale: float, causal: bool,
                accumulators: tuple, drop):
    """One q tile's dQ (accumulated in a PSUM bank over the K/V tiles it sees); its share of dK and dV
    added to the head's accumulators. K/V come from SBUF when `kv` holds them, else from HBM. With
    dropout mask M: dV takes (P * M)^T dO and dS = P * (M * dP - D), D = rowsum(dO * O) as without."""
    (b, h, hk), d, seq_k = heads, q.shape[3], k.shape[2]
    dk_acc, dv_acc = accumulators
    q_t, q_rows = _t_load(q, b, h, q0, nq, d), _load(q, b, h, q0, nq, d)
    do_t, do_rows = _t_load(do, b, h, q0, nq, d), _load(do, b, h, q0, nq, d)
    dots = tk.sum(tk.multiply(do_rows, _load(o, b, h, q0, nq, d), dtype=F32), axis=1)  # D = rowsum(dO * O)
    neg_lse = tk.multiply(tk.load(lse[b, h, q0:q0 + nq, 0:1]), -1.0)
    dq_psum = tk.zeros((nq, d), F32, buffer=tk.psum)
    for kt, (k0, nk, k_t, v_t, k_rows) in enumerate(kv or _bwd_kv_tiles(k, v, b, hk, seq_k, d)):
        if causal and k0 > q0 + nq - 1:
            break  # this K/V tile and the rest lie above the diagonal
        scores, s_scale = _masked(tk.matmul(q_t, k_t, transpose_x=True), mask, b, h, q0, nq, k0, nk, scale)
        scores = _causal(scores, q0, k0, causal)
        p = tk.isa.activation(tk.exp, scores, bias=neg_lse, scale=s_scale, dtype=F32)
        where = ((b, h, q.shape[1]), q0, k0, seq_k)
        dv_acc[kt] = tk.add(dv_acc[kt], tk.matmul(tk.copy(_dropped(p, drop, *where), dtype=q.dtype), do_rows,
                                                  transpose_x=True))
        dp = _dropped(tk.matmul(do_t, v_t, transpose_x=True), drop, *where)
        ds = tk.multiply(tk.multiply(p, tk.isa.tensor_tensor(dp, dots, tk.subtract)), scale, dtype=q.dtype)
        dk_acc[kt] = tk.add(dk_acc[kt], tk.matmul(ds, q_rows, transpose_x=True))
        dq_psum += tk.matmul(tk.copy(tk.transpose(ds), dtype=q.dtype), k_rows, transpose_x=True)
    return tk.copy(dq_psum, dtype=q.dtype)


flash_fwd_op = tk.custom_op("tilewise_kernels::flash_attention_fwd", flash_fwd)
flash_bwd_op = tk.custom_op("tilewise_kernels::flash_attention_bwd", flash_bwd)


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, causal, dropout, seed = inputs
    ctx.scale, ctx.causal, ctx.dropout = scale, causal, dropout
    ctx.save_for_backward(q, k, v, *output, mask, seed)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, mask, seed = ctx.saved_tensors
    dq, dk, dv = flash_bwd_op(q, k, v, mask, o, do.contiguous(), lse, ctx.scale, ctx.causal, ctx.dropout, seed)
    return dq, dk, dv, None, None, None, None, None


flash_fwd_op.register_autograd(_backward, setup_context=_setup)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """dropout(softmax(q k^T * scale + mask [causal]), dropout_p) v for q [B, H, S, D], k and v
    [B, H_kv, S_k, D] and an additive mask broadcastable to [B, H, S, S_k] (a bool mask: True keeps).
    Dropout's seed is drawn from `generator` (the CPU's default one if None), so torch.manual_seed
    makes a run repeat; its mask is the kernel's own (a hash of seed and position), not CPU's."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros((), dtype=q.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).contiguous()
    seed = None
    if dropout_p:
        drawn = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int32, generator=generator)
        seed = drawn.expand(TQ, 1).contiguous().to(q.device)
    o, _ = flash_fwd_op(q.contiguous(), k.contiguous(), v.contiguous(), mask, scale, bool(causal), float(dropout_p),
                        seed)
    return o


def _does_not_apply(q, k, v, attn_mask, dropout_p, enable_gqa) -> str | None:
    """Why flash_attention cannot compute this F.scaled_dot_product_attention call, or None."""
    if attn_mask is not None and (attn_mask.requires_grad or attn_mask.dim() > 4 or not (
            attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point)):
        return f"an attention mask of {attn_mask.dtype}, {attn_mask.dim()} dims (the kernel adds a constant mask)"
    if not q.dim() == k.dim() == v.dim() == 4:
        return f"inputs of {q.dim()}, {k.dim()}, {v.dim()} dims (the kernel takes [B, H, S, D])"
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.bfloat16):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (the kernel takes float32 or bfloat16, all alike)"
    if q.shape[-1] > TQ or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head dims {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]} (the kernel takes one head dim <= {TQ})"
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1] \
            or q.shape[1] != k.shape[1] and not enable_gqa:
        return f"shapes {list(q.shape)}, {list(k.shape)}, {list(v.shape)} (batch, heads or key lengths differ)"
    if 0 in q.shape or 0 in k.shape:
        return "an empty input"
    if not _bwd_fits(k.shape[2], k.shape[3]):
        return (f"{k.shape[2]} keys of head dim {k.shape[3]} (the backward's dK and dV accumulators, "
                f"{_bwd_accumulator_bytes(k.shape[2], k.shape[3]) // 1024} KiB per partition, leave too little "
                f"of the {_sbuf_bytes() // 1024} KiB of SBUF)")
    return None


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention by flash_attention, or the Reason it does not apply."""
    why = _does_not_apply(q, k, v, attn_mask, dropout_p, enable_gqa)
    if why is not None:
        return Reason(Why.KERNEL_DOES_NOT_APPLY, why)
    return flash_attention(q, k, v, causal=is_causal, scale=scale, mask=attn_mask, dropout_p=dropout_p)
