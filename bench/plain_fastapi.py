"""Baseline: the plain FastAPI wrapper an ML engineer typically writes today.

One forward pass per request, no batching. Serves the KServe v2 infer route.

Usage: BENCH_MODEL=mlp_tiny uvicorn bench.plain_fastapi:app --port 8000
"""

import os

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from bench.models import build

MODEL_NAME = os.environ.get("BENCH_MODEL", "mlp_tiny")

torch.set_num_threads(1)
model = build(MODEL_NAME)
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
    x = torch.tensor(tensor.data, dtype=torch.float32).reshape(tensor.shape)
    with torch.inference_mode():
        y = model(x)
    output = InferOutput(name="OUTPUT0", datatype="FP32", shape=list(y.shape), data=y.flatten().tolist())
    return InferResponse(model_name=model_name, outputs=[output])
