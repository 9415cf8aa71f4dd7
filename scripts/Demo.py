#!/usr/bin/env python3
"""ppl.pmx-compatible text generation: `python scripts/Demo.py --ckpt_dir D ...`, also under
`mpirun -np N` and `torchrun --nproc_per_node N`. Same as `python -m runner generate`. See --help."""

from runner.cli import generate, run

if __name__ == "__main__":
    run(generate)
