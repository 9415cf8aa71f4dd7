"""Which model and which shard a file is: safetensors metadata in every PMX shard, checked at load.

Each `model.{r:02d}.safetensors` carries in its header's `__metadata__`:

- `pmx_rank`: r, the shard this file is;
- `pmx_num_shards`: N, how many shards the split has;
- `pmx_fingerprint`: 32 hex digits (BLAKE2b-128) naming the model, the same in every shard and for every
  split of it: pmx_params.json without the fields a split changes (`num_shards`, `kv_replication`,
  `padded_dims`), then for each tensor in file order its name, dtype, unsplit shape and up to 64 KiB of
  its bytes sampled at 16 evenly spaced places. Split and merge keep it (merge(split(m)) stays
  bit-identical to m); two models, even of one architecture, differ.

A renamed or swapped shard (its `pmx_rank` is not the one its name says), a shard of another split
(`pmx_num_shards`) or of another model (`pmx_fingerprint`) is refused with a message naming the file.
Files without these keys (written before they existed, or by other tools) are accepted as before.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping, Optional

import torch

from runner.errors import PmxError
from runner.pmx.params import PmxParams
from runner.pmx.stored import Stored

RANK, NUM_SHARDS, FINGERPRINT = "pmx_rank", "pmx_num_shards", "pmx_fingerprint"
PLACEHOLDER = "0" * 32  # written first, replaced once every tensor has been seen
SAMPLES, SAMPLE_BYTES = 16, 4096


class Fingerprint:
    """Built while a model is written: the params first, then each full (unsplit) tensor in file order."""

    def __init__(self, params: PmxParams):
        d = params.replace(num_shards=1, kv_replication=1, padded_dims={}).to_dict()
        self._h = hashlib.blake2b(json.dumps(d, sort_keys=True).encode(), digest_size=16)

    def add(self, name: str, t: torch.Tensor | Stored) -> None:
        """Adds full tensor `t` (in memory, or left in its file: then only the sampled bytes are read)."""
        self._h.update(f"{name}|{t.dtype}|{list(t.shape)}".encode())
        if isinstance(t, Stored):
            n, read = t.nbytes, t.read
        else:
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            n, read = raw.numel(), lambda at, k: raw[at:at + k].numpy().tobytes()
        if n <= SAMPLES * SAMPLE_BYTES:
            self._h.update(read(0, n))
            return
        for k in range(SAMPLES):
            at = (n - SAMPLE_BYTES) * k // (SAMPLES - 1)
            self._h.update(read(at, SAMPLE_BYTES))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def shard_metadata(rank: int, num_shards: int) -> dict:
    return {RANK: str(rank), NUM_SHARDS: str(num_shards), FINGERPRINT: PLACEHOLDER}


def check_shards(readers: Mapping[int, object], num_shards: int) -> Optional[str]:
    """Checks the metadata of shard files {rank: SafetensorsReader} against their names and each other;
    returns the shared fingerprint (None for files written without one)."""
    seen: dict[Optional[str], object] = {}
    for rank, rd in sorted(readers.items()):
        meta = rd.metadata()
        if FINGERPRINT not in meta:
            seen.setdefault(None, rd)
            continue
        if meta.get(RANK) != str(rank):
            raise PmxError(f"{rd.path}: holds shard {meta.get(RANK)} (its {RANK} metadata), but its name says shard "
                           f"{rank}: the shard files were renamed or swapped")
        if meta.get(NUM_SHARDS) != str(num_shards):
            raise PmxError(f"{rd.path}: is one of {meta.get(NUM_SHARDS)} shards ({NUM_SHARDS}), but pmx_params.json "
                           f"says num_shards={num_shards}: shards of different splits are mixed")
        seen.setdefault(meta[FINGERPRINT], rd)
    if len(seen) > 1:
        (fa, a), (fb, b) = list(seen.items())[:2]
        raise PmxError(f"{b.path}: comes from another model than {a.path} ({FINGERPRINT} {fb or 'absent'} vs "
                       f"{fa or 'absent'}): shards of different models are mixed")
    return next(iter(seen), None)
