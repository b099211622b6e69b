"""The batching benchmark's two vLLM arms, the server and the offline limit, run one engine (no vLLM needed).

Both read their settings from one definition (``tests/real_engine/vllm_env.py``'s ``ENGINE``): the offline arm once
ran in the model's default bfloat16 (emulated on a CPU without AMX) beside a float32 server, and its "limit" came out
below the server it was the limit of. What each arm's log says it ran is compared before any ratio is taken.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import _common  # noqa: E402  (after benchmarks/ is on the path)
import bench_batching  # noqa: E402

RUN = subprocess.run
ENV = SimpleNamespace(python=Path("/venv/bin/python"), model_dir=Path("/cache/tiny-model"))


def vllm_log(dtype: str = "float32", max_len: int = 256, lora: bool = False) -> str:
    """The lines of a vLLM 0.32 log that say what it ran."""
    lines = [
        "INFO [core.py:134] Initializing a V1 LLM engine (v0.32.0) with config: model='/cache/tiny-model', "
        f"speculative_config=None, dtype=torch.{dtype}, max_seq_len={max_len}, download_dir=None,",
        "INFO OpenMP thread binding info: ",
        "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False",
        "\tlocal_rank=0, core ids=[1]",
        "INFO [kv_cache_utils.py:2328] CPU KV cache size: 43,680 tokens, Maximum concurrency for 256 tokens",
    ]
    return "\n".join(lines + (["INFO Using PunicaWrapperCPU."] if lora else []))


def as_kwargs(flags: List[str]) -> Dict[str, Any]:
    """Read ``vllm serve`` flags back as ``LLM`` keyword arguments (a flag without a value is ``True``)."""
    kwargs: Dict[str, Any] = {}
    for index, flag in enumerate(flags):
        if flag.startswith("--"):
            value = flags[index + 1] if index + 1 < len(flags) and not flags[index + 1].startswith("--") else True
            kwargs[flag[2:].replace("-", "_")] = int(value) if isinstance(value, str) and value.isdigit() else value
    return kwargs


@pytest.fixture()
def harness() -> Any:
    return _common.load_harness()


class Arms:
    """Stands in for vLLM: records the offline command and the server's settings, answers with canned logs."""

    def __init__(self, harness: Any, offline_log: str, server_log: str):
        self.harness, self.offline_log, self.server_log = harness, offline_log, server_log
        self.offline: List[Dict[str, Any]] = []
        self.server: List[Dict[str, Any]] = []
        self.stopped = 0

    def run(self, command: List[str], **options: Any) -> subprocess.CompletedProcess[str]:
        if "--engine-args" not in command:  # not the offline arm (the machine's description, say)
            return RUN(command, **options)
        self.offline.append({"argv": command, "env": options["env"]})
        stdout = json.dumps({"rates": [400.0, 420.0, 410.0]}) + "\n"
        return subprocess.CompletedProcess(command, 0, stdout=stdout, stderr=self.offline_log)

    def start_engine(self, env: Any, workdir: Path, *, settings: Any, report: Any) -> Any:
        argv = self.harness.server_command(env, settings, 8000, "key")
        self.server.append({"argv": argv, "env": settings.environ(), "workdir": workdir})
        return SimpleNamespace(log_text=lambda: self.server_log, stop=self.stop)

    def stop(self) -> None:
        self.stopped += 1


def run_arms(
    monkeypatch: pytest.MonkeyPatch, harness: Any, arms: Arms, workdir: Path = Path("/work-of-the-run")
) -> Any:
    monkeypatch.setattr(bench_batching.subprocess, "run", arms.run)
    monkeypatch.setattr(harness, "start_engine", arms.start_engine)
    return bench_batching.vllm_arms(harness, ENV, ["score", "sample"], 3, workdir)


def test_the_offline_limit_and_the_server_get_the_same_engine_settings(
    monkeypatch: pytest.MonkeyPatch, harness: Any
) -> None:
    arms = Arms(harness, vllm_log(), vllm_log())
    limits, _engine, ran = run_arms(monkeypatch, harness, arms)

    assert limits == {"score": 410.0, "sample": 410.0}
    (server,) = arms.server
    server_flags = server["argv"][server["argv"].index("--model") + 2 : server["argv"].index("--host")]
    for offline in arms.offline:
        argv = offline["argv"]
        assert argv[argv.index("--model") + 1] == server["argv"][server["argv"].index("--model") + 1]
        engine_args = json.loads(argv[argv.index("--engine-args") + 1])
        assert engine_args == as_kwargs(server_flags)
        assert engine_args == {
            "dtype": "float32",
            "max_model_len": 256,
            "max_num_seqs": 128,
            "max_num_batched_tokens": 2048,
        }
        assert server["env"].items() <= offline["env"].items()
    assert ran["settings"]["dtype"] == "float32" and ran["settings"]["enable_lora"] is False
    assert ran["ran"] == {
        "vllm": "0.32.0",
        "model": "/cache/tiny-model",
        "dtype": "float32",
        "max_model_len": "256",
        "kv_cache_tokens": "43,680",
        "omp_cores": "[1]",
        "enable_lora": False,
    }


def test_arms_whose_logs_say_they_ran_different_engines_are_refused(
    monkeypatch: pytest.MonkeyPatch, harness: Any
) -> None:
    arms = Arms(harness, vllm_log(dtype="bfloat16"), vllm_log())
    with pytest.raises(RuntimeError, match="different engines") as refused:
        run_arms(monkeypatch, harness, arms)
    assert "'dtype': 'bfloat16'" in str(refused.value) and "'dtype': 'float32'" in str(refused.value)
    assert arms.stopped == 1  # the server it started is not left running


def test_lora_on_one_side_only_is_a_difference(monkeypatch: pytest.MonkeyPatch, harness: Any) -> None:
    arms = Arms(harness, vllm_log(), vllm_log(lora=True))
    with pytest.raises(RuntimeError, match="different engines"):
        run_arms(monkeypatch, harness, arms)


def test_the_scheduler_is_set_not_left_to_each_entry_point(harness: Any) -> None:
    """vLLM 0.32 on a CPU picks its scheduler by entry point when none is given: ``LLM`` 256 sequences and 4,096
    tokens a step, ``vllm serve`` 128 and 2,048. The limit ran with twice the server's step (and measured 106
    samplings/s against the server's 165 that run); both arms now get the server's values."""
    for settings in (harness.ENGINE, harness.ENGINE.but(enable_lora=False)):
        kwargs = settings.llm_kwargs()
        assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (128, 2048)
        assert as_kwargs(settings.server_flags())["max_num_seqs"] == 128


def test_the_server_flags_and_the_llm_kwargs_say_the_same(harness: Any) -> None:
    for settings in (harness.ENGINE, harness.ENGINE.but(enable_lora=False), harness.ENGINE.but(max_loras=1)):
        assert as_kwargs(settings.server_flags()) == settings.llm_kwargs()
    assert harness.ENGINE.server_flags()[:2] == ["--dtype", "float32"]
    assert "--enable-lora" in harness.ENGINE.server_flags()
    assert "--max-loras" not in harness.ENGINE.but(enable_lora=False).server_flags()


def test_the_server_works_in_the_folder_it_is_given(monkeypatch: pytest.MonkeyPatch, harness: Any) -> None:
    """The server's log and adapter folder go where ``main`` says, a folder it removes at the end: each run (and each
    run of this file) left a ``bench-batching-*`` folder in the temporary directory, 291 of them on this machine."""
    arms = Arms(harness, vllm_log(), vllm_log())
    run_arms(monkeypatch, harness, arms, Path("/the/run/folder"))
    assert [server["workdir"] for server in arms.server] == [Path("/the/run/folder")]


def test_main_removes_the_run_folder_even_when_the_arms_differ(
    monkeypatch: pytest.MonkeyPatch, harness: Any, tmp_path: Path
) -> None:
    monkeypatch.setattr(bench_batching.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_common, "load_harness", lambda: harness)
    monkeypatch.setattr(harness, "ensure_env", lambda log: ENV)
    arms = Arms(harness, vllm_log(dtype="bfloat16"), vllm_log())
    monkeypatch.setattr(bench_batching.subprocess, "run", arms.run)
    monkeypatch.setattr(harness, "start_engine", arms.start_engine)
    with pytest.raises(RuntimeError, match="different engines"):
        bench_batching.main(["--vllm", "--rounds", "1"])
    assert arms.server and not arms.server[0]["workdir"].exists()
    assert list(tmp_path.iterdir()) == []
