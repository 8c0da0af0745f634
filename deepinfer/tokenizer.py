"""Text in and out: a ``tokenizers`` tokenizer, the model's chat template, and its EOS ids.

Transformers is not needed: ``tokenizer.json`` loads with the ``tokenizers`` library and the chat
template (``chat_template.jinja`` or ``tokenizer_config.json``) renders with a sandboxed jinja2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.errors import ChatOptionError, ModelLoadError


def _raise(message: str) -> None:
    raise TemplateError(message)


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON object file of the tokenizer folder ({} when absent; ``ModelLoadError`` naming it when
    it is not a readable JSON object)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON text: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


# Texts longer than this are encoded with the GIL released (``Tokenizer.encode``).
GIL_FREE_ENCODE_CHARS = 4096


def check_unicode(text: str, what: str) -> None:
    """``ValueError`` naming ``what`` and the position unless ``text`` encodes as UTF-8 (a lone surrogate
    does not; the tokenizer would fail on it with a bare ``TypeError``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start}") from None


def _token_text(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are strings or ``{"content": ...}`` dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode, decode and render chat prompts for one model folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        path = folder / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception for every parse failure
            raise ModelLoadError(f"{str(path)!r} is not a valid tokenizer file: {exc}") from None
        config = _read_json(folder / "tokenizer_config.json")
        template_file = folder / "chat_template.jinja"
        # Where the chat template comes from, for errors that name the file.
        self.chat_template_source = str(template_file if template_file.is_file() else folder / "tokenizer_config.json")
        try:
            template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        except UnicodeDecodeError:
            raise ModelLoadError(f"{str(template_file)!r} is not UTF-8 text") from None
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(f"{self.chat_template_source!r}: 'chat_template' must be a string (a list of "
                                 f"named templates is not supported), got {type(template).__name__}")
        self.chat_template: str | None = template
        self.special_tokens = {
            k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        bos = self.special_tokens["bos_token"]
        # Text prompts start with BOS when the tokenizer says so (Gemma, Llama); chat templates write their own.
        self.prompt_bos: int | None = (self._tok.token_to_id(bos) if config.get("add_bos_token") and bos
                                       else None)

    @staticmethod
    def exists(folder: Path) -> bool:
        return (folder / "tokenizer.json").is_file()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without added special tokens (chat templates carry their own).
        ``ValueError`` for text that is not valid Unicode (a lone surrogate, e.g. from JSON ``"\\ud800"``)."""
        check_unicode(text, "the text")
        if len(text) > GIL_FREE_ENCODE_CHARS:
            # ``encode_batch`` releases the GIL while it works (``encode`` holds it throughout), so a long
            # prompt tokenized on a worker thread does not stall the server's event loop; same ids.
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt: ``encode``, after BOS when tokenizer_config.json sets
        ``add_bos_token`` (and the text does not already start with it)."""
        ids = self.encode(text)
        if self.prompt_bos is not None and ids[:1] != [self.prompt_bos]:
            ids.insert(0, self.prompt_bos)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], /, **options: Any) -> str:
        """The chat template applied to ``messages`` with the generation prompt on; ``options`` are extra
        template variables (``chat_template_kwargs``, e.g. ``enable_thinking`` for templates that read it);
        ``messages`` and ``add_generation_prompt`` are the renderer's own (``ChatOptionError``)."""
        if not self.chat_template:
            raise ValueError(f"tokenizer in {str(self.folder)!r} has no chat template; use generate() instead")
        reserved = sorted(set(options) & {"messages", "add_generation_prompt"})
        if reserved:
            raise ChatOptionError(f"chat_template_kwargs: {reserved} are set by the chat renderer itself")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        # The template's own faults are the model folder's (ModelLoadError naming the file); a template that
        # refuses these messages (``raise_exception``) stays a TemplateError, the caller's.
        try:
            template = env.from_string(self.chat_template)
        except TemplateSyntaxError as exc:
            raise ModelLoadError(f"{self.chat_template_source!r}: the chat template does not parse: "
                                 f"{exc.message} (line {exc.lineno})") from None
        try:
            return template.render(messages=messages, add_generation_prompt=True, **{**specials, **options})
        except SecurityError as exc:
            raise ModelLoadError(f"{self.chat_template_source!r}: the chat template did something the jinja "
                                 f"sandbox refuses: {exc}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], /, **options: Any) -> tuple[str, list[int]]:
        """The rendered chat prompt and its token ids (no special tokens added: the template has them)."""
        text = self.render_chat(messages, **options)
        return text, self.encode(text)

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config.json's ``eos_token``, if it names one in the vocabulary."""
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.token_id(eos)


def eos_token_ids(folder: Path, hf_config: dict[str, Any], tokenizer: Tokenizer | None = None) -> frozenset[int]:
    """EOS ids from ``generation_config.json``, then ``config.json`` (API.md §4), then the tokenizer's
    ``eos_token`` (a model folder without either, used with e.g. ``tokenizer="deepseek-v4"``)."""
    for source in (_read_json(folder / "generation_config.json"), hf_config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return frozenset(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return frozenset([tokenizer.eos_token_id])
    return frozenset()
