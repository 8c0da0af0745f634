"""Third-party plugins end to end (API.md §1, §2): discovery through the entry-point group, activation
by config, selection of a strategy by name, config validation of a plugin section, clashes, import
failures, and observer hooks. The plugins live in ``tests/thirdparty`` and are installed per test by
writing a ``*.dist-info`` folder (see ``install_plugin`` in conftest.py)."""

from __future__ import annotations

import json
import logging
import random
from types import SimpleNamespace
from typing import Any

import pytest

from deepinfer import SamplingParams
from deepinfer.entrypoints import cli
from deepinfer.errors import ConfigError, PluginError
from deepinfer.plugins import PluginHost, discover_plugins

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")

SJF_DIST, SJF_VERSION = "deepinfer-sjf-plugin", "0.3.1"
CLASH_DIST = "deepinfer-clash-plugin"
FAULTY_DIST = "deepinfer-faulty-plugin"
BROKEN_DIST = "deepinfer-broken-plugin"

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture
def sjf(install_plugin: Any) -> str:
    install_plugin(SJF_DIST, {"sjf": "deepinfer_sjf_plugin:Plugin"}, SJF_VERSION)
    return "sjf"


@pytest.fixture
def clash(install_plugin: Any) -> str:
    install_plugin(CLASH_DIST, {"clash": "deepinfer_clash_plugin"})
    return "clash"


@pytest.fixture
def faulty(install_plugin: Any) -> str:
    install_plugin(FAULTY_DIST, {"faulty": "deepinfer_faulty_plugin:Plugin"})
    return "faulty"


@pytest.fixture
def broken(install_plugin: Any) -> str:
    install_plugin(BROKEN_DIST, {"broken": "deepinfer_broken_plugin:Plugin"})
    return "broken"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Five random prompts of distinct lengths, the longest not first (so fcfs ≠ longest-first)."""
    rng = random.Random(20240517)
    lengths = rng.sample(range(2, 48), 5)
    assert lengths[0] != max(lengths) and lengths[0] != min(lengths), lengths
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def admission_order(outputs: list[Any]) -> list[int]:
    """Input indices in the order the requests got their first token (= admission with max_num_seqs=1)."""
    times = [o.metrics.first_token_time for o in outputs]
    assert None not in times and len(set(times)) == len(times), times
    return sorted(range(len(outputs)), key=times.__getitem__)


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    capsys.readouterr()
    assert cli.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------ discovery


def test_installed_plugin_is_discovered_with_its_distribution(sjf: str) -> None:
    installed = discover_plugins()
    assert sjf in installed
    plugin = installed[sjf]
    assert (plugin.distribution, plugin.version) == (SJF_DIST, SJF_VERSION)
    assert plugin.value == "deepinfer_sjf_plugin:Plugin"
    assert plugin.loaded is None  # discovery imports nothing


def test_cli_plugins_lists_it_installed_not_enabled(sjf: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {row["name"]: row for row in cli_json(capsys, "plugins", "--json")}
    row = rows[sjf]
    assert row["distribution"] == SJF_DIST and row["version"] == SJF_VERSION
    assert row["enabled"] is False and row["error"] is None
    assert {"deepinfer_schedule_policies", "deepinfer_step_end", "deepinfer_request_end",
            "deepinfer_stats"} <= set(row["hooks"])

    rows = {row["name"]: row for row in cli_json(capsys, "plugins", "--json", "--set", "plugins.sjf.enabled=true")}
    assert rows[sjf]["enabled"] is True

    assert cli.main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert f"{SJF_DIST} {SJF_VERSION}" in text and "[installed]" in text


# ------------------------------------------------------------------------------------------ selection


def test_enabled_plugin_policy_admits_longest_first(sjf: str, make_llm: Any, prompts: list[list[int]]) -> None:
    lengths = [len(p) for p in prompts]
    fcfs = make_llm(max_num_seqs=1).generate(prompts, PARAMS, use_tqdm=False)
    assert admission_order(fcfs) == list(range(len(prompts)))

    llm = make_llm(max_num_seqs=1, scheduler={"policy": "longest_first"}, plugins={sjf: {"enabled": True}})
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    longest_first = sorted(range(len(prompts)), key=lambda i: -lengths[i])
    assert admission_order(outs) == longest_first != list(range(len(prompts)))
    # The plugin's own request_end observer saw the same order.
    assert llm.get_stats()[sjf]["finished_prompt_lens"] == sorted(lengths, reverse=True)
    # Only the order changed: outputs come back in input order with the same greedy tokens.
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]


@pytest.mark.parametrize("via", ["config", "env_alias"])
def test_plugin_field_reaches_the_policy(sjf: str, via: str, make_llm: Any, prompts: list[list[int]],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    section: dict[str, Any] = {"enabled": True}
    if via == "config":
        section["reverse"] = True
    else:  # the plugin maps this env name onto plugins.sjf.reverse (deepinfer_config_aliases)
        monkeypatch.setenv("DEEPINFER_SJF_REVERSE", "1")
    llm = make_llm(max_num_seqs=1, scheduler={"policy": "longest_first"}, plugins={sjf: section})
    assert llm.engine.config.plugins[sjf]["reverse"] in (True, 1)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    lengths = [len(p) for p in prompts]
    assert admission_order(outs) == sorted(range(len(prompts)), key=lambda i: lengths[i])


def test_policy_preemption_victim(sjf: str) -> None:
    host = PluginHost({sjf: {"enabled": True}}, discover_plugins())
    policy = host.select("deepinfer_schedule_policies", "longest_first", "scheduler.policy")
    running = [SimpleNamespace(request_id=str(i), num_prompt_tokens=n, arrival_time=float(i))
               for i, n in enumerate([30, 7, 19, 7])]
    # The victim is the one the policy would admit last: shortest prompt, latest arrival among ties.
    assert policy.preemption_victim(running).request_id == "3"
    assert [r.request_id for r in policy.order(running, 0.0)] == ["0", "2", "1", "3"]


def test_disabled_plugin_offers_nothing(sjf: str, make_llm: Any, prompts: list[list[int]]) -> None:
    for plugins in ({}, {sjf: {"enabled": False}}):
        with pytest.raises(ConfigError) as err:
            make_llm(scheduler={"policy": "longest_first"}, plugins=plugins)
        msg = str(err.value)
        assert "scheduler.policy" in msg and "'longest_first'" in msg
        assert "fcfs" in msg  # the offered names
        assert f"plugins.{sjf}.enabled" in msg  # and the installed plugin that would provide it

    llm = make_llm(max_num_seqs=1)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert admission_order(outs) == list(range(len(prompts)))
    assert sjf not in llm.get_stats()  # its observers are not registered either


def test_unknown_name_hint_names_every_disabled_provider(sjf: str, clash: str) -> None:
    host = PluginHost({}, discover_plugins())
    with pytest.raises(ConfigError) as err:
        host.select("deepinfer_schedule_policies", "longest_first", "scheduler.policy")
    msg = str(err.value)
    assert f"plugins.{sjf}.enabled=true" in msg and f"plugins.{clash}.enabled=true" in msg
    with pytest.raises(ConfigError) as err:
        host.select("deepinfer_schedule_policies", "round_robin_ish", "scheduler.policy")
    assert "fcfs" in str(err.value) and "disabled" not in str(err.value)


# ------------------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(("section", "path", "detail"), [
    ({"enabled": True, "bogus": 1}, "plugins.sjf.bogus", "unknown config key"),
    ({"enabled": True, "reverse": "sideways"}, "plugins.sjf.reverse", "bool"),
])
def test_invalid_plugin_section_fails_startup(sjf: str, make_llm: Any, section: dict[str, Any], path: str,
                                              detail: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_llm(plugins={sjf: section})
    msg = str(err.value)
    assert f"plugin '{sjf}'" in msg and path in msg and detail in msg


def test_settings_for_a_module_plugin_are_refused(clash: str, make_llm: Any) -> None:
    with pytest.raises(ConfigError, match=r"plugins\.clash\.depth: plugin 'clash' takes no settings"):
        make_llm(plugins={clash: {"enabled": True, "depth": 3}})


def test_two_plugins_offering_one_name_fail_startup(sjf: str, clash: str, make_llm: Any,
                                                    prompts: list[list[int]]) -> None:
    with pytest.raises(ConfigError) as err:
        make_llm(plugins={sjf: {"enabled": True}, clash: {"enabled": True}})  # even with policy fcfs
    msg = str(err.value)
    assert "'longest_first'" in msg and f"'{sjf}'" in msg and f"'{clash}'" in msg

    # Installed is not enabled: with only the clash plugin enabled, its (fcfs-like) policy is chosen.
    llm = make_llm(max_num_seqs=1, scheduler={"policy": "longest_first"}, plugins={clash: {"enabled": True}})
    assert admission_order(llm.generate(prompts, PARAMS, use_tqdm=False)) == list(range(len(prompts)))


def test_unknown_plugin_name_lists_installed(sjf: str, clash: str, make_llm: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as err:
        make_llm(plugins={"sjff": {"enabled": True}})
    msg = str(err.value)
    assert "plugins.sjff" in msg and sjf in msg and clash in msg

    assert cli.main(["plugins", "--set", "plugins.sjff.enabled=true"]) == 2
    stderr = capsys.readouterr().err
    assert "plugins.sjff" in stderr and sjf in stderr


def test_enabled_plugin_that_fails_to_import_stops_startup(broken: str, make_llm: Any) -> None:
    with pytest.raises(PluginError) as err:
        make_llm(plugins={broken: {"enabled": True}})
    msg = str(err.value)
    assert f"'{broken}'" in msg and BROKEN_DIST in msg and "deepinfer_no_such_dependency" in msg


def test_disabled_plugin_that_fails_to_import_only_warns(broken: str, sjf: str, make_llm: Any,
                                                         caplog: pytest.LogCaptureFixture,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.WARNING, logger="deepinfer.plugins"):
        llm = make_llm(plugins={sjf: {"enabled": True}})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"'{broken}'" in w and "failed to import" in w for w in warnings), warnings
    assert llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].finished
    assert sjf in llm.get_stats()  # the healthy plugin is still active

    rows = {row["name"]: row for row in cli_json(capsys, "plugins", "--json")}
    assert "deepinfer_no_such_dependency" in rows[broken]["error"] and rows[broken]["hooks"] == []


# ------------------------------------------------------------------------------------------ observers


def test_observer_hooks_and_stats(sjf: str, make_llm: Any, prompts: list[list[int]]) -> None:
    llm = make_llm(max_num_seqs=2, plugins={sjf: {"enabled": True}})
    plugin = llm.engine.host.enabled[sjf]
    assert plugin.started_info is not None and plugin.started_info.vocab_size == 256
    assert plugin.started_info.num_layers == 2

    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    stats = llm.get_stats()
    mine = stats[sjf]
    assert mine["steps"] == stats["steps"] > 0
    assert mine["requests_finished"] == len(prompts)
    assert sorted(mine["finished_prompt_lens"]) == sorted(len(p) for p in prompts)
    # Every scheduled token was seen once: the prompts (no prefix hits among random prompts) and the
    # decode steps (the last sampled token is never fed back).
    assert mine["prefill_tokens"] + mine["decode_tokens"] == (
        sum(len(p) for p in prompts) + len(prompts) * (PARAMS.max_tokens - 1))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == stats["generated_tokens"]

    assert not plugin.stopped
    llm.shutdown()
    assert plugin.stopped


def test_step_stats_split_prefill_and_decode(sjf: str, make_llm: Any, prompts: list[list[int]]) -> None:
    llm = make_llm(max_num_seqs=2, plugins={sjf: {"enabled": True}})
    llm.generate(prompts, PARAMS, use_tqdm=False)
    mine = llm.get_stats()[sjf]
    assert mine["decode_tokens"] == len(prompts) * (PARAMS.max_tokens - 1)
    assert mine["prefill_tokens"] == sum(len(p) for p in prompts)


@pytest.mark.parametrize(("fail_in", "hook"), [
    ("step_end", "deepinfer_step_end"),
    ("request_end", "deepinfer_request_end"),
    ("stats", "deepinfer_stats"),
])
def test_plugin_raising_in_a_hook_is_named(faulty: str, make_llm: Any, fail_in: str, hook: str) -> None:
    llm = make_llm(plugins={faulty: {"enabled": True, "fail_in": fail_in}})
    with pytest.raises(PluginError) as err:
        llm.generate([[7, 8, 9, 10]], PARAMS, use_tqdm=False)
        llm.get_stats()
    msg = str(err.value)
    assert f"plugin '{faulty}'" in msg and hook in msg and "deliberate failure" in msg
