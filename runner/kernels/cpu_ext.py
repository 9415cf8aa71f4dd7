"""This project's C++ CPU kernels (ops `torch.ops.pmx_cpu.*`): float32, int8 and int4 linears on weights repacked
into blocks of 64 output channels, k-major (runner/kernels/cpu_linear.cpp), and the collectives of ranks on one
machine through shared memory (runner/kernels/cpu_comm.cpp).

The extension is built on first use for this machine (-march=native, OpenMP as torch) and cached by torch under
~/.cache/torch_extensions (once per machine, ~20 s); where it cannot be built (no compiler or ninja) the callers
fall back to oneDNN / aten kernels with a warning.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

CPU_BLOCK = 64  # output channels per block of the packed weights


@functools.lru_cache(maxsize=None)
def cpu_ops():
    """torch.ops.pmx_cpu, built and loaded on first call; None where it cannot be built."""
    from torch.utils.cpp_extension import load
    try:
        load(name="pmx_cpu", sources=[str(Path(__file__).with_name(f)) for f in ("cpu_linear.cpp", "cpu_comm.cpp")],
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the slower oneDNN / aten kernels still work
        print(f"warning: this project's CPU kernels could not be built ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); using oneDNN / torch's aten kernels", file=sys.stderr)
        return None
    torch.library.register_fake("pmx_cpu::linear_f32")(lambda x, w, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_int8")(lambda x, w, s, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_int4")(lambda x, w, s, g, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::shm_all_reduce_")(lambda t, ws, rank, world, timeout: None)
    torch.library.register_fake("pmx_cpu::shm_all_gather")(lambda t, ws, rank, world, timeout:
                                                           t.new_empty(world * t.numel()))
    return torch.ops.pmx_cpu


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/64, K, 64]: blocks of 64 output channels, k-major inside a block (rows padded with 0)."""
    n, k = weight.shape
    nb = -(-n // CPU_BLOCK)
    return pad_rows(weight, nb * CPU_BLOCK).view(nb, CPU_BLOCK, k).transpose(1, 2).contiguous()


def unpack_blocks(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_blocks`: [N/64, K, 64] -> [N, K]."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]
