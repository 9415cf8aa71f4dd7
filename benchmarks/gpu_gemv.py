#!/usr/bin/env python3
"""Decode-shaped linears on CUDA: cuBLAS (F.linear) against two Triton kernels, per Llama-2-7B weight shape.

A decode step is y[M, N] = x[M, K] W[N, K]^T with M = the batch (1..16) and W read once: memory-bound, so each
kernel is given in GB/s of weight read. The weights rotate over copies larger than the L2 (as across layers in a
step). Kernels: `gemv` (M = 1: the engine's triton_ops.decode_linear, fp32 products summed per row) and `dot16`
(M <= 16: tl.dot on a 16-row tile), each over a small grid of block shapes, warps and pipeline stages; the best is
printed beside the engine's own choice (decode_blocks_linear). `--methods` adds the GEMV on weight-only quantised
weights (int8 per channel, int4 in groups of 128: GB/s of the bytes stored, against float16's cuBLAS time).

    python benchmarks/gpu_gemv.py [--ms "1 8"] [--copies 8] [--methods "fp16 int8 int4g128"]
"""

from __future__ import annotations

import itertools

import fire
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from runner.kernels.linear import QuantRows
from runner.kernels.triton_ops import decode_blocks_linear, decode_linear

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096)}


@triton.jit
def _dot16(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rm = tl.arange(0, 16)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mm[:, None], other=0.0)
            w = tl.load(rows + rk[None, :], mask=mn[:, None], other=0.0)
        else:
            mk = rk < K
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
            w = tl.load(rows + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _weights(method: str, n: int, k: int, dev) -> tuple[torch.Tensor, object, float]:
    """(stored weight, QuantRows or None, bytes stored) of a random [n, k] weight in `method`."""
    from runner.pmx.quant import quantize_int4, quantize_int8
    w = torch.randn(n, k, device=dev) * 0.02
    if method == "fp16":
        return w.half(), None, n * k * 2
    if method == "int8":
        q, s = quantize_int8(w)
        return q, QuantRows(s, None, "int8", 0), q.numel() + s.numel() * 4
    group = int(method.split("g")[1])
    q, s = quantize_int4(w, group)
    return q, QuantRows(s, None, "int4", group), q.numel() + s.numel() * 4


def main(ms: str = "1 8", copies: int = 8, reps: int = 200, methods: str = "fp16") -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    ms_list = [int(m) for m in str(ms).replace(",", " ").split()]
    configs = list(itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8), (3, 4)))
    print(f"{'shape':8} {'M':>3} {'method':>8} {'cublas us':>10} {'GB/s':>6} {'best triton':>34} {'us':>8} "
          f"{'GB/s':>6} {'engine us':>9} {'max err':>8}")
    for (name, (N, K)), M, method in itertools.product(SHAPES.items(), ms_list, str(methods).replace(",", " ").split()):
        if method != "fp16" and M != 1:
            continue
        stored = [_weights(method, N, K, dev) for _ in range(copies)]
        dense = [torch.randn(N, K, device=dev, dtype=torch.float16) * 0.02 for _ in range(copies)]
        x = torch.randn(M, K, device=dev, dtype=torch.float16)
        y = torch.empty(M, N, device=dev, dtype=torch.float16)
        gb = stored[0][2] / 1e9
        state = {"i": 0}

        def nxt(pool):
            state["i"] = (state["i"] + 1) % copies
            return pool[state["i"]]

        t_cublas = do_bench(lambda: torch.nn.functional.linear(x, nxt(dense)), rep=reps, return_mode="median") * 1e3
        w0, q0, _ = stored[0]
        ref = torch.nn.functional.linear(x.float(), dense[0].float() if q0 is None else _dequant(w0, q0))
        best, engine = None, None
        for kind, (bn, bk, warps, stages) in itertools.product(("gemv", "dot16"), configs):
            if kind == "gemv" and M != 1 or kind == "dot16" and (bn < 16 or method != "fp16"):
                continue
            grid = (triton.cdiv(N, bn),)
            even = K % bk == 0

            def run(item=None, kind=kind, blocks=(bn, bk, warps, stages)):
                w, q, _ = nxt(stored) if item is None else item
                if kind == "gemv":  # the engine's kernel (runner.kernels.triton_ops.decode_linear) at other blocks
                    return decode_linear(x, w, quant=q, blocks=blocks)
                _dot16[grid](x, w, y, M, N, K, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, num_warps=warps, num_stages=stages)
                return y
            try:
                err = float((run((w0, q0, 0)).float() - ref).abs().max() / ref.abs().max())
                t = do_bench(run, rep=reps, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                print(f"  {kind} {bn}x{bk} w{warps} s{stages}: {type(e).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, f"{kind} BN{bn} BK{bk} w{warps} s{stages}", err)
            if kind == "gemv" and (bn, bk, warps, stages) == decode_blocks_linear(N, K, q0 and q0.method):
                engine = t
        print(f"{name:8} {M:>3} {method:>8} {t_cublas:>10.1f} {N * K * 2 / 1e9 / t_cublas * 1e6:>6.0f} {best[1]:>34} "
              f"{best[0]:>8.1f} {gb / best[0] * 1e6:>6.0f} {engine if engine is None else round(engine, 1)!s:>9} "
              f"{best[2]:>8.1e}", flush=True)


def _dequant(w: torch.Tensor, q) -> torch.Tensor:
    from runner.pmx.quant import dequantize
    return dequantize(w, q.scale, q.method, torch.float32)


if __name__ == "__main__":
    fire.Fire(main)
