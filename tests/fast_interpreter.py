"""A faster Triton interpreter for the CPU test runs (TRITON_INTERPRET=1): device functions called from a kernel of
their own module skip re-patching triton.language.

Triton's interpreter patches triton.language's builtins (tl.load, tl.arange, tensor methods, ...) when a kernel
launch starts and restores them when it ends. It also patches them again on every call of a `@triton.jit` device
function, which finds them patched already (the kernel's launch did it, over the same module objects) and changes
nothing, but walks every member of the language modules to find that out: a quarter of an interpreted engine step
(this project's kernels call small device functions per program: `_rotate`, `_store_row`, `_kv_tile`, ...). Here a
device function whose module is the launching kernel's (the same globals, so the same language modules, patched by
the launch) runs without that walk; any other call goes through Triton's own path. What each kernel computes, and
how the interpreter runs it, is unchanged. Applied where the interpreter has the parts this relies on; otherwise the
interpreter is left as it is.
"""

from __future__ import annotations

import functools


def install() -> bool:
    """Applies the shortcut once per process; False where this Triton's interpreter lacks what it relies on."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    grid, device = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if grid is None or device is None or not hasattr(device, "rewrite") or not hasattr(ti, "InterpreterError"):
        return False
    if getattr(device.__call__, "_pmx_fast", False):
        return True
    launching: list = []   # the globals of the kernels whose launch is under way (innermost last)
    launch, call = grid.__call__, device.__call__

    @functools.wraps(launch)
    def launch_(self, *args, **kwargs):
        launching.append(self.fn.__globals__)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launching.pop()

    @functools.wraps(call)
    def call_(self, *args, **kwargs):
        if not launching or self.fn.__globals__ is not launching[-1]:
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # (as Triton's own device call reports it)
            raise ti.InterpreterError(repr(e)) from e

    call_._pmx_fast = True
    grid.__call__, device.__call__ = launch_, call_
    return True
