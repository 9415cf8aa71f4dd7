"""This project's C++ CPU kernels (ops `torch.ops.pmx_cpu.*`): float32, int8 and int4 linears on weights repacked
into blocks of 64 output channels, k-major (runner/kernels/cpu_linear.cpp), decode attention read in place from
the KV cache and one-pass residual + RMSNorm and SwiGLU (runner/kernels/cpu_step.cpp), and the collectives of
ranks on one machine through shared memory (runner/kernels/cpu_comm.cpp).

The extension is built on first use for this machine (-march=native, OpenMP as torch) and cached under
$TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions, in a folder named by a hash of its sources and flags (once per
machine and version, ~20-60 s; two checkouts of different versions never rebuild over each other); a build lock
left by a build that was killed is taken over after STALE_LOCK_S. Where it cannot be built (no compiler or ninja)
the callers fall back to oneDNN / aten kernels with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import sys
import time
from pathlib import Path

import torch

SOURCES = ("cpu_linear.cpp", "cpu_step.cpp", "cpu_comm.cpp", "cpu_decode.cpp")
CPU_BLOCK = 64  # output channels per block of the packed weights
HUGE_PAGE = 2 << 20            # bytes of a transparent huge page (x86-64, arm64 with 4K pages)
HUGE_PAGE_MIN_BYTES = HUGE_PAGE  # weights from one huge page up go in memory advised for transparent huge pages
CFLAGS = ("-O3", "-march=native", "-fopenmp")
STALE_LOCK_S = 900  # a build lock this old was left by a killed build (a build takes about a minute)


def build_directory() -> Path:
    """Where the extension of these sources and flags is built and cached."""
    h = hashlib.sha256(" ".join((torch.__version__, *CFLAGS)).encode())
    for f in SOURCES:
        h.update(Path(__file__).with_name(f).read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / f"pmx_cpu_{h.hexdigest()[:12]}"


@functools.lru_cache(maxsize=None)
def cpu_ops():
    """torch.ops.pmx_cpu, built and loaded on first call; None where it cannot be built."""
    from torch.utils.cpp_extension import load
    where = build_directory()
    try:
        where.mkdir(parents=True, exist_ok=True)
        lock = where / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            print(f"warning: {lock} is {time.time() - lock.stat().st_mtime:.0f} s old, left by a build that was "
                  "killed; removing it", file=sys.stderr)
            lock.unlink(missing_ok=True)
        if not (where / "pmx_cpu.so").exists():
            print(f"building this project's CPU kernels for this machine in {where} (once, about a minute)",
                  file=sys.stderr)
        load(name="pmx_cpu", sources=[str(Path(__file__).with_name(f)) for f in SOURCES], build_directory=str(where),
             extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the slower oneDNN / aten kernels still work
        print(f"warning: this project's CPU kernels could not be built ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); using oneDNN / torch's aten kernels", file=sys.stderr)
        return None
    torch.library.register_fake("pmx_cpu::linear_f32")(lambda x, w, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_int8")(lambda x, w, s, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_int4")(lambda x, w, s, g, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_dequant")(lambda x, w, s, m, g, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::decode_attention")(lambda q, cache, kv_scale, layout, layer, rows, kvlens,
                                                             window, scale, page_size=0, alibi=None:
                                                             torch.empty_like(q))
    torch.library.register_fake("pmx_cpu::shm_all_reduce_")(lambda t, ws, rank, world, timeout: None)
    torch.library.register_fake("pmx_cpu::shm_all_gather")(lambda t, ws, rank, world, timeout:
                                                           t.new_empty(world * t.numel()))
    return torch.ops.pmx_cpu


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor `t`, from HUGE_PAGE_MIN_BYTES up in a private mapping of its own advised for
    transparent huge pages (madvise MADV_HUGEPAGE; torch's allocator asks for none unless THP_MEM_ALLOC_ENABLE
    is set before it starts): a decode step streams every weight once, with fewer TLB misses on 2 MiB pages.
    Where the kernel grants no huge page (THP off) this is an ordinary copy."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return t.contiguous()
    # 2 MiB more than needed, so the tensor can start on a 2 MiB boundary: every whole 2 MiB of it can then be a
    # huge page (the slack is never touched, so it takes no memory)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps `mm` alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start: start + nbytes].view(t.dtype).view(t.shape).copy_(t)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/64, K, 64]: blocks of 64 output channels, k-major inside a block (rows padded with 0), in
    huge pages where large enough (:func:`huge_page_copy`)."""
    n, k = weight.shape
    nb = -(-n // CPU_BLOCK)
    return huge_page_copy(pad_rows(weight, nb * CPU_BLOCK).view(nb, CPU_BLOCK, k).transpose(1, 2))


def unpack_blocks(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_blocks`: [N/64, K, 64] -> [N, K]."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]
