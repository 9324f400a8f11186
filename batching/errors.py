"""One error tree for the whole service, and the one table that maps it to HTTP and gRPC.

Every error a client can see derives from :class:`ConveyorError`. The worker sends the
error's ``code`` (a short string) back in the reply, and the API rebuilds the same type
with :func:`from_code`, so HTTP and gRPC answers come from this table alone.
"""

from __future__ import annotations

from typing import ClassVar


class ConveyorError(Exception):
    """Base of every error conveyor reports to a client."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    grpc_status: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(ConveyorError):
    """The request does not match the model's signature or the protocol."""

    code = "invalid_input"
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"


class ModelNotFound(ConveyorError):
    code = "not_found"
    http_status = 404
    grpc_status = "NOT_FOUND"


class Overloaded(ConveyorError):
    """The model's queue is full, or the API process is too far behind to answer in time
    (api/overload.py). 503 / UNAVAILABLE, as Triton answers a full queue (clients retry on
    those codes), with ``Retry-After`` over HTTP."""

    code = "overloaded"
    http_status = 503
    grpc_status = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ConveyorError):
    """Redis is unreachable, or the model has no worker."""

    code = "unavailable"
    http_status = 503
    grpc_status = "UNAVAILABLE"


class MalformedShape(ConveyorError):
    """A JSON ``shape`` element that is not an unsigned integer (negative, a fraction, a
    string, a bool, a number beyond int64): the client's error, with Triton's text (Triton
    answers it 500 / INTERNAL, its one server error for bad input)."""

    code = "malformed_shape"
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"


class PayloadTooLarge(ConveyorError):
    """A request body above ``max_request_bytes``, before or after decompression."""

    code = "payload_too_large"
    http_status = 413
    grpc_status = "RESOURCE_EXHAUSTED"


class RequestTimeout(ConveyorError):
    """A request body not complete within ``http_body_timeout_s`` of its headers."""

    code = "request_timeout"
    http_status = 408
    grpc_status = "DEADLINE_EXCEEDED"


class HeadersTooLarge(ConveyorError):
    """A request line and headers above the HTTP listener's limit."""

    code = "headers_too_large"
    http_status = 431
    grpc_status = "RESOURCE_EXHAUSTED"


class ModelControlDisabled(Unavailable):
    """Repository load or unload while model control is off (Triton's model control
    mode NONE answers UNAVAILABLE too)."""

    code = "model_control_disabled"


class DeadlineExceeded(ConveyorError):
    code = "deadline_exceeded"
    http_status = 504
    grpc_status = "DEADLINE_EXCEEDED"


class Unauthenticated(ConveyorError):
    """No API key, or one the keys file does not hold."""

    code = "unauthenticated"
    http_status = 401
    grpc_status = "UNAUTHENTICATED"


class PermissionDenied(ConveyorError):
    """A known API key without the scope the endpoint needs."""

    code = "permission_denied"
    http_status = 403
    grpc_status = "PERMISSION_DENIED"


class Unsupported(ConveyorError):
    """A Triton feature conveyor does not offer (CUDA shared memory), or one switched off
    (client shared memory without ``allow_client_shm``): Triton's UNSUPPORTED."""

    code = "unsupported"
    http_status = 501
    grpc_status = "UNIMPLEMENTED"


class AlreadyExists(ConveyorError):
    """A shared memory region name already registered (Triton answers HTTP 400 too)."""

    code = "already_exists"
    http_status = 400
    grpc_status = "ALREADY_EXISTS"


class RegionNotFound(ConveyorError):
    """A request names a shared memory region that is not registered."""

    code = "region_not_found"
    http_status = 404
    grpc_status = "NOT_FOUND"


class TooManyRegions(ConveyorError):
    """Registering one more shared memory region would pass ``shm_max_regions``."""

    code = "too_many_regions"
    http_status = 400
    grpc_status = "RESOURCE_EXHAUSTED"


class FilesRefused(ConveyorError):
    """A repository load with ``file:`` parameters (model files from the client), which
    conveyor never takes: 500 / INTERNAL with Triton's "failed to poll from model
    repository", as Triton answers a load whose files it cannot write (its model-control
    client examples check that status and text)."""

    code = "files_refused"
    http_status = 500
    grpc_status = "INTERNAL"


class ModelFailure(ConveyorError):
    """The model raised while running a batch."""

    code = "model_failure"
    http_status = 500
    grpc_status = "INTERNAL"


class ModelCallFailed(ConveyorError):
    """A model that a Python model called from ``predict`` (batching/bls.py) answered an
    error, or its call could not be made: :attr:`model` names it. Raised as a subclass of
    this and of the error's own type (:func:`call_failed`), so it keeps that error's code
    and status: uncaught, the calling batch's requests answer it."""

    def __init__(self, message: str, model: str = "") -> None:
        super().__init__(message)
        self.model = model


_BY_CODE: dict[str, type[ConveyorError]] = {
    cls.code: cls
    for cls in (ConveyorError, InvalidInput, ModelNotFound, Overloaded, Unavailable,
                DeadlineExceeded, ModelFailure, ModelControlDisabled, Unauthenticated,
                PermissionDenied, PayloadTooLarge, RequestTimeout, HeadersTooLarge, Unsupported,
                AlreadyExists, RegionNotFound, TooManyRegions, MalformedShape, FilesRefused)
}


def from_code(code: str, message: str) -> ConveyorError:
    """Rebuild the error a worker reported by its code (unknown codes become 500s)."""
    return _BY_CODE.get(code, ConveyorError)(message)


def status_table() -> dict[str, tuple[int, str]]:
    """code -> (HTTP status, gRPC status name): the table the docs print."""
    return {code: (cls.http_status, cls.grpc_status) for code, cls in _BY_CODE.items()}


_CALLED: dict[str, type[ModelCallFailed]] = {}


def call_failed(model: str, code: str, message: str) -> ModelCallFailed:
    """The error of called model ``model``: a :class:`ModelCallFailed` that is also the
    type ``code`` names (unknown codes: :class:`ConveyorError`)."""
    cls = _BY_CODE.get(code, ConveyorError)
    made = _CALLED.get(cls.code)
    if made is None:
        made = _CALLED[cls.code] = type(f"Called{cls.__name__}", (ModelCallFailed, cls), {})
    return made(f"model {model!r} called from predict failed: {message}", model)
