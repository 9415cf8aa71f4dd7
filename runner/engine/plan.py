"""The plan of one engine step, made on the host from the batch's lengths (Python ints).

A step has two halves (DESIGN.md, "The step inside"): this plan, and the device step that reads only
the plan, the weights and the cache. Everything that depends on the lengths of the sequences is
worked out here, once per step and not once per layer: each new token's position and cache row, the
rotary angles, the rows of the last tokens, and how attention runs:

- the decoding sequences (one new token each, packed first) attend together: one query row each
  against the cache rows of its history, gathered to the longest history (a mask only when the
  histories differ in length or a sliding window cuts them);
- the sequences in prefill attend by groups, without padding: consecutive fresh prompts of one length
  form one batched causal attention over their own new keys; a prompt that continues (a later chunk)
  attends over its history in the cache with a causal mask offset by its start;
- with `fused_kvcache` off, ppl.pmx's unfused path: every sequence's whole history packed (its cache
  rows), attended sequence by sequence (`reference.attention_packed`).

The ppl.pmx step inputs (seqstarts, kvstarts, cachestarts, ...) are turned into a plan by
:func:`plan_from_inputs`; the generator makes the same plan straight from its Python ints with
:func:`make_plan`. Both run one code path, so a replayed dump runs exactly the step that made it.
On CPU, where the decode kernel reads each history in place from cachestarts and kvlens, a step where every
sequence decodes one token is written by :class:`DecodeBuffers` into persistent tensors without a torch call (the
same values as make_plan's; a torch call right after a decode step costs 15-40 us there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from runner.kernels.reference import PAGE_SIZE, Rotary


@dataclass
class DecodeAttention:
    """The leading `batch` query rows each decode one token of their sequence."""
    kv_slots: Optional[torch.Tensor]       # [Bd, N] int64: cache rows of each history (new token included),
                                           # padded by repeating its last row; None when only kernels that walk
                                           # the cache themselves read the plan (a CUDA graph's static inputs)
    mask: Optional[torch.Tensor]           # [Bd, 1, 1, N] bool, True where a key is seen; None: all N are
    cachestarts: torch.Tensor              # [Bd] or [Bd, MaxP]: what kernels that walk the cache themselves read
    kvlens: torch.Tensor                   # [Bd] int64

    @property
    def batch(self) -> int:
        return self.kvlens.shape[0]


@dataclass
class PrefillGroup:
    """`n` sequences of `seqlen` new tokens each: query rows [row0, row0 + n * seqlen)."""
    row0: int
    n: int
    seqlen: int
    kv_slots: Optional[torch.Tensor]       # [n, N] cache rows of the history + new tokens; None: a fresh
                                           # prompt attends over its own new keys (no cache read)
    mask: Optional[torch.Tensor]           # [n, 1, seqlen, N] bool; None: plain causal
    plain_causal: bool = True              # fresh prompts attending causally over their own new keys, no window
                                           # (kv_slots and mask None): the one case that needs neither
    cachestarts: Optional[torch.Tensor] = None   # [n] or [n, MaxP], and
    kvlens: Optional[torch.Tensor] = None        # [n]: what kernels that walk the cache themselves read


@dataclass
class PackedHistory:
    """ppl.pmx's unfused attention: every sequence's history, packed."""
    kv_slots: torch.Tensor                 # [sum kvlens] cache rows
    seqstarts: torch.Tensor                # [B + 1] (host)
    kvstarts: torch.Tensor                 # [B + 1] (host)
    start_pos: torch.Tensor                # [B] (host)
    attn_mask: Optional[torch.Tensor]      # [T, sum kvlens] additive, or None (causal)


@dataclass
class StepPlan:
    """Everything one step reads besides the token ids, the weights and the cache."""
    slots: torch.Tensor                    # [T] int64: cache row of each new token
    cos: torch.Tensor                      # [T, D/2] float32 rotary tables at each token's position
    sin: torch.Tensor
    last: Optional[torch.Tensor]           # [B] row of each sequence's last token; None when T == B
    decode: Optional[DecodeAttention] = None
    prefill: tuple = ()                    # PrefillGroup, ...
    packed: Optional[PackedHistory] = None

    @property
    def decode_only(self) -> bool:
        """Every sequence decodes one token: the static step that compiles (and CUDA graphs capture)."""
        return self.decode is not None and not self.prefill and self.packed is None and self.last is None


CacheOf = Union[int, Sequence[int]]        # a sequence's offset (mode 0) or its page starts (mode 1)


def _rows(cache: torch.Tensor, pos: torch.Tensor, paged: bool) -> torch.Tensor:
    """Cache rows of positions `pos` [B, N] for sequences whose cachestarts are `cache` ([B] or [B, MaxP])."""
    if not paged:
        return cache[:, None] + pos
    return torch.gather(cache, 1, torch.div(pos, PAGE_SIZE, rounding_mode="floor")) + pos % PAGE_SIZE


def _cache_tensor(caches: Sequence[CacheOf], paged: bool) -> torch.Tensor:
    if not paged:
        return torch.tensor(list(caches), dtype=torch.int64)
    maxp = max(len(c) for c in caches)
    return torch.tensor([list(c) + [0] * (maxp - len(c)) for c in caches], dtype=torch.int64)


def _window_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, kvlen: torch.Tensor, window: Optional[int]):
    """[B, 1, S, N] bool: key j seen by query at q_pos iff j <= q_pos, j < kvlen, j > q_pos - window."""
    allowed = (kv_pos[:, None, :] <= q_pos[:, :, None]) & (kv_pos < kvlen[:, None])[:, None, :]
    if window:
        allowed &= kv_pos[:, None, :] > q_pos[:, :, None] - window
    return allowed[:, None]


def make_plan(seqlens: Sequence[int], start_pos: Sequence[int], caches: Sequence[CacheOf], num_decoding: int,
              *, paged: bool, rotary: Rotary, device: torch.device, sliding_window: Optional[int] = None,
              fused_kvcache: bool = True, read_cache_in_prefill: bool = False, gather_rows: bool = True,
              decode_rows: Optional[bool] = None, attn_mask: Optional[torch.Tensor] = None,
              lean: bool = True) -> StepPlan:
    """The plan of a step over B packed sequences: sequence b has seqlens[b] new tokens from position
    start_pos[b], its cache at caches[b]; the first num_decoding sequences decode one token each.

    `read_cache_in_prefill`: fresh prompts attend over their keys as stored in the cache (an int8 cache:
    the same quantised keys that later steps see) instead of the new keys themselves.
    `gather_rows`: build the cache rows and masks that attention over gathered K/V reads (kv_slots, mask); off
    for kernels that walk the cache themselves from cachestarts and kvlens (Triton), which saves the host the
    work and the device a [B, N] copy per step.
    `decode_rows`: whether the decoding sequences' attention reads those rows and masks (default: gather_rows); off
    where a kernel reads the history in place from cachestarts and kvlens (the CPU decode kernel) while prefill
    still gathers.
    `lean`: a step where every sequence decodes one token from an offset cache is planned straight from the
    ints (:func:`_decode_plan`: the same plan with a third of the torch calls; the host plans right after a
    step that streamed the weights through its caches, where each call costs several times more).
    """
    B = len(seqlens)
    decode_rows = gather_rows if decode_rows is None else decode_rows
    if not 0 <= num_decoding <= B or any(n != 1 for n in seqlens[:num_decoding]):
        raise ValueError(f"the first {num_decoding} sequences must decode one token each, got lengths "
                         f"{list(seqlens[:num_decoding])}")
    if lean and num_decoding == B and not paged and fused_kvcache and decode_rows:
        return _decode_plan([int(p) for p in start_pos], [int(c) for c in caches], rotary, device, sliding_window)
    cache = _cache_tensor(caches, paged)                                              # [B] or [B, MaxP]
    seqlen_t, start_t = torch.tensor(list(seqlens)), torch.tensor(list(start_pos))
    T = int(sum(seqlens))
    if T == B:  # one token per sequence
        positions, bot = start_t, None
    else:
        bot = torch.repeat_interleave(torch.arange(B), seqlen_t, output_size=T)       # sequence of each token
        first = torch.cumsum(seqlen_t, 0) - seqlen_t
        positions = start_t[bot] + torch.arange(T) - first[bot]
    slots = (_rows(cache, positions[:, None], paged)[:, 0] if bot is None
             else _rows(cache[bot], positions[:, None], paged)[:, 0])
    kvlens = start_t + seqlen_t
    cos, sin = rotary.cos_sin(positions, end=int(max(int(p) + int(n) for p, n in zip(start_pos, seqlens))) if B else 0)
    last = None if T == B else (torch.cumsum(seqlen_t, 0) - 1)
    decode, prefill, packed = None, [], None
    to = dict(device=device, non_blocking=True)
    if not fused_kvcache:
        Tkv = int(kvlens.sum())
        kv_bot = torch.repeat_interleave(torch.arange(B), kvlens, output_size=Tkv)
        kv_pos = torch.arange(Tkv) - (torch.cumsum(kvlens, 0) - kvlens)[kv_bot]
        kv_slots = _rows(cache[kv_bot], kv_pos[:, None], paged)[:, 0]
        zero = torch.zeros(1, dtype=torch.int64)
        packed = PackedHistory(kv_slots.to(**to), torch.cat((zero, torch.cumsum(seqlen_t, 0))),
                               torch.cat((zero, torch.cumsum(kvlens, 0))), start_t,
                               attn_mask if attn_mask is not None and attn_mask.numel() else None)
    else:
        if num_decoding and not decode_rows:
            dl = kvlens[:num_decoding]
            decode = DecodeAttention(None, None, cache[:num_decoding].to(**to), dl.to(**to))
        elif num_decoding:
            dl = kvlens[:num_decoding]
            n_max = int(dl.max())
            kv_pos = torch.minimum(torch.arange(n_max)[None, :], (dl - 1)[:, None])   # [Bd, N], last row repeated
            kv_slots = _rows(cache[:num_decoding], kv_pos, paged)
            mask = None
            if int(dl.min()) != n_max or (sliding_window and n_max > sliding_window):
                mask = _window_mask((dl - 1)[:, None], torch.arange(n_max)[None, :].expand(num_decoding, n_max),
                                    dl, sliding_window)
            decode = DecodeAttention(kv_slots.to(**to), None if mask is None else mask.to(**to),
                                     cache[:num_decoding].to(**to), dl.to(**to))
        row = num_decoding
        b = num_decoding
        while b < B:
            S, p0 = int(seqlens[b]), int(start_pos[b])
            n = 1
            if p0 == 0:  # fresh prompts of one length, back to back: one batched causal attention
                while b + n < B and int(start_pos[b + n]) == 0 and int(seqlens[b + n]) == S:
                    n += 1
            group = slice(b, b + n)
            kv_slots = mask = None
            windowed = bool(sliding_window and S > sliding_window)
            plain = p0 == 0 and not read_cache_in_prefill and not windowed
            if gather_rows and (p0 > 0 or read_cache_in_prefill):
                N = int(kvlens[b])
                kv_pos = torch.arange(N)[None, :].expand(n, N)
                kv_slots = _rows(cache[group], kv_pos, paged).to(**to)
            if gather_rows and (p0 > 0 or windowed):
                q_pos = start_t[group, None] + torch.arange(S)[None, :]
                N = int(kvlens[b])
                mask = _window_mask(q_pos, torch.arange(N)[None, :].expand(n, N), kvlens[group],
                                    sliding_window).to(**to)
            prefill.append(PrefillGroup(row, n, S, kv_slots, mask, plain, cache[group].to(**to),
                                        kvlens[group].to(**to)))
            row += n * S
            b += n
    return StepPlan(slots.to(**to), cos.to(**to), sin.to(**to), None if last is None else last.to(**to),
                    decode, tuple(prefill), packed)


def _decode_plan(start: list, caches: list, rotary: Rotary, device: torch.device,
                 sliding_window: Optional[int]) -> StepPlan:
    """make_plan's plan of a step where every sequence decodes one token from an offset cache, from the ints."""
    kvl = [p + 1 for p in start]
    n_max = max(kvl)
    cache_t, kvlens = torch.tensor(caches), torch.tensor(kvl)
    cos, sin = rotary.cos_sin(torch.tensor(start), end=n_max)
    if len(start) == 1:
        kv_slots = torch.arange(caches[0], caches[0] + n_max)[None, :]
    else:
        kv_slots = cache_t[:, None] + torch.minimum(torch.arange(n_max)[None, :], (kvlens - 1)[:, None])
    mask = None
    if min(kvl) != n_max or (sliding_window and n_max > sliding_window):
        mask = _window_mask((kvlens - 1)[:, None], torch.arange(n_max)[None, :].expand(len(kvl), n_max), kvlens,
                            sliding_window)
    dev = (lambda t: t) if device.type == "cpu" else (lambda t: t.to(device, non_blocking=True))  # noqa: E731
    return StepPlan(dev(torch.tensor([c + p for c, p in zip(caches, start)])), dev(cos), dev(sin), None,
                    DecodeAttention(dev(kv_slots), None if mask is None else dev(mask), dev(cache_t), dev(kvlens)))


class DecodeBuffers:
    """The token ids and plan of a step where every sequence decodes one token, written into persistent host
    buffers: for engines whose kernels read the history in place from the plan's cachestarts and kvlens (the CPU
    decode kernel), so the plan is just the step's ints.

    Between two decode steps a CPU streams every weight of the model through its caches, and a torch call made
    right after that costs 15-40 us (its code and data come back from memory): make_plan's dozen calls took a quarter
    of a millisecond of a 10 ms step on the project's CPU (benchmarks/RESULTS.md, "Session 7"). Here the ints are
    written with numpy into tensors made once per batch size, and cos/sin are taken from the rotary tables, without a
    torch call. The tensors, and so the returned plan, are rewritten by the next call for the same batch size: a
    plan from here is for the step it is made for (its caller runs that step before planning the next one).
    """

    def __init__(self, rotary: Rotary, paged: bool, max_pages: int):
        self.paged, self.max_pages = paged, max_pages
        self._cos, self._sin = rotary.cos_table.numpy(), rotary.sin_table.numpy()
        self._by_batch: dict = {}

    def plan(self, tokens: Sequence[int], start_pos: Sequence[int], caches: Sequence[CacheOf]
             ) -> Optional[tuple[torch.Tensor, StepPlan]]:
        """(token ids [B], plan) of the decode step, or None where the buffers do not take it (a position past the
        rotary tables, a page table wider than max_pages)."""
        B = len(start_pos)
        if B == 0 or max(start_pos) >= self._cos.shape[0] or (self.paged and max(map(len, caches)) > self.max_pages):
            return None
        entry = self._by_batch.get(B)
        if entry is None:
            entry = self._by_batch[B] = self._new(B)
        ids, plan, (n_ints, n_cs, n_cos, n_sin) = entry
        if B == 1:  # scalar writes: a fifth of the time of the array calls below, cold
            p, c = int(start_pos[0]), caches[0]
            n_ints[0, 0], n_ints[2, 0] = tokens[0], p + 1                       # token id, kvlen
            if self.paged:
                n_cs[0, : len(c)], n_cs[0, len(c):] = c, 0
                n_ints[1, 0] = c[p // PAGE_SIZE] + p % PAGE_SIZE                 # slot
            else:
                n_cs[0], n_ints[1, 0] = c, c + p
            n_cos[0], n_sin[0] = self._cos[p], self._sin[p]
            return ids, plan
        start = np.asarray(start_pos, dtype=np.int64)
        n_ints[0] = tokens
        np.add(start, 1, out=n_ints[2])                                     # kvlens
        if self.paged:
            n_cs.fill(0)
            for b, pages in enumerate(caches):
                n_cs[b, : len(pages)] = pages
            np.add(n_cs[np.arange(B), start // PAGE_SIZE], start % PAGE_SIZE, out=n_ints[1])
        else:
            n_cs[:] = caches
            np.add(n_cs, start, out=n_ints[1])                              # slots
        np.take(self._cos, start, axis=0, out=n_cos)
        np.take(self._sin, start, axis=0, out=n_sin)
        return ids, plan

    def _new(self, B: int):
        ints = torch.zeros(3, B, dtype=torch.int64)                        # token ids, slots, kvlens
        cs = torch.zeros((B, self.max_pages) if self.paged else (B,), dtype=torch.int64)
        half = self._cos.shape[1]
        cos, sin = torch.zeros(B, half), torch.zeros(B, half)
        ids, slots, kvlens = ints
        plan = StepPlan(slots, cos, sin, None, DecodeAttention(None, None, cs, kvlens))
        return ids, plan, (ints.numpy(), cs.numpy(), cos.numpy(), sin.numpy())


def plan_from_inputs(seqstarts: torch.Tensor, kvstarts: torch.Tensor, cachestarts: torch.Tensor,
                     decoding_batches: torch.Tensor, start_pos: torch.Tensor, **kw) -> StepPlan:
    """The plan of a step given as ppl.pmx's dynamic-batching inputs (read once, on the host)."""
    seqstarts, kvstarts, start, cs = (t.detach().cpu().to(torch.int64) for t in
                                      (seqstarts, kvstarts, start_pos, cachestarts))
    seqlens = (seqstarts[1:] - seqstarts[:-1]).tolist()
    kvlens = (kvstarts[1:] - kvstarts[:-1]).tolist()
    start_l = start.tolist()
    if [s + n for s, n in zip(start_l, seqlens)] != kvlens:
        raise ValueError("kvstarts must equal start_pos + the new tokens of each sequence")
    caches = cs.tolist()
    return make_plan(seqlens, start_l, caches, int(decoding_batches.reshape(-1)[0]), **kw)
