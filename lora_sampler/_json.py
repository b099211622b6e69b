"""The JSON decoder every engine answer goes through: msgspec's when the ``[fast]`` extra is installed, else stdlib's.

Both give the same value for every document the standard library accepts: the fast decoder is tried first and the
standard library decides whatever it refuses (out-of-range numbers, lone surrogates). Both are strict: ``NaN`` and
``Infinity`` (Python's extension, no JSON) are refused, and so is nesting too deep to decode, as ``ValueError``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Union

Document = Union[bytes, bytearray, memoryview, str]

try:
    import msgspec
except ImportError:  # the fixed dependencies only: the standard library decodes
    msgspec = None  # type: ignore[assignment,unused-ignore]  # needed only where msgspec is installed


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"it holds {name}, which is not JSON")


#: The standard library's decoder, strict: NaN and Infinity never become values.
_STRICT = json.JSONDecoder(parse_constant=_refuse_constant)


def _stdlib_loads(data: Document) -> Any:
    if not isinstance(data, str):
        data = bytes(data)
        data = data.decode(json.detect_encoding(data), "surrogatepass")
    try:
        return _STRICT.decode(data)
    except RecursionError:
        raise ValueError("it is nested too deep to decode") from None


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
        except RecursionError:
            raise ValueError("it is nested too deep to decode") from None

    return fast_loads


#: Decode one JSON document (bytes or text); raises ``ValueError`` when ``json.loads`` does, and for NaN, Infinity
#: or nesting too deep (where ``json.loads`` returns a float or raises ``RecursionError``).
loads: Callable[[Document], Any] = _build()
#: Which decoder ``loads`` tries first: ``"msgspec"`` or ``"json (stdlib)"``.
DECODER_NAME = "json (stdlib)" if msgspec is None else "msgspec"
