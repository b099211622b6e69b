"""The JSON decoder every engine answer goes through: msgspec's when the ``[fast]`` extra is installed, else stdlib's.

Both give the same value for every document the standard library accepts: the fast decoder is tried first and the
standard library decides whatever it refuses (``NaN``/``Infinity``, out-of-range numbers, lone surrogates).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Union

Document = Union[bytes, bytearray, memoryview, str]

try:
    import msgspec
except ImportError:  # the fixed dependencies only: the standard library decodes
    msgspec = None  # type: ignore[assignment]


def _stdlib_loads(data: Document) -> Any:
    return json.loads(bytes(data) if isinstance(data, memoryview) else data)


def _build() -> Callable[[Document], Any]:
    if msgspec is None:
        return _stdlib_loads
    fast_decode = msgspec.json.Decoder().decode
    refused = msgspec.DecodeError  # ValidationError (out-of-range numbers) is one too

    def fast_loads(data: Document) -> Any:
        try:
            return fast_decode(data)
        except refused:
            return _stdlib_loads(data)  # the standard library's value, or its own error

    return fast_loads


#: Decode one JSON document (bytes or text); raises ``ValueError`` exactly when ``json.loads`` does.
loads: Callable[[Document], Any] = _build()
#: Which decoder ``loads`` tries first: ``"msgspec"`` or ``"json (stdlib)"``.
DECODER_NAME = "json (stdlib)" if msgspec is None else "msgspec"
