"""Batch jobs on Ray Data: sample every row of a dataset through one ``SamplerClient`` per actor.

Owns the picklable client settings, the ``map_batches`` callable and the file-to-file helper. It holds no API key
(only the name of the environment variable the worker reads it from) and never raises for a row: failures become
the row's error columns. Ray, pyarrow and pandas are imported lazily, so ``lora_sampler`` imports without them
(``pip install 'lora_sampler[ray]'``). Named ``ray_data`` rather than ``ray`` so that ``from lora_sampler import
ray_data`` never shadows a user's ``import ray``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from lora_sampler._client.client import SamplerClient
from lora_sampler._defaults import API_KEY_ENV, DEFAULT_MAX_WORKERS, DEFAULT_TIMEOUT
from lora_sampler._transport.exchange import without_userinfo
from lora_sampler.errors import EngineStatusError
from lora_sampler.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from lora_sampler.types import SampleOutput, SampleRequest, SamplingParams, check_count, checked_seconds

logger = logging.getLogger(__name__)

#: The result columns read from each sample's ``GeneratedSequence.to_dict()``: one entry per sample in each.
SEQUENCE_COLUMNS = ("tokens", "logprobs", "text", "stop_reason")
#: Columns ``SampleBatches`` adds, one value per row.
RESULT_COLUMNS = (*SEQUENCE_COLUMNS, "error", "error_type", "error_status")
#: ``ClientSettings`` fields handed to the worker's ``SamplerClient`` as they are, under the same names.
CLIENT_OPTIONS = ("lora_base_dir", "engine_lora_base_dir", "timeout", "retry", "max_workers", "verify")
#: Rows per ``map_batches`` batch: enough to keep ``max_workers`` requests in flight, small enough to stream.
DEFAULT_BATCH_SIZE = 256
#: CPUs reserved per sampling actor: it mostly waits on the network, so it should not starve Ray's read tasks.
DEFAULT_ACTOR_CPUS = 0.25
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ClientSettings:
    """What a Ray worker needs to build its own ``SamplerClient``: plain, picklable values, never a live session.

    The API key is not a field: the worker reads it from the environment variable ``api_key_env`` (or the file
    ``api_key_file``), so it never lands in a pickled task, a Ray object or a log.

    Args:
        base_url: The engine or router root, e.g. ``http://127.0.0.1:8000``.
        api_key_env: Name of the environment variable holding the key on the workers (not the key itself).
        api_key_file: A file holding the key on the workers (e.g. a mounted secret); read when the variable is unset.
        lora_base_dir: The resolver directory as the workers see it.
        engine_lora_base_dir: The same directory as the engine sees it; defaults to ``lora_base_dir``.
        max_workers: Threads (and requests in flight) per actor.
        timeout: ``(connect, read)`` seconds per request.
        retry: The ``RetryPolicy``; its hooks must be picklable.
        verify: TLS verification: True, False, or a CA bundle path on the workers.
        max_outage: Seconds each batch waits out an engine outage (a restart, no router worker) before its held
            rows fail (see docs/guides/outages.md); 0 fails them at once.
    """

    base_url: str
    api_key_env: Optional[str] = API_KEY_ENV
    api_key_file: Optional[str] = None
    lora_base_dir: Optional[str] = None
    engine_lora_base_dir: Optional[str] = None
    max_workers: int = DEFAULT_MAX_WORKERS
    timeout: Tuple[float, float] = DEFAULT_TIMEOUT
    retry: RetryPolicy = field(default=DEFAULT_RETRY_POLICY)
    verify: Union[bool, str] = True
    max_outage: float = 0.0

    def __post_init__(self) -> None:
        if self.api_key_env is not None and not _ENV_NAME.match(self.api_key_env):
            raise ValueError(
                "api_key_env must name an environment variable (letters, digits, _), not hold the key; "
                "set the key in that variable on the workers instead"
            )
        check_count("max_workers", self.max_workers, 1)
        checked_seconds(self.max_outage, "max_outage")

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["base_url"] = without_userinfo(self.base_url)  # a user:password@ in the URL is never printed
        return f"ClientSettings({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    def read_api_key(self) -> Optional[str]:
        """Return the key from ``api_key_env`` or ``api_key_file`` on this machine, or None."""
        if self.api_key_env and os.environ.get(self.api_key_env):
            return os.environ[self.api_key_env]
        if self.api_key_file:
            with open(self.api_key_file, encoding="utf-8") as handle:
                return handle.read().strip() or None
        return None

    def build(self) -> SamplerClient:
        """Build a ``SamplerClient`` from these settings (on the worker that will use it)."""
        options = {name: getattr(self, name) for name in CLIENT_OPTIONS}
        return SamplerClient(self.base_url, api_key=self.read_api_key(), **options)


class SampleBatches:
    """A ``Dataset.map_batches`` callable class: samples each row's prompt and adds the result columns.

    Ray builds one instance per actor, and the instance builds its ``SamplerClient`` on first use, so a pickled
    instance carries settings only. Each batch runs through ``sample_many(return_exceptions=True)``: a failed row
    gets ``error`` (the message), ``error_type`` and ``error_status`` (the HTTP status, or None) and empty
    sequence columns; an answered row gets ``tokens``, ``logprobs``, ``text`` and ``stop_reason`` as lists with
    one entry per sample, and ``error`` None. Input columns are kept.

    Args:
        settings: The ``ClientSettings``.
        adapter: The adapter name (or checkpoint path, published by each actor; publishing is idempotent).
        base_model: Sample the base model instead; exclusive with ``adapter``.
        num_samples: Completions per prompt.
        sampling_params: ``SamplingParams``; None means the defaults.
        prompt_column: The column holding prompts (text, or lists of token ids), or chat messages (lists of
            ``{"role", "content"}`` dicts, sent to ``/v1/chat/completions``).
        session_column: A column holding ``X-Session-ID`` values, if any (router affinity per row).
    """

    def __init__(
        self,
        settings: ClientSettings,
        *,
        adapter: Optional[str] = None,
        base_model: Optional[str] = None,
        num_samples: int = 1,
        sampling_params: Optional[SamplingParams] = None,
        prompt_column: str = "prompt",
        session_column: Optional[str] = None,
    ):
        if not isinstance(settings, ClientSettings):
            raise TypeError(f"settings must be a ClientSettings, got {type(settings).__name__}")
        #: The request fields every row shares, checked here once (a bad one fails now, not in every row).
        self.shared: Dict[str, Any] = dict(adapter=adapter, base_model=base_model, num_samples=num_samples)
        self.shared["sampling_params"] = sampling_params
        SampleRequest("probe", **self.shared)
        self.settings = settings
        self.prompt_column, self.session_column = prompt_column, session_column
        self._client: Optional[SamplerClient] = None

    def __getstate__(self) -> Dict[str, Any]:
        # Never pickle the live client: its session holds the Authorization header.
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    def __repr__(self) -> str:
        what = "adapter" if self.shared["adapter"] is not None else "base_model"
        return f"SampleBatches({without_userinfo(self.settings.base_url)!r}, {what}={self.shared[what]!r})"

    @property
    def client(self) -> SamplerClient:
        """This actor's client, built on first use."""
        if self._client is None:
            self._client = self.settings.build()
        return self._client

    def close(self) -> None:
        """Close the client (threads and pooled connections)."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __call__(self, batch: Any) -> Any:
        """Sample one batch (``pyarrow.Table``, ``pandas.DataFrame`` or dict of columns); return it with results."""
        import pyarrow as pa

        kind = "arrow" if isinstance(batch, pa.Table) else "dict" if isinstance(batch, dict) else "pandas"
        table = batch if kind == "arrow" else _to_table(batch, kind)
        prompts = table.column(self.prompt_column).to_pylist()
        sessions = table.column(self.session_column).to_pylist() if self.session_column else [None] * len(prompts)
        columns = self.sample_rows(prompts, sessions)
        for name in RESULT_COLUMNS:
            column = pa.array(columns[name], type=_result_types()[name])
            index = table.schema.get_field_index(name)
            table = table.set_column(index, name, column) if index >= 0 else table.append_column(name, column)
        if kind == "arrow":
            return table
        return table.to_pandas() if kind == "pandas" else table.to_pydict()

    def sample_rows(self, prompts: List[Any], sessions: List[Optional[str]]) -> Dict[str, List[Any]]:
        """Sample ``prompts`` (plain Python values) and return the result columns, one value per row.

        Each row goes to the client as a mapping of request fields: one it cannot build a request of (a bad prompt)
        is that row's own error, in its slot and never sent (``return_exceptions=True``), not the batch's.
        """
        requests = [self._request(prompt, session) for prompt, session in zip(prompts, sessions)]
        outcomes = self.client.sample_many(requests, return_exceptions=True, max_outage=self.settings.max_outage)
        rows = [_row(outcome) for outcome in outcomes]
        return {name: [row[name] for row in rows] for name in RESULT_COLUMNS}

    def _request(self, prompt: Any, session: Optional[str]) -> Dict[str, Any]:
        """The request fields of one row: its prompt cell (text or token ids), or its chat messages."""
        cell = _plain_prompt(prompt)
        chat = isinstance(cell, list) and bool(cell) and all(isinstance(item, dict) for item in cell)
        return {
            **self.shared,
            "prompt": None if chat else cell,
            "messages": cell if chat else None,
            "session_id": None if session is None else str(session),
        }


def _plain_prompt(prompt: Any) -> Any:
    """Turn a prompt cell into a str or a list of Python ints (Arrow and NumPy hand over their own types)."""
    if isinstance(prompt, str) or prompt is None:
        return prompt
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        return [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in prompt]
    return prompt


def _row(outcome: Any) -> Dict[str, Any]:
    """One row's result columns: one entry per sample in each sequence column, or its error and none."""
    if isinstance(outcome, SampleOutput):
        shown = [sequence.to_dict() for sequence in outcome.sequences]  # a NaN logprob (a null) as None
        columns = {name: [one[name] for one in shown] for name in SEQUENCE_COLUMNS}
        return {**columns, "error": None, "error_type": None, "error_status": None}
    status = outcome.status if isinstance(outcome, EngineStatusError) else None
    error = str(outcome) or repr(outcome)  # our messages are redacted; no response is kept
    empty: Dict[str, Any] = {name: [] for name in SEQUENCE_COLUMNS}
    return {**empty, "error": error, "error_type": type(outcome).__name__, "error_status": status}


def _result_types() -> Dict[str, Any]:
    """Return the Arrow type of each result column (built lazily: pyarrow is optional)."""
    import pyarrow as pa

    return {
        "tokens": pa.list_(pa.list_(pa.int64())),
        "logprobs": pa.list_(pa.list_(pa.float64())),
        "text": pa.list_(pa.string()),
        "stop_reason": pa.list_(pa.string()),
        "error": pa.string(),
        "error_type": pa.string(),
        "error_status": pa.int64(),
    }


def _to_table(batch: Any, kind: str) -> Any:
    import pyarrow as pa

    if kind == "dict":
        return pa.table({name: [_plain_prompt(v) for v in values] for name, values in batch.items()})
    return pa.Table.from_pandas(batch, preserve_index=False)


def sample_dataset(
    dataset: Any,
    settings: ClientSettings,
    *,
    actors: int = 2,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_cpus: float = DEFAULT_ACTOR_CPUS,
    **options: Any,
) -> Any:
    """Return ``dataset`` with the result columns added, sampled by ``actors`` actors (lazy, as Ray Data is).

    Args:
        dataset: A ``ray.data.Dataset`` with a prompt column.
        settings: The ``ClientSettings`` each actor builds its client from.
        actors: Sampling actors; each keeps ``settings.max_workers`` requests in flight.
        batch_size: Rows per batch.
        num_cpus: CPUs reserved per actor.
        **options: ``SampleBatches``' keyword arguments (``adapter``, ``base_model``, ``num_samples``,
            ``sampling_params``, ``prompt_column``, ``session_column``), checked here before any actor starts.
    """
    import ray.data

    SampleBatches(settings, **options)  # TypeError/ValueError for a bad option, here rather than in every actor
    return dataset.map_batches(
        SampleBatches,
        fn_constructor_args=(settings,),
        fn_constructor_kwargs=options,
        batch_format="pyarrow",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=num_cpus,
    )


def run_file(input_path: str, output_path: str, settings: ClientSettings, **kwargs: Any) -> Dict[str, int]:
    """Sample every row of a JSONL or Parquet file of prompts and write the rows with their results.

    The output keeps the input's row order. A ``.jsonl``/``.json`` output is one JSON Lines file, written by the
    driver as rows stream in, to a temporary name then renamed; a ``.parquet`` output is a folder of Parquet files
    written by Ray. Row failures are recorded in the ``error`` columns, never raised.

    Args:
        input_path: ``.jsonl``/``.json`` (one object a line, with a prompt column) or ``.parquet`` (file or folder).
        output_path: ``.jsonl``/``.json`` file, or ``.parquet`` folder.
        settings: The ``ClientSettings``.
        **kwargs: Passed to ``sample_dataset`` (``adapter``, ``base_model``, ``actors``, ...).

    Returns:
        ``{"rows": N, "failed": F}``.
    """
    import ray.data

    context = ray.data.DataContext.get_current()
    previous = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # rows come out in input order
    try:
        if _suffix(input_path) == ".parquet":
            dataset = ray.data.read_parquet(input_path)
        else:
            dataset = ray.data.read_json(input_path, lines=True)
        sampled = sample_dataset(dataset, settings, **kwargs)
        if _suffix(output_path) == ".parquet":
            sampled = sampled.materialize()
            sampled.write_parquet(output_path)
            failed = sum(
                table.num_rows - table.column("error").null_count
                for table in sampled.select_columns(["error"]).iter_batches(batch_format="pyarrow", batch_size=None)
            )
            return {"rows": sampled.count(), "failed": failed}
        return _write_jsonl(sampled.iter_batches(batch_format="pyarrow", batch_size=None), output_path)
    finally:
        context.execution_options.preserve_order = previous


def _suffix(path: str) -> str:
    name = path.rstrip("/").lower()
    return ".parquet" if name.endswith((".parquet", ".pq")) else os.path.splitext(name)[1]


def _write_jsonl(batches: Iterator[Any], output_path: str) -> Dict[str, int]:
    from lora_sampler._files import replacing
    from lora_sampler.batch._lines import to_json_line

    rows = failed = 0
    with replacing(output_path) as out:  # a temporary beside it, fsynced, then renamed over it
        for table in batches:
            for row in table.to_pylist():
                rows += 1
                failed += row.get("error") is not None
                out.write((to_json_line(row, default=str) + "\n").encode("utf-8"))  # strict JSON: NaN is written null
    return {"rows": rows, "failed": failed}
