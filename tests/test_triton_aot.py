"""Ahead-of-time compiles of every Triton kernel for sm_90 (and sm_80 with --extended), without a GPU
(runner.kernels.aot).

The engine's real specialisations (head_dim 64, 128 and 256, float16 and bfloat16, every cache layout, offset and
paged, float and int8 caches, decode with and without split-K (merged inside or by its kernel), prefill, sliding
windows, ALiBi, a partial rotary, GeGLU and soft-capped scores, int8 / int4 linears, the batch-1 decode linears with
their fusions and quantised weights, programmatic dependent launch on sm_90),
as the ops' wrappers pick their block sizes and warps, are compiled down to cubins by Triton and ptxas (which
ships in the triton wheel): what the interpreter cannot check. Each architecture compiles in its own process
(without TRITON_INTERPRET, which conftest sets for this one), a subset in which every choice (constexpr values,
dtypes, warps) is made at least once (`--cover 1`); with --extended, every pair of choices made together (`--cover
2`: about 120 of the 300 distinct specialisations an arch has); `python -m runner.kernels.aot` compiles them all.

The default run compiles for sm_90 alone: its specialisations are sm_80's (the same launches, every choice made)
plus the PDL variants of the decode linears, through the same Triton front end, and it compiles the spilling canary
that shows ptxas's report is read. What sm_80 adds is ptxas's register allocation for that target (a spill there);
--extended compiles both, at once. Each compile is one process on one core, so on an idle 2-core box sm_90 alone
takes about as long as both did side by side; on a busy one it saves ~20 s (54 -> 35 s beside a benchmark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
DEFAULT_ARCHS = (90,)  # (the module docstring says why)
ARCH_PARAMS = [pytest.param(a, marks=pytest.mark.extended) if a not in DEFAULT_ARCHS else a for a in ARCHS]


@pytest.fixture(scope="module")
def aot(tmp_path_factory, request):
    """{arch: the JSON of `python -m runner.kernels.aot --arch A`} (sm_90 also compiles the spilling canary): `--cover
    1` (every choice made at least once) for DEFAULT_ARCHS; with --extended, every arch at `--cover 2` (every pair of
    choices made together)."""
    tmp = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    extended = request.config.getoption("--extended")
    procs = {}
    for arch in ARCHS if extended else DEFAULT_ARCHS:
        cmd = [sys.executable, "-m", "runner.kernels.aot", "--arch", str(arch), "--json", str(tmp / f"{arch}.json"),
               "--cover", "2" if extended else "1"]
        if arch == 90:
            cmd.append("--canary")
        env_a = dict(env, TRITON_CACHE_DIR=str(tmp / f"cache{arch}"))  # fresh: nothing cached across runs
        procs[arch] = subprocess.Popen(cmd, cwd=ROOT, env=env_a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    out = {}
    for arch, p in procs.items():
        try:
            log, _ = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:  # (no compile left running after the test)
            for q in procs.values():
                q.kill()
            raise
        path = tmp / f"{arch}.json"
        assert path.is_file(), f"sm_{arch}: the ahead-of-time compile failed:\n{log[-4000:]}"
        out[arch] = dict(json.loads(path.read_text()), log=log)
    return out


def _kernel_names():
    from triton.runtime.jit import KernelInterface

    from runner.kernels import triton_ops, triton_quant
    return {name for mod in (triton_ops, triton_quant) for name, v in vars(mod).items()
            if isinstance(v, KernelInterface) and name.endswith("_kernel")}


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_aot_compiles_every_triton_kernel(aot, arch):
    names = _kernel_names()
    assert names >= {"_skip_rms_norm_kernel", "_rotary_kv_kernel", "_swiglu_kernel", "_decode_attn_kernel",
                     "_merge_splits_kernel", "_prefill_attn_kernel", "_quant_matmul_kernel"}
    got = {r["kernel"] for r in aot[arch]["results"]}
    assert got == names, f"not compiled for sm_{arch}: {sorted(names - got)}"
    assert all(r["arch"] == arch for r in aot[arch]["results"])


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_aot_no_register_spills(aot, arch):
    spilled = [(r["kernel"], r["labels"][0], r["spill_stores"], r["spill_loads"]) for r in aot[arch]["results"]
               if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, f"sm_{arch} register spills:\n{aot[arch]['log'][-4000:]}"
    assert all(0 < r["registers"] <= 255 for r in aot[arch]["results"])


def test_aot_spill_report_is_real(aot):
    """ptxas's report is what is parsed: the canary (a 16384-wide norm row forced onto one warp) spills."""
    canary = aot[90]["canary"]
    assert len(canary) == 1 and canary[0]["spill_stores"] > 0 and canary[0]["spill_loads"] > 0


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_aot_covers_the_engine_specialisations(aot, arch):
    results = aot[arch]["results"]
    labels = " | ".join(aot[arch]["launches"])
    for needed in ("float16", "bfloat16", "int8", "paged", "offset", "decode B=1", "decode B=64", "prefill",
                   "rotary+store", "swiglu", "norm 16384", "int4 g128", "mistral-7b-window",
                   "chatglm3-6b float16 rotary", "baichuan2-13b-alibi", "gemma-2-9b float16 geglu", "full layer"):
        assert needed in labels, needed
    for layout in range(4):
        assert f"layout {layout}" in labels
    by_kernel: dict = {}
    for r in results:
        for k, v in r["constexprs"].items():
            by_kernel.setdefault((r["kernel"], k), set()).add(v)
    for kernel in ("_decode_attn_kernel", "_prefill_attn_kernel"):
        assert by_kernel[(kernel, "BLOCK_D")] == {64, 128, 256}     # head dims 64, 128 and 256 (Gemma)
        assert by_kernel[(kernel, "QUANT")] == {False, True}
        assert by_kernel[(kernel, "PAGED")] == {False, True}
        assert by_kernel[(kernel, "HAS_WINDOW")] == {False, True}
        assert by_kernel[(kernel, "ALIBI")] == {False, True}
        assert by_kernel[(kernel, "SOFTCAP")] == {False, True}
    assert by_kernel[("_decode_attn_kernel", "SPLIT")] == {False, True}
    assert by_kernel[("_decode_attn_kernel", "MERGE")] == {False, True}          # splits merged inside, or not
    for flag in ("NORM", "RESIDUAL", "ROPE", "CACHE_QUANT", "SWIGLU", "GROUPED", "OFFSET"):  # the decode fusions
        assert by_kernel[("_decode_linear_kernel", flag)] == {False, True}, flag
    assert by_kernel[("_decode_linear_kernel", "WEIGHT")] == {16, 8, 4}            # float, int8, int4 weights
    assert by_kernel[("_decode_linear_kernel", "PDL")] == ({False, True} if arch == 90 else {False})
    assert by_kernel[("_rotary_kv_kernel", "QUANT")] == {False, True}
    assert by_kernel[("_swiglu_kernel", "GELU")] == {False, True}
    assert by_kernel[("_skip_rms_norm_kernel", "BLOCK")] >= {2048, 4096, 8192, 16384}
