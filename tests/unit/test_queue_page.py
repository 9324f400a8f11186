"""``GET /v2/conveyor/queues``: each model stream's depth, as JSON or an HTML table.

The streams live on the in-memory dispatcher's fakeredis; tests/test_flower_control.py
reads the page of a real stack."""

from __future__ import annotations

from fastapi.testclient import TestClient

from batching.keys import GROUP
from tests.unit.memory_dispatch import MemoryDispatcher


def test_the_page_counts_waiting_and_running_entries_per_stream(
        client: TestClient, dispatcher: MemoryDispatcher) -> None:
    keys = dispatcher.keys
    with dispatcher.sync_redis() as r:
        stream = keys.queue("echo", 2)
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for i in range(5):
            r.xadd(stream, {"d": i})
        r.xreadgroup(GROUP, "proc-1", {stream: ">"}, count=2)  # two being run
        r.set(keys.rows_waiting("echo"), 17)
        r.xadd(keys.dead_letter("echo"), {"d": 1})

    response = client.get("/v2/conveyor/queues")
    assert response.status_code == 200
    models = {m["name"]: m for m in response.json()["models"]}
    assert set(models) == {"echo", "slow"}
    echo = models["echo"]
    assert (echo["rows_waiting"], echo["dead_letter"], echo["max_queue_rows"]) == (17, 1, 10000)
    by_priority = {s["priority"]: s for s in echo["streams"]}
    assert by_priority[2] == {"priority": 2, "stream": stream, "entries": 5, "waiting": 3,
                              "running": 2}
    assert by_priority[1] == {"priority": 1, "stream": keys.queue("echo", 1), "entries": 0,
                              "waiting": 0, "running": 0}
    assert models["slow"]["rows_waiting"] == 0

    page = client.get("/v2/conveyor/queues", headers={"accept": "text/html,*/*;q=0.8"})
    assert page.headers["content-type"].startswith("text/html")
    assert f"<td>echo</td><td>2</td><td><code>{stream}</code></td><td>3</td><td>2</td>" in page.text
    assert "17 / 10000" in page.text
