"""Headless Chromium: a page as a person opening it sees it, scripts run.

``dom`` answers the page's HTML once its scripts have had ``BUDGET_MS`` of (virtual) time,
so a test can read what the browser shows; ``screenshot`` saves it as a PNG. Chromium is
the Debian package ``chromium``; tests that need it skip without it (:data:`CHROMIUM`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BUDGET_MS = 8000
"""Virtual time the page's scripts get (Flower's tables load over XHR after the page)."""
SIZE = (1400, 900)


def _run(url: str, *args: str, size: tuple[int, int] = SIZE) -> str:
    assert CHROMIUM is not None, "chromium is not installed (apt-get install chromium)"
    with tempfile.TemporaryDirectory(prefix="conveyor-chromium-") as profile:
        argv = [CHROMIUM, "--headless", "--disable-gpu", "--hide-scrollbars",
                f"--user-data-dir={profile}", f"--virtual-time-budget={BUDGET_MS}",
                f"--window-size={size[0]},{size[1]}", *args, url]
        if os.geteuid() == 0:  # Chromium's sandbox refuses root; the pages are our own
            argv.insert(1, "--no-sandbox")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=90, cwd=profile)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dom(url: str) -> str:
    return _run(url, "--dump-dom")


def screenshot(url: str, path: Path, size: tuple[int, int] = SIZE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(url, f"--screenshot={path.resolve()}", size=size)
    assert path.stat().st_size > 0
