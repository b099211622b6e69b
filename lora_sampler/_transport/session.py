"""The ``requests.Session`` of one engine (the client's own, or the user's), and the sending of one request on it.

Every request goes through ``Session.send`` (with ``stream=True``), so the session's mounted adapters, cookies,
hooks, TLS settings and proxies apply, and what ``responses`` or ``requests-mock`` patch is what runs. A user's
session prepares each request with ``Session.prepare_request`` (its auth, headers and cookies apply, as with
``Session.request``). The client's own session reads the environment requests users rely on (``HTTP(S)_PROXY``,
``NO_PROXY``, ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``, ``~/.netrc``) and merges its headers and auth once, when
it is made, instead of on every request: each request is then prepared with ``PreparedRequest``'s documented
``prepare_*`` steps from those fixed headers (the session's cookies are still sent once it holds any). Sending
only: no reading of the answer, no translation.

The client's own session mounts ``EngineAdapter``: requests' ``HTTPAdapter`` whose direct connections record
themselves, so deadlines and Ctrl-C can cut them. Only requests' documented extension points are used:
``HTTPAdapter`` subclassing, ``get_connection_with_tls_context`` ("exposed for use when subclassing", requests >=
2.32.2) and ``build_connection_pool_key_attributes``
(https://requests.readthedocs.io/en/latest/api/#requests.adapters.HTTPAdapter). For the engine reached without a
proxy the adapter hands out its one urllib3 pool of recording connections (``connections``), built when the session
is made with urllib3's public pool constructor from the TLS settings requests computed; through a proxy it is
requests' own adapter unchanged.
Everything else (sending, retries off, the mapping of urllib3's errors) is requests' ``HTTPAdapter.send``.
"""

from __future__ import annotations

import netrc
import os
from typing import Any, Dict, Mapping, Optional, Tuple, Union, cast
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter
from requests.structures import CaseInsensitiveDict
from urllib3.poolmanager import SSL_KEYWORDS

from lora_sampler._transport.connections import RecordingHTTPConnectionPool, RecordingHTTPSConnectionPool
from lora_sampler._transport.exchange import Exchange, without_userinfo
from lora_sampler._version import __version__

#: Extra pooled connections beyond ``max_workers``: proactive loads and callers' own threads run beside the pool.
POOL_HEADROOM = 4
#: Hosts (with their TLS settings) whose pools requests' own part of an adapter keeps (proxies, other hosts).
POOLS_PER_ADAPTER = 4


class EngineAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` with retries off whose pool for the engine builds connections a ``Slot`` can cut.

    Every request of the client's own session goes to one engine, with the TLS settings fixed when the session was
    made: the adapter builds that one pool when it is made, and hands it out for every request sent straight to the
    engine with those settings. Anything else (a proxy, another host, other TLS settings) gets requests' own pool.

    Args:
        root: A request prepared for the engine's root URL (its scheme, host and port).
        verify: The TLS verification the session sends with: True, False, or a CA bundle path.
        pool_maxsize: Connections kept per host (threads that may send at once, plus headroom).
    """

    def __init__(self, root: requests.PreparedRequest, verify: Union[bool, str], pool_maxsize: int):
        super().__init__(pool_connections=POOLS_PER_ADAPTER, pool_maxsize=pool_maxsize, max_retries=0)
        self.pool_maxsize = pool_maxsize
        self.verify = verify
        host_params, pool_kwargs = self.build_connection_pool_key_attributes(root, verify, None)
        parts = urlsplit(str(root.url))
        #: What the URL of every request this pool serves starts with: ``scheme://host[:port]/``.
        self.origin = f"{parts.scheme}://{parts.netloc}/"
        self.engine_pool = _recording_pool(host_params, pool_kwargs, pool_maxsize)

    def get_connection_with_tls_context(
        self,
        request: requests.PreparedRequest,
        verify: Any,
        proxies: Optional[Mapping[str, str]] = None,
        cert: Any = None,
    ) -> urllib3.HTTPConnectionPool:
        """Return the pool for ``request``: the engine's recording pool when it is sent straight to the engine with
        the session's TLS settings, requests' own otherwise."""
        url = str(request.url)
        direct = not (proxies and requests.utils.select_proxy(url, proxies))
        if direct and url.startswith(self.origin) and verify == self.verify and cert is None:
            return self.engine_pool
        return cast(urllib3.HTTPConnectionPool, super().get_connection_with_tls_context(request, verify, proxies, cert))

    def request_url(self, request: requests.PreparedRequest, proxies: Optional[Mapping[str, str]]) -> str:
        """Return the request target: the URL's path and query when no proxy is configured, as requests does.

        requests' own ``request_url`` parses the URL twice to find a proxy (47k instructions a request under
        callgrind, 2.6% of a whole request); with none configured, its answer is the path (a leading ``//`` folded,
        as there).
        """
        if proxies:
            url: str = super().request_url(request, proxies)
            return url
        path = request.path_url
        return "/" + path.lstrip("/") if path.startswith("//") else path

    def close(self) -> None:
        """Close every pooled connection now: requests' pools (proxies) and the engine's."""
        super().close()
        self.engine_pool.close()


def _recording_pool(
    host_params: Mapping[str, Any], pool_kwargs: Mapping[str, Any], maxsize: int
) -> urllib3.HTTPConnectionPool:
    """Build a recording pool as urllib3's ``PoolManager`` would: TLS settings only for https."""
    scheme, host, port = host_params["scheme"], host_params["host"], host_params["port"]
    if scheme == "https":
        return RecordingHTTPSConnectionPool(host, port or 443, maxsize=maxsize, block=False, **pool_kwargs)
    plain = {name: value for name, value in pool_kwargs.items() if name not in SSL_KEYWORDS}
    return RecordingHTTPConnectionPool(host, port or 80, maxsize=maxsize, block=False, **plain)


class EngineSession:
    """One engine's ``requests.Session``, with the auth and identity headers every request carries.

    Args:
        base_url: The printable engine root (no userinfo); its path prefixes every request path.
        api_key: Sent as ``Authorization: Bearer ...`` when given.
        basic: ``(user, password)`` from the URL's userinfo; without it and without a key, ``~/.netrc`` is read.
        max_workers: Threads that may send at once; the client's own pool keeps that many connections plus headroom.
        verify: TLS verification of the client's own session: True, False, or a CA bundle path.
        session: The user's session; None makes the client's own.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: Optional[str],
        basic: Optional[Tuple[str, str]],
        max_workers: int,
        verify: Union[bool, str],
        session: Optional[requests.Session] = None,
    ):
        self.base_url = base_url
        self.owned = session is None
        self.basic: Optional[Tuple[str, str]] = None
        self._request_headers: Dict[str, str] = {}
        self._request_auth: Optional[Tuple[str, str]] = None
        self._send_settings: Optional[Dict[str, Any]] = None
        self._fixed_headers: Optional[Dict[str, str]] = None
        #: The prepared (quoted, IDNA-encoded) engine root of the client's own session, no trailing slash.
        self._root = ""
        if session is None:
            self.session = self._own_session(api_key, basic, max_workers, verify)
        else:
            if not isinstance(session, requests.Session):
                raise TypeError(f"session must be a requests.Session, got {type(session).__name__}")
            if verify is not True:
                raise ValueError(
                    "verify= has no effect with session=: the session's own TLS settings are used; set "
                    "session.verify (True, False, or a CA bundle path) instead"
                )
            refuse_answer_retries(session, base_url)
            self.session = session
            if api_key:  # a session's auth handler (if it has one) runs after this, as requests always does
                self._request_headers["Authorization"] = f"Bearer {api_key}"
            elif basic and session.auth is None:
                self.basic = self._request_auth = basic

    @property
    def proxy(self) -> str:
        """The proxy requests to the engine go through (``HTTP(S)_PROXY``, a session's proxies), "" when direct.

        Printable: its ``user:password@`` is taken out. Named in errors, as what answered or refused.
        """
        url = self.base_url + "/"
        proxies = self._send_settings["proxies"] if self._send_settings is not None else None
        if proxies is None:  # a user's session: its proxies merged with the environment, as each send does
            proxies = self.session.merge_environment_settings(url, {}, None, None, None)["proxies"]
        return without_userinfo(requests.utils.select_proxy(url, proxies) or "")

    def _own_session(
        self, api_key: Optional[str], basic: Optional[Tuple[str, str]], max_workers: int, verify: Union[bool, str]
    ) -> requests.Session:
        session = requests.Session()
        # ``merge_environment_settings`` is what ``Session.request`` calls on every request; once is enough here.
        settings: Dict[str, Any] = dict(session.merge_environment_settings(self.base_url, {}, True, verify, None))
        session.trust_env = False  # read above; prepare_request must not read ~/.netrc again on every request
        session.verify = settings["verify"]
        session.proxies = settings["proxies"]
        self._send_settings = settings
        session.headers["User-Agent"] = f"lora-sampler/{__version__}"
        del session.headers["Connection"]  # "keep-alive" is what HTTP/1.1 means without it
        if api_key:
            session.headers["Authorization"] = f"Bearer {api_key}"
        else:
            self.basic = basic or netrc_auth(self.base_url)
            if self.basic:
                session.auth = self.basic  # requests sends it as basic auth (HTTPBasicAuth)
        # The session's headers with its auth applied, as prepare_request merges them into every request.
        template = session.prepare_request(requests.Request("GET", self.base_url + "/"))
        self._fixed_headers = {name: value for name, value in template.headers.items() if name != "Content-Length"}
        self._root = str(template.url).removesuffix("/")  # every request's URL is this root and its path
        adapter = EngineAdapter(template, settings["verify"], max_workers + POOL_HEADROOM)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        return session

    def _prepare_fixed(self, exchange: Exchange) -> requests.PreparedRequest:
        """Prepare a request of the client's own session from its fixed headers (no per-request merging)."""
        assert self._fixed_headers is not None
        prepared = requests.PreparedRequest()
        prepared.method = exchange.method
        prepared.url = self._root + exchange.path  # the client's paths are plain ASCII: quoting leaves them as they are
        # The fixed headers were checked by prepare_headers when the session was made; http.client checks each
        # header again as it is sent (a newline in a session id is refused there).
        prepared.headers = CaseInsensitiveDict(self._fixed_headers)
        prepared.headers.update(exchange.headers)
        prepared.prepare_body(exchange.data, None)
        # The session's cookies (a router or a gateway may set some) are sent back, as requests would.
        prepared.prepare_cookies(self.session.cookies)
        return prepared

    def send(self, exchange: Exchange) -> requests.Response:
        """Send one request through the session and return its response, status and headers read, body not.

        Redirects are not followed (the translation refuses them, naming their target).

        Raises:
            requests.RequestException: as requests raises it.
        """
        settings = self._send_settings
        if settings is not None:
            prepared = self._prepare_fixed(exchange)
        else:  # a user's session: prepared and merged with its environment as Session.request does
            headers = {**self._request_headers, **exchange.headers}
            url = self.base_url + exchange.path
            request = requests.Request(
                exchange.method, url, headers=headers, data=exchange.data, auth=self._request_auth
            )
            prepared = self.session.prepare_request(request)
            settings = dict(self.session.merge_environment_settings(str(prepared.url), {}, True, None, None))
        response: requests.Response = self.session.send(
            prepared, timeout=exchange.timeout, allow_redirects=False, **settings
        )
        return response

    def close(self) -> None:
        """Close the client's own session and every pooled connection now; a user's session is left to its owner."""
        if self.owned:
            self.session.close()


#: The methods the client sends: completions, loads and unloads are POSTs; listings, health and probes are GETs.
CLIENT_METHODS = ("POST", "GET")
#: A safe adapter to name in the refusal: it retries connections (nothing was sent yet), never reads or answers.
CONNECT_ONLY = "HTTPAdapter(max_retries=Retry(connect=3, read=False, respect_retry_after_header=False))"


def refuse_answer_retries(session: requests.Session, url: str) -> None:
    """Refuse a user's session whose adapter for ``url`` retries a request after it was sent (urllib3's ``Retry``).

    The client retries by its own table; retries under it multiply every time bound and, when urllib3 gives up on a
    status, leave a ``RetryError`` without the engine's status or words (it drops the body). Connection retries
    (nothing was sent) are kept. What an adapter does in its own ``send`` cannot be seen, and is the user's.

    Raises:
        ValueError: naming what the adapter retries and the adapter to mount instead.
    """
    try:
        adapter = session.get_adapter(url)
    except requests.exceptions.InvalidSchema:  # no adapter for the URL: the first request says so
        return
    retry = adapter.max_retries if isinstance(adapter, HTTPAdapter) else None
    if not isinstance(retry, urllib3.Retry):
        return
    retried = _retried_statuses(retry)
    what = [f"the statuses {retried}"] if retried else []
    if _retries_reads(retry):
        what.append("read errors (a read timeout, a dropped answer)")
    if what:
        raise ValueError(
            f"session=: the adapter mounted for {url} retries {' and '.join(what)} itself ({retry!r}); the client "
            "retries by its own table (retry=RetryPolicy(...)), and retries under it hide the engine's status and "
            "words and multiply every time bound. Mount requests' plain HTTPAdapter() there, or one that retries "
            f"connections only: {CONNECT_ONLY}"
        )


def _retried_statuses(retry: urllib3.Retry) -> str:
    """The statuses ``retry`` retries for a method the client sends (a Retry-After header counted as present)."""
    statuses = [
        status
        for status in range(400, 600)
        if any(retry.is_retry(method, status, has_retry_after=True) for method in CLIENT_METHODS)
    ]
    shown = ", ".join(map(str, statuses[:12]))
    return shown + (f" and {len(statuses) - 12} more" if len(statuses) > 12 else "")


def _retries_reads(retry: urllib3.Retry) -> bool:
    """Whether ``retry`` sends a request again after a read error (its ``read`` and ``total`` counts and methods)."""
    counts_allow = all(count is None or count > 0 for count in (retry.read, retry.total))
    methods = retry.allowed_methods
    return counts_allow and (not methods or any(method in methods for method in CLIENT_METHODS))


def netrc_auth(url: str) -> Optional[Tuple[str, str]]:
    """Return ``(login, password)`` for ``url``'s host from ``$NETRC``, ``~/.netrc`` or ``~/_netrc``, as requests does.

    A missing or unreadable file, or one that does not parse, means no credentials (as with requests).
    """
    host = urlsplit(url).hostname
    if not host:
        return None
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for candidate in candidates:
        path = os.path.expanduser(candidate)
        if not os.path.exists(path):
            continue
        try:
            found = netrc.netrc(path).authenticators(host)
        except (netrc.NetrcParseError, OSError):
            return None
        if found:
            login, account, password = found
            return (login or account or "", password or "")
        return None
    return None
