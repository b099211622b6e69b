"""Single calls through the retry table: ``sample`` or ``chat`` (adapter resolution, the attempt and the proactive
load), and the engine's own tokenizer.

``SampleCalls.run`` turns a ``SampleRequest`` into a ``SampleOutput`` (or the engine's error once the retry table ran
its course). ``tokenize``, ``tokenize_chat`` and ``detokenize`` ask the engine's tokenizer (``POST /tokenize``, a text
or chat messages; ``POST /detokenize``): a harness that counts tokens needs the tokenizer the engine scores with, and
asking the engine needs no tokenizer download. Each goes through the same retry table as a base-model request (there
is no adapter to load before a retry: the tokenizer does not depend on the adapter), never through scoring isolation.
The pieces the retry wrapper calls back into (``_Attempts``) hold no reference to what holds the
wrapper, so a client dropped without ``close()`` is freed by reference counting, not by a garbage-cycle collection.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

from lora_sampler._adapters.fleet import Fleet
from lora_sampler._adapters.loads import AdapterLoadCoordinator
from lora_sampler._adapters.registry import AdapterRegistry
from lora_sampler._client.isolation import ModelIsolation
from lora_sampler._client.outage import PromptLogprobFailures, is_outage, probe_timeout
from lora_sampler._transport.connections import is_cancelled
from lora_sampler._transport.exchange import new_id
from lora_sampler._transport.http import EngineTransport
from lora_sampler._wire.answers import text_of, tokens_of
from lora_sampler._wire.messages import PROMPT_LOGPROBS_FIELD, load_adapter_body
from lora_sampler._wire.refusals import is_router_serving_around
from lora_sampler._wire.routes import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    DETOKENIZE_PATH,
    HEALTH_PATH,
    LOAD_ADAPTER_PATH,
    MODELS_PATH,
    TOKENIZE_PATH,
)
from lora_sampler.errors import (
    EngineError,
    EngineProtocolError,
    EngineStatusError,
    ModelNotFoundError,
    RequestCancelledError,
)
from lora_sampler.retry import RetryPolicy, is_adapter_race, make_retrying
from lora_sampler.types import Adapter, Message, SampleOutput, SampleRequest, Timeout, outputs_from_batch, prompt_list

logger = logging.getLogger(__name__)

#: What one prompt of a batch gets: its output, or the error for it alone.
Outcome = Union[SampleOutput, EngineError]


@dataclass
class _Call:
    """One call as the retry glue sees it (no prompt text is logged from here): a completion, or a tokenizer request
    (``path``; scoring isolation admits completions only)."""

    model: str
    is_adapter: bool
    session_id: str
    payload: Dict[str, Any]
    started: float
    load_path: Optional[str]
    parse: Callable[[Any], Any]
    path: str = COMPLETIONS_PATH
    timeout: Optional[Timeout] = None
    prompts: int = 1


class _Attempts:
    """What the retry wrapper calls: one attempt, and the proactive load before a wait (see docs/guides/retries.md)."""

    def __init__(
        self,
        transport: EngineTransport,
        fleet: Optional[Fleet],
        loads: AdapterLoadCoordinator,
        load_timeout: float,
        isolation: ModelIsolation,
    ):
        self._transport = transport
        self._fleet = fleet
        self._loads = loads
        self._load_timeout = load_timeout
        self._isolation = isolation
        #: Retries so far (each failed attempt the table retries; progress bars show them).
        self.retries = 0
        self._retries_lock = threading.Lock()

    def attempt(self, call: _Call) -> Any:
        """Send exactly one completion request for ``call``; once its fan-out is cancelled, raise instead of retrying.

        Raises:
            RequestCancelledError: the request's fan-out was cancelled (its connection was shut down).
        """
        try:
            return self._send(call)
        except EngineError as error:
            if is_cancelled():  # a shut-down connection, not the engine: never retried
                raise RequestCancelledError(
                    "abandoned in flight: its fan-out was cancelled", model=call.model, adapter=call.is_adapter
                ) from error
            raise

    def _send(self, call: _Call) -> Any:
        """Send the one POST of ``call``: one prompt, or a prompt list (``prompts`` of them) for a batch.

        A completion is admitted by scoring isolation; a batched scoring request is a scoring request: it is admitted
        as one (``ModelIsolation``). A tokenizer request is not.
        """
        if is_cancelled():
            raise RequestCancelledError(
                "not sent: its fan-out was cancelled", model=call.model, adapter=call.is_adapter
            )
        completion = call.path in (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH)
        admission = self._isolation.admit(call.model, PROMPT_LOGPROBS_FIELD in call.payload) if completion else None
        with admission or contextlib.nullcontext():
            return self._transport.post_json(
                call.path,
                call.payload,
                model=call.model,
                adapter=call.is_adapter,
                session_id=call.session_id,
                timeout=call.timeout,
                parse=call.parse,
            )

    def before_retry(self, call: _Call, error: EngineError, attempt: int) -> None:
        """Count the retry; send the proactive load, shared by racing threads (on a fleet, reconcile every replica)."""
        with self._retries_lock:
            self.retries += 1
        if not call.is_adapter or call.load_path is None or is_cancelled():
            return
        if self._fleet is not None:
            self._fleet.reconcile(call.model, call.load_path)
        else:
            path = call.load_path
            self._loads.load_if_due(call.model, attempt, lambda: self.send_load(call.model, path, call.session_id))

    def send_load(self, name: str, path: str, session_id: str) -> None:
        """Ask the engine to load the adapter from ``path``; best-effort, so every answer and failure is only logged."""
        try:
            self._transport.post_adapter_command(
                LOAD_ADAPTER_PATH, name, load_adapter_body(name, path), session_id, self._load_timeout
            )
        except EngineError as exc:
            # 400 "already been loaded"; 404 runtime updating off or not visible yet; no answer.
            logger.debug("Proactive load of %r did not load it: %s", name, exc)
            return
        logger.debug("Proactive load of %r succeeded", name)


class SampleCalls:
    """Runs single requests: resolves the adapter, retries through the race, keeps the registry's counts.

    Args:
        transport: The engine transport.
        registry: The client's adapter registry (resolution, publish-once, in-flight counts for lineages).
        fleet: The replicas to reconcile after a retriable adapter failure, or None for the one engine.
        retry: The retry policy.
        mix_adapters: Let scoring requests share the engine with other models' requests (``ModelIsolation``).
    """

    def __init__(
        self,
        transport: EngineTransport,
        registry: AdapterRegistry,
        fleet: Optional[Fleet],
        retry: RetryPolicy,
        mix_adapters: bool = False,
    ):
        self._transport = transport
        self._registry = registry
        self._fleet = fleet
        self.loads = AdapterLoadCoordinator(episode_gap=2 * retry.max_delay + retry.load_timeout)
        #: The client's scoring isolation: every completion attempt is admitted by it.
        self.isolation = ModelIsolation(mix_adapters=mix_adapters)
        attempts = self._attempts = _Attempts(transport, fleet, self.loads, retry.load_timeout, self.isolation)
        #: The last 500 answered to a prompt-logprobs request (an outage right after names it as the likely cause).
        self.prompt_logprob_failures = PromptLogprobFailures()
        #: Settings (``_settings_of``) found refused request-wide, with the words of that refusal (``_confined``).
        self.request_wide: Dict[str, Tuple[str, Optional[int], str]] = {}
        self._retrying = make_retrying(retry, attempts.attempt, attempts.before_retry)

    @property
    def retries(self) -> int:
        """How many times these calls were retried so far (what a progress bar shows)."""
        return self._attempts.retries

    def run(self, request: SampleRequest) -> SampleOutput:
        """Run one ``SampleRequest`` through the retry table and return its output."""
        output: SampleOutput = self._counted(self._call_of([request]), request)
        return output

    def _call_of(self, requests: Sequence[SampleRequest]) -> _Call:
        """The call that sends ``requests``: one, or several differing only in their prompt, as a prompt list."""
        first = requests[0]
        model, load_path = self._model_of(first)
        payload = self._payload(first, model)
        parse: Callable[[Any], Any]
        if len(requests) == 1:
            parse = lambda body: SampleOutput.from_json(body, first, model=model)  # noqa: E731
        else:
            payload["prompt"] = prompt_list(requests)
            parse = lambda body: outputs_from_batch(body, requests, model=model)  # noqa: E731
        path = CHAT_COMPLETIONS_PATH if first.is_chat else COMPLETIONS_PATH
        adapter, session = first.adapter is not None, first.session_id or new_id()
        return _Call(
            model, adapter, session, payload, time.monotonic(), load_path, parse, path, first.timeout, len(requests)
        )

    def run_many(self, requests: Sequence[SampleRequest]) -> List[Outcome]:
        """Run requests that differ only in their prompt as one ``/v1/completions`` with a prompt list.

        The request goes through the retry table as a whole (the adapter race, transport failures). A failure that
        may belong to some of its prompts only (``_is_confinable``: a 400, 413, 422 or 500, or an answer that does not
        fit as a whole) is confined to them (``_confined``): the others are answered.

        Returns:
            Per request, in order: its output, or the error for its prompt alone (a refusal, or its part of the
            answer not fitting, as ``EngineProtocolError``).

        Raises:
            EngineError: what failed the request as a whole once the retry table ran its course (every prompt's):
                an outage, the adapter race given up, a 429/503, any other status.
        """
        answer = self._attempt(requests)
        return self._confined(requests, answer) if isinstance(answer, EngineError) else answer

    def _attempt(self, requests: Sequence[SampleRequest]) -> Union[List[Outcome], EngineError]:
        """Send ``requests`` as one request: per prompt its outcome, or the failure of the whole if confinable.

        Raises:
            EngineError: a failure that is not confinable (it is every prompt's).
        """
        try:
            return [self.run(requests[0])] if len(requests) == 1 else self._together(requests)
        except EngineError as error:
            if not _is_confinable(error):
                raise
            return error

    def _together(self, requests: Sequence[SampleRequest]) -> List[Outcome]:
        """Send several prompts as one request through the retry table; per prompt, its output or its part's error."""
        call = self._call_of(requests)
        parts: List[Union[SampleOutput, ValueError]] = self._counted(call, requests[0])
        return [self._part_error(part, call) if isinstance(part, ValueError) else part for part in parts]

    def _confined(self, requests: Sequence[SampleRequest], error: EngineError) -> List[Outcome]:
        """Give a batched request's failure to the prompts it belongs to; answer the others.

        The first prompt is sent alone. If it fails with the same words (status and message), the rest is sent as one
        request: failing with them too, the refusal is request-wide (a bad parameter): every prompt's, in three
        requests, and remembered for these settings, so a later batch failing so is not split again. Otherwise the
        rest is split in halves until each failure has its own prompt (``_halves``).
        """
        if len(requests) == 1:
            return [error]
        settings = self._settings_of(requests[0])
        if self.request_wide.get(settings) == _words(error):
            return [error] * len(requests)
        first = self._attempt(requests[:1])
        if not (isinstance(first, EngineError) and _words(first) == _words(error)):
            return (first if isinstance(first, list) else [first]) + self._halves(requests[1:])
        rest = self._attempt(requests[1:])
        if not isinstance(rest, EngineError):
            return [first, *rest]
        if _words(rest) != _words(error):
            return [first, *(self._halves(requests[1:]) if len(requests) > 2 else [rest])]
        if len(self.request_wide) >= _REMEMBERED_SETTINGS:
            self.request_wide.clear()  # a bound, not a cache policy: few settings refuse request-wide
        self.request_wide[settings] = _words(error)
        return [first, *[rest] * (len(requests) - 1)]

    def _halves(self, requests: Sequence[SampleRequest]) -> List[Outcome]:
        """Send each half of ``requests`` as one request and split a half that fails again, until each failure has
        its own prompt. Every part is sent: a failure need not come again, nor show in a smaller request."""
        outcomes: List[Outcome] = []
        middle = len(requests) // 2
        for part in (requests[:middle], requests[middle:]):
            answer = self._attempt(part) if part else []
            if not isinstance(answer, EngineError):
                outcomes += answer
            elif len(part) == 1:
                outcomes.append(answer)
            else:
                outcomes += self._halves(part)
        return outcomes

    def _settings_of(self, request: SampleRequest) -> str:
        """What a batch sends besides its prompts (the model and every body field), as a key for ``request_wide``."""
        model, _ = self._model_of(request)
        payload = self._payload(request, model)
        payload["prompt"] = isinstance(request.prompt, str)  # texts and token ids are checked apart by vLLM
        return json.dumps(payload, sort_keys=True, default=str)

    def _model_of(self, request: SampleRequest) -> Tuple[str, Optional[str]]:
        """Return the model name a request is sent to, and the engine's path to load it from (adapters only)."""
        if request.adapter is None:
            return str(request.base_model), None
        adapter = self._registry.resolve(request.adapter)
        return adapter.name, self._registry.engine_path(adapter)

    def _counted(self, call: _Call, request: SampleRequest) -> Any:
        """Run ``call`` through the retry table, counting it as in flight for its adapter (lineage retirement).

        A 5xx to a prompt-logprobs request is noted (see ``outage``); an adapter the race gave up on is named.
        """
        if call.is_adapter:
            self._registry.request_started(call.model)
        served = False
        try:
            output = self._retrying(call)
            served = True
        except EngineStatusError as error:
            if error.status >= 500 and request.wants_prompt_logprobs:
                self.prompt_logprob_failures.note(error)
            if call.is_adapter and isinstance(error, ModelNotFoundError):
                self._name_the_folder(error)
            raise
        finally:
            if call.is_adapter:
                self._registry.request_finished(call.model, served=served)
        if call.is_adapter:
            self.loads.forget(call.model)
        return output

    def _part_error(self, problem: ValueError, call: _Call) -> EngineProtocolError:
        """The error of one prompt whose part of a batched answer does not fit."""
        return EngineProtocolError(
            f"POST {COMPLETIONS_PATH} (model {call.model!r}, {call.prompts} prompts in one request): the engine at "
            f"{self._transport.base_url} answered with a part that does not fit: {problem}",
            model=call.model,
            adapter=call.is_adapter,
        )

    def _payload(self, request: SampleRequest, model: str) -> Dict[str, Any]:
        """The request's body; ``max_tokens=None`` becomes the engine's context length, which vLLM clamps to the
        room the prompt leaves (vLLM 0.32 reads ``"max_tokens": null`` as its default, 16)."""
        payload = request.to_payload(model)
        if "max_tokens" in payload and payload["max_tokens"] is None:
            context = self._registry.max_model_len()
            if context is None:
                del payload["max_tokens"]
            else:
                payload["max_tokens"] = context
        return payload

    def _name_the_folder(self, error: ModelNotFoundError) -> None:
        """Once the race gave up on an adapter whose folder is in ``lora_base_dir``, name that folder as the fix."""
        fix = self._registry.unwatched_folder_fix(str(error.model))
        if fix:
            error.message = error.message.replace(ModelNotFoundError.hint(True), fix)
            error.args = (error.message,)

    def tokenize(
        self, text: str, model: str, *, add_special_tokens: bool, session_id: Optional[str] = None
    ) -> Tuple[int, ...]:
        """Return the engine's token ids of ``text`` (with the specials its tokenizer adds, if asked)."""
        payload = {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}
        return cast(Tuple[int, ...], self._tokenizer_call(TOKENIZE_PATH, model, payload, tokens_of, session_id))

    def tokenize_chat(
        self, messages: Sequence[Message], model: str, *, add_generation_prompt: bool, continue_final_message: bool
    ) -> Tuple[int, ...]:
        """Return the token ids of ``messages`` rendered by the engine's chat template (vLLM's chat ``/tokenize``)."""
        payload = {
            "model": model,
            "messages": [dict(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        return cast(Tuple[int, ...], self._tokenizer_call(TOKENIZE_PATH, model, payload, tokens_of, None))

    def detokenize(self, tokens: Sequence[int], model: str) -> str:
        """Return the text of ``tokens`` as the engine's tokenizer decodes them (special tokens kept as text)."""
        payload = {"model": model, "tokens": list(tokens)}
        return cast(str, self._tokenizer_call(DETOKENIZE_PATH, model, payload, text_of, None))

    def _tokenizer_call(
        self, path: str, model: str, payload: Dict[str, Any], parse: Callable[[Any], Any], session: Optional[str]
    ) -> Any:
        """One tokenizer request through the retry table, as a base-model request."""
        return self._retrying(_Call(model, False, session or new_id(), payload, time.monotonic(), None, parse, path))

    def preload(self, adapter: Adapter) -> None:
        """Send one load request for ``adapter`` (best-effort, never admitted by the isolation; a fleet has it)."""
        path = self._registry.engine_path(adapter)
        if self._fleet is not None or path is None:
            return
        self._attempts.send_load(adapter.name, path, new_id())

    def probe(self) -> None:
        """One readiness probe with a probe's timeout (``probe_timeout``): ``GET /health``, then ``GET /v1/models``.

        A server without ``/health`` (404), and a router whose ``/health`` says some workers are down (it routes
        around them), go on to ``/v1/models``: that a replica of a fleet is away is no outage of the fleet.
        """
        timeout = probe_timeout(self._transport.timeout)
        try:
            self._transport.get_text(HEALTH_PATH, timeout=timeout)
        except EngineStatusError as exc:
            if exc.status != 404 and not is_router_serving_around(exc.status, exc.engine_message):
                raise
        self._transport.get_json(MODELS_PATH, timeout=timeout)


#: Statuses of a failure that may belong to some prompts of a request only, once the retry table gave up: a prompt
#: refused (400, 422), a body over a proxy's size limit (413), an engine failing on one prompt (500).
_CONFINABLE_STATUSES = (400, 413, 422, 500)
#: At most this many settings are remembered as refused request-wide (``SampleCalls.request_wide``).
_REMEMBERED_SETTINGS = 64


def _is_confinable(error: EngineError) -> bool:
    """Tell whether a batched request's failure may belong to some of its prompts only (so splitting it helps).

    A confinable status (not the adapter race, which the retry table owns, nor the router's outage 500, which the
    outage hold owns), or an answer that does not fit as a whole (a NaN, another prompt's echo, too few choices).
    429/503 and transport failures are the whole request's.
    """
    if isinstance(error, EngineProtocolError):
        return True
    if not isinstance(error, EngineStatusError) or error.status not in _CONFINABLE_STATUSES:
        return False
    return not is_adapter_race(error) and not is_outage(error)


def _words(error: EngineError) -> Tuple[str, Optional[int], str]:
    """What a failure says, without what differs between requests (an answer's excerpt): its kind, status, words."""
    if isinstance(error, EngineStatusError):
        return type(error).__name__, error.status, error.engine_message
    protocol = cast(EngineProtocolError, error)  # the only other confinable kind
    return type(error).__name__, protocol.status, protocol.message.replace(f"body starts {protocol.body_excerpt!r}", "")
