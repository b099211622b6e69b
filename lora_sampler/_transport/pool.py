"""The ``requests.Session`` of one engine, its pooled connections, and the sending of one request on them.

Speed: ``Session.request`` re-reads the environment (proxies, CA bundle, netrc) and builds cookie jars and hook
tables on every call, which more than doubles the client's CPU per request. The environment is read once here
instead, and requests go straight to the session's own pooled connections, configured by requests itself (TLS
verification, CA bundle, client certificate). The full ``Session`` path is kept whenever a proxy applies to the
engine URL, or when a test library has patched requests' transport (``responses``, ``requests-mock``), so those
keep working exactly as with plain requests. Sending only: no reading of the answer, no translation.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union, cast
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter

from lora_sampler._transport.cancel import track_connections
from lora_sampler._transport.deadline import DeadlineAdapter
from lora_sampler._transport.exchange import Exchange, pool_timeout
from lora_sampler._version import __version__

#: Extra pooled connections beyond ``max_workers``: proactive loads and callers' own threads run beside the pool.
POOL_HEADROOM = 4

# The transport methods as requests ships them: when a test library patches them, take the full Session path.
_PRISTINE_ADAPTER_SEND = HTTPAdapter.send
_PRISTINE_GET_ADAPTER = requests.Session.get_adapter


class EnginePool:
    """One engine's session and connection pool, with the auth and identity headers every request carries.

    Args:
        base_url: The printable engine root (no userinfo); its path prefixes every request path.
        api_key: Sent as ``Authorization: Bearer ...`` when given.
        basic: ``(user, password)`` from the URL's userinfo; without it and without a key, ``~/.netrc`` is read.
        max_workers: Threads that may send at once; the pool keeps that many connections plus headroom.
        verify: TLS verification: True, False, or a CA bundle path.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: Optional[str],
        basic: Optional[Tuple[str, str]],
        max_workers: int,
        verify: Union[bool, str],
    ):
        self.base_url = base_url
        self._prefix = urlsplit(base_url).path
        self.session = requests.Session()
        self._adapter = DeadlineAdapter(pool_connections=4, pool_maxsize=max_workers + POOL_HEADROOM, max_retries=0)
        self.session.mount("http://", self._adapter)
        self.session.mount("https://", self._adapter)
        # The environment requests users rely on (HTTP(S)_PROXY, NO_PROXY, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE,
        # ~/.netrc) is read here, once, instead of on every request.
        settings = self.session.merge_environment_settings(base_url, {}, None, verify, None)
        self.session.trust_env = False
        self.session.verify = settings["verify"]
        self.session.proxies = settings["proxies"]
        self.headers: Dict[str, str] = {"User-Agent": f"lora-sampler/{__version__}", "Accept": "*/*"}
        self.basic = None if api_key else basic or _netrc_auth(base_url)
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        elif self.basic:
            self.headers["Authorization"] = requests.auth._basic_auth_str(*self.basic)
        self.session.headers.update(self.headers)
        self._pool = self._direct_pool()
        if self._pool is not None:
            track_connections(self._pool)  # so an interrupted fan-out can shut its requests' sockets down

    def _direct_pool(self) -> Optional[urllib3.HTTPConnectionPool]:
        """Return the adapter's pool for the engine, configured by requests, or None when a proxy applies."""
        if requests.utils.select_proxy(self.base_url, self.session.proxies):
            return None
        probe = requests.Request("GET", self.base_url + "/").prepare()
        if hasattr(self._adapter, "get_connection_with_tls_context"):  # requests >= 2.32.2
            pool = self._adapter.get_connection_with_tls_context(probe, self.session.verify, None, None)
        else:  # pragma: no cover - older requests
            pool = self._adapter.get_connection(self.base_url, None)
            self._adapter.cert_verify(pool, self.base_url, self.session.verify, None)  # type: ignore[no-untyped-call]
        return cast(urllib3.HTTPConnectionPool, pool)

    def is_direct(self) -> bool:
        """Whether requests go straight to the pool: no proxy applies and no test library patched requests."""
        return (
            self._pool is not None
            and HTTPAdapter.send is _PRISTINE_ADAPTER_SEND
            and type(self.session).get_adapter is _PRISTINE_GET_ADAPTER
        )

    def open(self, exchange: Exchange) -> Any:
        """Send one request and return urllib3's response with the status and headers read, the body not yet.

        Raises:
            requests.RequestException, urllib3.exceptions.HTTPError, OSError: as the libraries raise them.
        """
        if not self.is_direct():
            return self._session_request(exchange).raw
        assert self._pool is not None
        return self._pool.urlopen(
            exchange.method,
            self._prefix + exchange.path,
            body=exchange.data,
            headers={**self.headers, **exchange.headers},
            timeout=pool_timeout(exchange.timeout)[2],
            retries=False,
            redirect=False,
            assert_same_host=False,
            preload_content=False,
            release_conn=False,
        )

    def _session_request(self, exchange: Exchange) -> requests.Response:
        """Send through ``Session.request``: the path for proxies and for patched (mocked) transports."""
        return self.session.request(
            exchange.method,
            self.base_url + exchange.path,
            data=exchange.data,
            headers=exchange.headers,
            timeout=exchange.timeout,
            stream=True,
            allow_redirects=False,
        )

    def close(self) -> None:
        """Close every pooled connection now, direct and through proxies.

        ``Session.close`` forgets the direct pool without closing it (its sockets would stay open until garbage
        collection), so it is closed here first.
        """
        if self._pool is not None:
            self._pool.close()
        self.session.close()


def _netrc_auth(base_url: str) -> Optional[Tuple[str, str]]:
    found: Any = requests.utils.get_netrc_auth(base_url)
    return cast(Optional[Tuple[str, str]], found)
