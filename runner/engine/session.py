"""One rank's engine, set up from the launch environment: rank, device, threads, communicator, shard, and the
model with its step runners and continuous-batching core."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.config import EngineConfig
from runner.engine.core import EngineCore
from runner.engine.model import Transformer, load_shard, random_shard
from runner.engine.runners import Stepper
from runner.errors import PmxError
from runner.parallel.comm import collective_timeout, make_comm
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
    engine: EngineCore     # continuous batching: generate, score, add / step

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
    """auto: float32 on CPU (half-precision matmul is slow there), the checkpoint's dtype on GPU."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else DTYPE_NAMES[params_dtype]
    if dtype not in DTYPE_NAMES:
        raise PmxError(f"--dtype must be auto, {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    return DTYPE_NAMES[dtype]


def check_world_size(ckpt_dir: str, num_shards: int, env: LaunchEnv) -> None:
    if num_shards != env.world_size:
        raise PmxError(f"{ckpt_dir}: the model is split into {num_shards} shard(s) but {env.world_size} "
                       f"rank(s) were started; launch -np {num_shards} or split it with "
                       f"scripts/Split.py --num_shards {env.world_size}")


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
        check_world_size(ckpt_dir, params.num_shards, env)
        headers = {r: SafetensorsReader(Path(ckpt_dir) / shard_file(r)) for r in {0, env.rank}}
        check_shards(headers, params.num_shards)
    dev = pick_device(config.device, env)
    torch_dtype = pick_dtype(config.dtype, params.dtype, dev)
    timeout_s = collective_timeout(config.collective_timeout)
    if dev.type == "cpu":
        set_cpu_threads(env)
    else:
        torch.cuda.set_device(dev)
    comm = make_comm(env, dev, config.comm_backend, timeout_s)
    if random_weights:
        weights = random_shard(params, env.rank, dev, torch_dtype, seed)
    else:
        own = headers[env.rank]
        with progress_bar(own.data_bytes(), f"loading {own.path.name}", show=progress and env.rank == 0) as bar:
            _, weights = load_shard(Path(ckpt_dir), env.rank, dev, torch_dtype, on_tensor=bar.update)
    comm.sync()
    model = Transformer(params, weights, comm, config)
    stepper = Stepper(model, config)
    if progress and env.rank == 0:
        print(f"engine: {comm.describe() + '; ' if comm.world_size > 1 else ''}{stepper.describe()}", file=sys.stderr,
              flush=True)
    return Session(env, dev, comm, model, stepper, EngineCore(model, stepper, config))
