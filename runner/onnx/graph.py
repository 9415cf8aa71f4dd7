"""An ONNX graph under construction (onnx.helper), and how a finished one is written: one file, or the weights as
ONNX external data where the protobuf would pass its 2 GB limit.

Both exports (:mod:`runner.onnx.opmx`, :mod:`runner.onnx.standard`) build their graphs with :class:`Graph`; value
names are chosen by the caller so that the per-layer values carry the names the layer dumps use
(`layer{i}_attention_norm`, ... see :mod:`runner.engine.layer_dump`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

TORCH_TO_ONNX = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
                 torch.bfloat16: TensorProto.BFLOAT16, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
                 torch.int16: TensorProto.INT16, torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64}
PROTOBUF_LIMIT = 2 ** 31 - 1
EXTERNAL_DATA_AT = 1_800_000_000  # weights past this many bytes go to external data (headroom for the graph)
MODEL_FILE, DATA_FILE = "model.onnx", "model.onnx.data"


class Graph:
    """Nodes, initializers, inputs and outputs of one graph; `domains` the opsets it imports."""

    def __init__(self, name: str, domains: dict[str, int]):
        self.name, self.domains = name, dict(domains)
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self._n = 0
        self.weight_bytes = 0

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def input(self, name: str, dtype: torch.dtype, shape: Sequence) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TORCH_TO_ONNX[dtype], list(shape)))
        return name

    def output(self, name: str, dtype: torch.dtype, shape: Sequence) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, TORCH_TO_ONNX[dtype], list(shape)))
        return name

    def weight(self, name: str, t: torch.Tensor) -> str:
        """An initializer holding `t` (bfloat16 stored as its bits, as ONNX does)."""
        t = t.detach().contiguous().cpu()
        if t.dtype == torch.bfloat16:
            proto = helper.make_tensor(name, TensorProto.BFLOAT16, list(t.shape),
                                       t.view(torch.int16).numpy().tobytes(), raw=True)
        else:
            proto = numpy_helper.from_array(t.numpy(), name)
        self.inits.append(proto)
        self.weight_bytes += t.numel() * t.element_size()
        return name

    def const(self, hint: str, values, dtype=np.int64) -> str:
        """A small constant initializer (shapes, indices)."""
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], outputs=1, domain: str = "", name: Optional[str] = None,
           **attrs) -> list[str]:
        """Adds a node; `outputs` is a count (fresh names) or the names. Returns the output names."""
        outs = [self.fresh(op_type) for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name or self.fresh(op_type),
                                           domain=domain, **attrs))
        return outs

    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, producer_name="pmx-runner", doc_string=doc,
                                  opset_imports=[helper.make_opsetid(d, v) for d, v in self.domains.items()])
        model.ir_version = min(model.ir_version, 10)  # readable by onnxruntime releases of the last two years
        return model


def save(model: onnx.ModelProto, directory: Path, external_data: Optional[bool] = None) -> Path:
    """Writes `model` as directory/model.onnx, its weights in directory/model.onnx.data when `external_data` (None:
    when the file would pass the protobuf limit); checks the written file with onnx.checker. Returns its path."""
    path = Path(directory) / MODEL_FILE
    if external_data is None:
        external_data = sum(len(t.raw_data) for t in model.graph.initializer) > EXTERNAL_DATA_AT
    onnx.save_model(model, str(path), save_as_external_data=external_data, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)
    onnx.checker.check_model(str(path), full_check=not external_data)
    return path


def value_info(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """{name: value info} of a model's inputs and outputs."""
    return {v.name: v for v in (*model.graph.input, *model.graph.output)}
