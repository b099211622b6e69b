"""lora_sampler.ray_data on a local, loopback-only Ray: 2,000 prompts over 2 actors, keys kept out of pickles.

Run with ``tox -e ray``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from typing import Any, List

import pytest
from conftest import ENGINE_KEY, ENGINE_KEY_ENV

from lora_sampler import RetryPolicy, SamplerClient, SamplingParams
from lora_sampler.ray_data import RESULT_COLUMNS, ClientSettings, SampleBatches, run_file, sample_dataset
from lora_sampler.testing import FakeEngine, write_adapter

pytestmark = pytest.mark.ray

BASE_MODEL = "tiny-base"
#: Small waits: the workers are other processes, where the testing switch of this one does not reach.
FAST_RETRY = RetryPolicy(base_delay=0.01, max_delay=0.05)


@pytest.fixture
def engine(tmp_path: Any, monkeypatch: Any) -> Any:
    """A FakeEngine with a key and the adapter ``lagging``; the key is in ENGINE_KEY_ENV for this process."""
    monkeypatch.setenv(ENGINE_KEY_ENV, ENGINE_KEY)  # Ray's workers inherited it from the ray_local fixture
    lora_dir = tmp_path / "loras"
    write_adapter(lora_dir / "lagging", BASE_MODEL)
    with FakeEngine(model=BASE_MODEL, lora_dir=lora_dir, api_key=ENGINE_KEY) as started:
        yield started


def _settings(engine: Any, **kwargs: Any) -> ClientSettings:
    return ClientSettings(
        engine.url, api_key_env=ENGINE_KEY_ENV, lora_base_dir=engine.lora_dir, max_workers=8, retry=FAST_RETRY, **kwargs
    )


def test_ray_node_binds_loopback_only(ray_local: Any) -> None:
    """The local Ray node runs on 127.0.0.1, never on the machine's other addresses."""
    nodes = ray_local.nodes()
    assert [node["NodeManagerAddress"] for node in nodes] == ["127.0.0.1"]
    assert ray_local.util.get_node_ip_address() == "127.0.0.1"


def test_ray_run_file_2000_prompts_two_actors_lagging_adapter(ray_local: Any, engine: Any, tmp_path: Any) -> None:
    """2,000 rows over 2 actors through the adapter race: each answered once, in input order, failures recorded."""
    engine.set_visibility_delay("lagging", requests=24)
    engine.inject_fault("status", model="lagging", status=500, count=5, message="scripted outage")
    source, target = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    with open(source, "w") as handle:
        for i in range(2000):
            handle.write(json.dumps({"id": i, "prompt": f"prompt number {i}"}) + "\n")
    params = SamplingParams(max_tokens=4, seed=7)
    summary = run_file(str(source), str(target), _settings(engine), adapter="lagging", sampling_params=params)
    # The fault fails 5 requests. A batch's 500 is split and its prompts sent again (a failure belongs to what caused
    # it), so how many prompts end failed depends on how the 5 fell on batches and on the prompts sent alone: every
    # failed row is one of those 500s, and every other row is answered once.
    outages = [r for r in engine.requests if r.path == "/v1/completions" and r.fault == "status"]
    assert [r.status for r in outages] == [500] * 5
    assert summary["rows"] == 2000

    with open(target) as handle:
        rows = [json.loads(line) for line in handle]
    assert [row["id"] for row in rows] == list(range(2000))
    failed = [row for row in rows if row["error"] is not None]
    assert len(failed) == summary["failed"]
    assert all(row["error_status"] == 500 and "scripted outage" in row["error"] for row in failed)
    assert all(row["error_type"] == "InternalServerError" and row["tokens"] == [] for row in failed)
    answered = [row for row in rows if row["error"] is None]
    assert all(len(row["tokens"]) == 1 and len(row["tokens"][0]) == len(row["logprobs"][0]) for row in answered)
    assert all(row["stop_reason"][0] in ("stop", "length") for row in answered)
    # The engine records no prompt count for a request a fault answered, so the failed prompts are counted from
    # the other side: the 200-answered completions hold exactly the 2000 - failed answered prompts, once each.
    answered_prompts = sum(r.prompts for r in engine.requests if r.path == "/v1/completions" and r.status == 200)
    assert answered_prompts == len(answered) == 2000 - len(failed)
    assert any(r.path == "/v1/load_lora_adapter" for r in engine.requests)  # the race was hit

    with SamplerClient(engine.url, api_key=ENGINE_KEY) as client:  # each row holds its own prompt's answer
        for row in answered[:: len(answered) // 4]:
            expected = client.sample(f"prompt number {row['id']}", adapter="lagging", sampling_params=params)
            assert row["tokens"][0] == list(expected.sequences[0].tokens)


def test_ray_sample_dataset_adds_columns_and_keeps_inputs(ray_local: Any, engine: Any) -> None:
    """sample_dataset adds the result columns beside the input columns, token-id prompts included."""
    dataset = ray_local.data.from_items([{"id": i, "prompt": [5, 6, 7 + i], "tag": "t"} for i in range(40)])
    out = sample_dataset(dataset, _settings(engine), base_model=BASE_MODEL, num_samples=2, actors=2, batch_size=8)
    rows = sorted(out.take_all(), key=lambda row: row["id"])
    assert [row["id"] for row in rows] == list(range(40))
    assert set(RESULT_COLUMNS) | {"id", "prompt", "tag"} == set(rows[0])
    assert all(len(row["tokens"]) == 2 and row["error"] is None for row in rows)


def test_ray_callable_pickles_without_the_key(ray_local: Any, engine: Any, caplog: Any, monkeypatch: Any) -> None:
    """A used SampleBatches pickles (pickle and Ray's cloudpickle) with no trace of the key, nor do logs or columns."""
    import pyarrow as pa
    from ray import cloudpickle

    caplog.set_level(logging.DEBUG, logger="lora_sampler")
    batches = SampleBatches(_settings(engine), adapter="lagging")
    table = batches(pa.table({"prompt": ["a", "b"]}))
    assert table.column("error").to_pylist() == [None, None]
    assert batches._client is not None  # the live client, with the key in its session headers
    for blob in (pickle.dumps(batches), cloudpickle.dumps(batches), cloudpickle.dumps(SampleBatches)):
        assert ENGINE_KEY.encode() not in blob
    assert pickle.loads(pickle.dumps(batches))._client is None

    monkeypatch.setenv(ENGINE_KEY_ENV, "sk-wrong-" + ENGINE_KEY)  # a refused key must not reach a column either
    refused = SampleBatches(_settings(engine), adapter="lagging")(pa.table({"prompt": ["a"]}))
    row = refused.to_pylist()[0]
    assert row["error_status"] == 401 and row["error_type"] == "AuthenticationError"
    assert ENGINE_KEY not in json.dumps(row)
    assert ENGINE_KEY not in caplog.text
    batches.close()


def test_ray_settings_refuse_a_key_in_place_of_a_variable_name() -> None:
    """ClientSettings holds the key's variable name; a key-looking value is refused with the fix."""
    with pytest.raises(ValueError, match="name an environment variable"):
        ClientSettings("http://127.0.0.1:1", api_key_env="sk-abc.def")


def test_ray_bad_rows_become_error_rows_in_pandas_batches(engine: Any) -> None:
    """A row whose prompt is unusable gets a ValueError in its error column; the other rows are sampled."""
    import pandas as pd

    frame = pd.DataFrame({"id": [1, 2, 3], "prompt": ["fine", "", "also fine"]})
    out = SampleBatches(_settings(engine), base_model=BASE_MODEL)(frame)
    assert isinstance(out, pd.DataFrame)
    errors: List[Any] = out["error"].tolist()
    assert pd.isna(errors[0]) and pd.isna(errors[2]) and "prompt must not be empty" in errors[1]
    assert out["error_type"].tolist()[1] == "ValueError"


def test_ray_lora_sampler_imports_without_ray() -> None:
    """lora_sampler and lora_sampler.ray_data import with ray and pyarrow made unimportable."""
    code = (
        "import sys; sys.modules['ray'] = None; sys.modules['pyarrow'] = None\n"
        "import lora_sampler, lora_sampler.ray_data; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert done.stdout.strip() == "ok", done.stderr
