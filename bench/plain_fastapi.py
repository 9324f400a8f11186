"""Baseline: the plain FastAPI wrapper an ML engineer typically writes today.

One onnxruntime call per request, no batching, on the same ONNX export and session options
as every other benchmarked system (bench.models.session). Serves the KServe v2 infer route.

Usage: BENCH_MODEL=mlp_tiny uvicorn bench.plain_fastapi:app --port 8000
"""

import os
import tempfile
from pathlib import Path

import numpy as np
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from bench.models import export_onnx, session

MODEL_NAME = os.environ.get("BENCH_MODEL", "mlp_tiny")

with tempfile.TemporaryDirectory() as _tmp:
    export_onnx(MODEL_NAME, Path(_tmp) / "model.onnx")
    model = session(Path(_tmp) / "model.onnx")
app = FastAPI()


class InferInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[float]


class InferRequest(BaseModel):
    inputs: list[InferInput]


class InferOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float]


class InferResponse(BaseModel):
    model_name: str
    outputs: list[InferOutput]


@app.post("/v2/models/{model_name}/infer")
def infer(model_name: str, request: InferRequest) -> InferResponse:
    if model_name != MODEL_NAME:
        raise HTTPException(status_code=404, detail=f"unknown model {model_name!r}")
    tensor = request.inputs[0]
    x = np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)
    y = model.run(None, {"INPUT0": x})[0]
    output = InferOutput(name="OUTPUT0", datatype="FP32", shape=list(y.shape), data=y.ravel().tolist())
    return InferResponse(model_name=model_name, outputs=[output])
