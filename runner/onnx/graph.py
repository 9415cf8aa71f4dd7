"""How an exported graph is written: one file, or the weights as ONNX external data where the protobuf would pass
its 2 GB limit; and the ONNX element types of torch's dtypes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import onnx
import torch
from onnx import TensorProto

TORCH_TO_ONNX = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
                 torch.bfloat16: TensorProto.BFLOAT16, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
                 torch.int16: TensorProto.INT16, torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64}
PROTOBUF_LIMIT = 2 ** 31 - 1
EXTERNAL_DATA_AT = 1_800_000_000  # weights past this many bytes go to external data (headroom for the graph)
MODEL_FILE, DATA_FILE = "model.onnx", "model.onnx.data"


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
