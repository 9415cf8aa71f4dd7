#!/usr/bin/env python3
"""CPU weight-only GEMM candidates on the 134M benchmark model's shapes, streaming distinct weights.

Each measurement cycles through enough distinct weights (at least --stream_mb of them) that every call
reads its weight from memory, not from the 32 MB L3, as a decode step does. Prints one line per
(threads, shape, M, kernel): the median microseconds per call over --repeats passes, and the
effective weight bandwidth. Run it with `nice -n -19` on a shared box and repeat.

    python benchmarks/quant_kernels.py [--threads 1,2] [--ms 1,16] [--kernels ...] [--repeats 5]

Kernels:
  fp32_pmx      float32 on this project's kernel (the engine's float path, runner.kernels.linear)
  fp32_onednn   float32 weight prepacked for oneDNN (the float path where the extension cannot be built)
  int8_aten     torch.ops.aten._weight_int8pack_mm (int8 [N, K], scales [N])
  int8_compile  torch.compile of F.linear(x, w.float()) * s: inductor's own dequantise-in-register loop
  int4_aten     torch.ops.aten._weight_int4pack_mm_for_cpu (groups of 128, packed by
                _convert_weight_to_int4pack_for_cpu)
  int8_pmx      this project's kernel (runner/kernels/cpu_linear.cpp): int8 blocks of 64 channels, k-major,
                converted to float in registers
  int4_pmx      the same for int4 (groups of 128)
  int8_w8a8     oneDNN's int8 GEMM with the activations quantised per row on the fly (not weight-only:
                shown for scale, not used)
"""

from __future__ import annotations

import json
import os
import statistics
import time

import fire
import torch
import torch.nn.functional as F

from runner.kernels.cpu_ext import cpu_ops

SHAPES = ((768, 2304), (768, 768), (768, 4096), (2048, 768), (768, 32000))  # (in, out): qkv, wo, w1|w3, w2, head
GROUP = 128


def _weights(kind: str, k: int, n: int, count: int):
    from runner.kernels.linear import Linear
    from runner.kernels.cpu_ext import pack_blocks
    from runner.kernels.quant_linear import pack_int4_blocks, pack_int4_aten
    from runner.pmx.quant import quantize_int4, quantize_int8
    out = []
    for i in range(count):
        w = torch.randn(n, k) * 0.02
        if kind in ("fp32_onednn", "fp32_pmx"):
            out.append(Linear(w, kernel=kind[5:]))
        elif kind in ("int8_aten", "int8_compile", "int8_w8a8"):
            out.append(quantize_int8(w))
        elif kind == "int4_aten":
            q, s = quantize_int4(w, GROUP)
            out.append(pack_int4_aten(q, s))
        elif kind == "int8_pmx":
            q, s = quantize_int8(w)
            out.append((pack_blocks(q), s, n))
        elif kind == "int4_pmx":
            out.append((*pack_int4_blocks(*quantize_int4(w, GROUP), int(cpu_ops().int4_layout(GROUP))), n))
    return out


def _call(kind: str):
    if kind in ("fp32_onednn", "fp32_pmx"):
        return lambda x, lin: lin(x)
    if kind == "int8_aten":
        return lambda x, qs: torch.ops.aten._weight_int8pack_mm(x, qs[0], qs[1])
    if kind == "int8_compile":
        f = torch.compile(lambda x, q, s: F.linear(x, q.to(x.dtype)) * s, dynamic=False)
        return lambda x, qs: f(x, qs[0], qs[1])
    if kind == "int4_aten":
        return lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p[0], GROUP, p[1])
    if kind == "int8_pmx":
        ops = cpu_ops()
        return lambda x, w: ops.linear_int8(x, w[0], w[1], w[2])
    if kind == "int4_pmx":
        ops = cpu_ops()
        return lambda x, w: ops.linear_int4(x, w[0], w[1], GROUP, w[2])
    if kind == "int8_w8a8":
        def w8a8(x, qs):
            q, s = qs
            xs = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
            xq = torch.round(x / xs).to(torch.int8)
            return torch._int_mm(xq, q.t()).float() * xs * s if x.shape[0] > 16 else \
                (xq.float() @ q.t().float()) * xs * s
        return w8a8
    raise SystemExit(f"unknown kernel {kind}")


def _bytes(kind: str, k: int, n: int) -> int:
    return {"fp32_onednn": 4 * k * n, "fp32_pmx": 4 * k * n, "int4_aten": k * n // 2 + 8 * n * k // GROUP,
            "int4_pmx": k * n // 2 + 4 * n * k // GROUP}.get(kind, k * n + 4 * n)


def main(threads="1,2", ms="1,16", kernels="fp32_pmx,fp32_onednn,int8_pmx,int4_pmx,int8_aten,int4_aten", repeats: int = 5,
         stream_mb: int = 160, json_path: str | None = None) -> None:
    rows = []
    parse = lambda v: [int(x) for x in str(v).replace(",", " ").split()] if not isinstance(v, (list, tuple)) else list(v)  # noqa: E731
    kinds = kernels.split(",") if isinstance(kernels, str) else list(kernels)
    print(f"load average {os.getloadavg()}")
    for kind in kinds:
        call = _call(kind)
        for k, n in SHAPES:
            count = max(2, stream_mb * (1 << 20) // _bytes(kind, k, n))
            ws = _weights(kind, k, n, count)
            for t in parse(threads):
                torch.set_num_threads(t)
                for m in parse(ms):
                    x = torch.randn(m, k)
                    for w in ws[:2]:
                        call(x, w)  # warm-up (and compile)
                    per_pass = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        for w in ws:
                            call(x, w)
                        per_pass.append((time.perf_counter() - t0) / len(ws) * 1e6)
                    us = statistics.median(per_pass)
                    row = dict(kernel=kind, k=k, n=n, m=m, threads=t, us=us, min_us=min(per_pass),
                               gbps=_bytes(kind, k, n) / us / 1e3)
                    rows.append(row)
                    print(f"{kind:13s} {k:5d}->{n:<6d} M={m:<3d} t={t} {us:9.1f} us (min {min(per_pass):9.1f})"
                          f" {row['gbps']:6.1f} GB/s", flush=True)
            del ws
    print(f"load average {os.getloadavg()}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    fire.Fire(main)
