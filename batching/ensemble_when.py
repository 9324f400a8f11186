"""A conditional ensemble step's ``when``: ``<tensor> <op> <number>``, e.g. ``count > 0``.

The step runs when some element of the tensor (an ensemble input or an earlier step's
output) compares true; docs/configuration.md#ensembles has the form.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le,
    ">": operator.gt, "<": operator.lt,
}
_FORM = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(==|!=|>=|<=|>|<)\s*([-+]?[\d.]+(?:[eE][-+]?\d+)?)\s*")


@dataclass(frozen=True, slots=True)
class Condition:
    tensor: str
    op: str
    value: float

    def holds(self, array: npt.NDArray[Any]) -> bool:
        """Whether some element of ``array`` compares true (none: an empty tensor)."""
        return bool(np.any(_OPS[self.op](array, self.value)))

    def describe(self) -> str:
        return f"{self.tensor} {self.op} {self.value:g}"


def read_condition(text: str) -> Condition:
    """``<tensor> <op> <number>``; raises ValueError saying the form."""
    match = _FORM.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not '<tensor> <op> <number>' (op: "
                         f"{' '.join(_OPS)})")
    try:
        value = float(match.group(3))
    except ValueError:
        raise ValueError(f"{match.group(3)!r} is not a number") from None
    return Condition(match.group(1), match.group(2), value)
