"""Command line: `python -m runner <command>` / `pmx-runner <command>`.

Commands: convert, split, merge, quantize (PMX layer); generate, replay, compare, bench, perplexity (engine); export
(ONNX, runner.onnx); serve (the OpenAI-compatible server). Each is a plain, typed function (the engine's flags are EngineConfig's,
shared by every engine command); fire dispatches to it, with the parse functions of :mod:`runner.args` so that
every flag is read as typed (`--input_dir X` and `--input-dir X` both work). :func:`run` is the error path of
every entry point: see :mod:`runner.parallel.job`. The engine's, the server's and ONNX's commands are imported when
asked for (`from runner.cli import generate` imports the engine only: every rank of every job starts faster).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Annotated, Callable, Optional

import fire

from runner.args import (Dtype, GroupSize, OneOf, Overwrite, PositiveInt, Progress, QuantizeEmbedding, QuantizeOutput,
                         QuantMethod, Range, check_argv, doc_lines, help_text, typed)
from runner.errors import PmxError
from runner.parallel.job import JobControl, describe
from runner.pmx.convert import convert as pmx_convert
from runner.pmx.convert import quantize_model, reshard
from runner.pmx.quant import scheme_from_flags, scheme_of
from runner.pmx.random_model import make_random_model as write_random_model


def convert(input_dir: str, output_dir: str, dtype: Dtype = "auto", num_shards: PositiveInt = 1,
            overwrite: Overwrite = False, progress: Progress = True, quantize: Optional[QuantMethod] = None,
            group_size: GroupSize = 128, quantize_output: Optional[QuantizeOutput] = None,
            quantize_embedding: Optional[QuantizeEmbedding] = None) -> None:
    """Convert a HuggingFace checkpoint directory or a GGUF file into a PMX directory.

    Args:
        input_dir: HF directory with config.json and model.safetensors / sharded safetensors / pytorch_model.bin; or a
            .gguf file (the first part of a split set), or a directory holding one.
        output_dir: PMX directory to create (pmx_params.json, model.XX.safetensors, tokenizer files).
        dtype: auto (the checkpoint's), float32, float16 or bfloat16.
        num_shards: split into this many tensor-parallel shards while converting.
    """
    quant = scheme_from_flags(quantize, group_size, quantize_output, quantize_embedding)
    p = pmx_convert(input_dir, output_dir, dtype=dtype, num_shards=num_shards, overwrite=overwrite, progress=progress,
                    quant=quant, report=print)
    q = scheme_of(p)
    print(f"converted {input_dir} ({p.architecture}, {p.num_layers} layers, {p.dtype}"
          f"{', ' + q.method + ' weights' if q else ''}) -> {output_dir} "
          f"({p.num_shards} shard{'s' if p.num_shards > 1 else ''})")


def quantize(input_dir: str, output_dir: str, quantize: QuantMethod = "int8", group_size: GroupSize = 128,
             quantize_output: Optional[QuantizeOutput] = None, quantize_embedding: Optional[QuantizeEmbedding] = None,
             num_shards: Optional[PositiveInt] = None, overwrite: Overwrite = False, progress: Progress = True) -> None:
    """Weight-only quantise a float PMX model (split or not): int8 per output channel or int4 in groups.

    Args:
        input_dir: float PMX directory.
        output_dir: PMX directory to create, its linears quantised.
        num_shards: shards of the output (default: as many as the input has).
    """
    quant = scheme_from_flags(quantize, group_size, quantize_output, quantize_embedding)
    p = quantize_model(input_dir, output_dir, quant, num_shards=num_shards, overwrite=overwrite, progress=progress)
    print(f"quantized {input_dir} -> {output_dir} ({quant.method}"
          f"{f', groups of {quant.group_size}' if quant.group_size else ''}"
          f"{', output float' if not quant.quantize_output else ''}"
          f"{', embedding float' if not quant.quantize_embedding else ''}; "
          f"{p.num_shards} shard{'s' if p.num_shards > 1 else ''})")


def split(input_dir: str, num_shards: PositiveInt, output_dir: str, overwrite: Overwrite = False,
          progress: Progress = True) -> None:
    """Cut a PMX model into `num_shards` tensor-parallel shards (an already split model is re-cut).

    Args:
        input_dir: PMX directory.
        num_shards: number of ranks the output is for.
        output_dir: PMX directory to create, in num_shards shards.
    """
    p = reshard(input_dir, output_dir, num_shards, overwrite=overwrite, progress=progress)
    pads = f", padded {p.padded_dims}" if p.padded_dims else ""
    reps = f", each KV head on {p.kv_replication} ranks" if p.kv_replication > 1 else ""
    print(f"split {input_dir} -> {output_dir} ({p.num_shards} shards{reps}{pads})")


def merge(input_dir: str, num_shards: PositiveInt, output_dir: str, overwrite: Overwrite = False,
          progress: Progress = True) -> None:
    """Put the `num_shards` shards of a split PMX model back into one, bit for bit.

    Args:
        input_dir: split PMX directory.
        num_shards: how many shards input_dir holds (checked against its pmx_params.json).
        output_dir: PMX directory to create (one shard, model.00.safetensors).
    """
    reshard(input_dir, output_dir, 1, overwrite=overwrite, progress=progress, expect_input_shards=num_shards)
    print(f"merged {input_dir} ({num_shards} shards) -> {output_dir}")


def make_random_model(output_dir: str, hidden_dim: PositiveInt = 128, intermediate_dim: PositiveInt = 344,
                      num_layers: PositiveInt = 2, num_heads: PositiveInt = 8, num_kv_heads: PositiveInt = 4,
                      vocab_size: Annotated[int, Range(259)] = 512,
                      dtype: Annotated[str, OneOf("float32", "float16", "bfloat16")] = "float32", seed: int = 0,
                      overwrite: Overwrite = False) -> None:
    """Write a random-weight HF Llama checkpoint with a small BPE tokenizer.json (for demos and benchmarks).

    Args:
        output_dir: HF directory to create (config.json, model.safetensors, tokenizer.json).
        hidden_dim: hidden size (a multiple of num_heads).
        intermediate_dim: MLP size.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (divides num_heads).
        vocab_size: vocabulary size (at least 259: the byte-level tokenizer's 256 bytes and 3 special tokens).
        dtype: float32, float16 or bfloat16.
        seed: seed of the random weights.
    """
    write_random_model(output_dir, hidden_dim, intermediate_dim, num_layers, num_heads, num_kv_heads, vocab_size, dtype, seed,
          overwrite)
    print(f"wrote a random-weight Llama checkpoint to {output_dir}")


ELSEWHERE = {  # command -> its module, imported when the command is asked for
    "generate": "runner.engine.demo", "serve": "runner.serve.server", "replay": "runner.engine.replay",
    "compare": "runner.engine.compare", "bench": "runner.engine.bench", "perplexity": "runner.engine.perplexity",
    "export": "runner.onnx.export", "onnx_replay": "runner.onnx.replay"}
ORDER = ("convert", "split", "merge", "quantize", "generate", "serve", "replay", "compare", "bench", "perplexity",
         "export", "onnx_replay", "make_random_model")


def __getattr__(name: str) -> Callable:
    """`from runner.cli import generate` (and the other commands of ELSEWHERE): imported on first use."""
    if name in ELSEWHERE:
        return getattr(importlib.import_module(ELSEWHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Commands(Mapping):
    """name -> command, in ORDER; a command of another module is imported when it is looked up."""

    def __getitem__(self, name: str) -> Callable:
        if name not in ORDER:
            raise KeyError(name)
        return __getattr__(name) if name in ELSEWHERE else globals()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(ORDER)

    def __len__(self) -> int:
        return len(ORDER)


COMMANDS = Commands()
HELP_FLAGS = ("--help", "-h", "-help")


def _resolve(component, argv: list[str], prog: str) -> tuple[Optional[Callable], list[str], str]:
    """(command, its arguments, its name for messages); command None for the list of commands."""
    if callable(component):
        return component, argv, prog
    if not argv or argv[0] in HELP_FLAGS:
        return None, argv, prog
    name = argv[0].replace("-", "_")
    if name not in component:
        close = difflib.get_close_matches(name, list(component), n=1)
        raise PmxError(f"{prog}: unknown command {argv[0]!r}" + (f"; did you mean {close[0]}?" if close else "") +
                       f" (commands: {', '.join(component)})")
    return component[name], argv[1:], f"{prog} {name}"


def _commands_help(component: dict, prog: str) -> str:
    width = max(map(len, component))
    rows = [f"  {name:<{width}}  {doc_lines(fn)[0].split('. ')[0].rstrip('.')}" for name, fn in component.items()]
    return "\n".join([f"usage: {prog} COMMAND [--flag value ...]   ({prog} COMMAND --help lists its flags)", "",
                      "commands:", *rows])


def run(component, argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """Runs a command (or a dict of them) from the command line.

    Every rank first joins the job (:class:`runner.parallel.job.JobControl`: MPI is initialised on every rank under
    mpirun, SIGINT / SIGTERM handled); flags are then checked against the command's signature (unknown
    flags refused with the closest name, values parsed as typed), and fire calls the command. Any failure
    becomes `rank r: error: ...` (just `error: ...` for one process), printed once, with exit status 2 for
    bad input (1 for an unexpected exception, with its traceback; 130 / 143 for SIGINT / SIGTERM); under
    mpirun the launcher then ends the whole job and under torchrun the elastic agent stops the others.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0] or "pmx-runner")
    if prog == "__main__.py":
        prog = "python -m runner"
    job = JobControl().start()
    with job.signals_handled():
        try:
            fn, args, name = _resolve(component, argv, prog)
            if fn is None or any(a in HELP_FLAGS for a in args):
                with contextlib.suppress(BrokenPipeError):  # e.g. `--help | head`
                    print(_commands_help(component, prog) if fn is None else help_text(fn, name), flush=True)
                return
            check_argv(fn, args, name)
            status = fire.Fire(typed(fn), command=args, name=name, serialize=lambda _: None)
            if isinstance(status, int) and status:  # replay / compare: 1 when something disagrees
                sys.exit(status)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 (every rank reports its own error, then the job ends)
            job.fail(*describe(e, skip=(__file__, os.path.dirname(fire.__file__))))


def main(argv: Optional[list[str]] = None) -> None:
    run(COMMANDS, argv)
