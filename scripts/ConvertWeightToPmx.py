#!/usr/bin/env python3
"""ppl.pmx-compatible entry point: same as `python -m runner convert`. See `--help`."""

from runner.cli import convert, run

if __name__ == "__main__":
    run(convert)
