import numpy as np
import pytest

from batching.datatypes import DATATYPES, from_numpy, from_raw, to_numpy, to_raw
from batching.envelope import Reply, Request, Tensor, split_rows
from batching.errors import InvalidInput


def test_request_round_trips_every_field() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    req = Request("7", "cv:reply:a", 1000, 900, 2, [Tensor.from_array("x", x)], ["y"],
                  {"k": 1})
    back = Request.decode(req.encode())
    assert (back.id, back.reply, back.deadline_ms, back.enq_ms, back.prio) == (
        "7", "cv:reply:a", 1000, 900, 2)
    assert back.outputs == ["y"] and back.params == {"k": 1}
    assert back.rows == 3
    np.testing.assert_array_equal(back.inputs[0].array(), x)


def test_reply_round_trips_outputs_and_errors() -> None:
    ok = Reply("1", [Tensor.from_array("y", np.ones((2, 2), np.int64))], batch_rows=5,
               queue_ms=1.5, exec_ms=2.5)
    back = Reply.decode(ok.encode())
    assert back.ok and back.batch_rows == 5 and back.queue_ms == 1.5
    np.testing.assert_array_equal(back.outputs[0].array(), np.ones((2, 2), np.int64))
    err = Reply.decode(Reply("2", error_code="model_failure", error="boom").encode())
    assert not err.ok and err.error == "boom"


@pytest.mark.parametrize("datatype", sorted(DATATYPES - {"BYTES"}))
def test_every_numeric_datatype_round_trips_raw(datatype: str) -> None:
    array = np.arange(6).reshape(2, 3).astype(to_numpy(datatype))
    assert from_numpy(array.dtype) == datatype
    np.testing.assert_array_equal(from_raw(to_raw(array), datatype, (2, 3)), array)


def test_bytes_round_trip_with_empty_and_non_ascii() -> None:
    array = np.array([b"", "grüße".encode(), b"\x00\xff"], dtype=np.object_)
    back = from_raw(to_raw(array), "BYTES", (3,))
    assert list(back) == list(array)


def test_raw_length_mismatch_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="do not fill shape"):
        from_raw(b"\x00" * 7, "FP32", (2,))


def test_split_rows_by_request_counts() -> None:
    parts = split_rows(np.arange(6).reshape(6, 1), [1, 3, 2])
    assert [p.ravel().tolist() for p in parts] == [[0], [1, 2, 3], [4, 5]]
