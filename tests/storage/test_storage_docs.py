"""The object-storage examples of the docs run as written, against a real S3 API server on loopback (moto).

They are the blocks marked ``<!-- docs-test: tox -e storage -->`` (see ``tests/_markdown.py``); the default suite
skips them. Each runs with ``client`` (a ``SamplerClient`` of a FakeEngine, publishing into ``loras``) and
``prompt`` bound, the environment pointing the storage library at the server, and bucket ``ckpts`` holding
``run1/step-400.tar.gz`` (an archive) and ``run1/step-500/`` (an adapter folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest
from _markdown import examples
from _s3server import BUCKET

from lora_sampler import SamplerClient
from lora_sampler.testing import FakeEngine, write_adapter, write_adapter_archive

BLOCKS = [block for block in examples("python") if block.env == "storage"]


def test_the_docs_have_storage_examples() -> None:
    """The object-storage guide has examples for this env (a marker typo would leave this file running none)."""
    assert any(block.where.startswith("docs/guides/object-storage.md") for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_storage_docs_example_runs(block: Any, s3: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """A storage example of the docs publishes and samples from the loopback store, as written."""
    monkeypatch.chdir(tmp_path)
    with FakeEngine(lora_dir="loras") as engine, SamplerClient(engine.url, lora_base_dir="loras") as client:
        s3.upload_file(str(write_adapter_archive("step-400.tar.gz", engine.model)), BUCKET, "run1/step-400.tar.gz")
        folder = write_adapter(tmp_path / "step-500", engine.model)
        for path in sorted(Path(folder).iterdir()):
            s3.upload_file(str(path), BUCKET, f"run1/step-500/{path.name}")
        names: Dict[str, Any] = {"__name__": "storage_example", "client": client, "prompt": "Once upon a time"}
        exec(compile(block.code, block.where, "exec"), names)
        published = sorted(entry.name for entry in Path("loras").iterdir() if not entry.name.startswith("."))
        assert [name.rsplit("-", 1)[0] for name in published] == ["step-400", "step-500"], published
