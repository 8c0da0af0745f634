"""Exception types raised by deepinfer.

Every error names the thing that is wrong (a config path, an argument, a plugin) and, where there is
one, the allowed range, so a user can fix it without reading the source.
"""


class DeepInferError(Exception):
    """Base class of every error deepinfer raises on purpose."""


class ConfigError(DeepInferError, ValueError):
    """An invalid configuration: unknown key, bad value, or an incompatible combination."""


class ModelNotFoundError(DeepInferError, ValueError):
    """A model path or alias that does not resolve to a model folder."""


class ModelLoadError(DeepInferError, ValueError):
    """A model folder whose files are damaged or inconsistent (malformed ``config.json``, wrong types in it,
    truncated or corrupt safetensors, a broken tokenizer or chat template); the message names the file."""


class ChatOptionError(DeepInferError, ValueError):
    """A chat option (``chat_template_kwargs``) the tokenizer's chat encoding does not accept: an
    unknown key where the encoding has a fixed set, a reserved name, or a bad value."""


class PluginError(DeepInferError):
    """A plugin failed to import, to configure itself, or raised inside a hook."""
