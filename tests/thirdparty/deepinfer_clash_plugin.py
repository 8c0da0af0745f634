"""A settings-free third-party plugin (the entry point names this module) whose policy name clashes
with ``deepinfer_sjf_plugin``: both offer ``longest_first``."""

from __future__ import annotations

from deepinfer import hookimpl
from deepinfer.defaults import FCFSPolicy


@hookimpl
def deepinfer_schedule_policies() -> dict[str, FCFSPolicy]:
    return {"longest_first": FCFSPolicy()}
