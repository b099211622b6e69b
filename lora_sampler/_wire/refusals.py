"""What vLLM and vllm-router say when they refuse, each phrase written once, and the predicates that read them.

Pure functions of an answer's status and message (the engine's words, as ``errors.read_engine_message`` extracts
them): the error classes, the registry, the fleet and the outage hold all ask here. No I/O, no error classes.
"""

from __future__ import annotations

import re

#: vLLM phrases that mean "this model name is not servable (yet)".
NOT_FOUND_PHRASES = ("does not exist", "not found", "cannot be found")
#: vLLM's 400 while the resolver found the adapter folder but could not load it yet.
NOT_LOADED_PHRASE = "was found but could not be loaded"
#: The text of Python's ``json.JSONDecodeError``, which vLLM's resolver surfaces as a 400 while an
#: ``adapter_config.json`` is half-written: "<reason>: line L column C (char N)".
JSON_DECODE_ERROR = re.compile(
    r"^(Expecting|Unterminated string|Invalid control character|Invalid \\|Extra data)[^\n]*"
    r": line \d+ column \d+ \(char \d+\)$"
)
#: vLLM's 400 for a load of a name it already holds: the adapter is loaded.
ALREADY_LOADED = "has already been loaded"
#: vLLM's 404 for an unload of a name it does not hold: the engine has let go of it.
NOT_HELD = "cannot be found"
#: vllm-router's answers when no worker can be reached: (status, how the message starts).
ROUTER_OUTAGE_ANSWERS = (
    (500, "Request failed: error sending request for url"),
    (503, "No available workers"),
)
#: vllm-router's ``GET /health`` while some (not all) workers fail their health checks: it routes around them.
ROUTER_SOME_WORKERS_DOWN = (503, "Unhealthy servers")

#: Statuses vLLM itself never answers: a proxy's or gateway's own word that its upstream (the engine) is away.
GATEWAY_STATUSES = (502, 504)


def is_not_loaded(status: int, message: str) -> bool:
    """Tell whether an answer says the adapter exists but is not loadable yet (the race: retry for adapters)."""
    return status == 400 and (NOT_LOADED_PHRASE in message.lower() or bool(JSON_DECODE_ERROR.match(message)))


def is_not_found(status: int, message: str) -> bool:
    """Tell whether an answer says the model name is unknown: any 404, or a 400 in vLLM's not-found words."""
    if status == 404:
        return True
    lowered = message.lower()
    return status == 400 and any(phrase in lowered for phrase in NOT_FOUND_PHRASES)


def is_already_loaded(message: str) -> bool:
    """Tell whether a refused load says the engine holds the adapter already (for a load: success)."""
    return ALREADY_LOADED in message


def is_not_held(status: int, message: str) -> bool:
    """Tell whether a refused unload says the engine holds no such adapter (it has let go; files may go).

    A 404 in other words (FastAPI's ``{"detail": "Not Found"}``) means runtime updating is off: the engine may
    still reload the adapter from disk, so it does not count.
    """
    return status == 404 and NOT_HELD in message


def is_router_outage(status: int, message: str) -> bool:
    """Tell whether an answer is vllm-router's own "no worker reachable" (every replica away, not a bad request)."""
    text = message.strip()
    return any(status == code and text.startswith(start) for code, start in ROUTER_OUTAGE_ANSWERS)


def is_gateway_failure(status: int, message: str, json_body: bool) -> bool:
    """Tell whether an answer is a proxy's own "my upstream is away": a 502 or 504, or a 503 that is not vLLM's.

    vLLM answers 503 in JSON and vllm-router's own 503 in its words (an outage, read by ``is_router_outage``); any
    other 503 (an HTML page, a bare status) came from a proxy in front of the engine.
    """
    if status in GATEWAY_STATUSES:
        return True
    if status != 503 or json_body:
        return False
    return not is_router_outage(status, message) and not is_router_serving_around(status, message)


def is_router_serving_around(status: int, message: str) -> bool:
    """Tell whether a ``/health`` answer is vllm-router's "some workers are down": it still serves through the rest."""
    code, start = ROUTER_SOME_WORKERS_DOWN
    return status == code and message.strip().startswith(start)
