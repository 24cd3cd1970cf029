"""A prompt's length in tokens, estimated without a tokenizer (conditional disaggregation).

The router has no tokenizer (it never needs the model's), so it estimates: **one token per
4 bytes of UTF-8 text**, rounded up. Four characters per token is the usual figure for
English text with the BPE vocabularies of current models; counting UTF-8 bytes rather than
characters keeps the figure from falling far short for scripts a tokenizer splits finely
(a CJK character is 3 bytes and often one token or more: 0.75 estimated), and it needs no
pass over the text to split words (a words-times-1.3 rule would count an unspaced Chinese
paragraph as one word). It is an estimate: a prompt of code or numbers has more tokens
per byte, and the decision it feeds only has to be right on the whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Bytes of UTF-8 text per estimated token.
BYTES_PER_TOKEN = 4
#: Chat content parts whose size says nothing of their token count (an image's tokens
#: depend on its pixels, not on its URL's length): a prompt with one is not estimated.
NON_TEXT_PARTS = frozenset({"image_url", "input_audio", "file", "video_url", "audio_url"})


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    """The prompt's token count, estimated from an OpenAI request body.

    A completion's ``prompt``: token ids count one each; text counts one token per
    :data:`BYTES_PER_TOKEN` bytes of UTF-8, rounded up. A chat's ``messages`` (and its
    ``tools``, which the chat template renders into the prompt): every string in them, the
    roles and names included (about the template's own overhead), the same way.

    Args:
        body: the client's request body (``PreprocessedRequest.body``).

    Returns:
        The estimated tokens; None if it cannot be estimated (non-text content such as an
        image, or no prompt in a form this knows).
    """
    prompt = body.get("prompt")
    if prompt is not None:
        return _prompt_tokens(prompt)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    size = _text_bytes(messages)
    tools = body.get("tools")
    if size is not None and tools is not None:
        extra = _text_bytes(tools)
        size = None if extra is None else size + extra
    return None if size is None else -(-size // BYTES_PER_TOKEN)


def _prompt_tokens(prompt: Any) -> int | None:
    if isinstance(prompt, str):
        return -(-len(prompt.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
    if isinstance(prompt, list):
        if all(type(item) is int for item in prompt):
            return len(prompt)  # token ids: exact
        total = 0
        for item in prompt:
            tokens = _prompt_tokens(item)
            if tokens is None:
                return None
            total += tokens
        return total
    return None


def _text_bytes(value: Any) -> int | None:
    """UTF-8 bytes of every string in ``value``; None if it holds a non-text part."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, Mapping):
        if value.get("type") in NON_TEXT_PARTS:
            return None
        total = 0
        for item in value.values():
            size = _text_bytes(item)
            if size is None:
                return None
            total += size
        return total
    if isinstance(value, list):
        total = 0
        for item in value:
            size = _text_bytes(item)
            if size is None:
                return None
            total += size
        return total
    return 0  # numbers, booleans, null: no text
