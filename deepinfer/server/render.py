"""Response pieces of the OpenAI endpoints: text deltas of a stream, logprobs in both OpenAI shapes, and
one chat choice (plain text, a reply parsed by deepseek-recipe, or a call forced by ``tool_choice``).

A chat choice is rendered in one of three ways:

- **plain**: the text is the content (a model whose replies are not parsed);
- **parsed**: the token ids go through deepseek-recipe's stream processor (``chat_output.ReplyStream``),
  which splits ``reasoning_content`` from ``content`` and parses tool calls; its deltas are sent as they
  are, with the finish reason it decides (``tool_calls`` when it parsed calls);
- **forced call** (a model without native tool calling, ``tool_choice`` naming one function): the text is
  that function's JSON arguments (constrained by the parameter schema), sent as one tool call.
"""

from __future__ import annotations

import uuid
from typing import Any

from deepinfer.chat_output import ReplyStream
from deepinfer.outputs import RequestOutput
from deepinfer.server.stops import StopHoldBack


class TextDelta:
    """Turns cumulative outputs into stream deltas. While a request runs, text that could still be
    cut (a partial stop string at the end, an incomplete UTF-8 character) is held back."""

    def __init__(self, holdback: StopHoldBack | None) -> None:
        self.holdback = holdback  # None: no stop strings
        self.sent = ""
        self.tokens = 0

    def step(self, out: RequestOutput) -> tuple[str, int, int]:
        """(the new safe text, the first and the end index of the tokens new since the last step)."""
        text = out.outputs[0].text
        end = len(text)
        if not out.finished:
            while end > len(self.sent) and text[end - 1] == "\ufffd":
                end -= 1
            if self.holdback is not None:  # incremental: the cost of a chunk is its new characters
                end -= self.holdback.advance(text[:end])
        delta = ""
        if end > len(self.sent) and text.startswith(self.sent):
            delta = text[len(self.sent):end]
            self.sent = text[:end]
        first, self.tokens = self.tokens, len(out.outputs[0].token_ids)
        return delta, first, self.tokens


class Formatter:
    """Logprobs in the two OpenAI shapes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def completion_logprobs(self, out: RequestOutput, first: int, last: int, offset: int) -> dict[str, Any]:
        comp = out.outputs[0]
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, row in zip(comp.token_ids[first:last], (comp.logprobs or [])[first:last], strict=False):
            s = self.token(tid)
            tokens.append(s)
            token_lps.append(row.get(tid))
            tops.append({self.token(t): lp for t, lp in sorted(row.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, out: RequestOutput, first: int, last: int, top_n: int) -> dict[str, Any]:
        comp = out.outputs[0]
        content = []
        for tid, row in zip(comp.token_ids[first:last], (comp.logprobs or [])[first:last], strict=False):
            s = self.token(tid)
            best = sorted(row.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({
                "token": s, "logprob": row.get(tid), "bytes": list(s.encode()),
                "top_logprobs": [{"token": self.token(t), "logprob": lp, "bytes": list(self.token(t).encode())}
                                 for t, lp in best],
            })
        return {"content": content}


def finish_reason(out: RequestOutput) -> str | None:
    """The OpenAI finish reason of an engine output (an abort reads as ``stop``)."""
    reason = out.outputs[0].finish_reason
    return None if reason is None else ("stop" if reason == "abort" else reason)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatChoice:
    """One choice of a chat response, streamed (``step``) or whole (``final``).

    ``parser``: the choice's deepseek-recipe reply stream (parsed replies); ``forced``: the function name
    of a forced call (a model without native tool calling); neither: plain text. ``logprobs``: None for
    none, else the number of top logprobs per token.
    """

    def __init__(self, index: int, formatter: Formatter, *, parser: ReplyStream | None = None,
                 forced: str | None = None, holdback: StopHoldBack | None = None,
                 logprobs: int | None = None) -> None:
        self.index = index
        self.formatter = formatter
        self.parser = parser
        self.forced = forced
        self.call_id = new_call_id() if forced is not None else None
        self.text = TextDelta(holdback)
        self.opened = False  # a forced call's opening delta (id, name) was sent
        self.fed = 0
        self.logprobs = logprobs
        self.done = False

    def _lp(self, out: RequestOutput, first: int, last: int) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.formatter.chat_logprobs(out, first, last, self.logprobs)

    def step(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The streamed choice objects (``index``, ``delta``, ``logprobs``, ``finish_reason``) that this output
        makes available (none, one, or several)."""
        if self.done:
            return []
        self.done = out.finished
        if self.parser is not None:
            first, last = self.fed, len(out.outputs[0].token_ids)
            self.fed = last
            reason = out.outputs[0].finish_reason if out.finished else None
            chunks = self.parser.feed(out.outputs[0].token_ids, reason)
            choices = [self._choice(c.delta, None) for c in chunks if c.delta]
            if out.finished:
                final = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), None)
                choices.append(self._choice({}, _parsed_finish(final, out)))
            if self.logprobs is not None and last > first:
                if not choices:
                    choices.append(self._choice({}, None))
                choices[0]["logprobs"] = self._lp(out, first, last)
            return choices
        text, first, last = self.text.step(out)
        finish = finish_reason(out) if out.finished else None
        if not (text or finish or (self.logprobs is not None and last > first)):
            return []
        if self.forced is None:
            delta: dict[str, Any] = {"content": text} if text else {}
        else:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            opening = not self.opened
            if opening:  # the call opens with its id and name
                self.opened = True
                call.update(id=self.call_id, type="function")
                call["function"] = {"name": self.forced, "arguments": text}
            delta = {"tool_calls": [call]} if text or opening else {}
            finish = "tool_calls" if finish == "stop" else finish
        choice = self._choice(delta, finish)
        choice["logprobs"] = self._lp(out, first, last)
        return [choice]

    def _choice(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def final(self, out: RequestOutput) -> dict[str, Any]:
        """The non-streamed choice object (``index``, ``message``, ``logprobs``, ``finish_reason``)."""
        comp = out.outputs[0]
        lp = self._lp(out, 0, len(comp.token_ids))
        message: dict[str, Any] = {"role": "assistant", "content": comp.text}
        finish = finish_reason(out)
        if self.parser is not None:
            self.parser.feed(comp.token_ids, comp.finish_reason)
            reply = self.parser.reply()
            message["content"] = reply.content or (None if reply.tool_calls else "")
            if reply.reasoning is not None:
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = [_call(c.id, c.name, c.arguments) for c in reply.tool_calls]
            finish = _parsed_finish(reply.finish_reason, out)
        elif self.forced is not None:
            assert self.call_id is not None
            message["content"] = None
            message["tool_calls"] = [_call(self.call_id, self.forced, comp.text)]
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": self.index, "message": message, "logprobs": lp, "finish_reason": finish}


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _parsed_finish(parser_reason: str | None, out: RequestOutput) -> str | None:
    """The parser's finish reason (``tool_calls`` when it parsed calls), else the engine's."""
    engine = finish_reason(out)
    if engine == "length":
        return "length"
    return parser_reason or engine
