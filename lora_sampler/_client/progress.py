"""The progress bar of ``SamplerClient.sample_many(progress=True)``.

tqdm is the optional ``cli`` extra, imported only when a bar is asked for; a missing tqdm is an ``ImportError``
naming the extra.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional


def collect_with_progress(results: Iterator[Any], requests: Iterable[Any]) -> List[Any]:
    """Drain ``results`` into a list while a tqdm bar counts them (the total is known for a list or tuple)."""
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError("progress=True needs tqdm: pip install 'lora_sampler[cli]'") from None
    total: Optional[int] = len(requests) if isinstance(requests, (list, tuple)) else None
    return list(tqdm(results, total=total, unit="req"))
