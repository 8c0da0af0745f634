"""Nothing in the ``DEEPINFER_`` namespace is silently ignored (issue 24): an unknown name warns once,
naming the closest known one; a boolean knob with a value that is not a boolean is a start-up error
naming the variable."""

from __future__ import annotations

import logging

import pytest

from deepinfer import LLM
from deepinfer.config import build_config, known_env_names
from deepinfer.errors import ConfigError


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "deepinfer.config"]


@pytest.mark.parametrize(("name", "closest"), [
    ("DEEPINFER_SCHEDULER_MAX_NUM_SEQS", "DEEPINFER_SCHEDULER__MAX_NUM_SEQS"),  # one underscore for two
    ("DEEPINFER_ENFORCE_EGAER", "DEEPINFER_ENFORCE_EAGER"),
    ("DEEPINFER_CACHE_BLOCK_SIZE", "DEEPINFER_CACHE__BLOCK_SIZE"),
])
def test_a_misspelt_name_warns_once_with_the_closest_known_one(name, closest, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.config"):
        build_config(environ={name: "8"})
        build_config(environ={name: "8"})
    messages = [m for m in _warnings(caplog) if name in m]
    assert len(messages) == 1, messages
    assert f"did you mean {closest}?" in messages[0]


def test_known_names_and_other_variables_do_not_warn(caplog):
    env = {"DEEPINFER_SCHEDULER__MAX_NUM_SEQS": "8", "DEEPINFER_ENFORCE_EAGER": "1", "DEEPINFER_CACHE_DIR": "/x",
           "DEEPINFER_API_KEY": "k"}
    with caplog.at_level(logging.WARNING, logger="deepinfer.config"):
        resolved = build_config(environ=env)
    assert resolved.config.scheduler.max_num_seqs == 8 and resolved.config.kernels.cuda_graphs is False
    assert _warnings(caplog) == []
    assert "DEEPINFER_SCHEDULER__MAX_NUM_SEQS" in known_env_names()


@pytest.mark.parametrize("name", ["DEEPINFER_ENFORCE_EAGER", "DEEPINFER_BATCH_INVARIANT",
                                  "DEEPINFER_FORCE_LOAD_BALANCE", "DEEPINFER_XGRAMMAR_DISABLE_CACHE"])
def test_a_boolean_knob_with_a_non_boolean_value_is_an_error(name):
    with pytest.raises(ConfigError, match=rf"environment variable {name} .*expected a boolean.*'banana'"):
        build_config(environ={name: "banana"})


@pytest.mark.parametrize(("value", "eager"), [("1", True), ("TRUE", True), ("on", True), ("0", False),
                                              ("False", False), ("", False), (" no ", False)])
def test_boolean_spellings(value, eager):
    assert build_config(environ={"DEEPINFER_ENFORCE_EAGER": value}).config.kernels.cuda_graphs is not eager


def test_start_up_refuses_the_bad_boolean(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "banana")
    with pytest.raises(ConfigError, match="DEEPINFER_ENFORCE_EAGER"):
        LLM(tiny_llama_dir)
