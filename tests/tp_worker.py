"""Runs fixed engine steps on one rank (under mpirun / torchrun, or alone) and saves rank 0's logits.

Used by the tests: prefill of several prompts of different lengths packed in one step, then decode
steps fed with given tokens (teacher forcing), so logits can be compared with transformers' and with
TP=1. Usage: python tests/tp_worker.py CKPT OUT.pt '[{"cache_layout": 2, ...}, ...]' PROMPTS_JSON [COMM_BACKEND]
(saves [option sets, steps, B, V] on the CPU, and in OUT.pt.json which steps each engine took: one-call decode,
sequence parallelism, with its collectives counted and how many found the partial sums already in place; with
"generate": n in PROMPTS_JSON, also each prompt's n greedy ids from the engine core, as "generated"); or
python tests/tp_worker.py --batch JOBS.json [COMM_BACKEND]: several such runs, one after the other, in one launch
(each with a session of its own, opened under the job's "env" where it gives one: e.g. PMX_SHM_COMM=0, read when
the session's communicator is made).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from runner.config import EngineConfig
from runner.engine.core import EngineCore
from runner.engine.fused_decode import OneCallDecode
from runner.engine.model import Transformer, load_shard
from runner.engine.runners import Stepper
from runner.engine.session import open_session
from runner.kernels.reference import PAGE_SIZE


def teacher_forced_logits(stepper: Stepper, prompts: list, conts: list) -> list[torch.Tensor]:
    """Step 0 prefills every prompt (one packed step); step k feeds conts[b][k-1], through ppl.pmx's step contract
    (Stepper.forward). Returns [B, V] per step."""
    model = stepper.model
    B, steps = len(prompts), len(conts[0])
    total = [len(p) + steps + 1 for p in prompts]
    paged = stepper.config.paged
    if paged:
        pages, nxt = [], 0
        for n in total:
            cnt = math.ceil(n / PAGE_SIZE)
            pages.append(list(range(nxt + (cnt - 1) * PAGE_SIZE, nxt - 1, -PAGE_SIZE)))  # pages out of order
            nxt += cnt * PAGE_SIZE
        maxp = max(len(p) for p in pages)
        cachestarts = torch.tensor([p + [0] * (maxp - len(p)) for p in pages])
        rows = nxt
    else:
        cachestarts = torch.tensor([0] + total[:-1]).cumsum(0)
        rows = sum(total)
    kv_cache, kv_scale = model.new_cache(rows)
    out = []
    for k in range(steps + 1):
        if k == 0:
            toks, seqlens, start = [t for p in prompts for t in p], [len(p) for p in prompts], [0] * B
        else:
            toks, seqlens, start = [c[k - 1] for c in conts], [1] * B, [len(p) + k - 1 for p in prompts]
        kvlens = [s + n for s, n in zip(start, seqlens)]
        out.append(stepper.forward(
            torch.tensor(toks), torch.empty(0), torch.tensor([0] + seqlens).cumsum(0), torch.tensor([0] + kvlens).cumsum(0),
            cachestarts, torch.tensor([B if k else 0]), torch.tensor(start), torch.tensor([max(seqlens)]),
            torch.tensor([max(kvlens)]), kv_cache, kv_scale))
    return out


def main(ckpt: str, out: str, options: str, prompts: str, comm_backend: str = "auto") -> None:
    spec, option_sets = json.loads(prompts), json.loads(options)
    sess = open_session(ckpt, EngineConfig(**option_sets[0], comm_backend=comm_backend))
    results, info = [], []
    for opts in option_sets:  # one launch, every option set: the same shard under each engine setting
        config = EngineConfig(**opts, comm_backend=comm_backend)
        weights = load_shard(ckpt, sess.env.rank, sess.device, sess.model.dtype,
                             matrix_dtype=sess.model.weight_dtype)[1]
        stepper = Stepper(Transformer(sess.model.params, weights, sess.comm, config), config)
        calls = {"reduce_norm": 0, "in_place": 0}
        shm = sess.comm.shm
        if shm is not None:  # count sequence parallelism's collectives, and the partials already in the shared area
            def counted(partial, *args, _run=shm.reduce_norm):
                calls["reduce_norm"] += 1
                calls["in_place"] += partial.data_ptr() == shm.partial(*partial.shape).data_ptr()
                return _run(partial, *args)
            shm.reduce_norm = counted
        results.append(torch.stack(teacher_forced_logits(stepper, spec["prompts"], spec["conts"])))
        if shm is not None:
            del shm.reduce_norm
        info.append({"fused_decode": any(isinstance(r, OneCallDecode) for r in stepper.runners), "shm": shm is not None,
                     "seq_parallel": stepper.runners[-1].sp is not None,
                     "weight_dtype": str(stepper.model.weight_dtype), **calls})
        if spec.get("generate"):
            generator = EngineCore(stepper.model, stepper, config)
            info[-1]["generated"] = generator.generate(spec["prompts"], spec["generate"])
    if sess.is_main:
        torch.save(torch.stack(results).cpu(), out)
        with open(out + ".json", "w") as f:
            json.dump(info, f)
    sess.close()


def batch(jobs: str, comm_backend: str = "auto") -> None:
    """Each job of the JSON list in the file `jobs` ({"ckpt", "out", "options", "spec"}: main's arguments, and
    optionally "env": variables set while the job runs, then restored) in turn on these ranks: one launch for the same
    test over many models or settings (its start-up, most of such a test's time, once)."""
    with open(jobs) as f:
        for job in json.load(f):
            env = job.get("env") or {}
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                main(job["ckpt"], job["out"], json.dumps(job["options"]), json.dumps(job["spec"]), comm_backend)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v


if __name__ == "__main__":
    if sys.argv[1] == "--batch":  # tp_worker.py --batch JOBS.json [COMM_BACKEND]
        batch(*sys.argv[2:4])
    else:
        main(*sys.argv[1:6])
