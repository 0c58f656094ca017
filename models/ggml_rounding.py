"""llama.cpp's CPU rounding in torch: the layers and ops `load_target(emulate_ggml=True)` puts in
the target model (models/target.py) so its states follow what the runtime computes.

What llama.cpp's CPU backend computes (AVX2/FMA/F16C build, flash attention on, batches < 64 rows
under GGML_BATCH_INVARIANT, i.e. what runtime/llama/target.py runs), and how these layers follow it:
- a quantized matmul quantizes each activation row to the weight's vec_dot_type per 32-block
  (Q4_1 -> q8_1: d = amax/127 stored f16, q = round-half-even(x * (127/amax)), s = f16(d * sum q));
  a Q4_1 x q8_1 block dot is d_w*d_x*sum(q_w*q_x) + m_w*s, accumulated with FMA in 8 lanes;
- flash attention converts Q, K, V to f16, takes the K.Q dot in f32 (ggml_vec_dot_f16) and keeps
  the running V sum in an f16 accumulator (online softmax, one key at a time, expf in f32);
- RMSNorm sums squares in double, rope takes cos/sin of f32 angles (theta *= theta_scale) from
  libm and FMA-contracts its rotation, SwiGLU uses ggml's vectorised expf.
`emulate_ggml=True` (default) reproduces the roundings that are cheap to reproduce (q8 rounding of
activations incl. the q8_1 block sums, f16 Q/K/V, exact norms, rope and SwiGLU) on torch's fast
matmuls; `exact=True` also reproduces the kernels' accumulation order (block-wise FMA dot products,
the f16 online-softmax accumulator), so that layer states match llama.cpp's bit for bit on the
bundled SmolLM2 Q4_1 (slow: for parity checks, not for feature extraction).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .common import MLP, RMSNorm

# GGUF weight type -> ggml's vec_dot_type: what the CPU matmul quantizes its activations to.
VEC_DOT_TYPE = {"F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0",
                "IQ4_NL": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1", "Q2_K": "q8_K", "Q3_K": "q8_K",
                "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K", "IQ4_XS": "q8_K"}


def _fma_exact(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # f32 products are exact in f64, so one f64 add then one rounding to f32 is an FMA
    return (a.double() * b.double() + c.double()).float()


_ADDCMUL_IS_FMA: bool | None = None


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma(a, b, c) = round_f32(a*b + c) as the AVX2 kernels compute it. torch's CPU addcmul is fused
    on x86 builds (checked once); otherwise the f64 route (4x slower) gives the same bits."""
    global _ADDCMUL_IS_FMA
    if _ADDCMUL_IS_FMA is None:
        g = torch.Generator().manual_seed(0)
        x, y, z = (torch.randn(4096, generator=g) for _ in range(3))
        _ADDCMUL_IS_FMA = bool(torch.equal(torch.addcmul(z, x, y), _fma_exact(x, y, z)))
    return torch.addcmul(c, a, b) if _ADDCMUL_IS_FMA else _fma_exact(a, b, c)


def _f32_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # IEEE division (torch turns `tensor / python scalar` and `scalar / tensor` into reciprocal
    # multiplies, which round differently from the C division ggml does)
    return torch.div(a, b)


def _q8_blocks(x: torch.Tensor, block: int = 32):
    """ggml's AVX2 quantize_row_q8_0/q8_1 on float32 x [..., n]: per block, d = amax/127 (f32),
    q = round-half-even(x * (127/amax)). Returns q [..., n/block, block] (integers as f32), d."""
    xb = x.unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True)
    c127 = torch.full_like(amax, 127.0)
    q = torch.round(xb * torch.where(amax > 0, _f32_div(c127, amax), torch.zeros_like(amax)))
    return q, _f32_div(amax, c127)[..., 0]


def ggml_round_activations(x: torch.Tensor, kind: str):
    """x float32 [..., n] -> (x as the matmul sees it, s-correction or None).

    For q8_1 the dot with a weight block's min m uses s = f16(d * sum q), not f16(d) * sum q; the
    returned correction [..., n/32] = s - f16(d) * sum q is what to add times the block mins."""
    if kind == "f16":
        return x.half().float(), None
    if kind == "bf16":
        return x.bfloat16().float(), None
    if kind == "q8_K":  # 256-blocks, f32 scale (approximate: the K-quant dots are not reproduced)
        q, d = _q8_blocks(x, 256)
        return (q * d[..., None]).flatten(-2), None
    q, d = _q8_blocks(x)
    d16 = d.half().float()
    xq = (q * d16[..., None]).flatten(-2)
    if kind == "q8_0":
        return xq, None
    sq = q.sum(-1)
    return xq, (d * sq).half().float() - d16 * sq


def q4_1_blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q4_1 GGUF tensor -> (q*d [out, in] exact in f32, mins m [out, in/32])."""
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, 20)  # block: d f16, m f16, 16 bytes of nibbles
    n_out, n_in = int(t.shape[1]), int(t.shape[0])
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = raw[:, 4:20]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)  # low nibbles = elements 0..15
    return (torch.from_numpy((q * d).reshape(n_out, n_in)),
            torch.from_numpy(np.ascontiguousarray(m.reshape(n_out, n_in // 32))))


def block_mins(t) -> torch.Tensor:
    """Per-block mins m [out, in/32] of a Q4_1/Q5_1 tensor (both start with d f16, m f16)."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, type_size)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(m.reshape(int(t.shape[1]), int(t.shape[0]) // 32)))


def _dot_q4_1_q8_1(x: torch.Tensor, wqd: torch.Tensor, mins: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """x [N, n_in] f32 @ a Q4_1 weight, bit for bit as ggml_vec_dot_q4_1_q8_1 (AVX2): per 32-block b,
    lane l (elements 4l..4l+3) accumulates acc_l = fma(d_w*d_x, sum_k q_w*q_x, acc_l) over blocks;
    result = hsum(acc) + sum_b m_b*s_b (scalar FMA loop). wqd [n_out, n_in] = q_w*d_w (exact)."""
    n, n_in = x.shape
    n_out, nb = mins.shape
    q, d = _q8_blocks(x)
    d16 = d.half().float()
    s = (d * q.sum(-1)).half().float()  # [N, nb]
    # d_w * (lane integer dot) is exact in f32 (11 + 13 bits), and so is every partial sum of it, so
    # one fma(d_x, that, acc) equals the kernel's fma(d_w*d_x, dot, acc)
    wg = wqd.view(n_out, nb * 8, 4).permute(1, 2, 0).contiguous()  # [nb*8, 4, n_out]
    qg = q.reshape(n, nb * 8, 4).permute(1, 0, 2).contiguous()      # [nb*8, N, 4]
    d16t, st = d16.t().contiguous(), s.t().contiguous()             # [nb, N]
    summs = torch.zeros(n, n_out)
    for b in range(nb):
        summs = _fma(st[b, :, None], mins[None, :, b], summs)
    out = torch.empty(n, n_out)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        xy = torch.bmm(qg[:, r0:r1], wg).view(nb, 8, r1 - r0, n_out)
        acc = torch.zeros(8, r1 - r0, n_out)
        for b in range(nb):
            acc = _fma(d16t[b, r0:r1, None], xy[b], acc)
        h = acc[4:] + acc[:4]  # hsum_float_8
        out[r0:r1] = ((h[0] + h[2]) + (h[1] + h[3])) + summs[r0:r1]
    return out


class QLinear(nn.Linear):
    """nn.Linear that, under emulate_ggml, rounds its input as llama.cpp's CPU matmul does for its
    weight type (`vec_dot`), adding the q8_1 block-sum correction times the weight's block `mins`
    (Q4_1/Q5_1); with `exact_wqd` (Q4_1 and exact=True) it reproduces the kernel's dot bit for bit."""

    vec_dot: str | None = None
    mins: torch.Tensor | None = None
    exact_wqd: torch.Tensor | None = None

    def forward(self, x):
        if self.vec_dot is None:
            return super().forward(x)
        xf = x.float()
        if self.exact_wqd is not None:
            out = _dot_q4_1_q8_1(xf.reshape(-1, xf.shape[-1]), self.exact_wqd, self.mins)
            out = out.view(*xf.shape[:-1], -1)
        else:
            xq, s_corr = ggml_round_activations(xf, self.vec_dot)
            out = xq @ self.weight.float().T
            if s_corr is not None and self.mins is not None:
                out = out + s_corr @ self.mins.T
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


class GgmlRMSNorm(RMSNorm):
    """ggml_rms_norm (+ mul): sum of f32 squares in double, scale = 1.0f/sqrtf(mean + eps) in f32
    (sqrt taken in double: torch's f32 sqrt is not correctly rounded), y = (x*scale)*w."""

    emulate = False

    def forward(self, x):
        if not self.emulate:
            return super().forward(x)
        xf = x.float()
        ss = (xf * xf).double().sum(-1, keepdim=True)
        mean = _f32_div(ss, torch.full_like(ss, x.shape[-1])).float()
        scale = _f32_div(torch.ones_like(mean), (mean + torch.tensor(self.eps, dtype=torch.float32)).double().sqrt().float())
        return ((xf * scale) * self.weight.float()).to(x.dtype)


_LIBM = None


def _libm_cos_sin(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cosf/sinf from the C library ggml links (its results differ from correctly rounded ones in
    ~0.6% of cases); correctly rounded f64 values where no libm is found."""
    global _LIBM
    if _LIBM is None:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
            for f in ("cosf", "sinf"):
                getattr(lib, f).restype = ctypes.c_float
                getattr(lib, f).argtypes = [ctypes.c_float]
            _LIBM = lib
        except OSError:
            _LIBM = False
    if _LIBM is False:
        t = theta.astype(np.float64)
        return np.cos(t).astype(np.float32), np.sin(t).astype(np.float32)
    return (np.frompyfunc(_LIBM.cosf, 1, 1)(theta).astype(np.float32),
            np.frompyfunc(_LIBM.sinf, 1, 1)(theta).astype(np.float32))


_ROPE_CACHE: dict = {}


def ggml_rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float):
    """ggml_rope_cache_init: theta_0 = pos, theta_{i+1} = theta_i * powf(base, -2/d) in f32 ->
    cos/sin [..., T, d/2] (f32), for integer positions >= 0 (a table up to the largest is cached)."""
    n_pos = int(positions.max()) + 1 if positions.numel() else 1
    key = (head_dim, float(base))
    table = _ROPE_CACHE.get(key)
    if table is None or table[0].shape[0] < n_pos:
        n = max(n_pos, 512)
        ts = np.float32(np.power(np.float64(base), -2.0 / head_dim))
        theta = np.empty((n, head_dim // 2), np.float32)
        t = np.arange(n, dtype=np.float32)
        for i in range(head_dim // 2):
            theta[:, i] = t
            t = (t * ts).astype(np.float32)
        c, s = _libm_cos_sin(theta)
        table = _ROPE_CACHE[key] = (torch.from_numpy(c), torch.from_numpy(s))
    idx = positions.long()
    return table[0][idx], table[1][idx]


def ggml_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """ggml's rotate_pairs as GCC contracts it: y0 = fma(x0, cos, -(x1*sin)), y1 = fma(x0, sin, x1*cos).
    x [B, H, T, D] f32, cos/sin [B or 1, T, D/2]."""
    c, s = cos[:, None], sin[:, None]
    if neox:
        x0, x1 = x.chunk(2, dim=-1)
        return torch.cat([_fma(x0, c, -(x1 * s)), _fma(x0, s, x1 * c)], dim=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([_fma(x0, c, -(x1 * s)), _fma(x0, s, x1 * c)], dim=-1).flatten(-2)


def _bits_to_f32(i: torch.Tensor) -> torch.Tensor:
    # int64 -> int32 keeps the low 32 bits (two's complement), like the SIMD integer ops
    return i.to(torch.int32).view(torch.float32)


def _hexf(v: str) -> torch.Tensor:
    return torch.tensor(float.fromhex(v), dtype=torch.float32)


def ggml_v_expf(x: torch.Tensor) -> torch.Tensor:
    """ggml's AVX2 ggml_v_expf (vec.h), step for step, on float32 x."""
    r = _hexf("0x1.8p23")
    z = _fma(x, _hexf("0x1.715476p+0"), r)
    n = z - r
    b = _fma(-n, _hexf("0x1.7f7d1cp-20"), _fma(-n, _hexf("0x1.62e4p-1"), x))
    e = z.view(torch.int32).to(torch.int64) << 23
    k = _bits_to_f32(e + 0x3F800000)
    u = b * b
    j = _fma(_fma(_fma(_hexf("0x1.0e4020p-7"), b, _hexf("0x1.573e2ep-5")), u,
                  _fma(_hexf("0x1.555e66p-3"), b, _hexf("0x1.fffdb6p-2"))), u, _hexf("0x1.ffffecp-1") * b)
    out = _fma(j, k, k)
    c = n.abs() > 126
    if bool(c.any()):  # |x| > ~87: ggml's overflow/underflow branch
        g = torch.where(n <= 0, 0x82000000, 0).to(torch.int64)
        s1 = _bits_to_f32(g + 0x7F000000)
        s2 = _bits_to_f32(e - g)
        out = torch.where(n.abs() > 192, s1 * s1, torch.where(c, _fma(s2, j, s2) * s1, out))
    return out


class GgmlMLP(MLP):
    """MLP whose SwiGLU is ggml_vec_swiglu_f32: silu(g) = g / (1 + ggml_v_expf(-g)), times up."""

    emulate = False

    def forward(self, x):
        if not self.emulate:
            return super().forward(x)
        g = self.gate_proj(x).float()
        u = self.up_proj(x).float()
        act = _f32_div(g, 1.0 + ggml_v_expf(0.0 - g)) * u
        return self.down_proj(act.to(x.dtype))


def _dot_f16_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ggml_vec_dot_f16 (AVX2: 4 accumulators of 8 f32 lanes, then GGML_F32x8_REDUCE) over the last
    dim of broadcastable a, b holding f16 values as f32."""
    p = a * b  # f16 x f16 products are exact in f32
    dim = p.shape[-1]
    n32 = dim - dim % 32
    if n32 == 0:
        res = torch.zeros(p.shape[:-1])
    else:
        acc = p[..., :32]
        for i in range(32, n32, 32):
            acc = acc + p[..., i:i + 32]  # fma with an exact product = one rounded add
        acc = acc.unflatten(-1, (4, 8))
        x0 = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])
        t0 = x0[..., :4] + x0[..., 4:]
        res = (t0[..., 0] + t0[..., 1]) + (t0[..., 2] + t0[..., 3])
    if n32 < dim:  # leftovers are added in double
        res = (res.double() + p[..., n32:].double().sum(-1)).float()
    return res


def ggml_flash_attn(q, k, v, scale: float) -> torch.Tensor:
    """ggml's CPU flash attention (one_chunk path: fewer than 64 query rows per batch, f16 K/V cache),
    causal by index. q [B, Hq, T, D] f32, k/v [B, Hkv, T, D] -> [B, T, Hq*D].
    Keys are visited in order; a new maximum rescales the f16 accumulator, each key adds v*expf(s-M)
    with an FMA rounded to f16; the row sum S is kept in f32."""
    B, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    qh, kh, vh = q.half().float(), k.half().float(), v.half().float()
    out = torch.empty(B, Hq, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for bi in range(B):
        s = torch.empty(Hq, T, T)
        for h in range(Hq):
            for r0 in range(0, T, 64):  # [64, T, D] products at a time
                s[h, r0:r0 + 64] = _dot_f16_rows(qh[bi, h, r0:r0 + 64, None], kh[bi, h // rep][None]) * scale
        s = s.masked_fill(~causal, float("-inf"))
        vv = vh[bi].repeat_interleave(rep, 0)  # [Hq, T, D]
        M = torch.full((Hq, T), float("-inf"))
        S = torch.zeros(Hq, T)
        acc = torch.zeros(Hq, T, D)
        for j in range(T):  # key j is seen by queries j..T-1
            sj, Mo = s[:, j:, j], M[:, j:]
            new = sj > Mo
            ms = torch.where(new, (Mo - sj).double().exp().float(), torch.ones_like(sj))
            vs = torch.where(new, torch.ones_like(sj), (sj - Mo).double().exp().float())
            a = acc[:, j:]
            a = torch.where(new[..., None], (a * ms[..., None]).half().float(), a)
            acc[:, j:] = _fma(vv[:, j:j + 1], vs[..., None], a).half().float()
            S[:, j:] = _fma(S[:, j:], ms, vs)
            M[:, j:] = torch.maximum(Mo, sj)
        out[bi] = acc * _f32_div(torch.ones_like(S), S)[..., None]
    return out.transpose(1, 2).flatten(2)


def ggml_attention_fast(q, k, v, mask, scale: float) -> torch.Tensor:
    """The cheap part of ggml's flash attention: f16 Q/K/V, f32 scores and softmax."""
    n_rep = q.shape[1] // k.shape[1]
    qh = q.half().float()
    kh = k.half().float().repeat_interleave(n_rep, dim=1)
    vh = v.half().float().repeat_interleave(n_rep, dim=1)
    att = (qh @ kh.transpose(-1, -2)) * scale
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    return (att @ vh).transpose(1, 2).flatten(2)
