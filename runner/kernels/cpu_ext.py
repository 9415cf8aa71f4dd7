"""This project's C++ CPU kernels (ops `torch.ops.pmx_cpu.*`): float32, int8 and int4 linears on weights repacked
into blocks of 64 output channels, k-major (runner/kernels/cpu_linear.cpp), decode attention read in place from
the KV cache and one-pass residual + RMSNorm and SwiGLU (runner/kernels/cpu_step.cpp), and the collectives of
ranks on one machine through shared memory (runner/kernels/cpu_comm.cpp).

The extension is built on first use for this machine (-march=native, OpenMP as torch), ~30 s on 2 cores, which rank
0 says on stderr. The build is cached in a directory named by a hash of what it is made of (the C++ files' contents,
the flags, torch's and Python's versions, the CPU), under $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions: any
clone of the same version on this machine finds it (torch's own cache is keyed by the extension's name and
rebuilds when the sources' paths or times change, e.g. in a fresh clone), and a changed source builds anew; a build
lock left by a build that was killed is taken over after STALE_LOCK_S. Where it cannot be built (no compiler or
ninja) the callers fall back to oneDNN / aten kernels with a warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import mmap
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from runner.parallel.launch import rank_from_environment
from runner.progress import note

SOURCES = ("cpu_linear.cpp", "cpu_gemm.cpp", "cpu_step.cpp", "cpu_comm.cpp", "cpu_decode.cpp")
CFLAGS, LDFLAGS = ("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)
BUILT = "built"  # written into the build directory once the library is complete
CPU_BLOCK = 64  # output channels per block of the packed weights
HUGE_PAGE = 2 << 20            # bytes of a transparent huge page (x86-64, arm64 with 4K pages)
HUGE_PAGE_MIN_BYTES = HUGE_PAGE  # weights from one huge page up go in memory advised for transparent huge pages
STALE_LOCK_S = 900  # a build lock this old was left by a killed build (a build takes about a minute)



@functools.lru_cache(maxsize=None)
def link_flags() -> tuple[str, ...]:
    """LDFLAGS, and the C++ runtime the compiler links (libstdc++.so.6) named by its full path, so that the library
    takes its C++ runtime from the one shared copy the process has. A toolchain that would link libstdc++.a into it
    (as one on an Ubuntu 24.04 CUDA image did: GCC 13's archive in a process running GCC 14's shared runtime) leaves
    two copies of the runtime in the process, whose streams crossed: every error message with a number in it (any
    refusal of a bad shape) crashed the process. A compiler without a libstdc++ (clang on libc++) links as it does."""
    cxx = os.environ.get("CXX", "c++")
    try:
        path = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        path = ""
    return LDFLAGS + ((os.path.realpath(path),) if os.path.isabs(path) and os.path.isfile(path) else ())


def build_dir() -> Path:
    """Where this version of the extension is built for this machine: a hash of the C++ files' contents, the flags,
    torch's and Python's versions and the CPU (its model and feature flags: -march=native)."""
    h = hashlib.blake2b(digest_size=8)
    here = Path(__file__).parent
    for path in sorted([*here.glob("*.cpp"), *here.glob("*.h")]):  # the sources and what they include
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    cpu = ""
    try:
        cpu = "".join(ln for ln in Path("/proc/cpuinfo").read_text().splitlines(keepends=True)
                      if ln.startswith(("model name", "flags", "Features", "CPU part")))
    except OSError:
        pass
    h.update(repr((CFLAGS, link_flags(), torch.__version__, sys.version_info[:2], platform.machine(),
                   sorted(set(cpu.splitlines())))).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return Path(root) / f"pmx_cpu-{h.hexdigest()}"


def _load_or_build(directory: Path) -> None:
    """Loads the library built in `directory`, building it first (and saying so, on rank 0) where it is not there.
    Ranks building at once take turns through torch's lock in the directory; the second finds the build done."""
    library = directory / "pmx_cpu.so"
    if (directory / BUILT).is_file() and library.is_file():
        torch.ops.load_library(str(library))
        return
    from torch.utils.cpp_extension import load
    loud = rank_from_environment()[0] == 0
    if loud:
        note(f"building this project's C++ CPU kernels for this machine (once per version: ~30 s on 2 cores) "
             f"into {directory}")
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"  # torch's build lock; one this old was left by a build that was killed
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        note(f"{lock} is {time.time() - lock.stat().st_mtime:.0f} s old, left by a build that was killed; removing it")
        lock.unlink(missing_ok=True)
    load(name="pmx_cpu", sources=[str(Path(__file__).with_name(f)) for f in SOURCES], extra_cflags=list(CFLAGS),
         extra_ldflags=list(link_flags()), is_python_module=False, build_directory=str(directory), verbose=False)
    (directory / BUILT).write_text(f"{time.perf_counter() - t0:.1f} s\n")
    if loud:
        note(f"built the C++ CPU kernels in {time.perf_counter() - t0:.0f} s")


@functools.lru_cache(maxsize=None)
def cpu_ops():
    """torch.ops.pmx_cpu, built (once per version and machine) and loaded on first call; None where it cannot be
    built."""
    try:
        _load_or_build(build_dir())
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the slower oneDNN / aten kernels still work
        print(f"warning: this project's CPU kernels could not be built ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); using oneDNN / torch's aten kernels", file=sys.stderr)
        return None
    torch.library.register_fake("pmx_cpu::linear_f32")(lambda x, w, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_f32_fused")(
        lambda x, w, n, swiglu=False, norm=None, eps=0.0, residual=None, glu_out=False:
        x.new_empty(x.shape[0], n // 2, dtype=torch.bfloat16 if w.dtype == torch.bfloat16 and bf16_k_pairs() else
                    torch.float32) if glu_out else x.new_empty(x.shape[0], n, dtype=torch.float32))
    torch.library.register_fake("pmx_cpu::linear_int8")(lambda x, w, s, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_int4")(lambda x, w, s, g, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_int8_group")(lambda x, w, s, g, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::linear_dequant")(lambda x, w, s, m, g, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("pmx_cpu::decode_attention")(lambda q, cache, kv_scale, layout, layer, rows, kvlens,
                                                             window, scale, page_size=0, alibi=None, softcap=0.0:
                                                             torch.empty_like(q))
    torch.library.register_fake("pmx_cpu::prefill_attention")(
        lambda q, k, v, scale, causal, softcap, bf16=False, bf16_out=False:
        q.new_empty(q.shape, dtype=torch.bfloat16 if bf16_out else q.dtype))
    torch.library.register_fake("pmx_cpu::shm_all_reduce_")(lambda t, ws, rank, world, timeout: None)
    torch.library.register_fake("pmx_cpu::shm_all_gather")(lambda t, ws, rank, world, timeout:
                                                           t.new_empty(world * t.numel()))
    return torch.ops.pmx_cpu


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(mmap_above: int = 32 << 20, trim_above: int = 1 << 30) -> bool:
    """Has glibc's malloc keep the memory a step frees for the next one: blocks below `mmap_above` bytes (glibc's
    largest setting) from the heap rather than from mappings of their own, freed memory returned to the system only
    past `trim_above` bytes. By default glibc maps and unmaps a step's larger activations (its threshold follows the
    last block freed) and the next step faults their pages in again: up to ~9,000 page faults and 20 ms of system
    time a 512-token prefill of the 178M gqa benchmark model (Zen 5), from one process to the next. For a CPU engine
    (runner.engine.session); False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_above)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_above))
    except (OSError, AttributeError):
        return False


def huge_page_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of `shape`, from HUGE_PAGE_MIN_BYTES up in a private anonymous mapping of its own advised
    for transparent huge pages (madvise MADV_HUGEPAGE; torch's allocator asks for none unless THP_MEM_ALLOC_ENABLE
    is set before it starts), whose pages are taken as they are first written. Where the kernel grants no huge page
    (THP off) its pages are ordinary ones."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # 2 MiB more than needed, so the tensor can start on a 2 MiB boundary: every whole 2 MiB of it can then be a
    # huge page (the slack is never touched, so it takes no memory)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps `mm` alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start: start + nbytes].view(dtype).view(shape)


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor `t`, in huge pages from HUGE_PAGE_MIN_BYTES up (:func:`huge_page_zeros`):
    a decode step streams every weight once, with fewer TLB misses on 2 MiB pages."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE_MIN_BYTES:
        return t.contiguous()
    return huge_page_zeros(tuple(t.shape), t.dtype).copy_(t)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/64, K, 64]: blocks of 64 output channels, k-major inside a block (rows padded with 0), in
    huge pages where large enough (:func:`huge_page_copy`). bfloat16 blocks take the layout of the machine's kernels
    (cpu_gemm.cpp), so this needs the extension for bfloat16: where the CPU has AVX512-BF16 (:func:`bf16_k_pairs`),
    the k-rows in pairs (row pair p holds (w[2p, c], w[2p + 1, c]) for each channel c; an odd K's last row plainly),
    for its dot-product instruction; elsewhere the channels in pairs inside each group of g = bf16_pair_channels()
    (channel i, then g/2 + i), which the kernels widen with a shift and a mask."""
    n, k = weight.shape
    nb = -(-n // CPU_BLOCK)
    blocks = pad_rows(weight, nb * CPU_BLOCK).view(nb, CPU_BLOCK, k).transpose(1, 2)
    if weight.dtype == torch.bfloat16 and bf16_k_pairs():
        even = k - k % 2
        paired = blocks[:, :even].reshape(nb, even // 2, 2, CPU_BLOCK).transpose(2, 3).reshape(nb, even, CPU_BLOCK)
        blocks = torch.cat([paired, blocks[:, even:]], dim=1)
    elif weight.dtype == torch.bfloat16:
        g = bf16_pair_channels()
        blocks = blocks.reshape(nb, k, CPU_BLOCK // g, 2, g // 2).transpose(3, 4).reshape(nb, k, CPU_BLOCK)
    return huge_page_copy(blocks)


def unpack_blocks(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_blocks`: [N/64, K, 64] -> [N, K]."""
    nb, k, _ = packed.shape
    if packed.dtype == torch.bfloat16 and bf16_k_pairs():
        even = k - k % 2
        rows = packed[:, :even].reshape(nb, even // 2, CPU_BLOCK, 2).transpose(2, 3).reshape(nb, even, CPU_BLOCK)
        packed = torch.cat([rows, packed[:, even:]], dim=1)
    elif packed.dtype == torch.bfloat16:
        g = bf16_pair_channels()
        packed = packed.reshape(nb, k, CPU_BLOCK // g, g // 2, 2).transpose(3, 4).reshape(nb, k, CPU_BLOCK)
    return packed.transpose(1, 2).reshape(-1, k)[:n]


def bf16_pair_channels() -> int:
    """The channels of a group whose bfloat16 weights the kernels hold in pairs (2 vectors: 16 on AVX2, 32 on
    AVX-512)."""
    ops = cpu_ops()
    if ops is None:
        raise RuntimeError("bfloat16 blocks are packed for this project's CPU kernels, which could not be built here")
    return int(ops.bf16_pair_channels())


def bf16_k_pairs() -> bool:
    """Whether the kernels take bfloat16 blocks with their k-rows in pairs (the CPU has AVX512-BF16: cpu_gemm.cpp)."""
    ops = cpu_ops()
    if ops is None:
        raise RuntimeError("bfloat16 blocks are packed for this project's CPU kernels, which could not be built here")
    return bool(ops.bf16_k_pairs())
