"""One rank's engine, set up from the launch environment: rank, device, threads, communicator, shard, and the
model with its step runners and continuous-batching core."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from runner.config import EngineConfig
from runner.engine.core import EngineCore
from runner.engine.model import Transformer, load_shard, random_shard
from runner.engine.runners import Stepper
from runner.errors import PmxError
from runner.kernels.cpu_ext import cpu_ops, keep_freed_memory
from runner.parallel.comm import SingleComm, collective_timeout, make_comm
from runner.parallel.launch import LaunchEnv, detect, set_cpu_threads
from runner.pmx.fingerprint import check_shards
from runner.pmx.params import PmxParams, shard_file
from runner.pmx.shard import sharded_params, unsharded_params
from runner.pmx.store import DTYPE_NAMES, SafetensorsReader
from runner.progress import progress_bar


@dataclass
class Session:
    env: LaunchEnv
    device: torch.device
    comm: object
    model: Transformer
    stepper: Stepper       # plans and runs steps (stepper.forward: ppl.pmx's step contract)
    core: EngineCore       # continuous batching: generate, score, add / step

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def close(self) -> None:
        self.comm.close()

    def log(self, *args) -> None:
        """Ordinary output: rank 0 only."""
        if self.is_main:
            print(*args, flush=True)


def pick_device(device: str, env: LaunchEnv) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise PmxError("--device cuda was asked for, but torch sees no CUDA device")
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    if device != "cpu":
        raise PmxError(f"--device must be auto, cpu or cuda, got {device!r}")
    return torch.device("cpu")


def pick_dtype(dtype: str, params_dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype. auto: float32 on CPU (half-precision arithmetic is slow there), the checkpoint's dtype on
    GPU."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else DTYPE_NAMES[params_dtype]
    if dtype not in DTYPE_NAMES:
        raise PmxError(f"--dtype must be auto, {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    return DTYPE_NAMES[dtype]


def pick_matrix_dtype(dtype: str, params_dtype: str, device: torch.device, prepack: bool = True) -> torch.dtype:
    """The dtype of the linear layers', output's and embedding's weights (load_shard's matrix_dtype): with auto on CPU a
    half-precision checkpoint's own, where this project's CPU kernels read it (they widen it to float32 in registers:
    a decode step reads half the bytes); otherwise the compute dtype (pick_dtype's)."""
    compute = pick_dtype(dtype, params_dtype, device)
    stored = DTYPE_NAMES.get(params_dtype, compute)
    if (dtype == "auto" and device.type == "cpu" and stored in (torch.bfloat16, torch.float16) and prepack
            and cpu_ops() is not None):
        return stored
    return compute


def check_world_size(ckpt_dir: str, params: PmxParams, env: LaunchEnv) -> None:
    """The ranks started must be the model's shard count; the error suggests only what would work: launching as
    many ranks as shards, and re-splitting for the ranks started where this model can be cut so (else the counts
    it can be cut into)."""
    if params.num_shards == env.world_size:
        return
    n, fix = env.world_size, f"launch -np {params.num_shards}"
    unsplit = unsharded_params(params)
    try:
        sharded_params(unsplit, n)
        fix += f" or split it with scripts/Split.py --num_shards {n}"
    except PmxError as e:
        why = str(e).split(": ", 1)[-1].split(";")[0]
        fix += f" (it cannot be split for {n} ranks: {why}; it can be for {_split_counts(unsplit)})"
    raise PmxError(f"{ckpt_dir}: the model is split into {params.num_shards} shard(s) but {n} rank(s) were "
                   f"started; {fix}")


def _split_counts(unsplit: PmxParams) -> str:
    """The shard counts (up to the number of query heads) that `unsplit` can be cut into, e.g. "1, 2, 4 or 8"."""
    ok = []
    for n in range(1, unsplit.num_heads + 1):
        try:
            sharded_params(unsplit, n)
            ok.append(str(n))
        except PmxError:
            pass
    return ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"


def open_session(ckpt_dir: str, config: EngineConfig = EngineConfig(), random_weights: bool = False, seed: int = 0,
                 progress: bool = False) -> Session:
    """This rank's engine. `ckpt_dir` is a PMX directory split into as many shards as ranks; with
    `random_weights` it may also be a bare pmx_params.json, cut for the ranks started, and the shard is
    random (see :func:`runner.engine.model.random_shard`).

    Everything that can be refused (rank count, shard files, device, dtype) is checked before the first
    collective; the ranks then wait for each other once loading is done, without the collective timeout
    (config.collective_timeout, default $PMX_COLLECTIVE_TIMEOUT or 30 s), which applies to every collective after.
    `progress` shows rank 0's loading on stderr, and which runner serves which steps."""
    env = detect()
    params = PmxParams.load(Path(ckpt_dir))
    if random_weights:
        params = sharded_params(unsharded_params(params), env.world_size)
    else:
        check_world_size(ckpt_dir, params, env)
        headers = {r: SafetensorsReader(Path(ckpt_dir) / shard_file(r)) for r in {0, env.rank}}
        check_shards(headers, params.num_shards)
    dev = pick_device(config.device, env)
    torch_dtype = pick_dtype(config.dtype, params.dtype, dev)
    matrix_dtype = pick_matrix_dtype(config.dtype, params.dtype, dev, config.prepack)
    timeout_s = collective_timeout(config.collective_timeout)
    if dev.type == "cpu":
        set_cpu_threads(env)
        keep_freed_memory()
    else:
        torch.cuda.set_device(dev)
    comm = make_comm(env, dev, config.comm_backend, timeout_s)
    if random_weights:
        weights = random_shard(params, env.rank, dev, torch_dtype, seed, matrix_dtype)
    else:
        own = headers[env.rank]
        with progress_bar(own.data_bytes(), f"loading {own.path.name}", show=progress and env.rank == 0) as bar:
            _, weights = load_shard(Path(ckpt_dir), env.rank, dev, torch_dtype, on_tensor=bar.update,
                                    matrix_dtype=matrix_dtype)
    draft = open_draft(config, params, Path(ckpt_dir), dev, torch_dtype) if config.speculative == "draft" else None
    comm.sync()
    model = Transformer(params, weights, comm, config)
    stepper = Stepper(model, config)
    if progress and env.rank == 0:
        print(f"engine: {comm.describe() + '; ' if comm.world_size > 1 else ''}{stepper.describe()}", file=sys.stderr,
              flush=True)
        if draft is not None:
            print(f"draft model: {config.speculative_model} ({draft.model.params.num_layers} layers, "
                  f"{draft.stepper.describe()})", file=sys.stderr, flush=True)
    return Session(env, dev, comm, model, stepper, EngineCore(model, stepper, config, draft))


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def open_draft(config: EngineConfig, target: PmxParams, target_dir: Path, dev: torch.device,
               dtype: torch.dtype) -> EngineCore:
    """--speculative draft: the draft model (config.speculative_model, a PMX directory of one shard) whole on this
    rank, in an engine core of its own with the target's cache settings (and no speculation, no prefix caching).
    Its vocabulary and tokenizer files must be the target's."""
    where = Path(config.speculative_model)
    params = PmxParams.load(where)
    if params.num_shards != 1:
        raise PmxError(f"--speculative_model {where}: the draft is split into {params.num_shards} shards; each rank "
                       f"runs it whole: merge it (scripts/Merge.py) into one shard")
    if params.vocab_size != target.vocab_size:
        raise PmxError(f"--speculative_model {where}: its vocabulary has {params.vocab_size} tokens, the target's "
                       f"{target.vocab_size}; a draft model needs the target's tokenizer")
    for name in TOKENIZER_FILES:
        mine, theirs = where / name, target_dir / name
        if mine.exists() and theirs.exists() and mine.read_bytes() != theirs.read_bytes():
            raise PmxError(f"--speculative_model {where}: {name} differs from the target's ({theirs}); a draft model "
                           f"needs the target's tokenizer")
    _, weights = load_shard(where, 0, dev, dtype, matrix_dtype=pick_matrix_dtype(config.dtype, params.dtype, dev,
                                                                                  config.prepack))
    dc = replace(config, speculative="off", speculative_model=None, enable_prefix_caching=False)
    model = Transformer(params, weights, SingleComm(), dc)
    stepper = Stepper(model, dc)
    return EngineCore(model, stepper, dc)
