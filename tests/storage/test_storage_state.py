"""A model of publishing from a store that changes and misbehaves between publishes (hypothesis' state machine).

Each step changes the store (uploads one of three archives under one key, deletes it, or has it rewritten right
after its next HEAD) and sets or clears a fault (silent, dripping, dropping) on HEAD, GET or the listing, then
publishes the key; the store, the published folders and the digest caches carry over from step to step. Invariants: a
publish ends within its bound (never a hang), returns an adapter holding exactly the bytes of one archive the key
held (its digest), or raises a ``PublishError``, never anything else; no temporary folder is ever left; with no
fault and no rewrite pending, a present object publishes and an absent one is "no such object". Bounded: a few
examples of a few steps: 1 s timeouts while a fault is set (a faulty request is cut within them), 5 s without one
(a healthy request is never cut by a slow machine; a hang is still caught by the publish's bound).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from _faultstore import BUCKET, FaultStore, outcome_within
from _s3server import temporaries
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lora_sampler.errors import PublishError
from lora_sampler.publish import checkpoint_digest, publish_checkpoint
from lora_sampler.testing import write_adapter_archive

KEY = "run/step-1.tar.gz"
URL = f"s3://{BUCKET}/{KEY}"
#: A publish's bound here: HEAD and GET at 2 s each (connect + read) while a fault is set, 10 s each without one,
#: retries inside; far below a hang.
BOUND = 30.0
FAULTS = st.sampled_from([None, "silent", "drip-body", "drop"])


class PublishFromAFaultyStore(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="storage-state-"))
        self.lora_dir = self.folder / "loras"
        self.lora_dir.mkdir()
        self.store = FaultStore(drip_interval=0.1)
        self.tight = self.store.options(config_kwargs={"connect_timeout": 1, "read_timeout": 1})
        self.loose = self.store.options(config_kwargs={"connect_timeout": 5, "read_timeout": 5})
        self.archives: List[bytes] = []
        self.digests: Dict[bytes, str] = {}
        for rank in (2, 4, 8):
            path = self.folder / f"rank-{rank}.tar.gz"
            write_adapter_archive(path, "tiny-base", rank=rank)
            self.archives.append(path.read_bytes())
            self.digests[path.read_bytes()] = str(checkpoint_digest(path))

    @rule(
        change=st.sampled_from(["upload", "delete", "rewrite after its HEAD", "none"]),
        variant=st.integers(0, 2),
        operation=st.sampled_from(["HEAD", "GET", "LIST"]),
        fault=FAULTS,
    )
    def change_then_publish(self, change: str, variant: int, operation: str, fault: Optional[str]) -> None:
        """Change the store (the object, one fault), then publish the key and check what came back."""
        if change == "upload":
            self.store.objects[KEY] = self.archives[variant]
        elif change == "delete":
            self.store.objects.pop(KEY, None)
        elif change == "rewrite after its HEAD":
            self.store.changes[KEY] = self.archives[variant]
        if fault is None:
            self.store.faults.pop(operation, None)
        else:
            self.store.faults[operation] = fault
        self.publish()

    def publish(self) -> None:
        before = self.store.objects.get(KEY)
        after = self.store.changes.get(KEY, before)
        healthy = not self.store.faults and KEY not in self.store.changes
        options = self.tight if self.store.faults else self.loose
        result = outcome_within(
            lambda: publish_checkpoint(URL, self.lora_dir, storage_options=options),
            BOUND,
            f"a publish (faults {self.store.faults})",
        )
        if isinstance(result, BaseException):
            assert isinstance(result, PublishError), repr(result)
            assert URL in str(result)
            if healthy:
                assert before is None and "no such object" in str(result), str(result)
            return
        assert result.digest in {self.digests[data] for data in (before, after) if data is not None}
        assert os.path.isfile(os.path.join(str(result.path), "adapter_config.json"))
        if healthy:
            assert before is not None and result.digest == self.digests[before]

    @invariant()
    def nothing_half_published(self) -> None:
        assert temporaries(self.lora_dir) == []

    def teardown(self) -> None:
        self.store.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


#: No AWS account is asked (storage/conftest.py): only the stand-in each machine starts.
pytestmark = pytest.mark.usefixtures("no_aws_account")
TestPublishFromAFaultyStore = PublishFromAFaultyStore.TestCase
TestPublishFromAFaultyStore.settings = settings(max_examples=6, stateful_step_count=5, deadline=None)
