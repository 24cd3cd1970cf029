"""Prompt length and tokens, and deterministic pseudo-text for the mock workers."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

#: Size of the mock vocabulary: token ids are in ``range(VOCAB_SIZE)``.
VOCAB_SIZE = 512
_VOCAB_BITS = 9
assert 1 << _VOCAB_BITS == VOCAB_SIZE

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]


def _word(i: int) -> str:
    # Pure arithmetic, so the vocabulary is the same on every Python version.
    n = len(_SYLLABLES)
    x = (i * 7919 + 104729) % (n**3)
    length = 1 + i % 3
    return "".join(_SYLLABLES[(x // n**k) % n] for k in range(length))


#: The text of each token id: a pseudo-word with a leading space.
WORDS: tuple[str, ...] = tuple(" " + _word(i) for i in range(VOCAB_SIZE))

_MASK64 = (1 << 64) - 1


def _seed64(*parts: object) -> int:
    key = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


#: Every token id, made once: a token an output holds is one of these, not an int of its
#: own (ids past 256 are not cached by Python; docs/performance.md, P3).
_TOKEN_IDS: tuple[int, ...] = tuple(range(VOCAB_SIZE))


class TokenStream:
    """A deterministic pseudo-random token sequence for one request.

    The sequence depends only on ``seed`` and ``request_id`` (never on the process or the
    worker), so the prefill's first token equals the decode's first token and a run
    repeats exactly. It is a 64-bit linear congruential generator: one multiply per token
    and no per-request state beyond one integer.
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int, request_id: str) -> None:
        self._state = _seed64(seed, "tokens", request_id)

    def next_id(self) -> int:
        """The next token id, in ``range(VOCAB_SIZE)``."""
        self._state = (self._state * 6364136223846793005 + 1442695040888963407) & _MASK64
        return _TOKEN_IDS[self._state >> (64 - _VOCAB_BITS)]

    def next_unit(self) -> float:
        """The next number in [0, 1), for seeded choices such as an early EOS."""
        self._state = (self._state * 6364136223846793005 + 1442695040888963407) & _MASK64
        return (self._state >> 11) / (1 << 53)


def seeded_unit(*parts: object) -> float:
    """A number in [0, 1) fixed by ``parts`` (a seed, a purpose, a key ...)."""
    return (_seed64(*parts) >> 11) / (1 << 53)


def _words_in(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # token ids
        return sum(_words_in(v) for v in value)
    if isinstance(value, Mapping):
        # a chat message ({"role", "content"}) or a content part ({"type": "text", "text"})
        if "content" in value:
            return _words_in(value["content"])
        if "text" in value:
            return _words_in(value["text"])
    return 0


_PROMPT_KEYS = ("prompt", "messages", "input_ids", "text")


def count_prompt_tokens(body: Mapping[str, Any]) -> int:
    """The length of a request's prompt in tokens, as the mock workers count it.

    A token is a whitespace-separated word of ``prompt`` (a string, or a list of strings
    or of token-id lists), of the ``content`` of each chat message, or of SGLang's
    ``text``; a list of integers (``prompt`` or ``input_ids``) counts one token each.

    Returns:
        The number of tokens, at least 1.
    """
    for key in _PROMPT_KEYS:
        if key in body:
            return max(1, _words_in(body[key]))
    return 1


def _tokens_in(value: Any, out: list[str | int]) -> None:
    # the tokens _words_in counts, in order
    if isinstance(value, str):
        out.extend(value.split())
    elif isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            out.extend(value)
        else:
            for v in value:
                _tokens_in(v, out)
    elif isinstance(value, Mapping):
        if "content" in value:
            _tokens_in(value["content"], out)
        elif "text" in value:
            _tokens_in(value["text"], out)


def prompt_tokens_of(body: Mapping[str, Any]) -> list[str | int]:
    """The tokens of a request's prompt, in order: the ones :func:`count_prompt_tokens`
    counts (words, or token ids)."""
    out: list[str | int] = []
    for key in _PROMPT_KEYS:
        if key in body:
            _tokens_in(body[key], out)
            break
    return out


def prompt_fingerprint(body: Mapping[str, Any]) -> bytes:
    """Bytes that identify a request's prompt (same prompt, same fingerprint)."""
    return orjson.dumps([body.get(key) for key in _PROMPT_KEYS],
                        option=orjson.OPT_SORT_KEYS, default=str)


def resolve_max_tokens(max_tokens: int | None, body: Mapping[str, Any], default: int) -> int:
    """The completion budget in tokens: ``max_tokens`` if set, else the body's
    ``max_completion_tokens`` or ``max_tokens`` (or SGLang's ``max_new_tokens``),
    else ``default``. Never negative."""
    if max_tokens is None:
        for key in ("max_completion_tokens", "max_tokens", "max_new_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                max_tokens = value
                break
        else:
            max_tokens = default
    return max(0, max_tokens)


def prompt_token_ids(seed: int, body: Mapping[str, Any]) -> list[int]:
    """The mock's tokenization of a prompt: the body's own token ids, or one id per
    prompt token fixed by the prompt (as many as :func:`count_prompt_tokens` counts)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    stream = TokenStream(seed, "prompt:" + prompt_fingerprint(body).hex())
    return [stream.next_id() for _ in range(count_prompt_tokens(body))]
