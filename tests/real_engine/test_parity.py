"""FakeEngine parity: the same scenarios, run against the fake and the real vLLM engine, get the same answers.

One scenario list, each scenario a plain function of an engine-like ``Target`` (``url``, ``api_key``, ``model``,
``lora_dir``, and ``source``: an adapter directory to copy). Each test runs one scenario on both engines, checks the
statuses vLLM answers (test_engine_bodies.py), and compares the two engines' answers: status, content type, body shape
(the keys of the error object, plain text, ...) and the whole body with names and engine-specific folders replaced
by placeholders. File paths under /tmp, /root, ... are *not* normalised here: vLLM rewrites them to ``<path>`` and the
fake must do the same. The fake gets the real engine's settings (exact ``--model`` string, key, max_model_len 256,
max_lora_rank 8, max_loras 4, vocab 1024) and its own resolver directory. Every scenario uses fresh adapter names.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import pytest
import requests

from lora_sampler import (
    AdapterNotReadyError,
    BadRequestError,
    EngineStatusError,
    ModelNotFoundError,
    RetryEvent,
    RetryPolicy,
    SampleOutput,
    SamplerClient,
    SamplingParams,
)
from lora_sampler.testing import FakeEngine

if TYPE_CHECKING:
    from conftest import RealEngine

#: The real engine's limits (vllm_env.ENGINE) and the tiny model's vocabulary.
MAX_MODEL_LEN = 256
MAX_LORA_RANK = 8
MAX_LORAS = 4
VOCAB_SIZE = 1024
#: Seconds an adapter stays invisible in the lag scenario.
LAG = 1.0
#: Short completions keep the engine work per request tiny.
PARAMS = SamplingParams(max_tokens=4)

_names = itertools.count(1)


@dataclass
class Target:
    """One engine as a scenario sees it: where it is, its settings, and a few request helpers.

    Attributes:
        kind: ``"fake"`` or ``"real"``.
        url: Root URL (no ``/v1``).
        api_key: The key the engine requires.
        model: The engine's ``--model`` string (every adapter's base model).
        lora_dir: The resolver directory.
        source: A valid adapter directory to copy (never served from directly).
        fake: The ``FakeEngine`` behind ``url`` (None for the real engine).
        names: Adapter names handed out by ``fresh_name`` (replaced by ``<name-N>`` when answers are compared).
    """

    kind: str
    url: str
    api_key: str
    model: str
    lora_dir: Path
    source: Path
    fake: FakeEngine | None = None
    names: list[str] = field(default_factory=list)
    session: requests.Session = field(default_factory=requests.Session, repr=False)

    def __post_init__(self) -> None:
        self.session.trust_env = False  # loopback only, never through a proxy from the environment

    def fresh_name(self, prefix: str = "parity") -> str:
        """Return an adapter name never used before in this session (the engine never forgets a name)."""
        name = f"{prefix}-{self.kind}-{next(_names)}-{uuid.uuid4().hex[:6]}"
        self.names.append(name)
        return name

    def headers(self, api_key: str | None = None) -> dict[str, str]:
        """Return the auth header for ``api_key`` (the engine's key by default)."""
        return {"Authorization": f"Bearer {api_key or self.api_key}"}

    def complete(
        self, model: str, prompt: Sequence[int] = (1, 2, 3), *, headers: dict[str, str] | None = None, **fields: Any
    ) -> requests.Response:
        """POST ``/v1/completions`` (4 tokens with logprobs and token ids unless ``fields`` say otherwise)."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": 4,
            "logprobs": 1,
            "return_token_ids": True,
        }
        body.update(fields)
        return self.session.post(
            f"{self.url}/v1/completions", json=body, headers=self.headers() if headers is None else headers, timeout=60
        )

    def tokenize(self, model: str, prompt: str, **fields: Any) -> requests.Response:
        """POST ``/tokenize`` (vLLM's tokenizer route, outside ``/v1``)."""
        body = {"model": model, "prompt": prompt, **fields}
        return self.session.post(f"{self.url}/tokenize", json=body, headers=self.headers(), timeout=60)

    def load(self, name: str, path: Path) -> requests.Response:
        """POST ``/v1/load_lora_adapter``."""
        body = {"lora_name": name, "lora_path": str(path)}
        return self.session.post(f"{self.url}/v1/load_lora_adapter", json=body, headers=self.headers(), timeout=60)

    def unload(self, name: str) -> requests.Response:
        """POST ``/v1/unload_lora_adapter``."""
        body = {"lora_name": name}
        return self.session.post(f"{self.url}/v1/unload_lora_adapter", json=body, headers=self.headers(), timeout=60)

    def models(self, api_key: str | None = None) -> requests.Response:
        """GET ``/v1/models``."""
        return self.session.get(f"{self.url}/v1/models", headers=self.headers(api_key), timeout=60)

    def staged_copy(self, name: str, **config: Any) -> Path:
        """Copy ``source`` to a dotted staging folder in ``lora_dir`` with ``config`` merged into its config."""
        staging = self.lora_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(self.source, staging)
        if config:
            path = staging / "adapter_config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        return staging

    def publish(self, name: str, **config: Any) -> Path:
        """Publish a copy of ``source`` as ``name`` atomically (staging folder, then one ``os.rename``)."""
        target = self.lora_dir / name
        os.rename(self.staged_copy(name, **config), target)
        return target

    def publish_late(self, name: str, delay: float) -> Callable[[], None]:
        """Make ``name`` appear after ``delay`` seconds; returns a function that waits for the publication.

        Real engine: a background thread renames a staged copy into place. Fake engine: the copy is published now
        and hidden with ``set_visibility_delay`` (a shared filesystem that lags).
        """
        if self.fake is not None:
            self.fake.set_visibility_delay(name, seconds=delay)
            self.publish(name)
            return lambda: None
        staging = self.staged_copy(name)

        def rename_later() -> None:
            time.sleep(delay)
            os.rename(staging, self.lora_dir / name)

        thread = threading.Thread(target=rename_later, name=f"publish-late-{name}", daemon=True)
        thread.start()
        return thread.join

    def normalise(self, text: str) -> str:
        """Replace this run's names, folders and model string by placeholders (``<path>`` is kept as it is)."""
        replacements = [(str(self.lora_dir), "<lora_dir>"), (str(self.lora_dir.parent), "<workdir>")]
        replacements += [(self.model, "<model>")]
        replacements += [(name, f"<name-{index}>") for index, name in enumerate(self.names)]
        for old, new in sorted(replacements, key=lambda pair: -len(pair[0])):  # longest first: dirs hold names
            text = text.replace(old, new)
        return text


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, comparable across engines: status, content type, body shape and the normalised body."""

    status: int
    content_type: str | None
    shape: tuple[str, ...]
    body: Any


def observe(target: Target, response: requests.Response) -> Answer:
    """Reduce ``response`` to an ``Answer`` (completions keep their keys and counts, not the sampled tokens)."""
    content_type = response.headers.get("content-type")
    if content_type != "application/json":
        return Answer(response.status_code, content_type, ("text",), target.normalise(response.text))
    data = response.json()
    if response.status_code == 200 and "choices" in data:
        choice = data["choices"][0]
        logprobs = choice["logprobs"] or {}
        shape = ("completion", *sorted(data), "choice:", *sorted(choice), "logprobs:", *sorted(logprobs))
        body = {
            "object": data["object"],
            "model": target.normalise(data["model"]),
            "choices": len(data["choices"]),
            "token_ids": len(choice["token_ids"]),
            "token_logprobs": len(logprobs.get("token_logprobs") or ()),
            "prompt_token_ids": choice["prompt_token_ids"],
            "finish_reason": choice["finish_reason"],
            "usage": data["usage"],
            "system_fingerprint": re.sub(r"-[0-9a-f]{8}$", "-<hash8>", str(data["system_fingerprint"])),
            "nulls": sorted(key for key, value in {**data, **choice}.items() if value is None),
            "prompt_logprobs": _prompt_logprobs_shape(choice["prompt_logprobs"], choice["prompt_token_ids"]),
        }
        return Answer(200, content_type, shape, body)
    if response.status_code == 200 and "tokens" in data:  # /tokenize: the shape, not the tokenizer's tokens
        tokens = data["tokens"]
        body = {"count": data["count"] == len(tokens) > 0, "ints": all(isinstance(t, int) for t in tokens)}
        body.update(max_model_len=data["max_model_len"], token_strs=data["token_strs"])
        return Answer(200, content_type, ("tokenize", *sorted(data)), body)
    inner = data.get("error")
    if isinstance(inner, dict):
        normalised = {**inner, "message": target.normalise(str(inner.get("message")))}
        return Answer(response.status_code, content_type, ("error-object", *sorted(inner)), normalised)
    return Answer(response.status_code, content_type, ("top-level", *sorted(data)), data)


def _prompt_logprobs_shape(entries: list[Any] | None, prompt: list[int] | None) -> Any:
    """Reduce vLLM's ``prompt_logprobs`` to its shape: None first, the prompt token's own entry first, its fields."""
    if entries is None:
        return None
    assert prompt is not None
    own_first = [next(iter(entry)) == str(token) for entry, token in zip(entries[1:], prompt[1:])]
    fields = sorted({key for entry in entries[1:] for info in entry.values() for key in info})
    sizes = {len(entry) for entry in entries[1:]}  # k, or k + 1 where the prompt token ranks below the top k
    return {
        "first": entries[0],
        "own_first": all(own_first),
        "k_or_k+1": max(sizes) - min(sizes) <= 1,
        "fields": fields,
    }


def _differences(fake: list[Answer], real: list[Answer]) -> str:
    """Describe where the fake's answers differ from the real ones, field by field."""
    lines = [f"{len(fake)} fake answers, {len(real)} real answers"]
    for index, (mine, theirs) in enumerate(zip(fake, real)):
        for name in ("status", "content_type", "shape", "body"):
            if getattr(mine, name) != getattr(theirs, name):
                lines.append(
                    f"answer {index} {name}:\n  fake: {getattr(mine, name)!r}\n  real: {getattr(theirs, name)!r}"
                )
    return "\n".join(lines)


# -- the scenarios: plain functions of a Target, returning the responses to compare ---------------------------------


def unknown_model(t: Target) -> list[requests.Response]:
    """A name with no directory in the resolver folder."""
    return [t.complete(t.fresh_name())]


def atomic_publish(t: Target) -> list[requests.Response]:
    """An adapter renamed into place in one step serves its first request."""
    name = t.fresh_name()
    t.publish(name)
    return [t.complete(name)]


def non_atomic_publish(t: Target) -> list[requests.Response]:
    """A directory with its config but no weights yet: found but not loadable, and not cached."""
    name = t.fresh_name()
    (t.lora_dir / name).mkdir()
    shutil.copy2(t.source / "adapter_config.json", t.lora_dir / name / "adapter_config.json")
    return [t.complete(name), t.complete(name)]


def zero_byte_config(t: Target) -> list[requests.Response]:
    """An empty adapter_config.json beside the weights: the JSON decoder's text as a 400."""
    name = t.fresh_name()
    (t.lora_dir / name).mkdir()
    shutil.copy2(t.source / "adapter_model.safetensors", t.lora_dir / name / "adapter_model.safetensors")
    (t.lora_dir / name / "adapter_config.json").write_bytes(b"")
    return [t.complete(name)]


def wrong_base_model(t: Target) -> list[requests.Response]:
    """A valid adapter of another base model is ignored by the resolver: the generic 404."""
    name = t.fresh_name()
    t.publish(name, base_model_name_or_path=t.model + "-other")
    return [t.complete(name)]


def rank_above_max(t: Target) -> list[requests.Response]:
    """``r`` 16 above ``--max-lora-rank`` 8: found but not loadable."""
    name = t.fresh_name()
    t.publish(name, r=16)
    return [t.complete(name)]


def load_already_loaded(t: Target) -> list[requests.Response]:
    """Loading a loaded name again, without load_inplace."""
    name = t.fresh_name()
    path = t.publish(name)
    return [t.load(name, path), t.load(name, path)]


def load_missing_path(t: Target) -> list[requests.Response]:
    """Loading from a path that holds no adapter (under /tmp: the message reads ``<path>``)."""
    return [t.load(t.fresh_name(), t.lora_dir.parent / "does-not-exist")]


def load_no_weights(t: Target) -> list[requests.Response]:
    """Loading a directory with a config but no weights: the worker's 500 (the path reads ``<path>``)."""
    name = t.fresh_name()
    (t.lora_dir / name).mkdir()
    shutil.copy2(t.source / "adapter_config.json", t.lora_dir / name / "adapter_config.json")
    return [t.load(name, t.lora_dir / name), t.complete(t.model)]


def unload_unknown(t: Target) -> list[requests.Response]:
    """Unloading a name the engine does not hold."""
    return [t.unload(t.fresh_name())]


def wrong_key(t: Target) -> list[requests.Response]:
    """A wrong key on completions (before the model check) and on the model list."""
    wrong = t.headers("wrong-key")
    return [t.complete(t.model, headers=wrong), t.complete(t.fresh_name(), headers=wrong), t.models("wrong-key")]


def over_length_prompt(t: Target) -> list[requests.Response]:
    """300 prompt ids with max_model_len 256, on the base and on a not-yet-loaded adapter."""
    name = t.fresh_name()
    t.publish(name)
    return [t.complete(t.model, [5] * 300), t.complete(name, [5] * 300)]


def max_tokens_above_max_model_len(t: Target) -> list[requests.Response]:
    """max_tokens 1000 with max_model_len 256."""
    return [t.complete(t.model, max_tokens=1000)]


def token_out_of_vocab(t: Target) -> list[requests.Response]:
    """A prompt id beyond the 1024-token vocabulary."""
    return [t.complete(t.model, [1, 2, 5000])]


def load_unload_success(t: Target) -> list[requests.Response]:
    """Load and unload answer plain text without a content type; the completion between them succeeds."""
    name = t.fresh_name()
    path = t.publish(name)
    return [t.load(name, path), t.complete(name), t.unload(name)]


def tokenize_base_and_unknown(t: Target) -> list[requests.Response]:
    """POST /tokenize for the base model (vLLM's TokenizeResponse) and for an unknown model (vLLM's 404)."""
    return [t.tokenize(t.model, "the model"), t.tokenize(t.fresh_name(), "the model")]


def prompt_logprobs_top_k(t: Target) -> list[requests.Response]:
    """prompt_logprobs=0 and =2: None first, then each prompt token's own entry first (and the top 2)."""
    prompt = [5, 6, 7, 8, 9]
    return [t.complete(t.model, prompt, max_tokens=1, prompt_logprobs=k) for k in (0, 2)]


#: scenario -> the statuses both engines must answer, in order.
SCENARIOS: dict[Callable[[Target], list[requests.Response]], list[int]] = {
    unknown_model: [404],
    atomic_publish: [200],
    non_atomic_publish: [400, 400],
    zero_byte_config: [400],
    wrong_base_model: [404],
    rank_above_max: [400],
    load_already_loaded: [200, 400],
    load_missing_path: [404],
    load_no_weights: [500, 200],
    unload_unknown: [404],
    wrong_key: [401, 401, 401],
    over_length_prompt: [400, 400],
    max_tokens_above_max_model_len: [400],
    token_out_of_vocab: [400],
    load_unload_success: [200, 200, 200],
    tokenize_base_and_unknown: [200, 404],
    prompt_logprobs_top_k: [200, 200],
}


# -- client-level scenarios: SamplerClient against each engine, reduced to a comparable outcome ----------------------


def _raised(action: Callable[[], object]) -> tuple[Any, ...]:
    """Run ``action``; return the error's class, status and attempts (or ``("returned",)``)."""
    try:
        action()
    except EngineStatusError as exc:
        return (type(exc).__name__, exc.status, exc.attempts)
    return ("returned",)


def client_base_model_typo(t: Target, client: SamplerClient, retries: list[RetryEvent]) -> tuple[Any, ...]:
    """A typo in the base model's name raises ModelNotFoundError after one attempt, no retry."""
    outcome = _raised(lambda: client.sample([1, 2, 3], base_model=t.model + "-typo", sampling_params=PARAMS))
    return (*outcome, len(retries))


def client_over_length(t: Target, client: SamplerClient, retries: list[RetryEvent]) -> tuple[Any, ...]:
    """An over-length prompt raises BadRequestError 400 after one attempt, base model and adapter alike."""
    name = t.fresh_name()
    t.publish(name)
    base = _raised(lambda: client.sample([5] * 300, base_model=t.model, sampling_params=PARAMS))
    adapter = _raised(lambda: client.sample([5] * 300, adapter=name, sampling_params=PARAMS))
    return (*base, *adapter, len(retries))


def client_lagging_adapter(t: Target, client: SamplerClient, retries: list[RetryEvent]) -> tuple[Any, ...]:
    """An adapter that becomes visible 1 s late is sampled through retries that all saw the 404."""
    name = t.fresh_name()
    wait = t.publish_late(name, LAG)
    try:
        output = client.sample([1, 2, 3], adapter=name, sampling_params=PARAMS)
    finally:
        wait()
    assert isinstance(output, SampleOutput)
    tokens = [len(sequence.tokens) for sequence in output.sequences]
    causes = {type(event.cause).__name__ for event in retries}
    return ("sampled", tokens, bool(retries), sorted(causes))


#: client scenario -> the outcome both engines must give.
CLIENT_SCENARIOS: dict[Callable[[Target, SamplerClient, list[RetryEvent]], tuple[Any, ...]], tuple[Any, ...]] = {
    client_base_model_typo: (ModelNotFoundError.__name__, 404, 1, 0),
    client_over_length: (BadRequestError.__name__, 400, 1, BadRequestError.__name__, 400, 1, 0),
    client_lagging_adapter: ("sampled", [4], True, [ModelNotFoundError.__name__]),
}


# -- fixtures ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_fake(vllm_engine: RealEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeEngine]:
    """A FakeEngine with the real engine's settings and its own resolver directory (stopped after the module)."""
    lora_dir = tmp_path_factory.mktemp("fake-engine") / "loras"
    lora_dir.mkdir()
    engine = FakeEngine(
        model=vllm_engine.model,
        lora_dir=lora_dir,
        api_key=vllm_engine.api_key,
        max_loras=MAX_LORAS,
        max_lora_rank=MAX_LORA_RANK,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB_SIZE,
    )
    with engine:
        yield engine


@pytest.fixture()
def targets(vllm_engine: RealEngine, parity_fake: FakeEngine) -> Iterator[dict[str, Target]]:
    """Fresh ``Target`` views of both engines for one test (their name lists start empty)."""
    assert parity_fake.lora_dir is not None
    made = {
        "fake": Target(
            "fake",
            parity_fake.url,
            vllm_engine.api_key,
            parity_fake.model,
            Path(parity_fake.lora_dir),
            vllm_engine.adapter_dir,
            fake=parity_fake,
        ),
        "real": Target(
            "real",
            vllm_engine.url,
            vllm_engine.api_key,
            vllm_engine.model,
            vllm_engine.lora_dir,
            vllm_engine.adapter_dir,
        ),
    }
    yield made
    for target in made.values():
        target.session.close()


def test_fake_engine_settings_match_the_real_engine(vllm_engine: RealEngine, parity_fake: FakeEngine) -> None:
    """The fake runs with the real engine's model string, key and limits (what the parity tests rely on)."""
    assert (parity_fake.model, parity_fake.api_key) == (vllm_engine.model, vllm_engine.api_key)
    assert (parity_fake.max_model_len, parity_fake.max_lora_rank, parity_fake.max_loras) == (256, 8, 4)
    assert parity_fake.vocab_size == VOCAB_SIZE
    models = vllm_engine.session.get(f"{vllm_engine.url}/v1/models", headers=vllm_engine.headers(), timeout=10)
    cards = {card["id"]: card for card in models.json()["data"]}
    assert cards[vllm_engine.model]["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=lambda scenario: scenario.__name__)
def test_fake_engine_answers_like_the_real_engine(
    targets: dict[str, Target], scenario: Callable[[Target], list[requests.Response]]
) -> None:
    """One scenario on both engines: the promised statuses, and equal shapes and normalised bodies."""
    answers = {kind: [observe(target, response) for response in scenario(target)] for kind, target in targets.items()}
    for kind, got in answers.items():
        assert [answer.status for answer in got] == SCENARIOS[scenario], (kind, got)
    assert answers["fake"] == answers["real"], _differences(answers["fake"], answers["real"])


@pytest.mark.parametrize("scenario", list(CLIENT_SCENARIOS), ids=lambda scenario: scenario.__name__)
def test_fake_engine_client_outcomes_match_the_real_engine(
    targets: dict[str, Target],
    scenario: Callable[[Target, SamplerClient, list[RetryEvent]], tuple[Any, ...]],
) -> None:
    """One client-level scenario through SamplerClient on both engines: the same, promised outcome."""
    outcomes = {}
    for kind, target in targets.items():
        retries: list[RetryEvent] = []
        policy = RetryPolicy(on_retry=retries.append)
        with SamplerClient(target.url, api_key=target.api_key, lora_base_dir=target.lora_dir, retry=policy) as client:
            outcomes[kind] = scenario(target, client, retries)
    assert outcomes["real"] == CLIENT_SCENARIOS[scenario]
    assert outcomes["fake"] == outcomes["real"]


def test_fake_engine_not_ready_cause_matches_the_real_engine(targets: dict[str, Target]) -> None:
    """A half-published adapter is AdapterNotReadyError on both engines (the 400 the client retries)."""
    causes = {}
    for kind, target in targets.items():
        name = target.fresh_name()
        (target.lora_dir / name).mkdir()
        shutil.copy2(target.source / "adapter_config.json", target.lora_dir / name / "adapter_config.json")
        policy = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.02)
        with SamplerClient(target.url, api_key=target.api_key, lora_base_dir=target.lora_dir, retry=policy) as client:
            causes[kind] = _raised(lambda: client.sample([1, 2, 3], adapter=name, sampling_params=PARAMS))  # noqa: B023
    assert causes["real"] == (AdapterNotReadyError.__name__, 400, 2)
    assert causes["fake"] == causes["real"]
