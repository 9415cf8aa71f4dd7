#!/usr/bin/env python3
"""ppl.pmx-compatible entry point: same as `python -m runner merge`. See `--help`."""

from runner.cli import merge, run

if __name__ == "__main__":
    run(merge)
