"""Triton-form calling model: runs its batch through ``twice`` with Triton's BLS.

One ``exec()`` asks for ``y`` and ``prio``, two ``async_exec()`` at once for ``y`` only;
``y`` is their sum (6x), ``prio`` the priority ``twice`` ran at. A batch whose first value
is -4 calls a model that is not served, -5 asks for ``exec(decoupled=True)``: either
error response becomes this model's ``TritonError`` answer.
"""

import asyncio
from typing import Any

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests: list[Any]) -> list[Any]:
        return [await self.answer(request) for request in requests]

    async def answer(self, request: Any) -> Any:
        x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
        target = "absent" if x[0, 0] == -4 else "twice"
        call = pb_utils.InferenceRequest(
            model_name=target, requested_output_names=["y", "prio"],
            inputs=[pb_utils.Tensor("x", x)],
            preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0))
        response = call.exec(decoupled=bool(x[0, 0] == -5))
        if response.has_error():
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"triton_caller: {response.error().message()}"))
        only_y = [pb_utils.InferenceRequest(model_name="twice", requested_output_names=["y"],
                                            inputs=[pb_utils.Tensor("x", x)])
                  for _ in range(2)]
        answers = await asyncio.gather(*(r.async_exec() for r in only_y))
        for answer in answers:
            if [t.name() for t in answer.output_tensors()] != ["y"]:
                raise pb_utils.TritonModelException("unrequested outputs came back")
        y = pb_utils.get_output_tensor_by_name(response, "y").as_numpy() \
            + sum(pb_utils.get_output_tensor_by_name(a, "y").as_numpy() for a in answers)
        prio = pb_utils.get_output_tensor_by_name(response, "prio")
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y), prio])
