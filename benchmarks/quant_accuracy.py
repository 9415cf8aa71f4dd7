#!/usr/bin/env python3
"""Accuracy of weight-only quantisation on the real checkpoints in ../shared/models: perplexity over a text
file (sliding window), logits SNR against the float model and greedy agreement, for fp32 / int8 / int4.

    python benchmarks/quant_accuracy.py [--text_file tests/data/story.txt] [--window 256] [--stride 128]

Each model is converted to PMX once (float32) and quantised with `quantize_model`: int8 per output channel, int4
with the group sizes given per model (the largest that divide its input dims are listed; stories260k's
intermediate 172 only takes 2 or 4); each with the default (output and embedding quantised too) and with both kept
float (`--quantize_output False --quantize_embedding False`, the default before). Logits SNR: 10 log10(sum fp32^2 / sum (q - fp32)^2) over every position of
the text's first window. Greedy: how many of 40 greedy tokens after "Once upon a time" equal the fp32 model's.
Prints a markdown table.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import fire
import torch

from runner.config import EngineConfig
from runner.engine.perplexity import evaluate
from runner.engine.session import open_session
from runner.engine.tokenizer import Tokenizer
from runner.pmx.convert import convert, quantize_model
from runner.pmx.quant import QuantScheme

REPO = Path(__file__).resolve().parents[1]
FLOAT_ENDS = dict(quantize_output=False, quantize_embedding=False)  # the default before issue 29: both kept float
MODELS = {"stories260k": [QuantScheme("int8"), QuantScheme("int8", **FLOAT_ENDS), QuantScheme("int4", 4),
                          QuantScheme("int4", 4, **FLOAT_ENDS)],
          "tinystories-656k": [QuantScheme("int8"), QuantScheme("int8", **FLOAT_ENDS), QuantScheme("int4", 32),
                               QuantScheme("int4", 32, **FLOAT_ENDS), QuantScheme("int4", 128),
                               QuantScheme("int4", 128, **FLOAT_ENDS)]}


def _engine(path: Path):
    return open_session(str(path), EngineConfig(compile="off")).core


def all_logits(engine, ids: list) -> torch.Tensor:
    """float32 logits [T, vocab] of every position of one prompt."""
    chunks = []
    engine.score([ids], lambda i, first, logits: chunks.append(logits))
    return torch.cat(chunks)


def label_of(s: QuantScheme) -> str:
    """int8, int4 g32; with what stays float named (the default quantises the output and the embedding too)."""
    kept = [n for n, q in (("output", s.quantize_output), ("embedding", s.quantize_embedding)) if not q]
    return s.method + (f" g{s.group_size}" if s.group_size else "") + (f", {' + '.join(kept)} float" if kept else "")


def _agree(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(text_file: str = str(REPO / "tests" / "data" / "story.txt"), window: int = 256, stride: int = 128,
         models_dir: str = str(REPO.parent / "shared" / "models")) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, schemes in MODELS.items():
            src = Path(models_dir) / name
            if not (src / "config.json").is_file():
                print(f"SKIPPED {name}: {src} not found")
                continue
            fp = Path(tmp) / f"{name}-fp32"
            convert(str(src), str(fp), progress=False)
            tok = Tokenizer(str(fp))
            ids = tok.encode(Path(text_file).read_text())
            prompt = tok.encode("Once upon a time")
            ref_model = _engine(fp)
            ref_logits = all_logits(ref_model, ids[:window])
            ref_greedy = ref_model.generate([prompt], 40)[0]
            variants = [("fp32", None, fp)]
            for s in schemes:
                out = Path(tmp) / f"{name}-{s.method}-{s.group_size}-{s.quantize_output}-{s.quantize_embedding}"
                quantize_model(str(fp), str(out), s, progress=False)
                variants.append((label_of(s), s, out))
            for label, s, path in variants:
                m = _engine(path)
                res = evaluate(m, ids, window, stride)
                logits = all_logits(m, ids[:window])
                err = (logits - ref_logits).square().sum()
                snr = math.inf if err == 0 else float(10 * torch.log10(ref_logits.square().sum() / err))
                size = sum(f.stat().st_size for f in path.glob("model.*.safetensors"))
                rows.append((name, label, res["perplexity"], snr, _agree(m.generate([prompt], 40)[0],
                                                                         ref_greedy), size, res["tokens"]))
    print(f"text: {text_file}, window {window}, stride {stride}\n")
    print("| model | weights | perplexity (tokens) | logits SNR vs fp32 | greedy tokens equal (of 40) | file bytes |")
    print("|---|---|---|---|---|---|")
    for name, label, ppl, snr, agree, size, tokens in rows:
        print(f"| {name} | {label} | {ppl:.3f} ({tokens}) | {'-' if math.isinf(snr) else f'{snr:.1f} dB'} | {agree} | "
              f"{size:,} |")


if __name__ == "__main__":
    fire.Fire(main)
