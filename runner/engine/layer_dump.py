"""Per-layer dumps (MacaPrecision's layer mode): Demo's `--dump_layers` writes, for each dumped step, each layer's
op outputs beside the step's tensors, as `rank_{r}/step{S}_layer{i}_{op}-{dims}-{dtype}.bin`:

    attention_norm  the attention input after RMSNorm            [T, hidden]
    q, k, v         the qkv linear's output, by heads (before q/k norms and rotary)   [T, heads of this rank, head_dim]
    attention       attention's output, by heads (wo's input)     [T, heads of this rank, head_dim]
    o               wo's output (all-reduced, bias added)         [T, hidden]
    ffn_norm        the MLP input after RMSNorm                   [T, hidden]
    residual        the residual stream after attention           [T, hidden]
    ffn             the MLP's output (all-reduced)                [T, hidden]

The values are taken by forward hooks registered on the model's modules from outside (runner/engine/model.py is not
changed). Only the eager step runs those modules one by one: while a dumped step runs, the Stepper is told to use
its plain eager runner (no one-call C++ decode step, no CUDA graph, no compiled step, no sequence parallelism, whose
residual stream is cut by rows), so a dump with --dump_layers times and runs those steps eagerly. The ONNX replay
writes the same names from its graph's values (runner.onnx.replay --dump_layers).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from runner.engine.dump import TensorDumper, write_tensor

LAYER_OPS = ("attention_norm", "q", "k", "v", "attention", "o", "ffn_norm", "residual", "ffn")
HEAD_OPS = {"q": "heads", "k": "kv_heads", "v": "kv_heads", "attention": "heads"}  # cut by heads across ranks


def layer_name(i: int, op: str) -> str:
    return f"layer{i}_{op}"


class LayerDumper(TensorDumper):
    """A TensorDumper that also writes each layer's values of the steps it dumps (see the module docstring)."""

    def __init__(self, root: str, rank: int, model, stepper, steps: Optional[Iterable[int]] = None,
                 meta: Optional[dict] = None):
        super().__init__(root, rank, steps, meta)
        self.stepper, self.step = stepper, None
        self.handles = []
        for i, layer in enumerate(model.layers):
            self._hooks(i, layer, model.heads, model.kv_heads, model.head_dim)

    def _write(self, i: int, op: str, t: torch.Tensor) -> None:
        if self.step is not None:
            write_tensor(self.dir, self.step, layer_name(i, op), t.float(), "the layer dump")

    def _hooks(self, i: int, layer, heads: int, kv_heads: int, hd: int) -> None:
        a = layer.attention

        def norm_hook(names):
            def hook(mod, args, out):  # (a hook returns None: it must not replace the output)
                for n, o in zip(names, out):
                    if n:
                        self._write(i, n, o)
            return hook

        def qkv_hook(mod, args, out):
            q, k, v = out.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
            for n, t in (("q", q), ("k", k), ("v", v)):
                self._write(i, n, t.reshape(t.shape[0], -1, hd))

        add = self.handles.append
        add(layer.attention_norm.register_forward_hook(norm_hook(("attention_norm", None))))
        add(layer.ffn_norm.register_forward_hook(norm_hook(("ffn_norm", "residual"))))
        if len(a.qkv) == 1:
            add(a.qkv[0].register_forward_hook(qkv_hook))
        else:
            for n, mod in zip("qkv", a.qkv):
                add(mod.register_forward_hook(lambda m, args, out, n=n: self._write(i, n, out.reshape(
                    out.shape[0], -1, hd))))
        add(a.wo.register_forward_pre_hook(lambda m, args: self._write(i, "attention", args[0].reshape(
            args[0].shape[0], -1, hd))))
        add(a.wo.register_forward_hook(lambda m, args, out: self._write(i, "o", out)))
        add(layer.feed_forward.register_forward_hook(lambda m, args, out: self._write(i, "ffn", out)))

    def dump(self, step: int, tensors: dict) -> None:
        """The step's inputs arm the hooks (and the eager runner) for the step; its logits disarm them."""
        super().dump(step, tensors)
        if "logits" in tensors:
            self.step, self.stepper.force_eager = None, False
        else:
            self.step, self.stepper.force_eager = step, True

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
