"""The Redis scripts of ``batching/lua/``, read one way: their text and its SHA1.

Every caller gets a script here, whether it sends the text with ``EVAL``, its SHA1 with
``EVALSHA`` or hands the text to redis-py's ``register_script``; one place reads the
package data, so no caller depends on how it is installed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    text: str = field(repr=False)
    sha: str
    """The SHA1 Redis caches the script under, for ``EVALSHA``."""


@cache
def script(name: str) -> Script:
    """``batching/lua/<name>.lua``; raises ``FileNotFoundError`` for an unknown name."""
    text = resources.files("batching").joinpath("lua").joinpath(f"{name}.lua").read_text()
    return Script(name, text, hashlib.sha1(text.encode()).hexdigest())


def pipelined(pipe: Any, text: str, keys: Sequence[str], args: Sequence[Any]) -> None:
    """Queue the script ``text`` on a redis-py pipeline as ``EVAL``: a Redis Cluster
    pipeline can neither send ``EVALSHA`` nor load a script a node lacks, and Redis caches
    the script by its hash either way."""
    pipe.execute_command("EVAL", text, len(keys), *keys, *args)
