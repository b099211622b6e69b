"""requests' ``HTTPAdapter`` whose direct connections record themselves, so deadlines and Ctrl-C can cut them.

Only requests' documented extension points are used: ``HTTPAdapter`` subclassing, ``get_connection_with_tls_context``
("exposed for use when subclassing", requests >= 2.32.2) and ``build_connection_pool_key_attributes``
(https://requests.readthedocs.io/en/latest/api/#requests.adapters.HTTPAdapter). For a URL reached without a proxy
the adapter hands out its own urllib3 pools of recording connections (``connections``), built with urllib3's public
pool constructors from the TLS settings requests computed; through a proxy it is requests' own adapter unchanged.
Everything else (sending, retries off, the mapping of urllib3's errors) is requests' ``HTTPAdapter.send``.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Mapping, Optional, Tuple, cast

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.poolmanager import SSL_KEYWORDS

from lora_sampler._transport.connections import RecordingHTTPConnectionPool, RecordingHTTPSConnectionPool

#: Hosts (with their TLS settings) whose pools an adapter keeps; requests' own default is 10.
POOLS_PER_ADAPTER = 4
#: URLs whose pool is remembered (the client sends to a handful).
MAX_CACHED_URLS = 64

PoolKey = Tuple[str, str, int, Tuple[Tuple[str, Any], ...]]


class EngineAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` with retries off whose direct pools build connections a ``Slot`` can cut.

    Args:
        pool_maxsize: Connections kept per host (threads that may send at once, plus headroom).
    """

    def __init__(self, pool_maxsize: int):
        self.pool_maxsize = pool_maxsize
        self.recording_pools: Dict[PoolKey, urllib3.HTTPConnectionPool] = {}
        #: The pool of each (URL, verify, cert) seen: the same few URLs come back on every request.
        self.pool_of_url: Dict[Tuple[Any, ...], urllib3.HTTPConnectionPool] = {}
        self.recording_lock = threading.Lock()
        super().__init__(pool_connections=POOLS_PER_ADAPTER, pool_maxsize=pool_maxsize, max_retries=0)

    def get_connection_with_tls_context(
        self,
        request: requests.PreparedRequest,
        verify: Any,
        proxies: Optional[Mapping[str, str]] = None,
        cert: Any = None,
    ) -> urllib3.HTTPConnectionPool:
        """Return the pool for ``request``: a recording pool when no proxy applies, requests' own otherwise."""
        if proxies and requests.utils.select_proxy(str(request.url), proxies):
            pool = super().get_connection_with_tls_context(request, verify, proxies, cert)
            return cast(urllib3.HTTPConnectionPool, pool)
        known = (request.url, verify, cert)
        found = self.pool_of_url.get(known)
        if found is not None:
            return found
        found = self._recording_pool_for(request, verify, cert)
        with self.recording_lock:
            if len(self.pool_of_url) >= MAX_CACHED_URLS:
                self.pool_of_url.clear()
            self.pool_of_url[known] = found
        return found

    def _recording_pool_for(
        self, request: requests.PreparedRequest, verify: Any, cert: Any
    ) -> urllib3.HTTPConnectionPool:
        host_params, pool_kwargs = self.build_connection_pool_key_attributes(request, verify, cert)
        scheme = str(host_params["scheme"])
        host = str(host_params["host"])
        port = int(host_params["port"] or (443 if scheme == "https" else 80))
        key: PoolKey = (scheme, host, port, tuple(sorted(pool_kwargs.items(), key=lambda item: item[0])))
        found = self.recording_pools.get(key)
        if found is not None:
            return found
        with self.recording_lock:
            found = self.recording_pools.get(key)
            if found is None:
                found = self.recording_pools[key] = _recording_pool(
                    scheme, host, port, self.pool_maxsize, dict(pool_kwargs)
                )
        return found

    def request_url(self, request: requests.PreparedRequest, proxies: Optional[Mapping[str, str]]) -> str:
        """Return the request target: the URL's path and query when no proxy is configured, as requests does.

        requests' own ``request_url`` parses the URL twice to find a proxy; with none configured, its answer is the
        path (a leading ``//`` folded, as there).
        """
        if proxies:
            url: str = super().request_url(request, proxies)
            return url
        path = request.path_url
        return "/" + path.lstrip("/") if path.startswith("//") else path

    def close(self) -> None:
        """Close every pooled connection now: requests' pools (proxies) and the recording ones."""
        super().close()
        with self.recording_lock:
            pools = list(self.recording_pools.values())
            self.recording_pools.clear()
            self.pool_of_url.clear()
        for pool in pools:
            pool.close()


def _recording_pool(
    scheme: str, host: str, port: int, maxsize: int, pool_kwargs: Dict[str, Any]
) -> urllib3.HTTPConnectionPool:
    """Build a recording pool as urllib3's ``PoolManager`` would: TLS settings only for https."""
    if scheme == "https":
        return RecordingHTTPSConnectionPool(host, port, maxsize=maxsize, block=False, **pool_kwargs)
    if scheme != "http":
        raise requests.exceptions.InvalidSchema(f"no connection adapter for {scheme}:// URLs")
    plain = {name: value for name, value in pool_kwargs.items() if name not in SSL_KEYWORDS}
    return RecordingHTTPConnectionPool(host, port, maxsize=maxsize, block=False, **plain)
