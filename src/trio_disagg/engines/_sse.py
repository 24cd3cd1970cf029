"""The framing of server-sent events (docs/protocols.md section 1): a leading byte order
mark, CR, LF and CRLF line ends, and the data of one event."""

from __future__ import annotations

#: The UTF-8 byte order mark a stream may start with: not part of its first event.
BOM = b"\xef\xbb\xbf"


def stream_start(data: bytes) -> bytes | None:
    """The first bytes of a stream without the byte order mark it may start with (the
    event-stream format strips one), or None while they may still be the start of one."""
    if len(data) < len(BOM) and BOM.startswith(data):
        return None
    return data[len(BOM):] if data.startswith(BOM) else data


def normalise_line_ends(data: bytes) -> tuple[bytes, bytes]:
    """``data`` with CRLF and CR line ends made LF (server-sent events allow all three),
    and a trailing CR held back (its LF may come with the next read)."""
    held = b""
    if data.endswith(b"\r"):
        data, held = data[:-1], b"\r"
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), held


def sse_data(event: bytes) -> bytes | None:
    """The data of one server-sent event (its ``data:`` lines joined by LF), or None for
    an event without data (a comment, a bare ``event:`` or ``id:``)."""
    lines: list[bytes] = []
    for line in event.split(b"\n"):
        field, colon, value = line.partition(b":")
        if field == b"data":
            lines.append(value[1:] if value[:1] == b" " else value)
        elif not field and not colon:
            continue  # a blank line
    return b"\n".join(lines) if lines else None
