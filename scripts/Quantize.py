#!/usr/bin/env python3
"""Weight-only quantisation of a PMX model: same as `python -m runner quantize`. See `--help`."""

from runner.cli import quantize, run

if __name__ == "__main__":
    run(quantize)
