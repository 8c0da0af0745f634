"""Damaged model folders and config files (issue 24): one line naming the file and what is wrong, exit
code 2 from the CLI, a ``ModelLoadError`` / ``ConfigError`` (both ``ValueError``) from the API."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.entrypoints import cli
from deepinfer.errors import ConfigError, ModelLoadError

ENGINE = {"kv_cache_bytes": 1 << 21, "block_size": 16}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bad_header(path: Path) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"{" + b"x" * (n - 1) + data[8 + n:])


def _edit_config(**fields: object) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads(path.read_text())
        config.update(fields)
        path.write_text(json.dumps(config))
    return edit


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


# (label, file to damage, damage, words the one-line message must contain)
DAMAGES: list[tuple[str, str, Callable[[Path], None], list[str]]] = [
    ("truncated safetensors", "model.safetensors", _truncate, ["model.safetensors", "safetensors"]),
    ("bad safetensors header", "model.safetensors", _bad_header, ["model.safetensors", "header"]),
    ("broken tokenizer.json", "tokenizer.json", lambda p: p.write_text('{"model": '), ["tokenizer.json"]),
    ("tokenizer_config.json not JSON", "tokenizer_config.json", lambda p: p.write_text("[1,"),
     ["tokenizer_config.json", "JSON"]),
    ("string for an int in config.json", "config.json", _edit_config(num_hidden_layers="two"),
     ["config.json", "num_hidden_layers", "integer"]),
    ("architectures not a list", "config.json", _edit_config(architectures="LlamaForCausalLM"),
     ["config.json", "architectures"]),
    ("an impossible value in config.json", "config.json", _edit_config(num_attention_heads=3),
     ["config.json", "does not match"]),
    ("malformed config.json", "config.json", lambda p: p.write_text('{"architectures": ['),
     ["config.json", "not valid JSON"]),
    ("binary config.json", "config.json", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"),
     ["config.json", "UTF-8"]),
    ("config.json not an object", "config.json", lambda p: p.write_text("[1, 2]"), ["config.json", "object"]),
    ("config.json is a directory", "config.json", _replace_with_dir, ["config.json", "directory"]),
]


@pytest.fixture
def damaged(tiny_llama_tok_dir: Path, tmp_path: Path) -> Callable[[str, Callable[[Path], None]], Path]:
    def make(name: str, damage: Callable[[Path], None]) -> Path:
        folder = tmp_path / "model"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tiny_llama_tok_dir, folder)
        damage(folder / name)
        return folder
    return make


def _assert_one_line(message: str, words: list[str]) -> None:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(("label", "name", "damage", "words"), DAMAGES, ids=[d[0] for d in DAMAGES])
def test_damaged_folder_names_the_file(label, name, damage, words, damaged, capsys):
    folder = damaged(name, damage)
    with pytest.raises(ModelLoadError) as info:
        LLM(folder, **ENGINE)
    _assert_one_line(str(info.value), words)
    code = cli.main(["generate", "--model", str(folder), "--set", "cache.kv_cache_bytes=2097152", "hi"])
    err = capsys.readouterr().err
    assert code == 2, err
    _assert_one_line(err.removeprefix("deepinfer: error: "), words)


def test_chat_template_the_sandbox_refuses(damaged, capsys):
    folder = damaged("chat_template.jinja", lambda p: p.write_text("{{ messages.append(1) }}"))
    llm = LLM(folder, **ENGINE)
    with pytest.raises(ModelLoadError) as info:
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    _assert_one_line(str(info.value), ["chat_template.jinja", "sandbox"])
    code = cli.main(["generate", "--chat", "--model", str(folder), "--set", "cache.kv_cache_bytes=2097152", "hi"])
    assert code == 2
    _assert_one_line(capsys.readouterr().err, ["chat_template.jinja", "sandbox"])


def test_chat_template_that_does_not_parse(damaged):
    folder = damaged("chat_template.jinja", lambda p: p.write_text("{% for m in messages %}{{ m.content }}"))
    with pytest.raises(ModelLoadError, match=r"chat_template.jinja.*does not parse"):
        LLM(folder, **ENGINE).chat([{"role": "user", "content": "hi"}], use_tqdm=False)


@pytest.mark.parametrize(("write", "words"), [
    (lambda p: p.mkdir(), ["directory"]),
    (lambda p: p.write_bytes(b"\x00\xff\xfe\x80binary"), ["UTF-8"]),
    (lambda p: p.write_text("cache: [1,"), ["not valid YAML"]),
])
def test_bad_engine_config_file(write, words, tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "engine.yaml"
    write(path)
    with pytest.raises(ConfigError) as info:
        LLM(tiny_llama_dir, config=str(path))
    _assert_one_line(str(info.value), [str(path), *words])
    assert cli.main(["generate", "--model", str(tiny_llama_dir), "--config", str(path), "hi"]) == 2
    _assert_one_line(capsys.readouterr().err, [str(path), *words])
