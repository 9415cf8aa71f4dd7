"""The C++ CPU kernels' first build (runner/kernels/cpu_ext.py): rank 0 says what is happening and how long it took,
once; the build is cached by content, so a clone of the same version elsewhere loads it without building, and a
changed source builds anew."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from jobs import ROOT, run_job
from runner.kernels.cpu_ext import build_dir, cpu_ops

LOAD = "from runner.kernels.cpu_ext import cpu_ops; assert cpu_ops() is not None; print('loaded', flush=True)"
BUILDING = "building this project's C++ CPU kernels"


def test_first_build_is_announced_once_and_cached_for_any_clone(tmp_path):
    """The new cache directory is seeded with the objects of this checkout's own build (the suite's first use of the
    kernels compiled them, or found them built for the same sources in the cache): ninja finds them up to date, so what
    runs here is the build's announcement, its lock between the ranks, the link and the marking as built, in seconds
    rather than the compile's ~50 s."""
    assert cpu_ops() is not None
    cache = tmp_path / "ext"
    env = {"TORCH_EXTENSIONS_DIR": str(cache)}
    seeded = cache / build_dir().name
    seeded.mkdir(parents=True)
    objects = []
    for f in build_dir().iterdir():
        if f.name.endswith((".o", ".o.d", ".ninja")) or f.name in (".ninja_log", ".ninja_deps"):
            shutil.copy2(f, seeded / f.name)  # with their times: ninja's logs hold them
            objects += [f.stat().st_mtime_ns] if f.name.endswith(".o") else []
    # A clone newer than the cached build of the same sources (a machine whose cache outlives its checkouts, as CI's
    # does) has sources newer than their objects, which ninja would compile again (~100 s there): the sources get the
    # time of the build they went into (their contents are the build's: its directory is named by their hash)
    built_at = min(objects) - 1_000_000_000
    for src in (ROOT / "runner" / "kernels").iterdir():
        if src.suffix in (".cpp", ".h") and src.stat().st_mtime_ns > built_at:
            os.utime(src, ns=(built_at, built_at))
    rc, out, err, secs = run_job([ROOT / "scripts" / "mpirun.sh", "-np", 2, sys.executable, "-c", LOAD], tmp_path,
                                 env, timeout=600)
    assert rc == 0 and out.split() == ["loaded", "loaded"], err
    lines = err.splitlines()
    assert len([ln for ln in lines if BUILDING in ln]) == 1 and not [ln for ln in lines if ln.startswith("rank 1")]
    assert [ln for ln in lines if ln.startswith("built the C++ CPU kernels in ")], err
    (built,) = cache.iterdir()
    assert built == seeded and (built / "pmx_cpu.so").is_file() and (built / "built").is_file()

    clone = tmp_path / "clone"  # another checkout of the same version: other paths, newer files
    shutil.copytree(ROOT / "runner", clone / "runner")
    env["PYTHONPATH"] = str(clone)
    script = tmp_path / "load.py"  # a script outside the checkout (`python -c` would import from the job's cwd)
    script.write_text(LOAD + "; import runner; print(runner.__file__)")
    t0 = time.monotonic()
    rc, out, err, _ = run_job([sys.executable, script], tmp_path, env, timeout=120)
    assert rc == 0 and out.split()[1] == str(clone / "runner" / "__init__.py") and BUILDING not in err, err
    assert time.monotonic() - t0 < secs and list(cache.iterdir()) == [built]

    with open(clone / "runner" / "kernels" / "cpu_step.cpp", "a") as f:  # a changed source: another build
        f.write("\n// changed\n")
    script.write_text("from runner.kernels.cpu_ext import build_dir; print(build_dir())")
    rc, out, err, _ = run_job([sys.executable, script], tmp_path, env, timeout=120)
    assert rc == 0 and out.strip().startswith(str(cache / "pmx_cpu-")) and out.strip() != str(built), out + err


def test_the_library_takes_the_shared_cpp_runtime_and_refuses_with_numbers():
    """The built library loads libstdc++ as the process's one shared copy (cpu_ext.link_flags: a toolchain that linked
    GCC's archive into it left two C++ runtimes in the process, and every refusal whose message holds a number
    crashed it), and such a refusal is a RuntimeError naming the value."""
    assert cpu_ops() is not None
    readelf = shutil.which("readelf")
    assert readelf is not None, "no readelf (binutils): the kernels' linker comes from the same package"
    dynamic = subprocess.run([readelf, "-d", "-W", str(build_dir() / "pmx_cpu.so")], capture_output=True, text=True,
                             check=True).stdout
    assert "[libstdc++.so.6]" in dynamic, dynamic
    symbols = subprocess.run([readelf, "--dyn-syms", "-W", str(build_dir() / "pmx_cpu.so")], capture_output=True,
                             text=True, check=True).stdout
    assert "_ZNKSt7codecvt" not in symbols  # (libstdc++'s own code, found in the library when the archive was linked)
    import torch
    from runner.kernels.linear import Linear
    from runner.kernels.quant_linear import CPU_KERNEL_MAX_ROWS, packed_args
    args = packed_args(Linear(torch.randn(130, 96), kernel="pmx"))
    with pytest.raises(RuntimeError, match=r"x must be contiguous float32 \[M, 96\]"):
        torch.ops.pmx_cpu.linear_into_(torch.randn(1, 95), *args, 130, CPU_KERNEL_MAX_ROWS, torch.empty(1, 130))


# The instruction sets whose branches of the kernels this machine's own build (-march=native) may never compile: an
# AVX-512 server's (AVX-512 F/BW/DQ/VL, VNNI, BF16: a Xeon since Sapphire Rapids, a Zen 4 or 5 takes those paths) and
# a CPU's without AVX2 (the portable loops; arm64 takes them too).
FOREIGN_ARCHS = ["sapphirerapids", pytest.param("x86-64-v2", marks=pytest.mark.extended)]


@pytest.mark.parametrize("arch", FOREIGN_ARCHS)
def test_every_instruction_set_branch_of_the_kernels_compiles(arch):
    """Each kernel source with per-instruction-set branches passes the compiler's checks (syntax, types, the
    intrinsics' signatures) for another machine than this one, with torch's headers as the build uses them."""
    from torch.utils.cpp_extension import include_paths
    import sysconfig
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    assert cxx is not None, "no C++ compiler: the kernels could not be built either"
    flags = ["-std=c++17", "-fsyntax-only", f"-march={arch}", "-fopenmp", "-DTORCH_EXTENSION_NAME=pmx_cpu",
             *(f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]])]
    sources = [p for p in sorted((ROOT / "runner" / "kernels").glob("cpu_*.cpp")) if "__AVX512" in p.read_text()]
    assert len(sources) >= 3  # the GEMMs, the quantised linears, the step's ops
    jobs = [(p, subprocess.Popen([cxx, *flags, str(p)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for p in sources]
    for p, job in jobs:
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, f"{p.name} for -march={arch}:\n{out[-4000:]}"


FAULTS = """
import resource, sys, torch
from runner.kernels.cpu_ext import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def steps():  # activations of growing sizes, as a step's chunks of a long prompt: 10 .. 30 MiB
    for mib in range(10, 31, 2):
        x = torch.empty(mib << 18)
        x.fill_(1.0)
        del x
steps()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_kept_for_the_next_step():
    """A CPU engine keeps what a step frees (keep_freed_memory): the second pass over the same allocations faults
    in few pages, where glibc's defaults map each block afresh and fault all of it in again (~30,000 pages here)."""
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])
    default, kept = faults("default"), faults("keep")
    assert kept * 10 < default, (kept, default)
