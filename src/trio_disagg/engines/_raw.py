"""The relay's fast path on bytes (docs/performance.md): a worker's common chunk, whose
choice the router relays as sent (B8) without parsing it, recognised by its bytes."""

from __future__ import annotations

from typing import Any

import orjson

_TEXT_START = b'{"index":0,"text":"'
_CONTENT_START = b'{"index":0,"delta":{"content":"'


def raw_choice_of(data: bytes, start: int) -> bytes | None:
    """The bytes of a chunk's one choice, from ``start`` (just after its envelope, which
    the caller checked), if the chunk is the common one: the choice is all the
    ``choices`` array holds, only a null ``usage`` may follow it, and it has ``index`` 0,
    one ``finish_reason`` (null), no ``token_ids``, and non-empty ``text`` (completions)
    or ``delta.content`` first (chat). Else None: the chunk is to be parsed.

    The checks are on bytes: JSON escapes a quote inside a string, so a pattern that
    starts with a quote cannot come from a string's content; a second choice would
    bring a second ``"finish_reason":`` or a ``},{"index":``.
    """
    if data.endswith(b"}]}"):
        choice = data[start:-2]
    elif data.endswith(b'}],"usage":null}'):
        choice = data[start:-15]
    else:
        return None
    if choice.startswith(_TEXT_START):
        first = choice[19:20]
    elif choice.startswith(_CONTENT_START):
        first = choice[31:32]
    else:
        return None
    if (first == b'"' or choice.count(b'"finish_reason":') != 1
            or b',"finish_reason":null' not in choice or b'"token_ids":' in choice
            or b'},{"index":' in choice):
        return None
    return choice


def learn_prefix(data: bytes, chunk: dict[str, Any]) -> bytes | None:
    """The envelope of ``data`` (a chunk that went into the burst, parsed as
    ``chunk``) if the fast path would have read it exactly: the bytes before its one
    choice, which :func:`raw_choice_of` accepts and which parse to that choice."""
    start = data.find(b'"choices":[')
    if start < 0:
        return None
    start += 11
    prefix = data[:start]
    if b'"usage"' in prefix:
        return None
    raw = raw_choice_of(data, start)
    choices = chunk.get("choices")
    if (raw is None or type(choices) is not list or len(choices) != 1
            or orjson.loads(raw) != choices[0]):
        return None
    return prefix
