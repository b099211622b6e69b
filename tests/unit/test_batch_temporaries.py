"""The output rewrite's temporary files: a killed rewrite's leftover is removed by the next run, and only that."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from lora_sampler.batch import one_writer, prepare_output
from lora_sampler.errors import LoraSamplerError

REPO_ROOT = Path(__file__).resolve().parents[2]

# Rewrites the output (it has a torn last line), and dies by SIGKILL at the fsync of the temporary file.
KILLED_REWRITE = """
import os, signal, sys
from lora_sampler.batch import _lines as batch
batch.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
batch.prepare_output(sys.argv[1])
"""


def write_output(path: Path, count: int, torn: bool = True) -> None:
    lines = "".join(json.dumps({"id": i, "model": "m", "sequences": []}) + "\n" for i in range(count))
    path.write_text(lines + ('{"id": "torn' if torn else ""), encoding="utf-8")


def temporaries(folder: Path) -> List[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


def test_killed_rewrite_leftover_is_removed_by_the_next_run(tmp_path: Path) -> None:
    """SIGKILL mid-rewrite leaves ``.out.jsonl.<random>.tmp`` and the output intact; the next run removes it."""
    output = tmp_path / "out.jsonl"
    write_output(output, 20_000)
    before = output.read_bytes()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    killed = subprocess.run([sys.executable, "-c", KILLED_REWRITE, str(output)], env=env, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    (leftover,) = temporaries(tmp_path)
    assert leftover.startswith(".out.jsonl.") and (tmp_path / leftover).stat().st_size > 0
    assert output.read_bytes() == before
    state = prepare_output(str(output))
    assert state.removed_temporaries == [str(tmp_path / leftover)]
    assert temporaries(tmp_path) == []
    assert state.rewritten and state.dropped_torn == 1 and len(state.done) == 20_000


def test_only_the_outputs_own_temporaries_are_removed(tmp_path: Path) -> None:
    """Other files, other outputs' temporaries, folders and links that look alike are all left alone."""
    output = tmp_path / "out.jsonl"
    write_output(output, 3, torn=False)
    ours = tmp_path / ".out.jsonl.k3_9xq0a.tmp"
    ours.write_text("partial")
    kept = [
        ".other.jsonl.abcd1234.tmp",  # another output's
        "out.jsonl.abcd1234.tmp",  # no leading dot
        ".out.jsonl.abcd123.tmp",  # 7 random characters
        ".out.jsonl.ABCD1234.tmp",  # not mkstemp's alphabet
        ".out.jsonl.abcd1234.tmp.bak",
        ".out.jsonl.keep",
    ]
    for name in kept:
        (tmp_path / name).write_text("x")
    (tmp_path / ".out.jsonl.folder00.tmp").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".out.jsonl.link0000.tmp")
    state = prepare_output(str(output))
    assert state.removed_temporaries == [str(ours)]
    assert not state.rewritten
    remaining = set(os.listdir(tmp_path))
    assert remaining == {"out.jsonl", ".out.jsonl.lock", ".out.jsonl.folder00.tmp", ".out.jsonl.link0000.tmp", *kept}


def test_temporary_of_a_run_holding_the_output_is_left_alone(tmp_path: Path) -> None:
    """While another run holds the output (mid-rewrite), a new run is refused at once (two writers, the contract);
    the other run's temporary is never removed."""
    output = tmp_path / "out.jsonl"
    write_output(output, 5)
    in_progress = tmp_path / ".out.jsonl.live0001.tmp"
    write_output(in_progress, 5, torn=False)
    with one_writer(str(output)):  # the other run, rewriting
        with pytest.raises(LoraSamplerError, match="another run is writing"):
            prepare_output(str(output))
        assert in_progress.exists()  # nothing removed
        os.replace(in_progress, output)  # the other run finishes its rewrite, then lets go
    state = prepare_output(str(output))
    assert state.removed_temporaries == []
    assert not state.rewritten and len(state.done) == 5
    assert temporaries(tmp_path) == []
