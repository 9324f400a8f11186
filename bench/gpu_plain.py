"""Baseline on the GPU: the plain FastAPI wrapper an ML engineer writes around a TorchScript
model, one model call per request, no batching, in one process.

It serves the KServe v2 infer route with binary tensors (the request conveyor gets in the
GPU benchmark): the JSON header, then the image's bytes; the logits go back the same way.
The model call runs in FastAPI's thread pool, so several requests reach the GPU at once,
each as a batch of one.

Usage: GPU_PLAIN_MODEL=repo/resnet50/model.pt GPU_PLAIN_DEVICE=cuda:0 \\
       uvicorn bench.gpu_plain:app --port 8000
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

DEVICE = os.environ.get("GPU_PLAIN_DEVICE", "cuda:0")
MODEL_NAME = os.environ.get("GPU_PLAIN_NAME", "resnet50")
model: Any = torch.jit.load(os.environ["GPU_PLAIN_MODEL"], map_location=DEVICE)  # type: ignore[no-untyped-call]
app = FastAPI()


def predict(images: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    with torch.inference_mode():
        out: np.ndarray[Any, Any] = model(torch.from_numpy(images).to(DEVICE)).float().cpu().numpy()
        return out


@app.post("/v2/models/{model_name}/infer")
async def infer(model_name: str, request: Request) -> Response:
    if model_name != MODEL_NAME:
        raise HTTPException(status_code=404, detail=f"unknown model {model_name!r}")
    body = await request.body()
    length = int(request.headers["inference-header-content-length"])
    tensor = json.loads(body[:length])["inputs"][0]
    images = np.frombuffer(body[length:], dtype=np.uint8).reshape(tensor["shape"])
    logits = await run_in_threadpool(predict, images)
    header = json.dumps({"model_name": model_name, "outputs": [{
        "name": "logits", "datatype": "FP32", "shape": list(logits.shape),
        "parameters": {"binary_data_size": logits.nbytes}}]}).encode()
    return Response(header + logits.tobytes(), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})
