"""The answer formats of the mock HTTP workers (docs/protocols.md section 5): OpenAI
completion and chat completion answers and chunks, with the choices beyond plain text a
request asks for (tool calls, logprobs, reasoning content) and the decode's answer faults.
A protocol's own format (SGLang's native ``/generate``) subclasses :class:`AnswerFormat`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import orjson

from ._text import VOCAB_SIZE, WORDS, seeded_unit
from ._wire_faults import REMOVED, AnswerFaults, answer_faults


class AnswerFormat:
    """How one request's answer is written: server-sent chunks, or one JSON object."""

    def bind_usage(self, usage: Callable[[int], dict[str, Any]]) -> None:
        """Tell the format the usage after ``n`` tokens (for formats that put it in every
        event); called before the first :meth:`token`."""

    def start(self) -> bytes:
        """The first bytes of a stream (a chat stream's role chunk), or ``b""``."""
        return b""

    def token(self, text: str, token: int | None, finish: str | None) -> bytes:
        """One token's event (``finish`` on the last one)."""
        raise NotImplementedError

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The usage event after the finish, or ``b""``."""
        return b""

    def answer(self, *, text: str, token_ids: list[int], finish: str,
               usage: dict[str, Any], top: Mapping[str, Any] | None = None,
               choice: Mapping[str, Any] | None = None) -> bytes:
        """A whole non-streamed answer; ``top`` and ``choice`` add protocol fields."""
        raise NotImplementedError


#: A body field of the mock workers only (a test hook, like ``"fault"``): a chat's first N
#: tokens go out as ``reasoning_content`` instead of ``content``.
REASONING_HOOK = "mock_reasoning_tokens"


@attrs.frozen(kw_only=True)
class ChoiceShape:
    """What a request asks of its answer's choices beyond plain text, as the mock workers
    send it (B8: the relay must carry it as sent). Made by :func:`choice_shape`.

    Attributes:
        decode: the answer is a decode's (else a prefill's: its ``length`` finish stays,
            the handoff needs it).
        tool: a chat with ``tools`` (``tool_choice`` not ``"none"``): the name of the
            function called, the first tool's. The tokens go out as the arguments of one
            tool call, ``{"arg0": "word", ...}``, instead of content.
        call_id: that call's ``id``, ``"call_<request id>"``.
        logprobs: a chat's ``logprobs: true``, or a completion's ``logprobs: k``.
        top_logprobs: alternatives per token: a chat's ``top_logprobs``, a completion's k.
        reasoning_tokens: a chat's :data:`REASONING_HOOK`: its first N tokens go out as
            ``reasoning_content``.
        faults: the decode's answer faults (final ``finish_reason``, ``stop_reason``, no
            usage chunk).
    """

    decode: bool
    tool: str | None = None
    call_id: str = ""
    logprobs: bool = False
    top_logprobs: int = 0
    reasoning_tokens: int = 0
    faults: AnswerFaults = attrs.field(factory=AnswerFaults)

    def finish(self, finish: str) -> str:
        """The ``finish_reason`` sent for the tokens' own ``finish``."""
        if self.faults.finish is not None:
            return self.faults.finish
        if self.tool is not None and (finish == "stop" or (finish == "length" and self.decode)):
            return "tool_calls"  # the mock's call is complete (its arguments closed)
        return finish

    def stop_reason(self) -> Any:
        """The final choice's ``stop_reason``."""
        value = self.faults.stop_reason
        return None if value is REMOVED else value


def choice_shape(body: Mapping[str, Any], *, chat: bool, decode: bool, request_id: str
                 ) -> ChoiceShape | None:
    """What ``body`` asks of its choices (:class:`ChoiceShape`); None for plain text.
    The answer faults count for a decode only.

    Raises:
        ValueError: a malformed answer fault.
    """
    faults = answer_faults(body) if decode else AnswerFaults()
    tool = None
    logprobs = False
    top = 0
    reasoning = 0
    if chat:
        tools = body.get("tools")
        if isinstance(tools, list) and tools and body.get("tool_choice") != "none":
            first = tools[0] if isinstance(tools[0], Mapping) else {}
            function = first.get("function")
            name = function.get("name") if isinstance(function, Mapping) else None
            tool = name if isinstance(name, str) else "tool"
        logprobs = body.get("logprobs") is True
        value = body.get("top_logprobs")
        top = value if type(value) is int and value > 0 else 0
        value = body.get(REASONING_HOOK)
        reasoning = value if type(value) is int and value > 0 else 0
    else:
        value = body.get("logprobs")
        if type(value) is int and value >= 0:
            logprobs, top = True, value
    if tool is None and not logprobs and not reasoning and not faults:
        return None
    return ChoiceShape(decode=decode, tool=tool, call_id=f"call_{request_id}",
                       logprobs=logprobs, top_logprobs=top, reasoning_tokens=reasoning,
                       faults=faults)


def _alternatives(token: int, text: str, logprob: float, k: int
                  ) -> list[tuple[str, float]]:
    """``k`` ``(text, logprob)`` candidates for a position, the sampled token first, then
    other words, each less likely, all distinct."""
    found = [(text, logprob)][:k]
    seen = {text}
    step = 0
    while len(found) < k:
        step += 1
        alt = WORDS[(token + 131 * step) % VOCAB_SIZE]
        if alt not in seen:
            seen.add(alt)
            found.append((alt, round(logprob - 0.5 * len(found), 4)))
    return found


class OpenAIFormat(AnswerFormat):
    """OpenAI completion and chat completion answers and chunks.

    A plain request's chunks are written from bytes made once. A request with a
    :class:`ChoiceShape` gets the fields it asks for, as vLLM sends them: a chat with
    ``tools`` one tool call (a first delta ``{"tool_calls": [{"index": 0, "id", "type":
    "function", "function": {"name", "arguments": ""}}]}``, then per token an argument
    fragment ``{"tool_calls": [{"index": 0, "function": {"arguments"}}]}``, no
    ``content``, finish ``tool_calls``; answered whole: ``message.tool_calls``,
    ``content: null``); ``logprobs`` per token (chat ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs"}]}``, completions ``{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}``, answered whole: all of them), fixed by ``seed``,
    the request id and the token's position; the first tokens as
    ``delta.reasoning_content`` (``message.reasoning_content``); and the answer faults.

    Args:
        chat: a chat completion.
        response_id: the answer's ``id``.
        model: echoed.
        with_ids: add ``token_ids`` to each choice (vLLM's ``return_token_ids``).
        top: fields added to every whole answer (vLLM's ``kv_transfer_params: null``).
        shape: what the request asks of its choices, or None for plain text.
        seed: with ``request_id``, fixes the logprobs.
        request_id: the request's id.
        sglang: a plain token's chunk as SGLang writes it (``"role":null`` before the
            content, null ``reasoning_content``, ``tool_calls``, ``matched_stop`` and
            ``usage``), not as vLLM does; a plain whole answer's choice likewise has
            ``matched_stop`` where vLLM's has ``stop_reason``.
        whole_message: the fields a whole chat answer's ``message`` carries even when
            nothing was generated for them, with these values (vLLM's ``tool_calls: []``).
        prompt_ids: the prompt's token ids to send as vLLM does for ``return_token_ids``
            (0.10.2 on): a chat's at the top level of its role-only first chunk and of
            its whole answer, a completion's in the first chunk's choice and in its
            whole answer's; None: not sent.
    """

    __slots__ = ("_args", "_at", "_called", "_chat", "_delta", "_head", "_ids", "_model",
                 "_offset", "_prompt_ids", "_request_id", "_response_id", "_seed", "_sglang",
                 "_shape", "_tail", "_tail_stop", "_top", "_usage_head", "_whole_message")

    def __init__(self, *, chat: bool, response_id: str, model: Any, with_ids: bool,
                 top: Mapping[str, Any] | None = None, shape: ChoiceShape | None = None,
                 seed: int = 0, request_id: str = "", sglang: bool = False,
                 prompt_ids: list[int] | None = None,
                 whole_message: Mapping[str, Any] | None = None) -> None:
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        head = (b'data: {"id":' + orjson.dumps(response_id) + b',"object":"' + kind
                + b'","created":' + str(int(time.time())).encode() + b',"model":'
                + orjson.dumps(model))
        self._head = head + b',"choices":[{"index":0,'
        self._usage_head = head + b',"choices":[],"usage":'
        self._chat, self._ids, self._model, self._top = chat, with_ids, model, top
        self._response_id, self._request_id = response_id, request_id
        self._shape, self._seed, self._sglang = shape, seed, sglang
        self._prompt_ids = prompt_ids  # (a completion's: until its first chunk took them)
        self._whole_message = whole_message or {}
        self._at = 0  # tokens sent
        self._args = 0  # tool call arguments sent
        self._offset = 0  # characters of text sent (a completion's text_offset)
        self._called = False  # the tool call's first delta sent
        # A text token's bytes around its text and after its finish: SGLang writes every
        # delta after its role chunk with "role":null first and its other fields null
        # after, "matched_stop" where vLLM writes "stop_reason", and a null usage.
        self._delta, self._tail = (
            (b'"delta":{"role":null,"content":',
             b',"reasoning_content":null,"tool_calls":null}') if sglang
            else (b'"delta":{"content":', b"}"))
        self._tail_stop = b',"matched_stop":null}],"usage":null}\n\n' if sglang else (
            b',"stop_reason":null}]}\n\n')

    def start(self) -> bytes:
        if not self._chat:
            return b""
        ids = b"" if self._prompt_ids is None else (
            b',"prompt_token_ids":' + orjson.dumps(self._prompt_ids))
        return (self._head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]' + ids + b"}\n\n")

    def _first_prompt_ids(self) -> list[int] | None:
        """A completion's prompt ids, for its first chunk only."""
        ids = None if self._chat else self._prompt_ids
        self._prompt_ids = None if ids is not None else self._prompt_ids
        return ids

    def token(self, text: str, token: int | None, finish: str | None) -> bytes:
        if self._shape is not None:
            return self._shaped_token(self._shape, text, token, finish)
        if self._chat:
            body = self._delta + orjson.dumps(text) + self._tail
        else:
            body = b'"text":' + orjson.dumps(text)
            if (ids := self._first_prompt_ids()) is not None:
                body += b',"prompt_token_ids":' + orjson.dumps(ids)
        if self._ids:
            body += b',"token_ids":' + (b"[]" if token is None else b"[%d]" % token)
        return (self._head + body + b',"logprobs":null,"finish_reason":'
                + orjson.dumps(finish) + self._tail_stop)

    def usage(self, usage: dict[str, Any]) -> bytes:
        if self._shape is not None and self._shape.faults.no_usage:
            return b""
        return self._usage_head + orjson.dumps(usage) + b"}\n\n"

    # --- shaped choices ------------------------------------------------------------------

    def _logprob(self, position: int) -> float:
        return -round(0.01 + 3.0 * seeded_unit(self._seed, "logprob", self._request_id,
                                               position), 4)

    def _chat_logprob(self, shape: ChoiceShape, position: int, text: str, token: int
                      ) -> dict[str, Any]:
        logprob = self._logprob(position)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": alt, "logprob": value, "bytes": list(alt.encode())}
                    for alt, value in _alternatives(token, text, logprob,
                                                    shape.top_logprobs)]}

    def _completion_logprobs(self, shape: ChoiceShape, start: int, offset: int,
                             tokens: list[tuple[str, int]]) -> dict[str, Any]:
        result: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                  "text_offset": []}
        for position, (text, token) in enumerate(tokens, start):
            logprob = self._logprob(position)
            result["tokens"].append(text)
            result["token_logprobs"].append(logprob)
            result["top_logprobs"].append(
                dict(_alternatives(token, text, logprob, shape.top_logprobs)))
            result["text_offset"].append(offset)
            offset += len(text)
        return result

    def _event(self, choice: dict[str, Any]) -> bytes:
        return self._head[:-len(b'{"index":0,')] + orjson.dumps(choice) + b"]}\n\n"

    def _shaped_token(self, shape: ChoiceShape, text: str, token: int | None,
                      finish: str | None) -> bytes:
        position = self._at
        if token is not None:
            self._at += 1
        final = {"finish_reason": shape.finish(finish) if finish is not None else None,
                 "stop_reason": shape.stop_reason() if finish is not None else None}
        if not self._chat:
            choice: dict[str, Any] = {"index": 0, "text": text}
            if (prompt_ids := self._first_prompt_ids()) is not None:
                choice["prompt_token_ids"] = prompt_ids
            if self._ids:
                choice["token_ids"] = [] if token is None else [token]
            choice["logprobs"] = (self._completion_logprobs(
                shape, position, self._offset, [(text, token)])
                if shape.logprobs and token is not None else None)
            self._offset += len(text)
            return self._event({**choice, **final})
        # a chat: the deltas this token makes, the one carrying the token's logprobs
        deltas: list[dict[str, Any]] = []
        carrier = 0
        reasoning = token is not None and position < shape.reasoning_tokens
        if reasoning:
            deltas.append({"reasoning_content": text})
        elif shape.tool is None:
            deltas.append({"content": text})
        if shape.tool is not None and (not reasoning or finish is not None):
            if not self._called:
                self._called = True
                deltas.append({"tool_calls": [{
                    "index": 0, "id": shape.call_id, "type": "function",
                    "function": {"name": shape.tool, "arguments": ""}}]})
            fragment = ""
            if token is not None and not reasoning:
                carrier = len(deltas)
                fragment = (("{" if self._args == 0 else ", ") + f'"arg{self._args}": '
                            + orjson.dumps(text.strip()).decode())
                self._args += 1
            if finish is not None:
                fragment += "}" if self._args else "{}"
            if fragment:
                deltas.append({"tool_calls": [{"index": 0,
                                               "function": {"arguments": fragment}}]})
        parts = []
        for i, delta in enumerate(deltas):
            carries = i == carrier and token is not None
            choice = {"index": 0, "delta": delta}
            if self._ids:
                choice["token_ids"] = [token] if carries else []
            choice["logprobs"] = ({"content": [self._chat_logprob(shape, position, text,
                                                                  token)]}
                                  if carries and shape.logprobs and token is not None
                                  else None)
            if i == len(deltas) - 1:
                choice.update(final)
            else:
                choice.update(finish_reason=None, stop_reason=None)
            parts.append(self._event(choice))
        return b"".join(parts)

    def _shaped_entry(self, shape: ChoiceShape, text: str, token_ids: list[int],
                      finish: str) -> dict[str, Any]:
        """A whole answer's choice: the concatenation of what its chunks would carry."""
        tokens = [(WORDS[t], t) for t in token_ids if 0 <= t < VOCAB_SIZE]
        if "".join(word for word, _ in tokens) != text:
            tokens = []  # not this mock's tokens: no per-token fields
        entry: dict[str, Any] = {"index": 0}
        logprobs: Any = None
        if self._chat:
            cut = min(shape.reasoning_tokens, len(tokens))
            message: dict[str, Any] = {"role": "assistant"}
            rest = tokens[cut:]
            if shape.tool is not None:
                arguments = "{" + ", ".join(
                    f'"arg{j}": ' + orjson.dumps(word.strip()).decode()
                    for j, (word, _) in enumerate(rest)) + "}"
                message["content"] = None
                message["tool_calls"] = [{"id": shape.call_id, "type": "function",
                                          "function": {"name": shape.tool,
                                                       "arguments": arguments}}]
            elif tokens and not rest:
                message["content"] = None  # all reasoning: no content, as vLLM and SGLang
            else:
                message["content"] = "".join(word for word, _ in rest) if tokens else text
            if shape.reasoning_tokens:
                message["reasoning_content"] = "".join(word for word, _ in tokens[:cut])
            entry["message"] = message
            if shape.logprobs:
                logprobs = {"content": [self._chat_logprob(shape, i, word, t)
                                        for i, (word, t) in enumerate(tokens)]}
        else:
            entry["text"] = text
            if shape.logprobs:
                logprobs = self._completion_logprobs(shape, 0, 0, tokens)
        entry["logprobs"] = logprobs
        entry["finish_reason"] = shape.finish(finish)
        entry["stop_reason"] = shape.stop_reason()
        return entry

    def answer(self, *, text: str, token_ids: list[int], finish: str,
               usage: dict[str, Any], top: Mapping[str, Any] | None = None,
               choice: Mapping[str, Any] | None = None) -> bytes:
        entry: dict[str, Any]
        if self._shape is not None:
            entry = self._shaped_entry(self._shape, text, token_ids, finish)
        else:
            entry = {"index": 0}
            if self._chat:
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            entry["logprobs"] = None
            entry["finish_reason"] = finish
            # the field its chunks end with: SGLang's ``matched_stop``, vLLM's ``stop_reason``
            entry["matched_stop" if self._sglang else "stop_reason"] = None
        if self._chat:
            message = entry["message"]
            for key, value in self._whole_message.items():
                if message.get(key) is None:
                    message[key] = list(value) if isinstance(value, list) else value
        if self._ids:
            entry["token_ids"] = token_ids
        if self._prompt_ids is not None and not self._chat:
            entry["prompt_token_ids"] = self._prompt_ids
        if choice:
            entry.update(choice)
        answer: dict[str, Any] = {
            "id": self._response_id,
            "object": "chat.completion" if self._chat else "text_completion",
            "created": int(time.time()),
            "model": self._model,
            "choices": [entry],
            "usage": usage,
        }
        if self._prompt_ids is not None and self._chat:
            answer["prompt_token_ids"] = self._prompt_ids
        if self._top:
            answer.update(self._top)
        if top:
            answer.update(top)
        return orjson.dumps(answer)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    """An OpenAI ``usage`` object with ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


