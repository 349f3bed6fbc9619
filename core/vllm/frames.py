"""Finding vLLM's objects from the frames that call into the connector.

Some of what kvpush needs from vLLM is not handed to a connector: the KV transfer
config whose extra config vLLM asks about, a worker's step queue, the engine's
request queue. Each is the `self` of a frame further up the stack when vLLM calls
us, so we look there once, at set-up, and do without it if vLLM's shape differs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def find_caller(test: Callable[[Any], bool]) -> Any | None:
    """The `self` of the nearest frame up the stack that passes `test`, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and test(owner):
            return owner
        frame = frame.f_back
    return None
