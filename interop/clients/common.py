"""JSON in, JSON lines out: the contract every Python driver keeps with interop/run.py.

Drivers run in other virtualenvs (paho 1.6, amqtt, ...), so this module uses only the
standard library. argv[1] is a JSON object; stdout gets `{"event": "ready"}` once a
subscriber is in place, and exactly one final line with the result.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any


def args() -> dict[str, Any]:
    """The driver's JSON argument."""
    return json.loads(sys.argv[1])


def emit(obj: dict[str, Any]) -> None:
    """Print one JSON line and flush, so the runner sees it at once."""
    print(json.dumps(obj), flush=True)


def ready() -> None:
    """Tell the runner the subscription is in place (publishers may start)."""
    emit({"event": "ready"})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)
