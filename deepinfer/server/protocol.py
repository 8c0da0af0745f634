"""Request bodies of the OpenAI-compatible endpoints, their validation, and OpenAI-style errors.

Bodies are strict: unknown fields, wrong types and bad values are HTTP 400 with
``{"error": {"message", "type", "param", "code"}}``. Fields of the OpenAI API that deepinfer does
not implement are unknown fields (400). ``frequency_penalty``, ``presence_penalty`` and ``logit_bias``
(keys are token ids as strings, as OpenAI sends them) are OpenAI's; ``repetition_penalty``,
``allowed_token_ids`` and ``min_tokens``-like ``first_n_token_no_eos`` are vLLM-style / reference
extensions, mapped onto ``SamplingParams`` fields of the same names.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.sampling.params import MAX_TEMPERATURE, SamplingParams

MAX_LOGPROBS = 20
MAX_CHOICES = 16  # ``n``: choices per request (each is its own engine request; see choices.py)
# OpenAI's rule for function names (they appear in prompts and in the model's tool-call markup).
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Stop strings per request and characters per stop string: the engine checks every stop against the text
# after each token, and a stream holds back up to the longest one (server/stops.py).
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 512


class APIError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by both endpoints (``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos`` are
    vLLM-style extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    first_n_token_no_eos: int | None = None

    def common_checks(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_LENGTH:
            raise bad_request(f"stop has a string of {longest} characters; at most {MAX_STOP_LENGTH} are allowed",
                              "stop")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}", "temperature")

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        structured: dict[str, Any] | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "structured": structured,
            "frequency_penalty": 0.0 if self.frequency_penalty is None else self.frequency_penalty,
            "presence_penalty": 0.0 if self.presence_penalty is None else self.presence_penalty,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": self._logit_bias(),
            "allowed_token_ids": self.allowed_token_ids,
            "first_n_token_no_eos": self.first_n_token_no_eos or 0,
        }
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            match = re.search(r"SamplingParams\.(\w+)", str(exc))
            raise bad_request(str(exc).replace("SamplingParams.", ""), match[1] if match else None) from exc


    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` keys are token ids written as strings."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise bad_request(f"logit_bias keys must be token ids (digits), got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None

    def the_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request(f"one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise bad_request("prompt is empty: at least one token is needed", "prompt")
        return prompt  # type: ignore[return-value]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.common_checks()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        max_tokens = 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions
        return self.sampling_params(max_tokens=max_tokens, logprobs=self.logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str


class MessageToolCall(_Body):
    """A tool call of an earlier assistant turn, sent back in the conversation (``index`` is tolerated:
    streamed calls carry it, and clients echo them back)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None


class ChatMessage(_Body):
    """One message. ``tool_calls`` (assistant), ``tool_call_id`` (tool) and ``reasoning_content`` (assistant,
    DeepSeek's thinking of that turn) are handed to the chat encoding as they are."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": c.function.model_dump()}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Body):
    """An OpenAI function tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"]
    function: FunctionSpec

    def as_dict(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChosenFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ChosenFunction


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    def structured(self) -> dict[str, Any] | None:
        """``SamplingParams.structured`` for this format: ``json_object`` is any JSON object,
        ``json_schema`` the schema under ``json_schema.schema`` (OpenAI's layout)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_schema": {"type": "object"}}
        schema = (self.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                              "response_format")
        return {"json_schema": schema}


class ChatRequest(_Sampling):
    """``chat_template_kwargs`` (vLLM's extension) are extra chat-template variables, handed to the
    tokenizer's ``encode_chat`` as ``LLM.chat`` does; with ``tokenizer="deepseek-v4"`` they are the V4
    encoding's options (``thinking``, ...), and a key it does not know is a 400."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    reasoning_effort: str | None = None

    def check_tools(self) -> None:
        """The tool declarations' form: unique, well-named functions whose ``parameters`` is an object
        schema; a ``tool_choice`` that names a declared function, and none that needs tools without them."""
        names: list[str] = []
        for i, tool in enumerate(self.tools or ()):
            fn = tool.function
            if not _FUNCTION_NAME.match(fn.name):
                raise bad_request(f"tools[{i}].function.name {fn.name!r} must be 1-64 letters, digits, '_' or '-'",
                                  "tools", "invalid_tools")
            if fn.name in names:
                raise bad_request(f"tools[{i}].function.name {fn.name!r} is declared twice", "tools", "invalid_tools")
            params = fn.parameters
            if params is not None and params.get("type", "object") != "object":
                raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of type 'object', got "
                                  f"type {params.get('type')!r}", "tools", "invalid_tools")
            names.append(fn.name)
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                              f"({names})", "tool_choice", "invalid_tool_choice")
        if choice == "required" and not names:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice", "invalid_tool_choice")

    def forced_function(self) -> FunctionSpec | None:
        """The function a named ``tool_choice`` forces, or the only tool under ``required``; None otherwise."""
        choice, tools = self.tool_choice, self.tools or []
        if isinstance(choice, NamedToolChoice):
            return next(t.function for t in tools if t.function.name == choice.function.name)
        if choice == "required" and len(tools) == 1:
            return tools[0].function
        return None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.common_checks()
        self.check_tools()
        structured = self.response_format.structured() if self.response_format is not None else None
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                  "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                    logprobs=logprobs, structured=structured)


def parse_body(raw: bytes, model: type[_Body]) -> Any:
    """JSON → the request model; every failure is an ``APIError`` 400 naming the field."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError:
        raise bad_request("the request body is nested too deeply to parse", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]]
        param = loc[0] if loc else None
        if err["type"] == "extra_forbidden":
            message = f"unknown field {'.'.join(loc)!r}"
            code = "unknown_field"
        else:
            message = f"{'.'.join(loc)}: {err['msg']}"
            code = "invalid_value"
        raise bad_request(message, param, code) from exc
