#!/usr/bin/env python3
"""CPU generation speed: pmx-runner at TP=1 and TP=2 (mpirun) against transformers, same weights/threads.

The project's standard random-weight Llama (dim 768, 12 layers, 12 heads, vocab 32000, fp32): decode
tokens/s at batch 1 and 16 (after an 8-token prompt), prefill tokens/s for 512 tokens. A shortcut for
`benchmarks/cpu_peers.py --shape base --systems pmx1,pmx2,transformers` (which also measures
CTranslate2 and llama.cpp); its flags pass through.

    python benchmarks/cpu_generate.py [--rounds 3] [--decode_tokens 32] [--engine_options '{...}']
"""

from functools import partial

import fire

from cpu_peers import main

if __name__ == "__main__":
    cpu_generate = partial(main, shape="base", systems="pmx1,pmx2,transformers")
    cpu_generate.__doc__ = __doc__
    fire.Fire(cpu_generate)
