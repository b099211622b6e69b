"""The futures the fan-out hands out are created as what they are: no class is reassigned on a live object."""

from __future__ import annotations

import ast
import pathlib
import threading
from typing import List, Sequence

from lora_sampler._client.fanout import FanOut, SampleFuture

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "lora_sampler"


def class_swaps() -> List[str]:
    """Every ``something.__class__ = ...`` in the package, as ``file:line``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign):
                found += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}"
                    for target in node.targets
                    if isinstance(target, ast.Attribute) and target.attr == "__class__"
                ]
    return found


def test_no_class_is_swapped_on_a_live_object() -> None:
    assert class_swaps() == []


def test_submit_returns_a_sample_future_settled_by_its_worker() -> None:
    fanout = FanOut(1)
    ran: List[int] = []

    def record(batch: Sequence[int]) -> List[None]:  # a fan-out runs batches: each submit is a batch of one
        ran.extend(batch)
        return [None] * len(batch)

    try:
        release = threading.Event()
        slow = fanout.submit(lambda batch: [release.wait(10) and batch[0] * 2], 21)  # type: ignore[arg-type]
        failing = fanout.submit(lambda batch: [1 / batch[0]], 0)  # type: ignore[arg-type]
        cancelled = fanout.submit(record, 7)  # type: ignore[arg-type]
        assert all(type(future) is SampleFuture for future in (slow, failing, cancelled))
        assert cancelled.cancel()  # not started: the one worker is busy
        release.set()
        assert slow.result(10) == 42 and isinstance(failing.exception(10), ZeroDivisionError)
        assert fanout.submit(record, 8).result(10) is None  # type: ignore[arg-type]
        assert cancelled.cancelled() and ran == [8]  # a cancelled future's request never ran
    finally:
        fanout.close()
