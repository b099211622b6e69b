"""``lora-sampler adapters``: the resolver folder listed (source, size, age) and cleaned (``--older-than``), never
removing an adapter another run holds a lease on or one the engine has loaded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lora_sampler import SamplerClient
from lora_sampler._adapters.lease import hold
from lora_sampler.cli import main
from lora_sampler.testing import FakeEngine, write_adapter_archive


def _age(folder: Path, hours: float) -> None:
    old = time.time() - hours * 3600
    os.utime(folder / ".lora_sampler.json", (old, old))


def test_adapters_lists_and_removes_only_what_nothing_uses(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """Four old adapters: one loaded on the engine, one leased by another run, two free; --older-than 1h removes
    the two free ones and says why the others stay; a young adapter stays."""
    names = []
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        for step in (1, 2, 3, 4, 5):
            archive = write_adapter_archive(tmp_path / f"step-{step}.tar.gz", engine.model, rank=step)
            names.append(client.publish(archive).name)
    for name in names[:4]:
        _age(lora_dir / name, 3)
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        client.sample([1, 2], adapter=names[0])  # loaded on the engine (this client's lease ends with it)
    lease = hold(str(lora_dir), names[1])  # another run using it
    try:
        argv = ["adapters", "--base-url", engine.url, "--lora-base-dir", str(lora_dir)]
        assert main(argv) == 0
        listing = capsys.readouterr().out
        for name in names:
            assert name in listing
        assert str(tmp_path / "step-1.tar.gz") in listing and " 3 h " in listing and "loaded" in listing
        assert "leased" in listing and "5 adapters in" in listing
        assert main([*argv, "--older-than", "1h", "--dry-run"]) == 0
        assert "would remove" in capsys.readouterr().out and all((lora_dir / n).is_dir() for n in names)
        assert main([*argv, "--older-than", "1h"]) == 0
        out = capsys.readouterr().out
    finally:
        lease.release()
    assert f"kept {names[0]}: loaded on the engine" in out and f"kept {names[1]}: another run holds a lease" in out
    assert [n for n in names if (lora_dir / n).is_dir()] == [names[0], names[1], names[4]]
    assert "2 adapters removed" in out
    assert main(["adapters", "--base-url", engine.url, "--lora-base-dir", str(lora_dir), "--older-than", "soon"]) == 2


def test_adapters_lists_a_folder_without_an_engine_and_removes_nothing_without_one(
    engine: FakeEngine, lora_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """No --base-url: the folder is listed (source, size, age) and says the engine was not asked; --older-than needs
    the engine (it spares loaded adapters), so without one it is a usage error and every folder stays."""
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        names = [
            client.publish(write_adapter_archive(tmp_path / f"s{n}.tar.gz", engine.model, rank=n)).name for n in (1, 2)
        ]
    for name in names:
        _age(lora_dir / name, 3)
    assert main(["adapters", "--lora-base-dir", str(lora_dir)]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in names) and "2 adapters in" in listing and " 3 h " in listing
    assert "no --base-url" in listing and "loaded" not in listing.replace("which of these it has loaded", "")
    assert main(["adapters", "--lora-base-dir", str(lora_dir), "--older-than", "1h"]) == 2
    assert "--older-than needs --base-url" in capsys.readouterr().err
    assert all((lora_dir / name).is_dir() for name in names)
