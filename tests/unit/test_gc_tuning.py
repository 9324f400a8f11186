"""The API's collector settings once it has started (api.main's lifespan)."""

from __future__ import annotations

import gc

from api.main import GC_THRESHOLDS
from batching.settings import Settings
from tests.unit.conftest import serve
from tests.unit.memory_dispatch import MemoryDispatcher


def test_the_started_api_collects_less_often(settings: Settings,
                                             dispatcher: MemoryDispatcher) -> None:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        with serve(settings, dispatcher):
            assert gc.get_threshold() == GC_THRESHOLDS == (20_000, 50, 100)
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
