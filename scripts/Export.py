#!/usr/bin/env python3
"""ppl.pmx-compatible ONNX export: `python scripts/Export.py --ckpt_dir D --export_path OUT ...`, under
`mpirun -np N` or `torchrun --nproc_per_node N` for a model split in N. Same as `python -m runner export`. See --help."""

from runner.cli import export, run

if __name__ == "__main__":
    run(export)
