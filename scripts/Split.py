#!/usr/bin/env python3
"""ppl.pmx-compatible entry point: same as `python -m runner split`. See `--help`."""

from runner.cli import split, run

if __name__ == "__main__":
    run(split)
