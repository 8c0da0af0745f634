"""The decode anchor (``deepinfer/bench/anchor.py``): the method's bookkeeping on a tiny model, a peer's
result file read and put beside ours by ``deepinfer bench --decode-anchor --baseline-file``, and bad
files refused with a message naming the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deepinfer.bench.anchor import anchor_lengths, anchor_prompts, anchor_table, read_peer_anchor, run_anchor
from deepinfer.entrypoints.cli import main


def _peer_file(path: Path) -> Path:
    rows = [{"B": 1, "decode_tok_s_median": 50.0, "decode_tok_s": [49.0, 50.0, 51.0]},
            {"B": 4, "decode_tok_s_median": 160.0, "decode_tok_s": [160.0]}, {"meta": {"mode": "eager"}}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_the_anchor_times_fresh_prompts_and_reports_medians(make_llm: Any) -> None:
    llm = make_llm(max_num_seqs=4)
    prompts_seen: list[list[list[int]]] = []
    generate = llm.generate

    def recording(prompts, params, **kw):
        prompts_seen.append(prompts)
        return generate(prompts, params, **kw)

    llm.generate = recording
    result = run_anchor(llm, [1, 4], repeats=2, prompt_len=6, decode_tokens=3)
    assert sorted(result) == [1, 4]
    for batch, row in result.items():
        assert len(row["decode_tok_s"]) == 2 and row["decode_tok_s_median"] > 0
        expected = [batch * 3 / (b - a) for a, b in zip(row["t1_s"], row["t_full_s"], strict=True)]
        assert row["decode_tok_s"] == pytest.approx(expected)
    # one warm-up and two repeats of two calls per batch, every call with prompts never seen before
    assert [len(p) for p in prompts_seen] == [1] * 5 + [4] * 5
    flat = [tuple(p) for call in prompts_seen for p in call]
    assert len(set(flat)) == len(flat) and all(len(p) == 6 for p in flat)
    assert anchor_prompts(2, 7, 100, 5) == anchor_prompts(2, 7, 100, 5)


def test_a_length_spread_varies_the_prompts_about_the_same_mean(make_llm: Any) -> None:
    # Balanced routing hashes the position: one length decodes in lockstep. The spread keeps the mean length
    # (a peer's one-length prompts read the same KV bytes) and gives every row of a batch its own length.
    for batch in (2, 16, 64):
        lengths = anchor_lengths(batch, 128, 63)
        assert sum(lengths) == 128 * batch and min(lengths) == 65 and max(lengths) == 191
        assert len(set(lengths)) == batch
    assert anchor_lengths(1, 128, 63) == [128] and anchor_lengths(3, 10, 0) == [10] * 3
    prompts = anchor_prompts(5, 3, 100, 8, length_spread=4)
    assert [len(p) for p in prompts] == [4, 6, 8, 10, 12] and all(2 <= t < 100 for p in prompts for t in p)
    with pytest.raises(ValueError, match="length_spread"):
        anchor_lengths(4, 8, 8)

    llm = make_llm(max_num_seqs=4)
    seen: list[list[int]] = []
    generate = llm.generate

    def recording(prompts, params, **kw):
        seen.append([len(p) for p in prompts])
        return generate(prompts, params, **kw)

    llm.generate = recording
    result = run_anchor(llm, [4], repeats=1, prompt_len=6, decode_tokens=2, length_spread=3)
    assert seen == [[3, 5, 7, 9]] * 3 and result[4]["prompt_lens"] == [3, 5, 7, 9]
    with pytest.raises(ValueError, match="length_spread"):
        run_anchor(llm, [4], prompt_len=6, length_spread=6)


def test_a_peer_file_is_read_and_tabled(tmp_path: Path) -> None:
    rows, meta = read_peer_anchor(_peer_file(tmp_path / "vllm_x.json"))
    assert sorted(rows) == [1, 4] and meta == {"mode": "eager"}
    ours = {1: {"decode_tok_s_median": 100.0, "decode_tok_s": [90.0, 100.0], "decode_step_ms_median": 10.0},
            2: {"decode_tok_s_median": 150.0, "decode_tok_s": [150.0], "decode_step_ms_median": 13.3}}
    table = anchor_table(ours, rows, "vllm").splitlines()
    assert table[0].endswith("vllm decode tok/s | deepinfer / vllm |")
    assert table[2] == "| 1 | 100.0 (90–100) | 10.00 | 50.0 | 2.00× |"
    assert table[3].endswith("| - | - |")  # the peer did not measure batch 2


@pytest.mark.parametrize("text, message", [("{not json}\n", "1: not valid JSON"),
                                           ('{"meta": {}}\n{"x": 1}\n', "2: expected"),
                                           ('{"meta": {}}\n', "no decode-anchor rows")])
def test_bad_peer_files_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "peer.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_peer_anchor(path)
    with pytest.raises(ValueError, match="No such file"):
        read_peer_anchor(tmp_path / "missing.json")


def test_bench_decode_anchor_puts_the_peer_beside_ours(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "anchor.json"
    code = main(["bench", "--model", str(tiny_llama_dir), "--decode-anchor", "1,4", "--repeats", "1",
                 "--input-len", "5", "--output-len", "2", "--baseline-file", str(_peer_file(tmp_path / "vllm_r.json")),
                 "--set", "cache.kv_cache_bytes=1048576", "--set", "cache.block_size=16", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "deepinfer / vllm" in printed and "| 4 |" in printed
    report = json.loads(out.read_text())
    assert sorted(report["decode_anchor"]) == ["1", "4"] and report["baseline_meta"] == {"mode": "eager"}
