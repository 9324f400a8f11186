"""The share of a ``lifo`` model's requests the HTTP listener refuses at once, learned from
what came back of those it let through (api/refusal_share.py, api/overload.py)."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.overload import CLIENTS, HEADROOM, SHARE_PER_ANSWER, SHED_MEMORY_S, Overload
from api.refusal_share import DOWN, MOST, UP, RefusalShare
from batching.config import BatchingConfig, ModelConfig
from batching.envelope import Reply, Request
from batching.errors import Overloaded
from tests.unit.memory_dispatch import MemoryDispatcher

BUDGET_S = 0.05


def lifo(overload: str = "lifo") -> ModelConfig:
    return ModelConfig("m", "onnx", batching=BatchingConfig(latency_target_ms=BUDGET_S * 1e3,
                                                            overload=overload))


def judged(config: ModelConfig | None = None) -> Overload:
    """An Overload that has seen ``CLIENTS`` connections send m a request that did not wait,
    and whose every draw refuses where the share is above 0 (its budget of refusals per
    answer does not age here: the sampler is not started)."""
    overload = Overload(share=RefusalShare(draw=lambda: 0.0))
    overload.learn("m", config or lifo())
    for client in range(CLIENTS):
        assert not overload.refuses_unread("m", 0.0, client)
    return overload


def test_late_answers_raise_the_share_and_answers_in_time_bring_it_down() -> None:
    share = RefusalShare()
    share.outcome("m", False)
    assert share.of("m") == pytest.approx(UP)
    for _ in range(1000):
        share.outcome("m", False)
    assert share.of("m") == MOST  # some still go through, to bring it back down
    for _ in range(1000):
        share.outcome("m", True)
    assert share.of("m") < 0.01
    assert share.of("other") == 0.0


def test_the_share_settles_where_its_odds_are_up_over_down_times_the_late_odds() -> None:
    for late_every in (8, 16, 64):  # one answer late, then late_every - 1 in time
        share = RefusalShare()
        for n in range(50_000):
            share.outcome("m", n % late_every != 0)
        odds = UP / DOWN / (late_every - 1)
        assert share.of("m") == pytest.approx(odds / (1 + odds), rel=0.2)


def test_after_a_shed_a_request_is_refused_with_the_share_whatever_its_wait() -> None:
    draws = iter([0.5, 0.01])
    overload = judged()
    overload.share.draw = lambda: next(draws)
    overload.answered("m", BUDGET_S / 2)  # in time: one answer, a refusal's budget
    overload.shed("m")  # came back shed unrun
    assert overload.share.of("m") == pytest.approx(UP)
    assert not overload.refuses_unread("m", 0.0, 0)  # drew 0.5: let through
    assert overload.refuses_unread("m", 0.0, 0)  # drew 0.01: refused, without a wait
    assert overload.refused_unread == 1


def test_late_answers_alone_refuse_nothing_until_a_shed() -> None:
    overload = judged()
    for _ in range(20):  # a host that other work slows, clients in a closed loop
        overload.answered("m", 2 * BUDGET_S)
    assert overload.share.of("m") > 0.3
    assert not any(overload.refuses_unread("m", 0.0, c) for c in range(CLIENTS))
    overload.standing_s = 0.0  # a backlog stands as soon as it is there
    overload.took_s["m"] = overload.took_dev_s["m"] = 0.0
    assert not overload.refuses_unread("m", 0.02, 0)  # standing: only the wait rule judges
    overload.shed("m")
    assert overload.refuses_unread("m", 0.0, 0)


def test_a_shed_is_remembered_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("api.overload.time.monotonic", lambda: now[0])
    overload = judged()
    overload.answered("m", 2 * BUDGET_S)
    overload.answered("m", 2 * BUDGET_S)
    overload.shed("m")
    now[0] += SHED_MEMORY_S * 0.9
    assert overload.refuses_unread("m", 0.0, 0)
    now[0] += SHED_MEMORY_S * 0.2
    assert not overload.refuses_unread("m", 0.0, 0)


def test_answers_in_time_leave_nothing_refused() -> None:
    overload = judged()
    for _ in range(100):
        overload.answered("m", BUDGET_S / 2)
    assert overload.share.of("m") == 0.0
    assert not overload.refuses_unread("m", 0.0, 0)


def test_a_model_too_slow_for_its_target_is_not_refused_for_it() -> None:
    overload = judged()
    for _ in range(100):  # every batch alone takes longer than the target allows
        overload.answered("m", 2 * BUDGET_S, exec_s=HEADROOM * BUDGET_S * 1.1)
    assert overload.share.of("m") == 0.0
    overload.answered("m", 2 * BUDGET_S, exec_s=HEADROOM * BUDGET_S * 0.9)
    assert overload.share.of("m") > 0.0


def test_refusals_by_the_share_are_held_to_a_budget_per_answer() -> None:
    overload = judged()
    for _ in range(10):
        overload.answered("m", 2 * BUDGET_S)  # late: the share rises; 10 answers
    overload.shed("m")
    refused = sum(overload.refuses_unread("m", 0.0, 0) for _ in range(100))
    assert refused == int(SHARE_PER_ANSWER * 10)  # a closed loop is not kept out by it
    overload.answered("m", 2 * BUDGET_S)
    assert overload.refuses_unread("m", 0.0, 0)  # one answer more: room for one more


def test_few_clients_and_fifo_models_are_never_refused_for_it() -> None:
    overload = Overload(share=RefusalShare(draw=lambda: 0.0))
    overload.learn("m", lifo())
    for _ in range(10):
        overload.answered("m", 2 * BUDGET_S)
    overload.shed("m")
    assert not any(overload.refuses_unread("m", 0.0, c) for c in range(CLIENTS - 1))
    fifo = judged(lifo("fifo"))
    for _ in range(10):
        fifo.answered("m", 2 * BUDGET_S)
        fifo.shed("m")
    assert fifo.share.of("m") == 0.0 and not fifo.refuses_unread("m", 0.0, 0)


def test_the_service_reports_what_the_inference_process_shed(
        client: TestClient, dispatcher: MemoryDispatcher,
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(Overload, "shed", lambda self, model: seen.append(model))
    shed = Overloaded("past capacity: cannot be answered within the model's latency target")

    def answer(request: Request) -> Reply:
        return Reply(request.id, error_code=shed.code, error=shed.message)

    dispatcher.answer = answer
    x = np.zeros((1, 4), np.float32)
    response = client.post("/v2/models/echo/infer", json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x.ravel().tolist()}]})
    assert response.status_code == 503
    assert seen == ["echo"]
