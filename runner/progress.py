"""Progress bars on stderr (tqdm), shown by rank 0 only: a person sees loading and generation move,
and ordinary output (stdout) stays clean."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def note(message: str) -> None:
    """One line on stderr that leaves a progress bar being drawn intact (it is redrawn below the line)."""
    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


def progress_bar(total: int, desc: str, unit: str = "B", show: bool = True) -> tqdm:
    """A tqdm bar on stderr (bytes scaled to kB / MB / GB); `show=False` gives a silent one."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr, disable=not show,
                mininterval=0.5, dynamic_ncols=True, leave=True)


class GenerationProgress:
    """Sequences done and tokens/s of one generation, fed by the generator's per-step hook."""

    def __init__(self, sequences: int, show: bool):
        self.shown = show
        self.bar = progress_bar(sequences, "generating", unit="seq", show=show)
        self.tokens, self.t0 = 0, time.perf_counter()

    def __call__(self, new_tokens: int, done: int) -> None:
        self.tokens += new_tokens
        self.bar.update(done - self.bar.n)
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens} tokens, {rate:.1f} tokens/s", refresh=False)

    def close(self) -> None:
        self.bar.close()
