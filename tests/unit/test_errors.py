"""The error hierarchy: requests compatibility, classification of vLLM bodies, pickling, no secrets."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import requests

import lora_sampler
from lora_sampler import errors
from lora_sampler.testing import _bodies

ALL_ERROR_CLASSES = [
    getattr(lora_sampler, name)
    for name in lora_sampler.__all__
    if name.endswith("Error") and issubclass(getattr(lora_sampler, name), errors.LoraSamplerError)
]


def fake_response(body: _bodies.VllmBody, url: str = "http://engine.test/v1/completions") -> requests.Response:
    """A requests.Response carrying ``body``, with a request that holds an Authorization header."""
    response = requests.Response()
    response.status_code = body.status
    response._content = body.body
    response.url = url
    response.request = requests.Request("POST", url, headers={"Authorization": "Bearer sk-secret-key"}).prepare()
    return response


@pytest.mark.parametrize("cls", ALL_ERROR_CLASSES, ids=lambda c: c.__name__)
def test_errors_every_class_pickles_and_copies(cls: Any) -> None:
    """Every error class round-trips through pickle and copy with its fields."""
    error = cls("boom", model="m", adapter=True, attempts=3)
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(clone) is cls
        assert (clone.message, clone.model, clone.adapter, clone.attempts) == ("boom", "m", True, 3)
        assert str(clone) == str(error)


def test_errors_sampling_interrupted_is_a_keyboard_interrupt_that_pickles_its_results() -> None:
    """The Ctrl-C error of sample_many stops like Ctrl-C and keeps its partial results through pickle and copy."""
    error = errors.SamplingInterruptedError("stopped", results=["a", None, "c"])
    assert isinstance(error, KeyboardInterrupt) and error.done == 2 and str(error) == "stopped"
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(clone) is errors.SamplingInterruptedError
        assert (clone.message, clone.results, clone.done) == ("stopped", ["a", None, "c"], 2)


def test_errors_status_error_is_an_http_error_with_response() -> None:
    """A status error is a requests.HTTPError with .response, and an OSError (as RequestException is)."""
    response = fake_response(_bodies.engine_dead())
    error = errors.EngineStatusError.from_response(response, model="tiny", adapter=False)
    assert isinstance(error, requests.HTTPError) and isinstance(error, OSError)
    assert error.response is response and error.status == 500
    assert str(error).startswith("POST /v1/completions for base model 'tiny' failed with HTTP 500: EngineCore")


def test_errors_transport_classes_match_requests() -> None:
    """Connection, timeout and connect-timeout errors are the matching requests exceptions."""
    assert issubclass(errors.EngineConnectionError, requests.ConnectionError)
    assert issubclass(errors.EngineTimeoutError, requests.Timeout)
    connect_timeout = errors.EngineConnectTimeoutError("x")
    assert isinstance(connect_timeout, requests.ConnectTimeout)
    assert isinstance(connect_timeout, requests.ConnectionError) and isinstance(connect_timeout, requests.Timeout)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_bodies.model_not_found("a", "base"), errors.ModelNotFoundError),
        (_bodies.model_not_found("a", "base").older(), errors.ModelNotFoundError),
        (_bodies.adapter_not_loadable("a"), errors.AdapterNotReadyError),
        (_bodies.adapter_config_json_error(""), errors.AdapterNotReadyError),
        (_bodies.adapter_config_json_error('{"a": "b'), errors.AdapterNotReadyError),
        (_bodies.adapter_config_json_error('{"a" 1}'), errors.AdapterNotReadyError),
        (_bodies.unauthorized(), errors.AuthenticationError),
        (_bodies.prompt_too_long(256, 300), errors.BadRequestError),
        (_bodies.token_out_of_vocab(5000), errors.BadRequestError),
        (_bodies.retry_later(), errors.InternalServerError),
        (_bodies.route_not_found(), errors.ModelNotFoundError),
    ],
)
def test_errors_classify_vllm_bodies(body: _bodies.VllmBody, expected: type) -> None:
    """Each verbatim vLLM body maps to the class the retry table acts on."""
    error = errors.EngineStatusError.from_response(fake_response(body), model="a", adapter=True)
    assert type(error) is expected
    assert error.engine_message == body.message


def _status_body(status: int, message: str = "refused") -> _bodies.VllmBody:
    return _bodies.error(status, message, "Error")


@pytest.mark.parametrize(
    ("status", "message", "expected"),
    [
        (400, "bad parameter", "BadRequestError"),
        (401, "Unauthorized", "AuthenticationError"),
        (403, "Forbidden", "PermissionDeniedError"),
        (404, "The model `x` does not exist.", "ModelNotFoundError"),
        (422, "field required", "UnprocessableEntityError"),
        (429, "slow down", "RateLimitError"),
        (500, "boom", "InternalServerError"),
        (503, "busy", "InternalServerError"),
        (409, "conflict", "EngineStatusError"),
    ],
)
def test_errors_status_classes_carry_the_openai_sdk_names(status: int, message: str, expected: str) -> None:
    """Each status raises the class the OpenAI SDK names for it, still an EngineStatusError and an HTTPError."""
    error = errors.EngineStatusError.from_response(
        fake_response(_status_body(status, message)), model="a", adapter=False
    )
    assert type(error).__name__ == expected and type(error) is getattr(lora_sampler, expected)
    assert isinstance(error, errors.EngineStatusError) and isinstance(error, requests.HTTPError)
    assert error.status_code == status == error.status


def test_errors_old_meanings_hold_under_the_openai_names() -> None:
    """403 stays an AuthenticationError, a 400 "does not exist" is a ModelNotFoundError and a BadRequestError."""
    forbidden = errors.EngineStatusError.from_response(fake_response(_status_body(403)), model="a", adapter=False)
    assert isinstance(forbidden, errors.AuthenticationError) and isinstance(forbidden, errors.PermissionDeniedError)
    old = _status_body(400, "The model `a` does not exist.")
    error = errors.EngineStatusError.from_response(fake_response(old), model="a", adapter=True)
    assert isinstance(error, errors.ModelNotFoundError) and isinstance(error, errors.BadRequestError)
    not_ready = errors.EngineStatusError.from_response(
        fake_response(_bodies.adapter_not_loadable("a")), model="a", adapter=True
    )
    assert isinstance(not_ready, errors.BadRequestError) and not_ready.status_code == 400
    assert issubclass(errors.ModelNotFoundError, errors.NotFoundError)


def test_errors_status_classes_pickle_with_their_status() -> None:
    """A classified error keeps its class, status and status_code through pickle, without the live response."""
    for status in (400, 401, 403, 404, 422, 429, 500):
        error = errors.EngineStatusError.from_response(fake_response(_status_body(status)), model="a", adapter=False)
        clone = pickle.loads(pickle.dumps(error))
        assert type(clone) is type(error) and clone.status_code == status and clone.response is None


def test_errors_read_router_plain_text_and_401_string_shape() -> None:
    """vllm-router's plain-text 500 and the 401 string shape both give a readable engine message."""
    text = _bodies.VllmBody(500, b"Request failed: error sending request for url (http://127.0.0.1:1/v1/x)", None)
    assert errors.read_engine_message(fake_response(text)).startswith("Request failed: error sending")
    assert errors.read_engine_message(fake_response(_bodies.unauthorized())) == "Unauthorized"


@pytest.mark.parametrize("adapter", [False, True])
def test_errors_an_html_page_is_named_in_one_line_with_the_base_url_fix(adapter: bool) -> None:
    """A server that is not vLLM answers a web page: the error names it by its title in one line (no markup) and
    says to check base_url, not the model name (before: the page's 13 lines and "check the base model name")."""
    page = b"<!DOCTYPE html>\n<html>\n<head>\n<title>404 Not Found</title>\n</head>\n<body>\n<h1>Not Found</h1>\n"
    page += b"<p>The requested URL was not found on this server.</p>\n<hr>\n<address>Apache</address>\n</body></html>\n"
    response = fake_response(_bodies.VllmBody(404, page, "text/html"))
    assert errors.read_engine_message(response) == "an HTML page (404 Not Found)"
    error = errors.EngineStatusError.from_response(response, model="tiny", adapter=adapter)
    text = str(error)
    assert "\n" not in text and "<" not in text and "base_url" in text and "without /v1" in text
    assert "Check the base model name" not in text and "resolver directory" not in text
    other = _bodies.VllmBody(500, b"<oops> not a page", None)  # text that merely starts with a tag stays as it is
    assert errors.read_engine_message(fake_response(other)) == "<oops> not a page"


def test_errors_never_contain_the_api_key() -> None:
    """str(), repr() and pickles of an error never carry the Authorization header's key."""
    error = errors.EngineStatusError.from_response(fake_response(_bodies.unauthorized()), model="m", adapter=False)
    assert error.response.request.headers["Authorization"] == "Bearer sk-secret-key"  # the trap is real
    assert "sk-secret-key" not in str(error) and "sk-secret-key" not in repr(error)
    assert b"sk-secret-key" not in pickle.dumps(error)
    assert "LORA_SAMPLER_API_KEY" in str(error)


def test_errors_long_engine_message_is_truncated() -> None:
    """A huge body (an HTML error page) is cut to a bounded message."""
    body = _bodies.VllmBody(502, b"<html>" + b"x" * 50_000, "text/html")
    error = errors.EngineStatusError.from_response(fake_response(body), model="m", adapter=False)
    assert len(error.engine_message) <= errors.MAX_ENGINE_MESSAGE_CHARS + 3


def test_errors_attempts_appear_in_the_message() -> None:
    """An error stamped with several attempts says so."""
    error = errors.ModelNotFoundError("no such model", model="m", attempts=6)
    assert str(error) == "no such model (gave up after 6 attempts)"


@pytest.mark.parametrize("base", ["tiny-base", "/root/.cache/lora_sampler/tiny-model"])
def test_errors_hint_follows_the_engine_sentence_with_one_period(base: str) -> None:
    """vLLM's 404 ends its sentence with a period (or, for a path alias, with none): the hint adds exactly one."""
    body = _bodies.model_not_found("step-1", base)
    error = errors.EngineStatusError.from_response(fake_response(body), model="step-1", adapter=True)
    assert ".." not in str(error)
    expected_alias = "tiny-base." if base == "tiny-base" else "<path>."
    assert f"Valid aliases: {expected_alias} Check that the adapter is published" in str(error)


def test_errors_fleet_error_keeps_the_replicas_through_pickle() -> None:
    """FleetError's replicas (URL -> answer) survive pickling, so a process pool's caller sees which failed."""
    error = lora_sampler.FleetError("2 of 3", model="a", adapter=True, replicas={"http://r1:8000": "HTTP 404"})
    clone = pickle.loads(pickle.dumps(error))
    assert clone.replicas == {"http://r1:8000": "HTTP 404"} and isinstance(clone, lora_sampler.LoraSamplerError)
