"""Cache URLs: which remote locations a cache may be read from, checked before anything is fetched.

A remote cache is addressed by one URL, the folder that holds its ``manifest.json``: ``s3://bucket/prefix``,
``gs://bucket/prefix``, ``az://container/prefix`` or ``https://host/path`` (``http://`` too, for a server on the
user's own network). A URL never carries credentials — no ``user:password@``, no query string (where signed URLs
keep their signatures) — because URLs travel in workflows and API prompts, which are shared files; credentials
come from the environment or the provider's own files (:mod:`.client`). This module imports nothing optional, so
the rest of the library can tell a URL from a folder without the remote extra installed.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["CacheURL", "SCHEMES", "is_remote_url", "parse_cache_url"]

SCHEMES = ("s3", "gs", "az", "https", "http")
"""URL schemes of remote caches: S3 (and S3-compatible stores through ``AWS_ENDPOINT_URL``), Google Cloud Storage,
Azure Blob Storage, and plain HTTP(S) servers (read only)."""

MAX_URL = 2048
"""Characters in a cache URL (far above any real bucket and prefix; stops a hostile value early)."""

_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


class CacheURL(str):
    """The URL of a remote cache, or of a file in it: a ``str`` (messages print it as it is) that joins like a
    ``Path`` (``url / "shards/x.safetensors"``), so the reader's messages name remote files as they name local
    ones."""

    __slots__ = ()

    def __truediv__(self, rel: str) -> CacheURL:
        return CacheURL(f"{self.rstrip('/')}/{rel}")

    @property
    def scheme(self) -> str:
        """``s3``, ``gs``, ``az``, ``https`` or ``http``."""
        return self.split("://", 1)[0].lower()


def is_remote_url(value: object) -> bool:
    """Whether ``value`` is a string that names a remote cache (``<scheme>://...`` of :data:`SCHEMES`), rather than
    a folder. Says nothing about whether the URL is valid: :func:`parse_cache_url` checks that."""
    if isinstance(value, CacheURL):
        return True
    if not isinstance(value, str):
        return False
    m = _SCHEME_RE.match(value.strip())
    return m is not None and m.group(1).lower() in SCHEMES


def parse_cache_url(value: str) -> CacheURL:
    """Check a remote cache's URL and return it normalised (scheme lower case, no trailing ``/``).

    Raises:
        ValueError: naming the URL and what is wrong with it: an unknown scheme, no bucket or host, credentials or
            a query string in it, ``..`` or empty path segments, control characters, or more than :data:`MAX_URL`
            characters.
    """
    if not isinstance(value, str):
        raise ValueError(f"a cache URL must be a string, got {type(value).__name__}")
    url = value.strip()
    shown = f"{url[:120]!r}" + ("..." if len(url) > 120 else "")
    if len(url) > MAX_URL or any(ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise ValueError(f"cache URL {shown}: longer than {MAX_URL} characters or holding control characters")
    m = _SCHEME_RE.match(url)
    scheme = m.group(1).lower() if m else ""
    if scheme not in SCHEMES:
        raise ValueError(f"cache URL {shown}: the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"cache URL {shown}: {exc}") from None
    if "@" in parts.netloc or parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(f"cache URL {shown}: credentials, query strings and fragments are not allowed in a cache "
                         "URL (it is stored in workflows); give the bare URL and put credentials in the "
                         "environment or the provider's usual files (see the README, 'Training from a bucket')")
    host = parts.netloc
    if scheme in ("http", "https"):
        if not host or parts.hostname is None:
            raise ValueError(f"cache URL {shown}: no host")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ValueError(f"cache URL {shown}: bad port") from None
    elif not _BUCKET_RE.fullmatch(host):
        raise ValueError(f"cache URL {shown}: {scheme}:// needs a bucket (container) name after it, of letters, "
                         "digits, '.', '_' and '-'")
    segments = [s for s in parts.path.split("/")]
    inner = segments[1:-1] if segments and segments[-1] == "" else segments[1:]
    if any(s in ("", ".", "..") for s in inner):
        raise ValueError(f"cache URL {shown}: empty, '.' or '..' path segments are not allowed")
    return CacheURL(f"{scheme}://{host}{parts.path}".rstrip("/"))
