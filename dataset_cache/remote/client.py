"""The object-store client of remote caches: obstore, reduced to the few calls the reader and the publisher make.

obstore (MIT; a Rust core, no Python dependencies) speaks S3, GCS, Azure and plain HTTP with one API: a GET of ONE
byte range per request, ``If-Match`` on reads, create-only and ``If-Match`` puts, and its own retries with
exponential backoff and jitter on server errors, dropped connections and timeouts. Why obstore and not fsspec is
in docs/ARCHITECTURE.md ("Remote caches"). It is an optional extra: this module imports it on first use and says
what to install when it is missing.

Credentials are never ours to handle: obstore reads each provider's environment variables (``AWS_*``,
``GOOGLE_*``, ``AZURE_*``), instance and workload identities, and Google's application-default credentials file;
for S3, the shared ``~/.aws`` files (``AWS_PROFILE``) are read through boto3 when it is installed. A URL never
carries any (:mod:`.urls`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import CacheReplacedError, RemoteExtraMissingError, RemoteUnreachableError
from .urls import CacheURL

__all__ = ["RemoteOptions", "Fetched", "ObjectClient", "load_obstore", "DEFAULT_FETCH_BYTES", "default_fetch_dir"]

DEFAULT_FETCH_BYTES = 20 << 30
"""20 GiB of fetched bytes kept on the local disk (``STREAMCACHE_FETCH_CACHE_GB`` overrides): a typical LoRA
dataset's cache many times over, and little on a disk that holds models."""

_PACK_ROOT = Path(__file__).resolve().parents[2]


def default_fetch_dir() -> Path:
    """Where fetched bytes are kept unless told otherwise: ``$STREAMCACHE_FETCH_CACHE``, else
    ``$XDG_CACHE_HOME/streamcache/fetched`` (``~/.cache/streamcache/fetched``)."""
    env = os.environ.get("STREAMCACHE_FETCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "streamcache" / "fetched"


def _default_fetch_bytes() -> int:
    env = os.environ.get("STREAMCACHE_FETCH_CACHE_GB")
    if env:
        try:
            return max(0, int(float(env) * (1 << 30)))
        except ValueError:
            raise ValueError(f"STREAMCACHE_FETCH_CACHE_GB={env!r}: give a number of GiB (0 keeps nothing)") from None
    return DEFAULT_FETCH_BYTES


@dataclass(frozen=True)
class RemoteOptions:
    """How a remote cache is fetched. The defaults suit S3-like stores; tests and benchmarks shorten the times.

    Attributes:
        fetch_dir: the local disk cache of fetched bytes (default :func:`default_fetch_dir`).
        fetch_bytes: its bound (``STREAMCACHE_FETCH_CACHE_GB``, else :data:`DEFAULT_FETCH_BYTES`); 0 keeps nothing,
            so every read fetches again.
        block_bytes: the unit fetched and kept: a read fetches the blocks its rows lie in, so neighbouring rows come
            with one request, and a block is never fetched twice while it is kept.
        request_bytes: the most one GET asks for (adjacent missing blocks share a request up to this).
        requests_in_flight: GETs of one cache running at once (S3 serves ~5 Gbps per connection, so a read
            fetches its ranges in parallel).
        retries, backoff_s, max_backoff_s, retry_timeout_s: obstore's retries of server errors, dropped
            connections and timeouts (exponential backoff with jitter).
        connect_timeout_s, timeout_s: per request; ``None`` keeps obstore's defaults (5 s and 30 s).
        claim_wait_s: how long a process waits for a block another process sharing the fetch cache is fetching
            (the ranks of a run on several devices) before fetching it too; a claim older than this is taken over,
            so 0 fetches every block this process wants itself.
    """

    fetch_dir: Path | None = None
    fetch_bytes: int = field(default_factory=_default_fetch_bytes)
    block_bytes: int = 4 << 20
    request_bytes: int = 16 << 20
    requests_in_flight: int = 8
    retries: int = 5
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    retry_timeout_s: float = 120.0
    connect_timeout_s: float | None = None
    timeout_s: float | None = None
    claim_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.block_bytes < 4096 or self.request_bytes < self.block_bytes:
            raise ValueError("block_bytes must be >= 4096 and request_bytes >= block_bytes")
        if self.requests_in_flight < 1 or self.retries < 0 or self.fetch_bytes < 0:
            raise ValueError("requests_in_flight must be >= 1, retries and fetch_bytes >= 0")


class Fetched(NamedTuple):
    """A GET's bytes (a buffer), the size of the whole object and its ETag (``None`` when the server sends none)."""

    data: Any
    size: int
    etag: str | None


def load_obstore() -> Any:
    """The ``obstore`` module.

    Raises:
        RemoteExtraMissingError: it is not installed, naming what to install into which python.
    """
    try:
        import obstore
        import obstore.store  # the store constructors
    except ImportError as exc:
        req = _PACK_ROOT / "requirements-remote.txt"
        how = (f"`{sys.executable} -m pip install -r {req}`" if req.is_file()
               else f"`{sys.executable} -m pip install obstore`")
        raise RemoteExtraMissingError(
            f"a cache at a URL (s3://, gs://, az://, https://) needs the optional object-store client obstore, "
            f"which is not installed ({exc}). Install the pack's remote extra into the python that runs it: {how}; "
            "a cache on the local disk needs nothing more") from None
    return obstore


_TRUE = ("1", "true", "yes", "on")


def _allow_http(url: CacheURL) -> bool:
    """Plain HTTP only where the user asked for it: an ``http://`` cache URL, or ``*_ALLOW_HTTP`` set (as for an
    S3-compatible server on the local network, with ``AWS_ENDPOINT_URL=http://...``)."""
    if url.scheme == "http":
        return True
    return any(os.environ.get(f"{p}_ALLOW_HTTP", "").lower() in _TRUE for p in ("AWS", "GOOGLE", "AZURE"))


def _s3_credentials() -> Any:
    """obstore's boto3 credential provider when boto3 finds credentials that obstore would not (the shared
    ``~/.aws`` files, ``AWS_PROFILE``, SSO); ``None`` to leave credentials to obstore (environment, instance
    and workload identities)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in _TRUE:
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:  # boto3 is not ours to require: without it, obstore's own sources apply
        return None
    session = boto3.Session()
    if session.get_credentials() is None:
        return None
    return Boto3CredentialProvider(session)


def short_reason(exc: BaseException) -> str:
    """obstore's message without its debug dump, on one line (it names the method, the URL, the retries)."""
    text = str(exc).split("\n\nDebug source", 1)[0]
    text = re.sub(r"\s+", " ", text).strip()
    return text[:400] + ("..." if len(text) > 400 else "")


class ObjectClient:
    """The objects of one remote cache (paths relative to its URL), fetched and put with obstore.

    Thread-safe (obstore's stores are); calls block the calling thread only (obstore releases the GIL).

    Raises (every method): RemoteExtraMissingError; RemoteUnreachableError (the network, a server error after
    the retries, a timeout, credentials refused), naming the object's URL.
    """

    def __init__(self, url: CacheURL, options: RemoteOptions | None = None) -> None:
        self.url = url
        self.options = options or RemoteOptions()
        self._ob = load_obstore()
        self._store = self._make_store()

    def _make_store(self) -> Any:
        o = self.options
        retry = {"max_retries": o.retries, "retry_timeout": timedelta(seconds=o.retry_timeout_s),
                 "backoff": {"init_backoff": timedelta(seconds=o.backoff_s),
                             "max_backoff": timedelta(seconds=o.max_backoff_s), "base": 2}}
        client: dict[str, Any] = {}
        if _allow_http(self.url):
            client["allow_http"] = True
        if o.connect_timeout_s is not None:
            client["connect_timeout"] = timedelta(seconds=o.connect_timeout_s)
        if o.timeout_s is not None:
            client["timeout"] = timedelta(seconds=o.timeout_s)
        kwargs: dict[str, Any] = {"retry_config": retry}
        if client:
            kwargs["client_options"] = client
        if self.url.scheme == "s3":
            provider = _s3_credentials()
            if provider is not None:
                kwargs["credential_provider"] = provider
        try:
            return self._ob.store.from_url(str(self.url), **kwargs)
        except Exception as exc:  # obstore's configuration errors (no account, a bad endpoint, ...)
            raise RemoteUnreachableError(self.url, f"cannot set up the object-store client ({short_reason(exc)})",
                                         ) from None

    def where(self, rel: str) -> CacheURL:
        """The URL of the object ``rel`` (for messages)."""
        return self.url / rel if rel else self.url

    def get(self, rel: str, *, if_match: str | None = None) -> Fetched:
        """The whole object ``rel``.

        Raises:
            FileNotFoundError: there is no such object (``filename`` is its URL).
            CacheReplacedError: ``if_match`` was given and the object's ETag is another.
        """
        options: dict[str, Any] = {"if_match": if_match} if if_match else {}
        return self._get(rel, options, "fetching")

    def get_range(self, rel: str, begin: int, end: int, *, if_match: str | None = None) -> Fetched:
        """Bytes ``[begin, end)`` of ``rel`` in ONE ranged GET (never a multi-range request: S3 has none, and some
        servers answer one with the whole object). Fewer bytes than asked (the object ends first) come back as
        they are: the caller compares ``size`` with what it expects and names the truncated object.

        Raises:
            FileNotFoundError, CacheReplacedError: as :meth:`get`.
        """
        options: dict[str, Any] = {"range": (begin, end)}
        if if_match:
            options["if_match"] = if_match
        return self._get(rel, options, f"fetching bytes {begin}-{end} of")

    def head(self, rel: str, *, if_match: str | None = None) -> Fetched:
        """The object's size and ETag, no bytes (``data`` is empty).

        Raises:
            FileNotFoundError, CacheReplacedError: as :meth:`get`.
        """
        options: dict[str, Any] = {"head": True}
        if if_match:
            options["if_match"] = if_match
        result = self._call(rel, "checking", lambda: self._ob.get(self._store, rel, options=options))
        meta = result.meta
        return Fetched(b"", int(meta["size"]), meta.get("e_tag"))

    def _get(self, rel: str, options: dict[str, Any], action: str) -> Fetched:
        def call() -> Fetched:
            result = self._ob.get(self._store, rel, options=options)
            data = result.bytes()
            meta = result.meta
            return Fetched(data, int(meta["size"]), meta.get("e_tag"))

        return self._call(rel, action, call)

    def create(self, rel: str, data: Any) -> bool:
        """Put ``rel`` unless an object of that name exists (create-only: nothing is ever overwritten). Returns
        whether it was created."""
        ob = self._ob

        def call() -> bool:
            try:
                ob.put(self._store, rel, data, mode="create")
            except ob.exceptions.AlreadyExistsError:
                return False
            return True

        return self._call(rel, "uploading", call)

    def replace(self, rel: str, data: Any, etag: str | None) -> None:
        """Put ``rel`` only if it still is the version ``etag`` (``None``: only if there is none), so two publishers
        never silently overwrite each other.

        Raises:
            CacheReplacedError: another version is there now.
        """
        ob = self._ob
        mode: Any = {"e_tag": etag} if etag else "create"

        def call() -> None:
            try:
                ob.put(self._store, rel, data, mode=mode)
            except ob.exceptions.AlreadyExistsError:
                raise CacheReplacedError(self.where(rel), "it was created by someone else meanwhile") from None

        self._call(rel, "uploading", call)

    def _call(self, rel: str, action: str, call: Any) -> Any:
        ob = self._ob
        where = self.where(rel)
        try:
            return call()
        except (CacheReplacedError, RemoteExtraMissingError):
            raise
        except FileNotFoundError:
            raise FileNotFoundError(2, f"no such object ({action} it)", str(where)) from None
        except ob.exceptions.NotFoundError:
            raise FileNotFoundError(2, f"no such object ({action} it)", str(where)) from None
        except ob.exceptions.PreconditionError:
            raise CacheReplacedError(where, "it changed since it was first read (its ETag no longer matches)") \
                from None
        except (ob.exceptions.PermissionDeniedError, ob.exceptions.UnauthenticatedError) as exc:
            raise RemoteUnreachableError(where, f"access denied while {action} it ({short_reason(exc)})") from None
        except ob.exceptions.BaseError as exc:
            raise RemoteUnreachableError(where, f"failed while {action} it ({short_reason(exc)})") from None
        except OSError as exc:  # obstore maps some transport errors to built-in ones
            raise RemoteUnreachableError(where, f"failed while {action} it ({short_reason(exc)})") from None
