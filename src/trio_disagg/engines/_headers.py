"""The headers a :class:`~trio_disagg.engines.WorkerClient` sends with every request (a
worker's API key), checked and encoded once, and the message of a worker refusing them."""

from __future__ import annotations

import datetime
import email.utils
import time
from collections.abc import Mapping

#: The characters of an HTTP header name (RFC 9110 ``token``).
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789"
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
#: Names the client sets itself, from the URL and the body: never a default.
_CLIENT_SET = frozenset({b"host", b"content-length", b"transfer-encoding"})
#: A worker's statuses that refuse the router's credentials, not the request.
CREDENTIAL_STATUSES = frozenset({401, 403, 407})
#: What :class:`DefaultHeaders` takes: names to values, each ``str`` or ``bytes``.
HeaderMap = (Mapping[str, str | bytes] | Mapping[bytes, str | bytes]
             | Mapping[str | bytes, str | bytes])


def _name_bytes(name: str | bytes) -> bytes:
    if isinstance(name, str):
        if not name.isascii():
            raise ValueError(f"header name {name!r} is not ASCII")
        name = name.encode("ascii")
    elif not isinstance(name, bytes):
        raise TypeError(f"a header name must be str or bytes, got {type(name).__name__}")
    if not name or not _TOKEN.issuperset(name):
        raise ValueError(f"header name {name!r} is not an HTTP token (it has a CR, LF, "
                         f"NUL, space, colon or non-ASCII byte, or is empty)")
    return name.lower()


def _value_bytes(name: bytes, value: str | bytes) -> bytes:
    """``value`` (UTF-8 if a str). It may be a secret: an error names the header only."""
    if isinstance(value, str):
        value = value.encode()
    elif not isinstance(value, bytes):
        raise TypeError(f"the value of header {name.decode()!r} must be str or bytes, got "
                        f"{type(value).__name__}")
    if b"\r" in value or b"\n" in value or b"\0" in value:
        raise ValueError(f"the value of header {name.decode()!r} has a CR, LF or NUL")
    return value


class DefaultHeaders:
    """Headers sent with every request of a client, encoded once (the request path joins
    the bytes, never a dict).

    A request's own header of the same name (case-insensitive) wins: the default is then
    left out of that request, as httpx does with a client's ``headers``.

    Args:
        headers: header names to values, ``str`` (a name ASCII, a value UTF-8) or
            ``bytes``; names are sent in lower case.

    Raises:
        ValueError: a name that is not an HTTP token (a CR, LF, NUL, space, colon or
            non-ASCII character, or empty), a value with a CR, LF or NUL (a header
            injection), or ``host``, ``content-length`` or ``transfer-encoding`` (the
            client's own). The message names the header, never its value.
        TypeError: a name or value neither ``str`` nor ``bytes``.
    """

    __slots__ = ("_pairs", "encoded", "names")

    def __init__(self, headers: HeaderMap | None = None) -> None:
        pairs: dict[bytes, bytes] = {}
        for raw_name, raw_value in (headers or {}).items():
            name = _name_bytes(raw_name)
            if name in _CLIENT_SET:
                raise ValueError(f"header {name.decode()!r} is set by the client itself")
            if name in pairs:
                raise ValueError(f"header {name.decode()!r} is given twice")
            pairs[name] = _value_bytes(name, raw_value)
        self._pairs = pairs
        #: The names, in lower case.
        self.names = frozenset(pairs)
        #: ``name: value\r\n`` for each, as appended to a request's head.
        self.encoded = b"".join(name + b": " + value + b"\r\n" for name, value in pairs.items())

    def __repr__(self) -> str:  # the values may be secrets: names only
        return f"<DefaultHeaders {', '.join(name.decode() for name in self._pairs)}>"

    def for_request(self, headers: Mapping[bytes, bytes]) -> bytes:
        """What to append to a request's head with its own ``headers``: :attr:`encoded`,
        without the defaults the request sets itself (rare: then encoded anew)."""
        names = self.names
        if not names or not any(name.lower() in names for name in headers):
            return self.encoded
        own = {name.lower() for name in headers}
        return b"".join(name + b": " + value + b"\r\n"
                        for name, value in self._pairs.items() if name not in own)


def bearer(key: str) -> dict[str, str]:
    """The headers of a worker API key: ``{"authorization": "Bearer <key>"}``."""
    return {"authorization": f"Bearer {key}"}


def credentials_refused(role: str, url: str, status: int, message: str) -> str:
    """The message of a worker's 401, 403 or 407 (:data:`CREDENTIAL_STATUSES`): the
    worker refused the router's credentials, most likely a missing or wrong worker API
    key (a worker started with ``--api-key``)."""
    return (f"{role} worker {url} answered {status} ({message}): a missing or wrong worker "
            f"API key? Start the router with the workers' key (serve --worker-api-key or "
            f"TRIO_DISAGG_WORKER_API_KEY; WorkerClient(headers=...))")


#: The statuses whose ``Retry-After`` the router passes on: a worker too busy (429) or
#: unavailable (503) for now.
RETRY_AFTER_STATUSES = frozenset({429, 503})
#: The longest wait a worker's ``Retry-After`` is read as, in seconds (one day).
LONGEST_RETRY_AFTER = 86400.0


def refusal_retry_after(status: int, headers: Mapping[str, str]) -> float | None:
    """The wait a worker's refusal asks for (:func:`retry_after`), if its status is one
    of :data:`RETRY_AFTER_STATUSES`; else None."""
    if status not in RETRY_AFTER_STATUSES:
        return None
    return retry_after(headers, time.time())


def retry_after(headers: Mapping[str, str], now: float) -> float | None:
    """How long a worker's answer asks its client to wait before trying again, in seconds.

    ``retry-after-ms`` (milliseconds, as OpenAI's API sends it) wins over
    ``retry-after``, which is a whole number of seconds or an HTTP date (RFC 9110,
    section 10.2.3): a date in the past is 0, a wait longer than a day
    (:data:`LONGEST_RETRY_AFTER`) is a day. A value that is neither (negative, garbage) is
    no value at all.

    Args:
        headers: the answer's headers, names in lower case.
        now: the wall-clock time (``time.time()``), for a date.

    Returns:
        Seconds, 0 to :data:`LONGEST_RETRY_AFTER`; None if the answer asks for no
        particular wait.
    """
    value = headers.get("retry-after-ms")
    if value is not None and (seconds := _number(value)) is not None:
        return min(seconds / 1000, LONGEST_RETRY_AFTER)
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _number(value)
    if seconds is not None:
        return min(seconds, LONGEST_RETRY_AFTER)
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; one without a zone is taken as such
        when = when.replace(tzinfo=datetime.UTC)
    return min(max(0.0, when.timestamp() - now), LONGEST_RETRY_AFTER)


def _number(text: str) -> float | None:
    """A non-negative number written in decimal (``"7"``, ``"1.5"``; as long as it likes,
    which may make it infinite), else None."""
    text = text.strip()
    if not text.isascii() or not text.replace(".", "", 1).isdigit():
        return None
    return float(text)
