#!/usr/bin/env python3
"""OpenAI-compatible server: `python scripts/Server.py --ckpt_dir D [--port 8000] ...`, also under
`mpirun -np N` and `torchrun --nproc_per_node N`. Same as `python -m runner serve`. See --help."""

from runner.cli import run, serve

if __name__ == "__main__":
    run(serve)
