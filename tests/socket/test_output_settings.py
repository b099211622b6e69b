"""An output remembers the settings that changed its answers: a re-run with others is refused, --restart starts over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

import lora_sampler
from lora_sampler import SamplerClient, SamplingParams
from lora_sampler.batch import sweep
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter_archive


def _records(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _completions(engine: FakeEngine) -> int:
    return sum(1 for request in engine.requests if request.path.endswith("/completions"))


def _sample(engine: FakeEngine, inp: Path, out: Path, *flags: str) -> List[str]:
    base = ["sample", "--base-url", engine.url, "--base-model", engine.model, "--input", str(inp)]
    return [*base, "--output", str(out), "--quiet", *flags]


@pytest.fixture
def inp(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{n}", "prompt": [1, 2, n]}) + "\n" for n in range(6)))
    return path


def test_sample_rerun_with_another_temperature_is_refused_naming_it(
    engine: FakeEngine, inp: Path, tmp_path: Path, capsys: Any
) -> None:
    """A second run with --temperature 0 into an output answered at 1.0 sends nothing and names the setting."""
    out = tmp_path / "out.jsonl"
    assert main(_sample(engine, inp, out, "--temperature", "1.0")) == 0
    before, sent = out.read_bytes(), _completions(engine)
    capsys.readouterr()
    assert main(_sample(engine, inp, out, "--temperature", "0")) == 2
    err = capsys.readouterr().err
    assert "temperature 1.0 -> 0.0" in err and "--restart" in err and str(out) in err
    assert len(err.strip().splitlines()) == 1
    assert out.read_bytes() == before and _completions(engine) == sent


@pytest.mark.parametrize(
    "flags",
    [("--max-tokens", "3"), ("--num-samples", "2"), ("--seed", "7"), ("--extra-body", '{"min_tokens": 2}')],
)
def test_sample_rerun_with_any_answer_setting_changed_is_refused(
    engine: FakeEngine, inp: Path, tmp_path: Path, capsys: Any, flags: Any
) -> None:
    """Max tokens, samples, seed and extra body fields are remembered: changing one is refused."""
    out = tmp_path / "out.jsonl"
    assert main(_sample(engine, inp, out)) == 0
    capsys.readouterr()
    assert main(_sample(engine, inp, out, *flags)) == 2
    assert flags[0].lstrip("-").replace("-", "_").split("_body")[0] in capsys.readouterr().err


def test_sample_rerun_with_a_changed_prompt_is_refused_naming_the_line(
    engine: FakeEngine, inp: Path, tmp_path: Path, capsys: Any
) -> None:
    """An answered id whose prompt changed stops the job (exit 2) naming its line; its old answer is not kept."""
    out = tmp_path / "out.jsonl"
    assert main(_sample(engine, inp, out)) == 0
    lines = inp.read_text().splitlines()
    lines[3] = json.dumps({"id": "p3", "prompt": [9, 9, 9]})
    inp.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(_sample(engine, inp, out)) == 2
    err = capsys.readouterr().err
    assert "line 4 (id 'p3')" in err and "--restart" in err
    assert len(_records(out)) == 6


def test_sample_rerun_changing_only_pace_settings_resumes_and_appended_lines_are_new_work(
    engine: FakeEngine, inp: Path, tmp_path: Path
) -> None:
    """Concurrency, prompts per request, timeout and retry-failed change freely; lines appended to the input run."""
    out = tmp_path / "out.jsonl"
    assert main(_sample(engine, inp, out, "--concurrency", "4")) == 0
    with inp.open("a") as handle:
        handle.write(json.dumps({"id": "new", "prompt": [5]}) + "\n")
    pace = ("--concurrency", "1", "--prompts-per-request", "1", "--timeout", "5,60", "--no-retry-failed")
    assert main(_sample(engine, inp, out, *pace)) == 0
    assert [r["id"] for r in _records(out)][-1] == "new" and len(_records(out)) == 7


def test_sample_restart_answers_every_line_again_with_the_new_settings(
    engine: FakeEngine, inp: Path, tmp_path: Path
) -> None:
    """--restart drops the old answers and runs every line with the new settings, then resumes under them."""
    out = tmp_path / "out.jsonl"
    assert main(_sample(engine, inp, out, "--max-tokens", "4")) == 0
    assert main(_sample(engine, inp, out, "--max-tokens", "2", "--restart")) == 0
    records = _records(out)
    assert len(records) == 6 and all(len(r["sequences"][0]["tokens"]) <= 2 for r in records)
    sent = _completions(engine)
    assert main(_sample(engine, inp, out, "--max-tokens", "2")) == 0  # the new settings are remembered
    assert _completions(engine) == sent


def test_score_rerun_into_a_sample_output_is_refused(
    engine: FakeEngine, inp: Path, tmp_path: Path, capsys: Any
) -> None:
    """Scoring into an output of samples is another kind of answer: refused, naming it."""
    out = tmp_path / "out.jsonl"
    assert main(_sample(engine, inp, out)) == 0
    capsys.readouterr()
    argv = ["score", "--base-url", engine.url, "--base-model", engine.model, "--input", str(inp), "--output", str(out)]
    assert main([*argv, "--quiet"]) == 2
    assert "kind 'sample' -> 'score'" in capsys.readouterr().err


def test_python_sweep_rerun_with_another_max_tokens_is_refused_and_restart_starts_over(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """The Python sweep's finished checkpoints remember their settings: another max_tokens is refused; restart=True
    evaluates them again, and the new settings are remembered."""
    archive = write_adapter_archive(tmp_path / "step-1.tar.gz", engine.model)
    prompts = [{"id": n, "prompt": [1, n]} for n in range(4)]
    with SamplerClient(engine.url, lora_base_dir=str(lora_dir)) as client:
        first = list(sweep(client, [archive], prompts, output_dir=str(tmp_path / "run"), max_tokens=4))
        assert first[0].rows == 4
        with pytest.raises(lora_sampler.OutputSettingsError, match=r"max_tokens 4 -> 2.*restart=True"):
            list(sweep(client, [archive], prompts, output_dir=str(tmp_path / "run"), max_tokens=2))
        again = list(sweep(client, [archive], prompts, output_dir=str(tmp_path / "run"), max_tokens=2, restart=True))
        sent = engine.requests.copy()
        resumed = list(sweep(client, [archive], prompts, output_dir=str(tmp_path / "run"), max_tokens=2))
    assert again[0].rows == 4 and not again[0].resumed
    assert resumed[0].resumed and engine.requests == sent  # the new settings are the remembered ones now


def test_cli_sweep_restart_flag_starts_the_folder_over(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """`sweep --restart` is built from the same setting: another --max-tokens is refused, then answered again."""
    archive = write_adapter_archive(tmp_path / "step-1.tar.gz", engine.model)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": [1, 2]}\n')
    base = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--checkpoints", archive]
    argv = [*base, "--input", str(inp), "--output-dir", str(tmp_path / "run"), "--quiet"]
    assert main([*argv, "--max-tokens", "4"]) == 0
    assert main([*argv, "--max-tokens", "2"]) == 2
    assert "max_tokens 4 -> 2" in capsys.readouterr().err
    assert main([*argv, "--max-tokens", "2", "--restart"]) == 0


def test_output_settings_error_pickles_with_its_fields() -> None:
    """The refusal keeps its path and setting through pickling, like every error."""
    import pickle

    error = lora_sampler.OutputSettingsError("x", path="o.jsonl", setting="temperature")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.setting, str(copy)) == ("o.jsonl", "temperature", "x")
    assert isinstance(copy, ValueError)


def test_sampling_params_defaults_are_remembered_by_name() -> None:
    """Every SamplingParams field is a named setting (a new field is compared by name too)."""
    from lora_sampler.batch._lines import PROMPT_LINES, LineDefaults, settings_changes

    one = PROMPT_LINES.settings(LineDefaults(sampling_params=SamplingParams(temperature=0.5, stop=["a"])), "m")
    two = PROMPT_LINES.settings(LineDefaults(sampling_params=SamplingParams(temperature=0.5, stop=("a",))), "m")
    assert settings_changes(one, two) == ""
    assert settings_changes({"kind": "sample"}, one) == ""  # settings an older version did not remember


def test_sweep_rerun_with_a_changed_prompt_for_a_finished_checkpoint_is_refused_naming_the_line(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """A finished checkpoint's answered ids remember their prompts: a requests file that changes one is refused
    (naming the line and the way out) before anything is sent, as `sample`'s output is; appended lines are not."""
    archive = write_adapter_archive(tmp_path / "step-1.tar.gz", engine.model)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": n, "prompt": [1, n]}) + "\n" for n in range(3)))
    base = ["sweep", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--checkpoints", archive]
    argv = [*base, "--input", str(inp), "--output-dir", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 0
    inp.write_text("".join(json.dumps({"id": n, "prompt": [1, n + (n == 1) * 50]}) + "\n" for n in range(3)))
    capsys.readouterr()
    sent = _completions(engine)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "line 2 (id 1)" in err and "--restart" in err, err
    assert _completions(engine) == sent
    assert main([*argv, "--restart"]) == 0
    assert main(argv) == 0  # the changed prompt is the remembered one now


def test_python_sweep_rerun_with_a_changed_prompt_is_refused(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path
) -> None:
    """The Python sweep keeps the same rule for a sequence of lines."""
    archive = write_adapter_archive(tmp_path / "step-1.tar.gz", engine.model)
    with SamplerClient(engine.url, lora_base_dir=str(lora_dir)) as client:
        list(sweep(client, [archive], [{"id": n, "prompt": [1, n]} for n in range(3)], output_dir=str(tmp_path / "r")))
        changed = [{"id": n, "prompt": [1, 7]} for n in range(3)]
        with pytest.raises(lora_sampler.OutputSettingsError, match=r"line 1 \(id 0\).*restart=True"):
            list(sweep(client, [archive], changed, output_dir=str(tmp_path / "r")))
