"""One ``sample`` or ``chat`` call through the retry table: adapter resolution, the attempt and the proactive load.

``SampleCalls.run`` turns a ``SampleRequest`` into a ``SampleOutput`` (or the engine's error once the retry table ran
its course). The pieces the retry wrapper calls back into (``_Attempts``) hold no reference to what holds the
wrapper, so a client dropped without ``close()`` is freed by reference counting, not by a garbage-cycle collection.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

from lora_sampler._adapters.fleet import Fleet
from lora_sampler._adapters.loads import AdapterLoadCoordinator
from lora_sampler._adapters.registry import AdapterRegistry
from lora_sampler._client.isolation import ModelIsolation
from lora_sampler._client.outage import PromptLogprobFailures
from lora_sampler._client.progress import RetryCounter
from lora_sampler._transport.cancel import is_cancelled
from lora_sampler._transport.http import EngineTransport, Timeout, new_id
from lora_sampler._wire.messages import PROMPT_LOGPROBS_FIELD, load_adapter_body
from lora_sampler._wire.routes import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    HEALTH_PATH,
    LOAD_ADAPTER_PATH,
    MODELS_PATH,
)
from lora_sampler.errors import EngineError, EngineProtocolError, EngineStatusError, RequestCancelledError
from lora_sampler.retry import RetryHook, RetryPolicy, is_adapter_race, make_retrying
from lora_sampler.types import Adapter, SampleOutput, SampleRequest, outputs_from_batch, prompt_list

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    """One ``sample`` call as the retry glue sees it (no prompt text is logged from here)."""

    model: str
    is_adapter: bool
    session_id: str
    payload: Dict[str, Any]
    started: float
    load_path: Optional[str]
    parse: Callable[[Any], Any]
    is_chat: bool = False
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
        """Send the one completion POST of ``call``: one prompt, or a prompt list (``prompts`` of them) for a batch.

        A batched scoring request is a scoring request: it is admitted as one (``ModelIsolation``).
        """
        if is_cancelled():
            raise RequestCancelledError(
                "not sent: its fan-out was cancelled", model=call.model, adapter=call.is_adapter
            )
        with self._isolation.admit(call.model, PROMPT_LOGPROBS_FIELD in call.payload):
            return self._transport.post_json(
                CHAT_COMPLETIONS_PATH if call.is_chat else COMPLETIONS_PATH,
                call.payload,
                model=call.model,
                adapter=call.is_adapter,
                session_id=call.session_id,
                timeout=call.timeout,
                parse=call.parse,
            )

    def before_retry(self, call: _Call, error: EngineError, attempt: int) -> None:
        """Send the proactive load, shared by racing threads; on a fleet, reconcile every replica instead."""
        if not call.is_adapter or call.load_path is None or is_cancelled():
            return
        if self._fleet is not None:
            self._fleet.reconcile(call.model, call.load_path)
        else:
            path = call.load_path
            self._loads.load_if_due(call.model, attempt, lambda: self.send_load(call, path))

    def send_load(self, call: _Call, path: str) -> None:
        """Ask the engine to load the adapter from ``path``; best-effort, so every answer and failure is only logged."""
        payload = load_adapter_body(call.model, path)
        try:
            self._transport.post_adapter_command(
                LOAD_ADAPTER_PATH, call.model, payload, call.session_id, self._load_timeout
            )
        except EngineError as exc:
            # 400 "already been loaded"; 404 runtime updating off or not visible yet; no answer.
            logger.debug("Proactive load of %r did not load it: %s", call.model, exc)
            return
        logger.debug("Proactive load of %r succeeded", call.model)


def _no_parse(body: Any) -> SampleOutput:
    raise AssertionError("a load request's answer is plain text, never parsed as a completion")  # pragma: no cover


class SampleCalls:
    """Runs single requests: resolves the adapter, retries through the race, keeps the registry's counts.

    Args:
        transport: The engine transport.
        registry: The client's adapter registry (resolution, publish-once, in-flight counts for lineages).
        fleet: The replicas to reconcile after a retriable adapter failure, or None for the one engine.
        retry: The retry policy.
        isolation: Keeps scoring requests apart from other models' requests (every attempt is admitted by it).
    """

    def __init__(
        self,
        transport: EngineTransport,
        registry: AdapterRegistry,
        fleet: Optional[Fleet],
        retry: RetryPolicy,
        isolation: Optional[ModelIsolation] = None,
    ):
        self._transport = transport
        self._registry = registry
        self._fleet = fleet
        self.loads = AdapterLoadCoordinator(episode_gap=2 * retry.max_delay + retry.load_timeout)
        #: The client's scoring isolation.
        self.isolation = isolation if isolation is not None else ModelIsolation()
        attempts = self._attempts = _Attempts(transport, fleet, self.loads, retry.load_timeout, self.isolation)
        #: Retries of this client's calls so far (progress bars show them).
        self.retries = RetryCounter()
        #: The last 500 answered to a prompt-logprobs request (an outage right after names it as the likely cause).
        self.prompt_logprob_failures = PromptLogprobFailures()
        counting = dataclasses.replace(
            retry, on_retry=(*cast(Tuple[RetryHook, ...], retry.on_retry), self.retries.hook)
        )
        self._retrying = make_retrying(counting, attempts.attempt, attempts.before_retry)

    def run(self, request: SampleRequest) -> SampleOutput:
        """Run one ``SampleRequest`` through the retry table and return its output."""
        model, load_path = self._model_of(request)
        call = _Call(
            model=model,
            is_adapter=request.adapter is not None,
            session_id=request.session_id or new_id(),
            payload=self._payload(request, model),
            started=time.monotonic(),
            load_path=load_path,
            parse=lambda body: SampleOutput.from_json(body, request, model=model),
            is_chat=request.is_chat,
            timeout=request.timeout,
        )
        output: SampleOutput = self._counted(call, request)
        return output

    def run_many(self, requests: Sequence[SampleRequest]) -> List[Union[SampleOutput, EngineError]]:
        """Run requests that differ only in their prompt as one ``/v1/completions`` with a prompt list.

        The request goes through the retry table as a whole (the adapter race, transport failures). A 400 for the
        whole request (one prompt too long, a token out of vocabulary) is split in halves, again and again, so that
        only the prompts it is about get it; the others are answered.

        Returns:
            Per request, in order: its output, or the error for its prompt alone (that 400, or its part of the
            answer not fitting, as ``EngineProtocolError``).

        Raises:
            EngineError: what failed the request as a whole once the retry table ran its course (every prompt's).
        """
        if len(requests) == 1:
            try:
                return [self.run(requests[0])]
            except EngineStatusError as error:
                if not _is_about_prompts(error):
                    raise
                return [error]
        first = requests[0]
        model, load_path = self._model_of(first)
        payload = self._payload(first, model)
        payload["prompt"] = prompt_list(requests)
        call = _Call(
            model=model,
            is_adapter=first.adapter is not None,
            session_id=first.session_id or new_id(),
            payload=payload,
            started=time.monotonic(),
            load_path=load_path,
            parse=lambda body: outputs_from_batch(body, requests, model=model),
            timeout=first.timeout,
            prompts=len(requests),
        )
        try:
            parts: List[Union[SampleOutput, ValueError]] = self._counted(call, first)
        except EngineStatusError as error:
            if not _is_about_prompts(error):
                raise
            half = len(requests) // 2  # a refusal about some prompt: find which, in halves
            return self.run_many(requests[:half]) + self.run_many(requests[half:])
        return [self._part_error(part, call) if isinstance(part, ValueError) else part for part in parts]

    def _model_of(self, request: SampleRequest) -> Tuple[str, Optional[str]]:
        """Return the model name a request is sent to, and the engine's path to load it from (adapters only)."""
        if request.adapter is None:
            return str(request.base_model), None
        adapter = self._registry.resolve(request.adapter)
        return adapter.name, self._registry.engine_path(adapter)

    def _counted(self, call: _Call, request: SampleRequest) -> Any:
        """Run ``call`` through the retry table, counting it as in flight for its adapter (lineage retirement)."""
        if not call.is_adapter:
            return self._attempted(call, request)
        model = call.model
        self._registry.request_started(model)
        served = False
        try:
            output = self._attempted(call, request)
            served = True
        finally:
            self._registry.request_finished(model, served=served)
        self.loads.forget(model)
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

    def _attempted(self, call: _Call, request: SampleRequest) -> Any:
        """The call through the retry table; a 5xx to a prompt-logprobs request is noted (see ``outage``)."""
        try:
            return self._retrying(call)
        except EngineStatusError as error:
            if error.status >= 500 and request.wants_prompt_logprobs:
                self.prompt_logprob_failures.note(error)
            raise

    def preload(self, adapter: Adapter) -> None:
        """Send one load request for ``adapter`` (best-effort, never admitted by the isolation; a fleet has it)."""
        path = self._registry.engine_path(adapter)
        if self._fleet is not None or path is None:
            return
        self._attempts.send_load(_Call(adapter.name, True, new_id(), {}, time.monotonic(), path, _no_parse), path)

    def probe(self, timeout: Tuple[float, float]) -> None:
        """One readiness probe: ``GET /health`` (skipped when the server has none), then ``GET /v1/models``."""
        try:
            self._transport.get_text(HEALTH_PATH, timeout=timeout)
        except EngineStatusError as exc:
            if exc.status != 404:
                raise
        self._transport.get_json(MODELS_PATH, timeout=timeout)


#: Statuses of a refusal that may concern some prompts of a request only (413: a proxy's body size limit).
_PROMPT_REFUSALS = (400, 413)


def _is_about_prompts(error: EngineStatusError) -> bool:
    """Tell whether a refusal of a batched request may concern only some of its prompts (so splitting it helps)."""
    return error.status in _PROMPT_REFUSALS and not is_adapter_race(error)
