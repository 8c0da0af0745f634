"""Chat replies split into reasoning, answer content and tool calls (issue 35).

A DeepSeek model (``tokenizer="deepseek-v4"``) is served the way DeepSeek's own API serves it: the request
is converted by deepseek-recipe (``ChatCompletionRequest.convert``), which yields the prompt, the sampling
rules of its mode and the parsing options of its reply; the generated token ids are pushed, as they arrive,
into the recipe's own ``StreamProcessor``, which separates ``reasoning_content`` from ``content`` and parses
the model's tool-call markup (DSML) into OpenAI ``tool_calls``. ``ReplyStream`` wraps one such processor;
its chunks are OpenAI Chat Completions deltas. EOS ids are never pushed (the recipe's rule: its processor
sees text tokens and a finish, not the end-of-sequence token).

For ``tool_choice`` ``required`` or a named function the recipe reports the output constraint
``tool_call_required`` (the prompt already opened the tool-call block); ``tool_call_grammar`` turns its
tool list into an xgrammar EBNF grammar of that markup, so the model can only write well-formed calls of
the declared functions with their declared parameter names. For ``response_format`` it reports ``json``
(with the schema); in thinking mode that grammar starts after ``</think>``.

Models without a reply parser (every other tokenizer) keep the raw text as the content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer.outputs import ToolCall

DSML = "｜DSML｜"  # the V4 tool-call markup's marker (a normal, non-special vocabulary entry)


@dataclass
class ReplyChunk:
    """One streamed piece of a reply: an OpenAI delta (``content``, ``reasoning_content``, ``tool_calls``;
    empty and null fields left out) and, on the last one, the finish reason the parser decided."""

    delta: dict[str, Any]
    finish_reason: str | None = None


@dataclass
class ChatReply:
    """A whole parsed reply. ``finish_reason`` is the parser's: ``tool_calls`` when calls were parsed."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


class ReplyStream:
    """One choice's reply through deepseek-recipe's ``StreamProcessor`` (Chat Completions flavour).

    ``feed(token_ids, finish_reason)`` takes the cumulative output token ids of the request (and its finish
    reason once it finished) and returns the chunks that became available; ``reply()`` is everything so
    far, accumulated by the recipe's ``ChatCompletionResponse``. ``skip_ids`` (the model's EOS ids) are
    never pushed. ``stop`` strings are the processor's stop sequences, so a stop string the engine matched
    is cut from the content as from the text.
    """

    def __init__(self, recipe: Any, request: Any, tokenizer: Any, *, skip_ids: frozenset[int],
                 stop: Sequence[str] = ()) -> None:
        options = request.parsing_options
        if stop:
            options.stop_sequences = list(stop)
        generator = recipe.ChatCompletionRequest.chunk_generator(request, "chatcmpl", "deepseek")
        self._recipe = recipe
        self._processor = recipe.StreamProcessor(generator, options, tokenizer)
        self._response = recipe.ChatCompletionResponse("chatcmpl", "deepseek", 0, 0, 0)
        self._skip = skip_ids
        self._fed = 0
        self._finished = False
        self._chunks(self._processor.push(recipe.InferenceChunk.ready()))  # the role chunk, accumulated only

    @property
    def finished(self) -> bool:
        return self._finished

    def feed(self, token_ids: Sequence[int], finish_reason: str | None = None) -> list[ReplyChunk]:
        """Push the ids after those already pushed; with ``finish_reason`` (``stop``, ``length``, ``abort``)
        also the finish, which flushes what the processor held back. ``error`` closes the processor."""
        if self._finished:
            return []
        new = [t for t in token_ids[self._fed:] if t not in self._skip]
        self._fed = len(token_ids)
        raw: list[Any] = []
        # The processor finishes by itself on a stop sequence; nothing may be pushed after that.
        if new and not self._processor.finished:
            raw += self._processor.push(self._recipe.InferenceChunk.tokens(new))
        if finish_reason is not None:
            self._finished = True
            if finish_reason == "error":
                self._processor.close()
            elif not self._processor.finished:
                reason = self._recipe.InferenceFinishReason
                raw += self._processor.push(self._recipe.InferenceChunk.finish(
                    reason.Length if finish_reason == "length" else reason.Stop))
                raw += self._processor.finish()
        return self._chunks(raw)

    def _chunks(self, raw: Sequence[Any]) -> list[ReplyChunk]:
        out = []
        for chunk in raw:
            data = json.loads(chunk.to_json())
            self._response.accumulate(chunk)
            for choice in data.get("choices", ()):
                delta = {k: v for k, v in (choice.get("delta") or {}).items()
                         if k != "role" and v is not None and v != ""}
                if delta or choice.get("finish_reason"):
                    out.append(ReplyChunk(delta, choice.get("finish_reason")))
        return out

    def reply(self) -> ChatReply:
        """The reply accumulated so far (the whole reply once ``feed`` saw the finish)."""
        choice = json.loads(self._response.to_json())["choices"][0]
        message = choice.get("message") or {}
        calls = [ToolCall(c["id"], c["function"]["name"], c["function"].get("arguments") or "")
                 for c in message.get("tool_calls") or ()]
        return ChatReply(content=message.get("content"), reasoning=message.get("reasoning_content"),
                         tool_calls=calls, finish_reason=choice.get("finish_reason"))


@dataclass
class ChatPrompt:
    """An encoded chat request. ``request`` is deepseek-recipe's converted request when the tokenizer
    parses replies (None otherwise); through it come the recipe's sampling rules (``temperature``,
    ``top_p``), its output constraint, and ``reply_stream``."""

    text: str
    token_ids: list[int]
    request: Any = None
    recipe: Any = None
    recipe_tokenizer: Any = None

    @property
    def parses_replies(self) -> bool:
        return self.request is not None

    @property
    def thinking(self) -> bool:
        return self.request is not None and bool(self.request.conversation.thinking_mode)

    def sampling_rules(self) -> dict[str, float]:
        """The recipe's resolved ``temperature`` and ``top_p`` (thinking mode fixes them; outside it they are
        the requested values or its defaults); empty without the recipe."""
        if self.request is None:
            return {}
        options = self.request.inference_options
        rules = {"temperature": options.temperature, "top_p": options.top_p}
        return {k: float(v) for k, v in rules.items() if v is not None}

    def constraint(self) -> tuple[str, dict[str, Any]] | None:
        """The recipe's output constraint as ``SamplingParams`` fields, with the request field it comes
        from: ``("tools", {"structured": {"ebnf": ...}})`` for ``tool_call_required`` (the DSML grammar),
        ``("response_format", ...)`` for ``json`` (its schema; any JSON value when it gives none). In
        thinking mode the grammar starts after ``</think>`` (``so_args`` with that trigger), so the reasoning
        stays free. None when the recipe reports no constraint we enforce: ``tool_call`` (``auto``) is left
        free, as the recipe leaves it to the backend."""
        if self.request is None:
            return None
        constraint = self.request.inference_options.output_constraint
        if constraint is None or constraint.kind not in ("tool_call_required", "json"):
            return None
        if constraint.kind == "tool_call_required":
            field, kind, schema = "tools", "ebnf", tool_call_grammar(json.loads(constraint.schema))
        else:
            field, kind, schema = "response_format", "json", constraint.schema or "{}"
        if not self.thinking:
            return field, {"structured": {"ebnf" if kind == "ebnf" else "json_schema": schema}}
        end_think = self.recipe_tokenizer.encode(self.recipe.SpecialToken.ThinkingEnd.default_str())
        return field, {"so_args": {"schema_type": kind, "schema": schema, "trigger_token_ids": list(end_think)}}

    def reply_stream(self, *, skip_ids: frozenset[int], stop: Sequence[str] = ()) -> ReplyStream | None:
        """A fresh parser of one choice's reply (None without the recipe)."""
        if self.request is None:
            return None
        return ReplyStream(self.recipe, self.request, self.recipe_tokenizer, skip_ids=skip_ids, stop=stop)


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any],
                request_fields: Mapping[str, Any] | None = None) -> ChatPrompt:
    """Encode ``messages`` with ``tokenizer``'s chat encoding. A tokenizer with ``chat_request`` (the
    DeepSeek one) converts them through deepseek-recipe, with ``request_fields`` (Chat Completions body
    fields such as ``temperature``, ``top_p``) beside them; any other renders its template with ``options``
    as variables. Errors are the tokenizer's (``ChatOptionError``, ``ValueError``, ``TemplateError``)."""
    chat_request = getattr(tokenizer, "chat_request", None)
    if chat_request is None:
        text, ids = tokenizer.encode_chat(list(messages), **options)
        return ChatPrompt(text, list(ids))
    request = chat_request(messages, request_fields=request_fields, **options)
    text, ids = tokenizer.encode_request(request)
    return ChatPrompt(text, ids, request, tokenizer.recipe(), tokenizer.recipe_tokenizer())


def parse_reply(prompt: ChatPrompt, token_ids: Sequence[int], finish_reason: str | None, *,
                skip_ids: frozenset[int], stop: Sequence[str] = ()) -> ChatReply | None:
    """A finished reply parsed whole (None when ``prompt`` has no reply parser)."""
    stream = prompt.reply_stream(skip_ids=skip_ids, stop=stop)
    if stream is None:
        return None
    stream.feed(token_ids, finish_reason or "stop")
    return stream.reply()


def tool_call_grammar(tools: Sequence[Mapping[str, Any]]) -> str:
    """An xgrammar EBNF grammar of the V4 tool-call block's remainder (the prompt opened it with
    ``<｜DSML｜tool_calls>``): one or more ``invoke`` blocks of the declared functions, each with parameters
    named as declared (a parameter whose schema type is ``string`` is written raw with ``string="true"``,
    any other as a JSON value with ``string="false"``), then the block's end. Raw string values cannot
    contain ``<``; parameter order and required parameters are not enforced."""
    rules: list[str] = []
    invokes: list[str] = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool)
        name = function["name"]
        properties = (function.get("parameters") or {}).get("properties") or {}
        params = []
        for j, (pname, schema) in enumerate(properties.items()):
            is_string = isinstance(schema, Mapping) and schema.get("type") == "string"
            head = f'<{DSML}parameter name="{pname}" string="{"true" if is_string else "false"}">'
            value = "raw_text" if is_string else "json_value"
            rules.append(f"param_{i}_{j} ::= {_lit(head)} {value} {_lit(f'</{DSML}parameter>')} {_lit(chr(10))}")
            params.append(f"param_{i}_{j}")
        body = f"({' | '.join(params)})*" if params else '""'
        rules.append(f"invoke_{i} ::= {_lit(f'<{DSML}invoke name={json.dumps(name)}>' + chr(10))} {body} "
                     f"{_lit(f'</{DSML}invoke>' + chr(10))}")
        invokes.append(f"invoke_{i}")
    if not invokes:
        raise ValueError("tool_call_grammar: no tools to call")
    return "\n".join([
        f"root ::= ({' | '.join(invokes)})+ {_lit(f'</{DSML}tool_calls>')}",
        *rules,
        'raw_text ::= [^<]*',
        _JSON_VALUE,
    ])


def _lit(text: str) -> str:
    """An EBNF string literal (JSON string literals are valid xgrammar literals)."""
    return json.dumps(text, ensure_ascii=False)


# Any JSON value, compact or spaced (a tool argument of a non-string type).
_JSON_VALUE = r"""json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" ws (json_member (ws "," ws json_member)*)? ws "}"
json_member ::= json_string ws ":" ws json_value
json_array ::= "[" ws (json_value (ws "," ws json_value)*)? ws "]"
json_string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]))* "\""
json_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws ::= [ \n\t]*"""
