"""A small HTTP client for the price sources (stdlib only): separate connect and read timeouts,
retries with backoff on 5xx/429 and dropped connections, a User-Agent, proxies from the
environment (``HTTPS_PROXY`` ...), and every failure turned into a :class:`SourceError` that
names the host and says what went wrong in words.

Timeouts and backoff can be changed through the environment:
``CLOUDTRAIN_HTTP_CONNECT_TIMEOUT`` (10 s), ``CLOUDTRAIN_HTTP_READ_TIMEOUT`` (60 s),
``CLOUDTRAIN_HTTP_RETRIES`` (3), ``CLOUDTRAIN_HTTP_BACKOFF`` (1 s, doubled each retry).
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping

from . import SourceError

MAX_RETRY_AFTER = 60.0


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name, "").strip()
    try:
        return float(v) if v else default
    except ValueError:
        return default


def _user_agent() -> str:
    try:
        from importlib.metadata import version

        ver = version("cloudtrain")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        ver = "dev"
    return f"cloudtrain/{ver} (catalog refresh)"


@dataclass
class HttpConfig:
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    user_agent: str = ""

    @classmethod
    def from_env(cls, read_timeout: float | None = None) -> HttpConfig:
        return cls(connect_timeout=_env_float("CLOUDTRAIN_HTTP_CONNECT_TIMEOUT", 10.0),
                   read_timeout=read_timeout if read_timeout is not None
                   else _env_float("CLOUDTRAIN_HTTP_READ_TIMEOUT", 60.0),
                   retries=int(_env_float("CLOUDTRAIN_HTTP_RETRIES", 3)),
                   backoff=_env_float("CLOUDTRAIN_HTTP_BACKOFF", 1.0),
                   user_agent=_user_agent())


# --- connections whose socket gets the read timeout once connected ----------------------------

class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, read_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timeout = read_timeout

    def connect(self) -> None:
        super().connect()
        if self._read_timeout is not None and self.sock is not None:
            self.sock.settimeout(self._read_timeout)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, read_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timeout = read_timeout

    def connect(self) -> None:
        super().connect()
        if self._read_timeout is not None and self.sock is not None:
            self.sock.settimeout(self._read_timeout)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, read_timeout: float) -> None:
        super().__init__()
        self._rt = read_timeout

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_HTTPConnection, req, read_timeout=self._rt)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, read_timeout: float) -> None:
        super().__init__()
        self._rt = read_timeout

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        context = self._context  # type: ignore[attr-defined]  # urllib's own; typeshed omits it
        return self.do_open(_HTTPSConnection, req, context=context, read_timeout=self._rt)


# --- errors in words --------------------------------------------------------------------------

_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}


def _describe(exc: BaseException, cfg: HttpConfig) -> tuple[str, bool, bool]:
    """(reason, unreachable, worth retrying) for a failure below HTTP."""
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        inner = exc.reason
        if isinstance(inner, BaseException):
            exc = inner
        else:
            return str(inner), True, False
    if isinstance(exc, socket.gaierror):
        return "name resolution failed: offline, or no DNS", True, False
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return (f"no answer within the timeout ({cfg.connect_timeout:g} s to connect, "
                f"{cfg.read_timeout:g} s to read)"), True, False
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused", True, False
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted ({exc.verify_message})", True, False
    if isinstance(exc, ssl.SSLError):
        return f"TLS error ({exc.reason or exc})", True, True
    if isinstance(exc, (http.client.RemoteDisconnected, http.client.IncompleteRead,
                        ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return "the connection was dropped", True, True
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return "network unreachable", True, False
        return (exc.strerror or str(exc)), True, exc.errno in _TRANSIENT_ERRNOS
    if isinstance(exc, http.client.HTTPException):
        return f"bad HTTP answer ({type(exc).__name__})", False, True
    return str(exc) or type(exc).__name__, True, False


def _http_error_detail(e: urllib.error.HTTPError) -> str:
    """The server's own words, briefly (Google and Azure put them in a JSON error object)."""
    try:
        body = e.read(4096).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - an unreadable error body: the status code says enough
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    err = data.get("error", data) if isinstance(data, dict) else None
    if isinstance(err, dict):
        msg = err.get("message") or err.get("Message")
        if isinstance(msg, str):
            return msg.strip().splitlines()[0][:200] if msg.strip() else ""
    return ""


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    v = e.headers.get("Retry-After") if e.headers else None
    try:
        return min(float(v), MAX_RETRY_AFTER) if v else None
    except ValueError:
        return None


class Http:
    """GETs with retries; ``sleep`` is injectable for tests."""

    def __init__(self, cfg: HttpConfig | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg or HttpConfig.from_env()
        self._sleep = sleep
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler(), _HTTPHandler(self.cfg.read_timeout),
            _HTTPSHandler(self.cfg.read_timeout))

    @staticmethod
    def host(url: str) -> str:
        return urllib.parse.urlsplit(url).hostname or url

    def _with_retries(self, url: str, headers: Mapping[str, str] | None,
                      consume: Callable[[http.client.HTTPResponse], Any]) -> Any:
        host = self.host(url)
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise SourceError(host, f"not an http(s) URL: {url}")
        hdrs = {"User-Agent": self.cfg.user_agent or _user_agent(), "Accept": "*/*"}
        hdrs.update(headers or {})
        attempt = 0
        while True:
            req = urllib.request.Request(url, headers=hdrs)
            delay: float | None = None
            try:
                with self._opener.open(req, timeout=self.cfg.connect_timeout) as resp:
                    return consume(resp)
            except urllib.error.HTTPError as e:
                transient = e.code == 429 or 500 <= e.code < 600
                detail = _http_error_detail(e)
                reason = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
                if not transient or attempt >= self.cfg.retries:
                    if transient and attempt:
                        reason += f" (after {attempt + 1} attempts)"
                    raise SourceError(host, reason) from None
                delay = _retry_after(e)
            except SourceError:
                raise
            except (OSError, http.client.HTTPException) as e:
                reason, unreachable, transient = _describe(e, self.cfg)
                if not transient or attempt >= self.cfg.retries:
                    raise SourceError(host, reason, unreachable=unreachable) from None
            if delay is None:
                delay = self.cfg.backoff * (2 ** attempt)
            self._sleep(delay)
            attempt += 1

    def get_json(self, url: str, headers: Mapping[str, str] | None = None) -> Any:
        def consume(resp: http.client.HTTPResponse) -> Any:
            body = resp.read()
            try:
                return json.loads(body)
            except ValueError:
                raise SourceError(self.host(url), "the answer is not JSON "
                                  f"(HTTP {resp.status}, {len(body)} bytes)") from None

        return self._with_retries(url, headers, consume)

    def download(self, url: str, dest: IO[bytes],
                 on_bytes: Callable[[int], None] | None = None) -> int:
        """Stream the body into ``dest`` (rewound and truncated on a retry); bytes written."""
        def consume(resp: http.client.HTTPResponse) -> int:
            dest.seek(0)
            dest.truncate()
            n = 0
            while True:
                chunk = resp.read(1 << 20)
                if not chunk:
                    break
                dest.write(chunk)
                n += len(chunk)
                if on_bytes is not None:
                    on_bytes(n)
            return n

        return self._with_retries(url, None, consume)
