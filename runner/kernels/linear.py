"""Dense layer y = x W^T + b with the fastest weight format the device has.

On CPU in float32 the weight is reordered once, at load, into oneDNN's blocked layout and applied
with oneDNN's matmul: 1.3-2x faster than `F.linear` (MKL) at the small row counts of decoding on
this project's CPU box (see benchmarks/RESULTS.md). oneDNN costs about 20 us per call, so small
weights (under PREPACK_MIN_NUMEL elements, where MKL is faster) stay plain. Elsewhere (GPU, half
precision, a torch without oneDNN) it is plain `F.linear` on the [out, in] weight.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

PREPACK_MIN_NUMEL = 1 << 19  # below this, MKL's F.linear wins on the measured CPU (M = 1 and 16)


@torch.library.custom_op("pmx::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """x [M, in] @ W^T (+ b) with W prepacked by oneDNN; an op of its own so torch.compile calls it as it is
    (inductor would only take oneDNN weights it packed itself, a second copy of the model)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.numel() >= PREPACK_MIN_NUMEL
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(torch.nn.Module):
    """y = x W^T + b for W [out, in]; `prepack` picks oneDNN's blocked weight where it is usable."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, prepack: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", bias, persistent=False)
        packed = None
        if prepack and _onednn_usable(weight):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            except RuntimeError:  # an unusual oneDNN build: keep the plain path
                packed = None
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("weight", None if packed is not None else weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dtype != torch.float32:
            raise TypeError(f"this layer holds a float32 oneDNN weight; got {x.dtype} input")
        y = onednn_linear(x.reshape(-1, self.in_features).contiguous(), self.packed, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)
