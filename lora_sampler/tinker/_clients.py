"""Tinker's ``ServiceClient`` and ``SamplingClient`` over a ``SamplerClient`` and your own vLLM engine.

``SamplingClient`` is a ``tinker.SamplingClient`` whose calls go to the engine through the client's sampling path:
the adapter is published on first use, every request rides the retry table and the adapter-load race, waits out an
outage when ``max_outage`` is set, and is cancelled by Ctrl-C. ``ServiceClient`` makes them, as Tinker's does. A
``SamplingClient`` pickles the client's options without the API key (a child process reads the key from
``$LORA_SAMPLER_API_KEY``); ``TINKER_API_KEY`` is never read or sent.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import pickle
import threading
from typing import Any, Dict, Optional, Tuple, Union

import tinker
from tinker.lib.public_interfaces import AwaitableConcurrentFuture

from lora_sampler._client.client import SamplerClient
from lora_sampler._client.outage import OutageHook
from lora_sampler.tinker import _convert
from lora_sampler.tinker._future import TinkerFuture
from lora_sampler.types import Adapter, AdapterSpec, SampleRequest

#: What ``tokenizer=`` takes: a tokenizer object (returned as is), or a local tokenizer folder.
TokenizerSpec = Union[None, str, "os.PathLike[str]", Any]


def _unsupported(argument: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{argument} is not supported by lora_sampler.tinker: {why}")


class _ProcessClients:
    """One ``SamplerClient`` per pickled client in a process, for sampling clients unpickled there; closed at exit.

    The key is the client's pickle (its options, never the API key: ``SamplerClient.__reduce__``), so every copy of
    sampling clients over one client shares one client here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: Dict[Tuple[int, bytes], SamplerClient] = {}
        atexit.register(self.close)

    def get(self, pickled: bytes) -> SamplerClient:
        """This process's client for a pickled one (made on first use)."""
        key = (os.getpid(), pickled)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = pickle.loads(pickled)  # noqa: S301  (our own client's pickle)
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close(wait=False)


_PROCESS_CLIENTS = _ProcessClients()


class SamplingClient(tinker.SamplingClient):  # type: ignore[misc]
    """A ``tinker.SamplingClient`` that samples one adapter (or the base model) on your own vLLM engine.

    Made by ``ServiceClient.create_sampling_client``, or directly over a ``SamplerClient`` you hold. Every call is
    one request through the client (retry table, adapter race, outage hold, Ctrl-C); the futures are both
    ``concurrent.futures.Future`` and awaitable, and resolve to Tinker's own types.

    Args:
        client: The ``SamplerClient`` to send through (not closed by this object).
        model_path: Anything ``adapter=`` takes: a checkpoint archive or folder (local or ``s3://``), an
            ``Adapter``, or a published adapter name; published on first use. None samples the base model.
        base_model: The engine's base model name, when ``model_path`` is None (then it is what is sampled); with a
            ``model_path``, only what ``get_base_model()`` answers. None with no ``model_path`` samples the
            engine's first served base model.
        tokenizer: What ``get_tokenizer()`` returns: a tokenizer object, or a local tokenizer folder; None loads it
            from the engine's model folder when this machine can read it.
        max_outage: Seconds each call waits out an engine outage (0: fail at once), as ``SamplerClient.imap``.
        on_outage: Called with an ``OutageEvent`` while the engine is away.
    """

    def __init__(
        self,
        client: SamplerClient,
        *,
        model_path: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        tokenizer: TokenizerSpec = None,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
    ):
        if not isinstance(client, SamplerClient):
            raise TypeError(f"client must be a lora_sampler.SamplerClient, got {type(client).__name__}")
        if model_path is not None and not isinstance(model_path, (Adapter, str, os.PathLike)):
            raise TypeError(f"model_path must be a checkpoint path, an Adapter or an adapter name, got {model_path!r}")
        if base_model is not None and (not isinstance(base_model, str) or not base_model):
            raise TypeError(f"base_model must be a non-empty str, got {base_model!r}")
        self._client = client
        self._model_path = model_path
        self._given_base_model = base_model
        self._tokenizer_spec = tokenizer
        self._tokenizer: Any = None
        self._max_outage = max_outage
        self._on_outage = on_outage
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        if self._model_path is not None:
            name = self._model_path.name if isinstance(self._model_path, Adapter) else os.fspath(self._model_path)
            model = f"model_path={name!r}"
        else:
            model = f"base_model={self._given_base_model!r}"
        return f"lora_sampler.tinker.SamplingClient({model}, base_url={self._client.base_url!r})"

    # -- what is sampled -----------------------------------------------------------------------------------------

    def _model(self) -> Dict[str, Any]:
        """``adapter=`` or ``base_model=`` of every request of this client (by default the engine's first served base
        model: the client caches the list)."""
        if self._model_path is not None:
            return {"adapter": self._model_path}
        return {"base_model": self._given_base_model or self._client.served_base_models()[0]}

    # -- sampling ------------------------------------------------------------------------------------------------

    def sample(
        self,
        prompt: Any,
        num_samples: int,
        sampling_params: Any,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: Any = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: Optional[int] = None,
    ) -> TinkerFuture[Any]:
        """Sample ``num_samples`` completions of ``prompt``; return the future of a ``tinker.SampleResponse``.

        As Tinker's: ``stop=[]`` stops only at ``max_tokens`` (vLLM's ``ignore_eos``), integer stops are stop token
        ids, ``max_tokens=None`` generates until the context is full; the prompt logprobs start with None.
        Arguments are checked here, before any request.

        Raises:
            NotImplementedError: ``target_prompt_logprobs`` or ``prompt_alt_tokens_k`` (vLLM's OpenAI API serves
                neither), or a prompt with image or audio chunks.
            TypeError, ValueError: bad arguments, each named.
        """
        if target_prompt_logprobs is not None:
            raise _unsupported("target_prompt_logprobs", "vLLM's OpenAI API returns no logprobs of chosen ids")
        if prompt_alt_tokens_k:
            raise _unsupported("prompt_alt_tokens_k", "vLLM's OpenAI API draws no alternatives to prompt tokens")
        tokens = _convert.prompt_tokens(prompt)
        last_n = _convert.checked_last_n(prompt_logprobs_last_n, include_prompt_logprobs, len(tokens))
        params, extra = _convert.sampling_params(sampling_params)
        request = SampleRequest(
            tokens,
            num_samples=num_samples,
            sampling_params=params,
            prompt_logprobs=bool(include_prompt_logprobs),
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            extra_body=extra,
            **self._model(),
        )
        topk_prompt, topk_sample = topk_prompt_logprobs, topk_sample_logprobs
        return TinkerFuture(
            self._client.submit_request(request, max_outage=self._max_outage, on_outage=self._on_outage),
            lambda output: _convert.sample_response(
                output, topk_prompt=topk_prompt, topk_sample=topk_sample, last_n=last_n
            ),
        )

    async def sample_async(self, *args: Any, **kwargs: Any) -> Any:
        """``await sample(...)``: the ``tinker.SampleResponse``."""
        return await self.sample(*args, **kwargs)

    def compute_logprobs(self, prompt: Any, prompt_logprobs_last_n: Optional[int] = None) -> TinkerFuture[Any]:
        """Return the future of each prompt token's logprob given those before it (None first, as Tinker's).

        As Tinker's own: one generated token with the prompt logprobs, whose ``SampleResponse.prompt_logprobs`` is
        the list (float32, as Tinker sends them); ``prompt_logprobs_last_n`` leaves the positions before the last N
        as None.
        """
        one_token = tinker.SamplingParams(max_tokens=1)
        sampled = self.sample(
            prompt, 1, one_token, include_prompt_logprobs=True, prompt_logprobs_last_n=prompt_logprobs_last_n
        )
        return TinkerFuture(sampled, lambda response: response.prompt_logprobs)

    async def compute_logprobs_async(self, prompt: Any, prompt_logprobs_last_n: Optional[int] = None) -> Any:
        """``await compute_logprobs(...)``: the list of logprobs."""
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    # -- the model -----------------------------------------------------------------------------------------------

    def get_base_model(self) -> str:
        """The base model's name: ``base_model=`` when given, else the engine's model (its ``--model``; cached)."""
        return self._given_base_model or self._client.engine_model()

    async def get_base_model_async(self) -> str:
        """``get_base_model()``, off the event loop (the first call may ask the engine)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.get_base_model)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer: ``tokenizer=`` as given, or loaded (``transformers``) from a local folder.

        Without ``tokenizer=``, the engine's model folder is tried when this machine can read it (the engine runs
        here, or shares the filesystem). Nothing is fetched from the Hugging Face Hub.

        Raises:
            RuntimeError: no tokenizer can be had; the message names what to pass.
            ImportError: a folder must be loaded and ``transformers`` is missing.
        """
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def _load_tokenizer(self) -> Any:
        spec = self._tokenizer_spec
        if spec is not None and not isinstance(spec, (str, os.PathLike)):
            return spec
        folder = os.fspath(spec) if spec is not None else self.get_base_model()
        if not os.path.isdir(folder):
            where = "tokenizer=" if spec is not None else "the engine's model"
            raise RuntimeError(
                f"no tokenizer for {folder!r}: {where} is not a folder this machine can read. Pass "
                "ServiceClient(..., tokenizer=<a local tokenizer folder, or a tokenizer object>) (for FakeEngine, "
                "lora_sampler.testing.ByteTokenizer()); nothing is downloaded from the Hub"
            )
        try:
            import transformers  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ImportError(
                f"loading the tokenizer in {folder!r} needs transformers: pip install transformers"
            ) from exc
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)

    # -- Tinker's other methods ----------------------------------------------------------------------------------

    def get_telemetry(self) -> None:
        """None: nothing is reported anywhere."""
        return None

    def on_queue_state_change(self, queue_state: Any, queue_state_reason: Optional[str]) -> None:
        """Nothing: an engine of your own has no Tinker queue."""

    def get_sampler_handle(self) -> str:
        """Not served: pickle the client to pass it to another process."""
        raise _unsupported("get_sampler_handle", "pickle the SamplingClient instead (it carries no API key)")

    # -- pickling ------------------------------------------------------------------------------------------------

    def __reduce__(self) -> Any:
        """Pickle the client (its options, never the API key: the child reads ``$LORA_SAMPLER_API_KEY``) and the model.

        Raises:
            TypeError: the client sends through a user's ``session=`` (``SamplerClient.__reduce__`` says why).
        """
        state = {
            "model_path": self._model_path,
            "base_model": self._given_base_model,
            "tokenizer": self._tokenizer_spec,
            "max_outage": self._max_outage,
            "on_outage": self._on_outage,
        }
        return _restore, (pickle.dumps(self._client), state)


def _restore(pickled: bytes, state: Dict[str, Any]) -> SamplingClient:
    """Rebuild a pickled ``SamplingClient`` over this process's copy of its client."""
    return SamplingClient(_PROCESS_CLIENTS.get(pickled), **state)


class ServiceClient:
    """Tinker's ``ServiceClient`` for your own vLLM engine: it makes ``SamplingClient`` values.

    Args:
        base_url: The engine root, e.g. ``http://127.0.0.1:8000``.
        api_key: The engine's key; defaults to ``$LORA_SAMPLER_API_KEY`` (never ``TINKER_API_KEY``).
        lora_base_dir: The engine's resolver folder as this machine sees it (where checkpoints are published).
        tokenizer: What sampling clients' ``get_tokenizer()`` returns (a tokenizer object or a local folder).
        max_outage: Seconds each call waits out an engine outage (0: fail at once).
        on_outage: Called with an ``OutageEvent`` while the engine is away.
        **options: Further ``SamplerClient`` options (``timeout``, ``retry``, ``max_workers``, ``replicas``, ...).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: Optional[str] = None,
        lora_base_dir: Union[str, os.PathLike[str], None] = None,
        tokenizer: TokenizerSpec = None,
        max_outage: float = 0.0,
        on_outage: Optional[OutageHook] = None,
        **options: Any,
    ):
        self._client = SamplerClient(base_url, api_key=api_key, lora_base_dir=lora_base_dir, **options)
        self._defaults: Dict[str, Any] = {"tokenizer": tokenizer, "max_outage": max_outage, "on_outage": on_outage}

    @property
    def sampler_client(self) -> SamplerClient:
        """The ``SamplerClient`` every sampling client of this service sends through."""
        return self._client

    def __repr__(self) -> str:
        return f"lora_sampler.tinker.ServiceClient({self._client.base_url!r})"

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self.close(wait=exc_type is None)

    def close(self, *, wait: bool = True) -> None:
        """Close the client (its sampling clients stop working); ``wait=False`` cancels what is in flight."""
        self._client.close(wait=wait)

    def create_sampling_client(
        self,
        model_path: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> Any:
        """Return what tinker 0.38 returns: a future of the ``SamplingClient``, also usable (deprecated) as one.

        Nothing is sent yet: a checkpoint is published on the first call that samples it.

        Args:
            model_path: Anything ``adapter=`` takes (a checkpoint archive or folder, local or ``s3://``, an
                ``Adapter``, a published adapter name); None samples the base model.
            base_model: The base model to sample when ``model_path`` is None (default: the engine's).
            retry_config: Tinker's retry settings; not served (the client's ``retry=`` applies).
            record_stability_info: Tinker's training record; not served.

        Raises:
            NotImplementedError: ``retry_config`` or ``record_stability_info=True``.
        """
        if retry_config is not None:
            raise _unsupported("retry_config", "pass retry=lora_sampler.RetryPolicy(...) to ServiceClient instead")
        if record_stability_info:
            raise _unsupported("record_stability_info", "vLLM keeps no stability record for training")
        ready: concurrent.futures.Future[tinker.SamplingClient] = concurrent.futures.Future()
        ready.set_result(SamplingClient(self._client, model_path=model_path, base_model=base_model, **self._defaults))
        return tinker.BackcompatSamplingClientFuture(AwaitableConcurrentFuture(ready))

    async def create_sampling_client_async(
        self,
        model_path: Optional[AdapterSpec] = None,
        base_model: Optional[str] = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """``await create_sampling_client(...)``: the ``SamplingClient``."""
        future = self.create_sampling_client(model_path, base_model, retry_config, record_stability_info)
        return await future  # type: ignore[no-any-return]
