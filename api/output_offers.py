"""Which requests' large outputs come back by reference, and the replies that name them
resolved (batching/output_refs.py, api/output_upload.py).

A request gets an offer when its model's inference processes reach this API process's
bytes endpoint (``CONVEYOR_TENSOR_TRANSPORT=fetch``, or ``auto`` where they do not share
this host's memory: the path its large inputs take too) and its outputs may hold a tensor
of ``CONVEYOR_TENSOR_ARENA_MIN_BYTES`` or more. The offer's bound is the request's expected
output size, from its model's declared outputs and its rows, or, where a dim or datatype
leaves that open, ``CONVEYOR_MAX_REQUEST_BYTES``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

from api.bytes_endpoint import BytesEndpoint
from api.output_upload import Uploads
from batching.config import ModelConfig
from batching.datatypes import to_numpy
from batching.envelope import Reply, Request
from batching.errors import ConveyorError
from batching.output_refs import OFFER, Offer, is_output_ref
from batching.settings import Settings
from batching.tensor_arena import SHM_DIR, host_token


class OutputOffers:
    """Offers the uploads of ``uploads`` (on ``endpoint``) to the requests of ``models``
    that ``reaches(model)`` says come from processes able to upload."""

    def __init__(self, uploads: Uploads, endpoint: BytesEndpoint,
                 models: Mapping[str, ModelConfig], reaches: Callable[[str], bool],
                 open_bound: int) -> None:
        self.uploads = uploads
        self._endpoint = endpoint
        self._models = models
        self._reaches = reaches
        self._open_bound = open_bound
        endpoint.on_upload = uploads.receive

    def offer(self, model: str, request: Request, rows: int) -> Offer | None:
        """An upload place for ``request``'s large outputs (in its ``params``), or None."""
        config = self._models.get(model)
        if config is None or not self._endpoint.started or not self._reaches(model):
            return None
        bound = expected_bytes(config, request.outputs, rows)
        if bound is None:
            bound = self._open_bound
        elif bound < self.uploads.min_bytes:
            return None
        offer = self.uploads.offer(self._endpoint.where, bound, request.deadline_ms)
        request.params[OFFER] = offer.pack()
        return offer

    def resolve(self, offer: Offer | None, reply: Reply) -> None:
        """``reply``'s uploaded outputs replaced by their bytes; :class:`ConveyorError`
        (500 / ``INTERNAL``) if this process holds no such upload (``offer`` None: the
        request was offered none): never other bytes, nor none."""
        named = [t for t in reply.outputs if is_output_ref(t.ref)]
        if not named:
            return
        parts = None if offer is None else self.uploads.take(offer.id)
        for tensor in named:
            assert tensor.ref is not None
            rid, index, length = tensor.ref
            if (parts is None or offer is None or rid != offer.id or not isinstance(index, int)
                    or not 0 <= index < len(parts) or len(parts[index]) != length):
                raise ConveyorError(
                    f"the reply's output {tensor.name!r} names bytes uploaded to this API "
                    f"process that it does not hold (upload {rid}, tensor {index})")
            tensor.raw, tensor.ref = parts[index], None

    def free(self, offer: Offer) -> None:
        self.uploads.free(offer.id)


def expected_bytes(config: ModelConfig, wanted: list[str], rows: int) -> int | None:
    """The bytes of the outputs ``wanted`` (all if none named) of a request of ``rows``
    rows, as the model declares them; None where a dim or a datatype leaves them open."""
    specs = [s for s in config.outputs if not wanted or s.name in wanted]
    if not specs:
        return None
    total = 0
    for spec in specs:
        dims = spec.shape[1:] if config.batched else spec.shape
        if spec.datatype == "BYTES" or any(d < 0 for d in dims):
            return None
        total += (rows if config.batched else 1) * math.prod(dims) * to_numpy(
            spec.datatype).itemsize
    return total


def offers_from(settings: Settings, endpoint: BytesEndpoint | None,
                models: Mapping[str, ModelConfig], shares: Callable[[str, str], bool],
                directory: Path = SHM_DIR) -> OutputOffers | None:
    """The offers ``settings`` ask for: on ``endpoint`` unless large tensors go through
    Redis; with ``auto``, to the models whose processes do not ``shares`` this host's
    memory."""
    if endpoint is None or settings.tensor_transport == "redis":
        return None
    if settings.tensor_transport == "fetch":
        def reaches(model: str) -> bool:
            return True
    else:
        token = host_token(directory)

        def reaches(model: str) -> bool:
            return token is None or not shares(model, token)
    return OutputOffers(Uploads(settings.tensor_arena_min_bytes), endpoint, models, reaches,
                        settings.max_request_bytes)
