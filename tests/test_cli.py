"""The ``deepinfer`` command (API.md §6): ``generate`` end to end on a tiny model, and how bad input
exits (status 2 with a message on stderr, no traceback)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints import cli

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")

SMALL_CACHE = ["--set", "cache.kv_cache_bytes=1048576", "--set", "cache.block_size=16"]
SUMMARY = re.compile(r"^(\d+) requests, (\d+) tokens in ([\d.]+) s: ([\d.]+) tok/s$", re.MULTILINE)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_prints_outputs_and_tokens_per_second(tiny_llama_tok_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["Hello there", "The capital of France is"]
    code, out, err = run(capsys, "generate", *prompts, "--model", str(tiny_llama_tok_dir), "--max-tokens", "4",
                         *SMALL_CACHE)
    assert code == 0, err
    match = SUMMARY.search(err)
    assert match is not None, err
    requests, tokens, seconds, rate = int(match[1]), int(match[2]), float(match[3]), float(match[4])
    assert requests == 2 and 2 <= tokens <= 8
    assert seconds >= 0 and rate > 0
    assert abs(tokens / rate - seconds) <= 0.006  # seconds are printed to 0.01, the rate to 0.1

    # Greedy by default: the printed texts are what the Python API generates.
    llm = LLM(tiny_llama_tok_dir, kv_cache_bytes=1 << 20, block_size=16)
    expected = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert sum(len(o.outputs[0].token_ids) for o in expected) == tokens
    for prompt, output in zip(prompts, expected, strict=True):
        assert f"### {prompt}\n{output.outputs[0].text}\n" in out


def test_generate_from_file_with_chat_template(tiny_llama_tok_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first question\n\nsecond question\nthird question\n")
    code, out, err = run(capsys, "generate", "--file", str(prompts), "--chat", "--model", str(tiny_llama_tok_dir),
                         "--max-tokens", "2", "--temperature", "0.8", "--seed", "3", *SMALL_CACHE)
    assert code == 0, err
    match = SUMMARY.search(err)
    assert match is not None and int(match[1]) == 3, err
    assert [line for line in out.splitlines() if line.startswith("### ")] == [
        "### first question", "### second question", "### third question"]


@pytest.mark.parametrize("flag", ["scheduler.max_num_seqs", "max_num_seqs=4", "=4"])
def test_bad_set_syntax_exits_2(flag: str, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "generate", "hi", "--model", str(tiny_llama_dir), "--set", flag)
    assert code == 2 and out == ""
    assert "deepinfer: error:" in err and repr(flag) in err and "expected section.field=value" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("flag", "needles"), [
    ("scheduler.max_num_seqs=0", ["scheduler.max_num_seqs", "greater than or equal to 1"]),
    ("kernels.atention=torch", ["kernels.atention", "unknown config key", "attention"]),
    ("model.dtype=fp64", ["model.dtype", "'bfloat16'"]),
])
def test_bad_set_value_exits_2(flag: str, needles: list[str], tiny_llama_dir: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "hi", "--model", str(tiny_llama_dir), "--set", flag)
    assert code == 2
    for needle in needles:
        assert needle in err, (needle, err)


def test_generate_errors_exit_2(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama_dir))
    assert code == 2 and "give prompts" in err

    code, _, err = run(capsys, "generate", "hi", "--model", str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere" in err and "known aliases" in err

    code, _, err = run(capsys, "generate", "hi", "--model", str(tiny_llama_dir), "--config",
                       str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err and "does not exist" in err

    # The tiny model folder has no tokenizer: a text prompt is refused, naming what is missing.
    code, _, err = run(capsys, "generate", "hi", "--model", str(tiny_llama_dir), *SMALL_CACHE)
    assert code == 2 and "tokenizer" in err


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--set"],
    ["generate", "hi", "--max-tokens", "many"],
    ["config"],
    ["nosuchcommand"],
])
def test_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[Any]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage: deepinfer" in capsys.readouterr().err


def test_chat_keeps_the_conversation(tiny_llama_tok_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    lines = iter(["Hello", "And again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen: list[int] = []
    original = LLM.chat

    def spy(self: LLM, messages: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(messages))
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(LLM, "chat", spy)
    code, out, err = run(capsys, "chat", "--model", str(tiny_llama_tok_dir), "--max-tokens", "3", *SMALL_CACHE)
    assert code == 0, err
    assert seen == [1, 3]  # the second turn carries the first question and the model's reply
    assert len(out.splitlines()) >= 2
