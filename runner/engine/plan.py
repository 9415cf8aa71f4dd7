"""The plan of one engine step, made on the host from the batch's lengths (Python ints).

A step has two halves (docs/architecture.md, "Inside a step"): this plan, and the device step that reads only the
plan, the weights and the cache. Everything that depends on the sequences' lengths is worked out here, once per
step: each new token's position and cache row, the rotary angles, the rows whose logits are wanted, and how
attention runs:

- the decoding sequences (one new token each, packed first) attend together: one query row each against its
  history, read in place by kernels that walk the cache themselves (`PlanSpec.gather_decode` off: cachestarts and
  kvlens are all they read), else gathered to the longest history (a mask where lengths differ or a window cuts:
  one per window the layers have);
- the sequences in prefill attend by groups, without padding: consecutive fresh prompts of one length form one
  batched causal attention over their own new keys; a prompt that continues (a later chunk) attends over its
  history in the cache with a causal mask offset by its start;
- unfused (`PlanSpec.packed`, ppl.pmx's fused_kvcache off): each sequence's whole history packed, attended
  sequence by sequence (`reference.attention_packed`).

:func:`make_plan` is the one planning function; :class:`DecodeInputs` writes the plan of a step where every
sequence decodes one token straight from the ints into persistent buffers (numpy, no torch call: the buffers
CUDA graphs replay from, and on CPU the plan itself). ppl.pmx's step inputs (a dump) become the same ints with
:func:`lengths_of_inputs`, so a replayed dump runs exactly the step that made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from runner.kernels import reference as ref
from runner.kernels.reference import PAGE_SIZE


@dataclass
class DecodeAttention:
    """The leading `batch` query rows each decode one token of their sequence."""
    kv_slots: Optional[torch.Tensor]       # [Bd, N] int64: cache rows of each history (new token included),
                                           # padded by repeating its last row; None where kernels read it in place
    masks: dict                            # layers' window (0: none) -> [Bd, 1, 1, N] bool, True where a key is
                                           # seen, or None: all N are
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
    masks: dict                            # layers' window (0: none) -> [n, 1, seqlen, N] bool, or None: plain causal
    plain_causal: bool = True              # fresh prompts attending causally over their own new keys (no window cut)
    cachestarts: Optional[torch.Tensor] = None   # [n] or [n, MaxP], and
    kvlens: Optional[torch.Tensor] = None        # [n]: what kernels that walk the cache themselves read

    def plain_for(self, window: int) -> bool:
        """Plain causal attention over the new keys for a layer of `window` (0: none), which cuts none of them."""
        return self.plain_causal and not (window and self.seqlen > window)


@dataclass
class PackedHistory:
    """ppl.pmx's unfused attention: every sequence's history, packed."""
    kv_slots: torch.Tensor                 # [sum kvlens] cache rows
    seqstarts: torch.Tensor                # [B + 1] (host)
    kvstarts: torch.Tensor                 # [B + 1] (host)
    start_pos: torch.Tensor                # [B] (host)
    attn_mask: Optional[torch.Tensor]      # [T, sum kvlens] additive, or None (causal)


@dataclass
class StepInputs:
    """A step as ppl.pmx's dynamic-batching inputs, tensors all (Stepper.forward documents them): what a traced step
    reads. Nothing is planned on the host; the kernel set's step ops (KernelSet.rotary_step, cache_attention) work out
    positions, cache rows and masks from these, as ppl.pmx's operators do (the export kernel sets)."""
    seqstarts: torch.Tensor
    kvstarts: torch.Tensor
    cachestarts: torch.Tensor
    decoding_batches: torch.Tensor
    start_pos: torch.Tensor
    max_seqlen: torch.Tensor
    max_kvlen: torch.Tensor
    attn_mask: torch.Tensor                # [T, sum kvlens] additive, or empty: causal (auto_causal)


@dataclass
class StepPlan:
    """Everything one step reads besides the token ids, the weights and the cache."""
    slots: Optional[torch.Tensor]          # [T] int64: cache row of each new token
    cos: Optional[torch.Tensor]            # [K, T, D/2] float32: each of the model's K ropes at each token's position
    sin: Optional[torch.Tensor]            # (a layer reads its rope's, Attention.rope)
    last: Optional[torch.Tensor]           # rows whose logits are wanted (each sequence's last, or all of a
                                           # scored one's); None: every row
    decode: Optional[DecodeAttention] = None
    prefill: tuple = ()                    # PrefillGroup, ...
    packed: Optional[PackedHistory] = None
    q_scale: Optional[torch.Tensor] = None  # [T] float32: logn scaling of each query (None: every factor is 1)
    inputs: Optional[StepInputs] = None     # a traced step: ppl.pmx's inputs instead of everything above but `last`

    @classmethod
    def traced(cls, inputs: StepInputs) -> "StepPlan":
        """The plan of a traced step (an export): each sequence's last row wanted, everything else read from
        `inputs` by the kernel set's step ops."""
        return cls(None, None, None, inputs.seqstarts[1:] - 1, inputs=inputs)

    @property
    def decode_only(self) -> bool:
        """Every sequence decodes one token: the static step that compiles and that CUDA graphs capture."""
        return self.decode is not None and not self.prefill and self.packed is None and self.last is None


CacheOf = Union[int, Sequence[int]]        # a sequence's offset (mode 0) or its page starts (mode 1)


@dataclass
class StepLengths:
    """One step's batch as Python ints: sequence b has seqlens[b] new tokens from position start[b], its cache at
    caches[b]; the first num_decoding decode one token each; all_rows[b]: every row's logits (scoring), not just
    the last one's. `rowwise`: every sequence decodes (speculative decoding verifies its guesses), so that the step
    is that of one decoding row per new token, each row at its own position over its sequence's cache (the rows'
    keys and values are all stored before any row attends: row j sees rows before it): what the decode step's
    kernels run (:meth:`rows`)."""
    tokens: list
    seqlens: list
    start: list
    caches: list
    num_decoding: int
    all_rows: tuple = ()
    rowwise: bool = False

    def rows(self) -> tuple[list, list]:
        """(positions, cache starts) of each new token as a decoding row of its own."""
        start, caches = [], []
        for p, n, c in zip(self.start, self.seqlens, self.caches):
            start += range(p, p + n)
            caches += [c] * n
        return start, caches


@dataclass(frozen=True)
class PlanSpec:
    """How an engine's steps are planned: fixed when the engine is built."""
    rotaries: tuple              # the model's ropes (reference.Rotary), its layers' kinds
    device: torch.device
    paged: bool
    windows: tuple               # the windows of the model's layers (0: a layer without one), each once
    packed: bool                 # ppl.pmx's unfused attention over packed histories (fused_kvcache off)
    read_cache_in_prefill: bool  # fresh prompts attend over their keys as stored (an int8 cache: what later steps see)
    gather_prefill: bool         # prefill attention over gathered rows (else a kernel walks the cache)
    gather_decode: bool          # decode attention over gathered rows (else a kernel reads the history in place)
    logn_scaling: Optional[int] = None  # queries past this length are scaled (reference.logn_scale); None: off


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


def make_plan(b: StepLengths, spec: PlanSpec, attn_mask: Optional[torch.Tensor] = None) -> StepPlan:
    """The plan of a step over the packed sequences of `b` (see the module docstring). `attn_mask`: the explicit
    additive mask [T, sum kvlens] of ppl.pmx's auto_causal off (unfused attention only)."""
    seqlens, start_pos, B, nd, paged = b.seqlens, b.start, len(b.seqlens), b.num_decoding, spec.paged
    cache = _cache_tensor(b.caches, paged)                                            # [B] or [B, MaxP]
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
    end = max(int(p) + int(n) for p, n in zip(start_pos, seqlens)) if B else 0
    kvlens = start_t + seqlen_t
    seq_end = None  # (LongRoPE's: one past the last position of each token's sequence)
    if any(r.long_from is not None for r in spec.rotaries):
        seq_end = kvlens if bot is None else kvlens[bot]
    cos, sin = (t[0][None] if len(t) == 1 else torch.stack(t)
                for t in zip(*(r.cos_sin(positions, end, seq_end) for r in spec.rotaries)))
    q_scale = ref.logn_scale(positions, spec.logn_scaling) if spec.logn_scaling and end > spec.logn_scaling else None
    ends = torch.cumsum(seqlen_t, 0)
    if any(b.all_rows):
        last = torch.cat([torch.arange(e - n, e) if whole else (e - 1)[None]
                          for e, n, whole in zip(ends, seqlen_t, b.all_rows)])
        last = None if last.numel() == T else last
    else:
        last = None if T == B else ends - 1
    decode, prefill, packed = None, [], None
    to = dict(device=spec.device, non_blocking=True)
    if spec.packed:
        Tkv = int(kvlens.sum())
        kv_bot = torch.repeat_interleave(torch.arange(B), kvlens, output_size=Tkv)
        kv_pos = torch.arange(Tkv) - (torch.cumsum(kvlens, 0) - kvlens)[kv_bot]
        kv_slots = _rows(cache[kv_bot], kv_pos[:, None], paged)[:, 0]
        zero = torch.zeros(1, dtype=torch.int64)
        packed = PackedHistory(kv_slots.to(**to), torch.cat((zero, ends)), torch.cat((zero, torch.cumsum(kvlens, 0))),
                               start_t, attn_mask if attn_mask is not None and attn_mask.numel() else None)
    else:
        if nd:
            dl = kvlens[:nd]
            kv_slots, masks = None, dict.fromkeys(spec.windows)
            if spec.gather_decode:
                n_max = int(dl.max())
                kv_pos = torch.minimum(torch.arange(n_max)[None, :], (dl - 1)[:, None])  # [Bd, N], last row repeated
                kv_slots = _rows(cache[:nd], kv_pos, paged).to(**to)
                for window in spec.windows:
                    if int(dl.min()) != n_max or (window and n_max > window):
                        masks[window] = _window_mask((dl - 1)[:, None], torch.arange(n_max)[None, :].expand(
                            nd, n_max), dl, window).to(**to)
            decode = DecodeAttention(kv_slots, masks, cache[:nd].to(**to), dl.to(**to))
        row, i = nd, nd
        while i < B:
            S, p0 = int(seqlens[i]), int(start_pos[i])
            n = 1
            if p0 == 0:  # fresh prompts of one length, back to back: one batched causal attention
                while i + n < B and int(start_pos[i + n]) == 0 and int(seqlens[i + n]) == S:
                    n += 1
            group, N = slice(i, i + n), int(kvlens[i])
            kv_slots, masks = None, dict.fromkeys(spec.windows)
            if spec.gather_prefill and (p0 > 0 or spec.read_cache_in_prefill):
                kv_slots = _rows(cache[group], torch.arange(N)[None, :].expand(n, N), paged).to(**to)
            for window in spec.windows:
                if spec.gather_prefill and (p0 > 0 or (window and S > window)):
                    q_pos = start_t[group, None] + torch.arange(S)[None, :]
                    masks[window] = _window_mask(q_pos, torch.arange(N)[None, :].expand(n, N), kvlens[group],
                                                 window).to(**to)
            plain = p0 == 0 and not spec.read_cache_in_prefill
            prefill.append(PrefillGroup(row, n, S, kv_slots, masks, plain, cache[group].to(**to),
                                        kvlens[group].to(**to)))
            row, i = row + n * S, i + n
    return StepPlan(slots.to(**to), cos.to(**to), sin.to(**to), None if last is None else last.to(**to),
                    decode, tuple(prefill), packed, None if q_scale is None else q_scale.to(**to))


class _Buffers:
    """The persistent tensors of a decode step of `size` sequences: token ids, cache slots, history lengths and
    cache starts (one int64 buffer), cos / sin of each of `ropes` ropes (one float32 buffer), and the plan that reads
    them. On CUDA each has a pinned host mirror that the step's ints are written into, then copied over; on CPU the
    host buffers are the plan."""

    def __init__(self, size: int, ropes: int, half: int, max_pages: Optional[int], device: torch.device):
        self.size, self.max_pages = size, max_pages
        pin = device.type == "cuda"
        self.host_ints = torch.zeros((3 + (max_pages or 1)) * size, dtype=torch.int64, pin_memory=pin)
        self.host_floats = torch.zeros(2 * ropes * size * half, dtype=torch.float32, pin_memory=pin)
        self.ints = self.host_ints.to(device) if pin else self.host_ints
        self.floats = self.host_floats.to(device) if pin else self.host_floats
        self.copied = torch.cuda.Event() if pin else None   # the last write's copies out of the host buffers
        self.tokens, slots, kvlens = self.ints[: 3 * size].view(3, size)
        cs = self.ints[3 * size:]
        cos, sin = self.floats.view(2, ropes, size, half)
        self.plan = StepPlan(slots, cos, sin, None, DecodeAttention(
            None, {}, cs.view(size, max_pages) if max_pages is not None else cs, kvlens))
        slots.fill_(-1)

    def write(self, tokens: Sequence[int], start_pos: Sequence[int], caches: Sequence[CacheOf], cos_table: np.ndarray,
              sin_table: np.ndarray) -> None:
        """The step's ints, written with numpy into the host buffers (cos / sin of each rope from its tables [K, n,
        half]); rows past the batch are padding (token 0 at slot -1, which stores nothing, with a history of length
        0)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous write's copies have left the host buffers
        ints, floats = self.host_ints.numpy(), self.host_floats.numpy()
        B, S, W = len(start_pos), self.size, self.max_pages
        tok, slots, kvlens = ints[: 3 * S].reshape(3, S)
        cs = ints[3 * S:] if W is None else ints[3 * S:].reshape(S, W)
        cos, sin = floats.reshape(2, cos_table.shape[0], S, -1)
        if B == S == 1:  # scalar writes: a fifth of the time of the array calls below
            p, c = int(start_pos[0]), caches[0]
            tok[0], kvlens[0] = tokens[0], p + 1
            if W is None:
                cs[0], slots[0] = c, c + p
            else:
                cs[0, : len(c)], cs[0, len(c):] = c, 0
                slots[0] = c[p // PAGE_SIZE] + p % PAGE_SIZE
            cos[:, 0], sin[:, 0] = cos_table[:, p], sin_table[:, p]
        else:
            start = np.asarray(start_pos, dtype=np.int64)
            tok[:B], tok[B:], kvlens[B:], slots[B:] = tokens, 0, 0, -1
            np.add(start, 1, out=kvlens[:B])
            if W is None:
                cs[:B], cs[B:] = caches, 0
                np.add(cs[:B], start, out=slots[:B])
            else:
                cs.fill(0)
                for i, pages in enumerate(caches):
                    cs[i, : len(pages)] = pages
                np.add(cs[np.arange(B), start // PAGE_SIZE], start % PAGE_SIZE, out=slots[:B])
            for k in range(cos_table.shape[0]):
                np.take(cos_table[k], start, axis=0, out=cos[k, :B])
                np.take(sin_table[k], start, axis=0, out=sin[k, :B])
            cos[:, B:], sin[:, B:] = 0.0, 0.0
        if self.copied is not None:
            self.ints.copy_(self.host_ints, non_blocking=True)
            self.floats.copy_(self.host_floats, non_blocking=True)
            self.copied.record()


class DecodeInputs:
    """Writes a step where every sequence decodes one token, for engines whose kernels read each history in place
    from the plan's cachestarts and kvlens, into persistent buffers straight from its ints: one set of buffers per
    size that `size_of(batch)` gives (the batch itself, or for CUDA graphs its bucket, padded). The plan returned
    holds until the next step of that size is written."""

    def __init__(self, spec: PlanSpec, size_of: Callable[[int], int] = lambda b: b):
        self.size_of, self.device, self.paged = size_of, spec.device, spec.paged
        self.max_pages = -(-spec.rotaries[0].max_pos // PAGE_SIZE) if spec.paged else None
        self.tables = tuple(np.stack([getattr(r, t).numpy() for r in spec.rotaries])  # [ropes, positions, D/2]
                            for t in ("cos_table", "sin_table"))
        # positions it takes: those of the tables, and none a logn scaling would scale (their plans carry no q_scale)
        self.end = min(self.tables[0].shape[1], spec.logn_scaling or self.tables[0].shape[1])
        self.buffers: dict[int, _Buffers] = {}

    def write(self, tokens: Sequence[int], start_pos: Sequence[int], caches: Sequence[CacheOf]
              ) -> Optional[tuple[torch.Tensor, StepPlan]]:
        """(token ids [B], plan), or None where the buffers do not take the step (a position past the rotary tables
        or where logn scaling starts, a page table wider than max_pages)."""
        B = len(start_pos)
        if B == 0 or max(start_pos) >= self.end or (
                self.paged and max(map(len, caches)) > self.max_pages):
            return None
        size = self.size_of(B)
        buf = self.buffers.get(size)
        if buf is None:
            buf = self.buffers[size] = _Buffers(size, *self.tables[0].shape[::2], self.max_pages, self.device)
        buf.write(tokens, start_pos, caches, *self.tables)
        return buf.tokens if size == B else buf.tokens[:B], buf.plan

    def owner(self, plan: StepPlan) -> Optional[_Buffers]:
        """The buffers whose plan `plan` is, or None (a plan made by make_plan)."""
        buf = self.buffers.get(plan.slots.shape[0])
        return buf if buf is not None and buf.plan is plan else None


def lengths_of_inputs(seqstarts: torch.Tensor, kvstarts: torch.Tensor, cachestarts: torch.Tensor,
                      decoding_batches: torch.Tensor, start_pos: torch.Tensor, token_ids: torch.Tensor) -> StepLengths:
    """A step given as ppl.pmx's dynamic-batching inputs, as ints (read once, on the host)."""
    seqstarts, kvstarts, start, cs = (t.detach().cpu().to(torch.int64) for t in
                                      (seqstarts, kvstarts, start_pos, cachestarts))
    seqlens = (seqstarts[1:] - seqstarts[:-1]).tolist()
    start_l, nd = start.tolist(), int(decoding_batches.reshape(-1)[0])
    if [s + n for s, n in zip(start_l, seqlens)] != (kvstarts[1:] - kvstarts[:-1]).tolist():
        raise ValueError("kvstarts must equal start_pos + the new tokens of each sequence")
    if not 0 <= nd <= len(seqlens) or any(n != 1 for n in seqlens[:nd]):
        raise ValueError(f"the first {nd} sequences must decode one token each, got lengths {seqlens[:nd]}")
    return StepLengths(token_ids.detach().cpu().tolist(), seqlens, start_l, cs.tolist(), nd)


def causal_mask(b: StepLengths, window: Optional[int], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """ppl.pmx's explicit additive causal (and sliding-window) mask [T, sum kvlens] of a step with sequences in
    prefill (auto_causal off); None for a step where every sequence decodes."""
    if b.num_decoding == len(b.seqlens):
        return None
    kvlens = [p + n for p, n in zip(b.start, b.seqlens)]
    mask = torch.zeros(sum(b.seqlens), sum(kvlens), dtype=dtype)
    s0 = k0 = 0
    for n, kv, p0 in zip(b.seqlens, kvlens, b.start):
        qpos, kpos = p0 + torch.arange(n)[:, None], torch.arange(kv)[None, :]
        bad = (kpos > qpos) | ((kpos <= qpos - window) if window else torch.zeros_like(kpos, dtype=torch.bool))
        mask[s0:s0 + n, k0:k0 + kv] = torch.zeros(bad.shape, dtype=dtype).masked_fill(bad, float("-inf"))
        s0, k0 = s0 + n, k0 + kv
    return mask


def step_inputs(b: StepLengths, attn_mask: Optional[torch.Tensor], dtype: torch.dtype) -> dict:
    """The step as ppl.pmx's dynamic-batching inputs, without the cache (what a dump holds)."""
    kvlens = [p + n for p, n in zip(b.start, b.seqlens)]
    return dict(token_ids=torch.tensor(b.tokens, dtype=torch.int64),
                attn_mask=torch.empty(0, dtype=dtype) if attn_mask is None else attn_mask,
                seqstarts=torch.tensor([0] + b.seqlens, dtype=torch.int64).cumsum(0),
                kvstarts=torch.tensor([0] + kvlens, dtype=torch.int64).cumsum(0),
                cachestarts=_cache_tensor(b.caches, isinstance(b.caches[0], list)),
                decoding_batches=torch.tensor([b.num_decoding], dtype=torch.int64),
                start_pos=torch.tensor(b.start, dtype=torch.int64),
                max_seqlen=torch.tensor([max(b.seqlens)], dtype=torch.int64),
                max_kvlen=torch.tensor([max(kvlens)], dtype=torch.int64))
