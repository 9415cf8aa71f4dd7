"""One rank's engine, set up from the launch environment: rank, device, threads, communicator, shard."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runner.engine.model import EngineOptions, Transformer, load_shard, random_shard
from runner.errors import PmxError
from runner.parallel.comm import DEFAULT_TIMEOUT_S, make_comm
from runner.parallel.launch import LaunchEnv, detect, set_cpu_threads
from runner.pmx.shard import sharded_params, unsharded_params
from runner.pmx.store import DTYPE_NAMES


@dataclass
class Session:
    env: LaunchEnv
    device: torch.device
    comm: object
    model: Transformer

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


def open_session(ckpt_dir: str, options: EngineOptions = EngineOptions(), device: str = "auto",
                 dtype: str = "auto", comm_backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 random_weights: bool = False, seed: int = 0) -> Session:
    """This rank's engine. `ckpt_dir` is a PMX directory split into as many shards as ranks; with
    `random_weights` it may also be a bare pmx_params.json, cut for the ranks started, and the shard is
    random (see :func:`runner.engine.model.random_shard`)."""
    env = detect()
    dev = pick_device(device, env)
    if dev.type == "cpu":
        set_cpu_threads(env)
    else:
        torch.cuda.set_device(dev)
    from runner.pmx.params import PmxParams
    params = PmxParams.load(Path(ckpt_dir))
    if random_weights:
        params = sharded_params(unsharded_params(params), env.world_size)
    elif params.num_shards != env.world_size:
        raise PmxError(f"{ckpt_dir}: the model is split into {params.num_shards} shard(s) but {env.world_size} "
                       f"rank(s) were started; launch -np {params.num_shards} or split it with "
                       f"scripts/Split.py --num_shards {env.world_size}")
    comm = make_comm(env, dev, comm_backend, timeout_s)
    torch_dtype = pick_dtype(dtype, params.dtype, dev)
    if random_weights:
        weights = random_shard(params, env.rank, dev, torch_dtype, seed)
    else:
        _, weights = load_shard(Path(ckpt_dir), env.rank, dev, torch_dtype)
    return Session(env, dev, comm, Transformer(params, weights, comm, options))
