"""A third-party plugin that cannot be imported (its dependency is missing)."""

import deepinfer_no_such_dependency  # noqa: F401

Plugin = None
