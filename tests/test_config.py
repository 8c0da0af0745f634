"""The layered config (API.md §5): defaults < file (YAML/JSON) < environment < overrides, the mapped
reference knobs, errors that name the full field path and the allowed values, keyword overrides of
``LLM(...)``, and ``deepinfer config show``."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

import deepinfer.config as config_mod
from deepinfer import LLM
from deepinfer.config import (
    FLAT_OVERRIDES,
    SECTION_OVERRIDES,
    EngineConfig,
    build_config,
    env_overrides,
    overrides_to_tree,
    set_flags_to_tree,
)
from deepinfer.entrypoints import cli
from deepinfer.errors import ConfigError

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")


def write_config(folder: Path, tree: dict[str, Any], fmt: str) -> Path:
    path = folder / f"engine.{fmt}"
    path.write_text(json.dumps(tree) if fmt == "json" else yaml.safe_dump(tree))
    return path


def nested(path: str, value: Any) -> dict[str, Any]:
    """``"a.b"``, v → ``{"a": {"b": v}}``."""
    *parents, leaf = path.split(".")
    tree: dict[str, Any] = {leaf: value}
    for key in reversed(parents):
        tree = {key: tree}
    return tree


def env_name(path: str) -> str:
    section, _, rest = path.partition(".")
    return f"DEEPINFER_{section.upper()}__{rest.upper().replace('.', '__')}"


@pytest.fixture
def fresh_knob_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which reference knobs already warned in this process."""
    monkeypatch.setattr(config_mod, "_warned_knobs", set())


# ------------------------------------------------------------------------------------------ precedence


def test_defaults_have_no_sources() -> None:
    resolved = build_config(environ={})
    cfg = resolved.config
    assert resolved.sources == {}
    assert cfg == EngineConfig()
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.policy, cfg.scheduler.executor) == (256, "fcfs", "auto")
    assert (cfg.cache.block_size, cfg.cache.prefix_caching, cfg.cache.max_backtrack) == (128, True, "auto")
    assert (cfg.kernels.batch_invariant, cfg.kernels.cuda_graphs) == (False, True)
    assert cfg.plugins == {}


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_file_env_override_precedence(fmt: str, tmp_path: Path) -> None:
    rng = random.Random(11)
    file_seqs, env_seqs, file_tokens, env_tokens, over_tokens = rng.sample(range(2, 4000), 5)
    block = rng.choice([16, 32, 64])
    path = write_config(tmp_path, {
        "scheduler": {"max_num_seqs": file_seqs, "max_num_batched_tokens": file_tokens},
        "cache": {"block_size": block},
        "kernels": {"attention": "torch", "cuda_graphs": True},
    }, fmt)
    environ = {
        "DEEPINFER_SCHEDULER__MAX_NUM_SEQS": str(env_seqs),
        "DEEPINFER_SCHEDULER__MAX_NUM_BATCHED_TOKENS": str(env_tokens),
        "DEEPINFER_ENFORCE_EAGER": "1",  # a mapped reference knob beats the file too
    }
    resolved = build_config(config=path, environ=environ,
                            overrides={"scheduler": {"max_num_batched_tokens": over_tokens}})
    cfg = resolved.config
    assert cfg.scheduler.max_num_seqs == env_seqs
    assert cfg.scheduler.max_num_batched_tokens == over_tokens
    assert cfg.cache.block_size == block and cfg.kernels.attention == "torch"
    assert cfg.kernels.cuda_graphs is False
    assert cfg.scheduler.chunked_prefill is True  # untouched default
    assert resolved.sources == {
        "scheduler.max_num_seqs": "environment",
        "scheduler.max_num_batched_tokens": "override",
        "cache.block_size": f"file {path}",
        "kernels.attention": f"file {path}",
        "kernels.cuda_graphs": "environment",
    }

    # Without env and overrides the file's values stand.
    only_file = build_config(config=path, environ={}).config
    assert (only_file.scheduler.max_num_seqs, only_file.scheduler.max_num_batched_tokens) == (file_seqs, file_tokens)


def test_config_dict_and_engine_config_object_are_sources() -> None:
    resolved = build_config(config={"sampling": {"seed": 7}}, environ={"DEEPINFER_SAMPLING__SEED": "9"})
    assert resolved.config.sampling.seed == 9 and resolved.sources == {"sampling.seed": "environment"}

    obj = EngineConfig(scheduler={"max_num_seqs": 3})
    resolved = build_config(config=obj, environ={})
    assert resolved.config.scheduler.max_num_seqs == 3
    assert resolved.sources == {"scheduler.max_num_seqs": "config object"}


@pytest.mark.parametrize(("environ", "expected"), [
    ({"DEEPINFER_BATCH_INVARIANT": "1"}, {"batch_invariant": True}),
    ({"DEEPINFER_ENFORCE_EAGER": "1"}, {"cuda_graphs": False}),
    ({"DEEPINFER_ENFORCE_EAGER": "0", "DEEPINFER_BATCH_INVARIANT": "true"},
     {"cuda_graphs": True, "batch_invariant": True}),
    ({"DEEPINFER_FORCE_LOAD_BALANCE": "yes"}, {"force_balanced_routing": True}),
])
def test_mapped_reference_knobs(environ: dict[str, str], expected: dict[str, bool]) -> None:
    resolved = build_config(environ=environ)
    kernels = resolved.config.kernels.model_dump()
    default = EngineConfig().kernels.model_dump()
    assert kernels == {**default, **expected}
    assert resolved.sources == {f"kernels.{field}": "environment" for field in expected}


def test_override_beats_mapped_knob() -> None:
    resolved = build_config(environ={"DEEPINFER_ENFORCE_EAGER": "1"}, overrides={"kernels": {"cuda_graphs": True}})
    assert resolved.config.kernels.cuda_graphs is True
    assert resolved.sources["kernels.cuda_graphs"] == "override"


def test_env_values_are_typed_and_reach_plugin_sections() -> None:
    environ = {
        "DEEPINFER_SCHEDULER__CHUNKED_PREFILL": "false",
        "DEEPINFER_CACHE__GPU_MEMORY_UTILIZATION": "0.5",
        "DEEPINFER_CACHE__MAX_BACKTRACK": "3",
        "DEEPINFER_MODEL__TOKENIZER": "/models/tok",
        "DEEPINFER_PLUGINS__SPEC_DECODE__MAX_DRAFT": "4",
        "DEEPINFER_CACHE_DIR": "/tmp/not-a-config-knob",  # no "__": not config, ignored
        "OTHER_SCHEDULER__MAX_NUM_SEQS": "1",  # not ours
    }
    cfg = build_config(environ=environ).config
    assert cfg.scheduler.chunked_prefill is False
    assert cfg.cache.gpu_memory_utilization == 0.5 and cfg.cache.max_backtrack == 3
    assert cfg.model.tokenizer == "/models/tok"
    assert cfg.plugins == {"spec_decode": {"max_draft": 4}}
    assert cfg.scheduler.max_num_seqs == 256


def test_unimplemented_reference_knob_warns_once(fresh_knob_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deepinfer.config"):
        for _ in range(3):
            resolved = build_config(environ={"DEEPINFER_NCCL_NUM_SMS": "4", "DEEPINFER_ENFORCE_EAGER": "1",
                                             "DEEPINFER_CACHE_DIR": "/tmp/x"})
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "DEEPINFER_NCCL_NUM_SMS" in messages[0], messages
    assert resolved.sources == {"kernels.cuda_graphs": "environment"}  # the knob changed nothing


def test_plugin_alias_maps_a_reference_knob(fresh_knob_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    environ = {"DEEPINFER_USE_NEXTN_DECODE": "3"}
    with caplog.at_level(logging.WARNING, logger="deepinfer.config"):
        tree = env_overrides(environ, {"DEEPINFER_USE_NEXTN_DECODE": "plugins.spec_decode.max_draft"})
    assert tree == {"plugins": {"spec_decode": {"max_draft": 3}}}
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="deepinfer.config"):
        assert env_overrides(environ) == {}  # nobody maps it: one warning
    assert ["DEEPINFER_USE_NEXTN_DECODE" in r.getMessage() for r in caplog.records] == [True]


def test_max_backtracking_tokens_maps_onto_cache_max_backtrack(fresh_knob_warnings: None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deepinfer.config"):
        resolved = build_config(environ={"DEEPINFER_MAX_BACKTRACKING_TOKENS": "6"})
    assert resolved.config.cache.max_backtrack == 6
    assert resolved.sources == {"cache.max_backtrack": "environment"}
    assert not caplog.records  # mapped, so no "not implemented" warning


# ------------------------------------------------------------------------------------------ errors


BAD_VALUES = [
    # (path, value, env text, what the message must also contain); the message starts with "path:"
    ("scheduler.max_num_seq", 3, "3", ["unknown config key", "did you mean 'max_num_seqs'", "chunked_prefill"]),
    ("schedular.max_num_seqs", 3, "3", ["schedular: unknown config key", "'scheduler'", "kernels"]),
    ("model.dtype", "fp64", "fp64", ["'fp64'", "'float32'", "'bfloat16'", "'float16'"]),
    ("cache.kv_dtype", "int4", "int4", ["'int4'", "'bf16'", "'fp8'", "'fp4'"]),
    ("scheduler.max_num_seqs", 0, "0", ["greater than or equal to 1"]),
    ("cache.gpu_memory_utilization", 1.5, "1.5", ["less than or equal to 1"]),
    ("cache.block_size", 8192, "8192", ["less than or equal to 4096"]),
    ("scheduler.max_num_seqs", "many", "many", ["integer", "'many'"]),
]


@pytest.mark.parametrize("source", ["file", "env", "override"])
@pytest.mark.parametrize(("path", "value", "env_text", "needles"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_config_names_path_and_allowed(source: str, path: str, value: Any, env_text: str,
                                           needles: list[str], tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"environ": {}}
    if source == "file":
        kwargs["config"] = write_config(tmp_path, nested(path, value), "yaml")
    elif source == "env":
        kwargs["environ"] = {env_name(path): env_text}
    else:
        kwargs["overrides"] = nested(path, value)
    with pytest.raises(ConfigError) as err:
        build_config(**kwargs)
    msg = str(err.value)
    reported = path.split(".")[0] if path.startswith("schedular") else path  # an unknown section
    assert f"{reported}:" in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_every_problem_is_reported() -> None:
    with pytest.raises(ConfigError) as err:
        build_config(config={"scheduler": {"max_num_seqs": -1}, "model": {"device": "tpu"}}, environ={})
    msg = str(err.value)
    assert "scheduler.max_num_seqs:" in msg and "model.device:" in msg and "'cuda'" in msg


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("broken.yaml", "scheduler: [max_num_seqs: 4\n", "YAML"),
    ("broken.json", '{"scheduler": {"max_num_seqs": 4}', "JSON"),
    ("list.yaml", "- scheduler\n- cache\n", "mapping"),
])
def test_unreadable_config_file(tmp_path: Path, name: str, text: str, needle: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        build_config(config=path, environ={})
    assert name in str(err.value) and needle in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(config=tmp_path / "missing.yaml", environ={})


# ------------------------------------------------------------------------------------- overrides


def test_flat_overrides_land_in_their_sections() -> None:
    rng = random.Random(5)
    values = {"max_num_seqs": rng.randint(1, 64), "block_size": rng.choice([16, 32]), "dtype": "float32",
              "seed": rng.randint(0, 1000), "expert_parallel_size": 2, "kv_cache_bytes": 1 << 20}
    tree = overrides_to_tree(values)
    assert tree == {
        "scheduler": {"max_num_seqs": values["max_num_seqs"]},
        "cache": {"block_size": values["block_size"], "kv_cache_bytes": 1 << 20},
        "model": {"dtype": "float32"},
        "sampling": {"seed": values["seed"]},
        "parallel": {"expert_parallel_size": 2},
    }
    cfg = build_config(overrides=tree, environ={"DEEPINFER_SCHEDULER__MAX_NUM_SEQS": "99"}).config
    assert cfg.scheduler.max_num_seqs == values["max_num_seqs"]  # overrides beat env


def test_flat_override_table_matches_the_schema() -> None:
    for key, section in FLAT_OVERRIDES.items():
        section_model = EngineConfig.model_fields[section].annotation
        assert key in section_model.model_fields, (key, section)
    for key, section in SECTION_OVERRIDES.items():
        assert section in EngineConfig.model_fields, key


def test_section_overrides_merge() -> None:
    scheduler = {"chunked_prefill": False, "policy": "longest_first"}
    plugins = {"sjf": {"enabled": True, "reverse": True}}
    tree = overrides_to_tree({"max_num_seqs": 2, "scheduler": scheduler, "model_config": {"max_model_len": 64},
                              "plugins": plugins})
    assert tree == {
        "scheduler": {"max_num_seqs": 2, "chunked_prefill": False, "policy": "longest_first"},
        "model": {"max_model_len": 64},
        "plugins": {"sjf": {"enabled": True, "reverse": True}},
    }
    assert scheduler == {"chunked_prefill": False, "policy": "longest_first"}  # inputs untouched
    resolved = build_config(config={"scheduler": {"max_num_batched_tokens": 128}}, overrides=tree, environ={})
    assert resolved.config.scheduler.max_num_batched_tokens == 128  # deep-merged over the file
    assert resolved.config.scheduler.chunked_prefill is False
    assert resolved.sources["plugins.sjf.reverse"] == "override"

    with pytest.raises(ConfigError, match="scheduler= must be a mapping"):
        overrides_to_tree({"scheduler": 4})


def test_unknown_keyword_is_named() -> None:
    with pytest.raises(ConfigError) as err:
        overrides_to_tree({"max_num_seq": 2})
    assert "'max_num_seq'" in str(err.value) and "max_num_seqs" in str(err.value)


def test_llm_rejects_unknown_keyword_and_bad_values(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        LLM(tiny_llama_dir, max_num_seq=2)
    assert "'max_num_seq'" in str(err.value) and "max_num_seqs" in str(err.value)
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_seqs: .*greater than or equal to 1"):
        LLM(tiny_llama_dir, max_num_seqs=0)


def test_llm_layers_file_env_and_keywords(make_llm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, {"scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 700},
                                   "sampling": {"seed": 17}}, "yaml")
    monkeypatch.setenv("DEEPINFER_SCHEDULER__MAX_NUM_BATCHED_TOKENS", "600")
    llm = make_llm(config=str(path), max_num_seqs=2)
    cfg = llm.engine.config
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, cfg.sampling.seed) == (2, 600, 17)
    assert llm.engine.scheduler.max_num_seqs == 2 and llm.engine.scheduler.max_num_batched_tokens == 600
    assert llm.engine.config_sources["sampling.seed"] == f"file {path}"
    assert llm.engine.config_sources["cache.block_size"] == "override"


def test_set_flags() -> None:
    tree = set_flags_to_tree(["scheduler.max_num_seqs=8", "kernels.cuda_graphs=false", "model.tokenizer=/a/b=c",
                              "cache.max_backtrack=auto", "plugins.sjf.enabled=true"])
    assert tree == {"scheduler": {"max_num_seqs": 8}, "kernels": {"cuda_graphs": False},
                    "model": {"tokenizer": "/a/b=c"}, "cache": {"max_backtrack": "auto"},
                    "plugins": {"sjf": {"enabled": True}}}
    for bad in ("scheduler.max_num_seqs", "max_num_seqs=8"):
        with pytest.raises(ConfigError, match=r"expected section\.field=value"):
            set_flags_to_tree([bad])


# ------------------------------------------------------------------------------------------ config show


def test_config_show_json_reports_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, {"cache": {"block_size": 32}, "scheduler": {"max_num_seqs": 4}}, "yaml")
    monkeypatch.setenv("DEEPINFER_SCHEDULER__MAX_NUM_SEQS", "8")
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    assert cli.main(["config", "show", "--json", "--config", str(path), "--set", "kernels.attention=torch"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["config"]["cache"]["block_size"] == 32
    assert shown["config"]["scheduler"]["max_num_seqs"] == 8
    assert shown["config"]["kernels"]["cuda_graphs"] is False
    assert shown["config"]["model"]["dtype"] == "auto"
    assert shown["sources"] == {
        "cache.block_size": f"file {path}",
        "scheduler.max_num_seqs": "environment",
        "kernels.cuda_graphs": "environment",
        "kernels.attention": "override",
    }


def test_config_show_text(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_SCHEDULER__MAX_NUM_SEQS", "8")
    assert cli.main(["config", "show", "--set", "plugins.sjf.reverse=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  max_num_seqs: 8    # from environment" in lines
    assert '  dtype: "auto"' in lines  # defaults carry no source
    assert any(line.strip() == "reverse: true    # from override" for line in lines), lines


def test_config_show_bad_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "show", "--set", "cache.kv_dtype=int4"]) == 2
    err = capsys.readouterr().err
    assert "cache.kv_dtype" in err and "'fp8'" in err


def test_an_old_config_path_moves_in_each_source_so_precedence_holds() -> None:
    """A dotted alias (``deepinfer_config_aliases``) is an old path of a field: each source's value moves
    onto the new path before the sources merge, and the plugin section that used to own it mirrors it."""
    aliases = {"plugins.spec_decode.max_draft": "speculative.max_draft"}
    old_in_env = build_config(environ={"DEEPINFER_PLUGINS__SPEC_DECODE__MAX_DRAFT": "2"},
                              overrides={"speculative": {"max_draft": 4}}, aliases=aliases)
    new_in_env = build_config(environ={"DEEPINFER_SPECULATIVE__MAX_DRAFT": "2"},
                              overrides={"plugins": {"spec_decode": {"max_draft": 4}}}, aliases=aliases)
    for resolved in (old_in_env, new_in_env):
        assert resolved.config.speculative.max_draft == 4  # the override wins whichever name it uses
        assert resolved.config.plugins["spec_decode"]["max_draft"] == 4
        assert resolved.sources["speculative.max_draft"] == "override"
    env_only = build_config(environ={"DEEPINFER_PLUGINS__SPEC_DECODE__MAX_DRAFT": "2"}, aliases=aliases)
    assert env_only.config.speculative.max_draft == 2 and env_only.sources["speculative.max_draft"] == "environment"
    untouched = build_config(environ={}, aliases=aliases).config
    assert untouched.speculative.max_draft == 5 and "spec_decode" not in untouched.plugins  # nothing created
    conflict = r"config dict: plugins\.spec_decode\.max_draft=3 and speculative\.max_draft=1"
    with pytest.raises(ConfigError, match=conflict):
        build_config(config={"plugins": {"spec_decode": {"max_draft": 3}}, "speculative": {"max_draft": 1}},
                     environ={}, aliases=aliases)
    # DEEPINFER_ENABLE_MTP_VARLEN's 1/0 is the core plan field's varlen/fixed.
    assert build_config(overrides={"speculative": {"plan": 0}}, environ={}).config.speculative.plan == "fixed"
