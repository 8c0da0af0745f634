"""Prefill/decode hand-off (issue 34 item 3): a prefill-role engine in another process computes prompts and
publishes their blocks and hand-off records; a decode-role engine here continues them, and the tokens
equal a single engine's, greedy and seeded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.engine.handoff import HandoffRecord, admit_handoff
from deepinfer.errors import ConfigError

BLOCK = 16
PARAMS = [{"temperature": 0, "max_tokens": 12, "ignore_eos": True},
          {"temperature": 1.0, "top_p": 0.9, "max_tokens": 12, "seed": 5, "ignore_eos": True, "logprobs": 2},
          {"temperature": 0.8, "max_tokens": 10, "ignore_eos": True, "presence_penalty": 0.5}]  # engine-seeded


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (40, 53, 70)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("handoff-llama"))[1]


def _engine_args(disk: Path | None) -> dict[str, Any]:
    store = {"cache": {"kv_store": "disk"}, "plugins": {"kv_store": {"enabled": True, "disk_dir": str(disk)}}}
    return {"kv_cache_bytes": 1 << 22, "block_size": BLOCK, "max_model_len": 128, **(store if disk else {})}


PREFILL_ROLE = textwrap.dedent("""
    import json, sys
    from deepinfer import LLM, SamplingParams
    from deepinfer.engine.handoff import prefill_and_publish
    folder, args, work = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(folder, **args)
    records = [prefill_and_publish(llm.engine, prompt, SamplingParams(**params))[0].to_json()
               for prompt, params in work]
    llm.shutdown()
    print(json.dumps(records))
""")


@pytest.mark.slow  # a prefill-role process and two engines here: about 10 s on the 2-core VM
def test_a_decode_engine_in_another_process_continues_like_a_single_engine(llama_dir: Path, tmp_path: Path) -> None:
    prompts = _prompts()
    work = [[p, params] for p, params in zip(prompts, PARAMS, strict=True)]
    done = subprocess.run([sys.executable, "-c", PREFILL_ROLE, str(llama_dir), json.dumps(_engine_args(tmp_path)),
                           json.dumps(work)], capture_output=True, text=True, timeout=300, check=True)
    records = [HandoffRecord.from_json(text) for text in json.loads(done.stdout.strip().splitlines()[-1])]
    assert [len(r.block_hashes) for r in records] == [n // BLOCK for n in map(len, prompts)]

    single = LLM(llama_dir, **_engine_args(None))
    want = single.generate(prompts, [SamplingParams(**p) for p in PARAMS], use_tqdm=False)
    single.shutdown()

    decode = LLM(llama_dir, **_engine_args(tmp_path))
    engine = decode.engine
    computed: list[int] = []
    schedule = engine.scheduler.schedule

    def counted() -> Any:
        out = schedule()
        computed.append(out.num_tokens)
        return out

    engine.scheduler.schedule = counted
    ids = [admit_handoff(engine, r).request_id for r in records]
    outputs: dict[str, Any] = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    tiers = decode.get_stats()["kv_tiers"]
    decode.shutdown()
    got = [outputs[i].outputs[0] for i in ids]
    assert [c.token_ids for c in got] == [w.outputs[0].token_ids for w in want]
    assert got[1].logprobs is not None and len(got[1].logprobs) == len(got[1].token_ids)
    for have, ref in zip(got[1].logprobs, want[1].outputs[0].logprobs, strict=True):  # the first one travelled
        assert have.keys() == ref.keys() and list(have.values()) == pytest.approx(list(ref.values()), abs=1e-4)
    # The first step computes each prompt's last partial block and its first token only.
    assert computed[0] == sum(len(p) % BLOCK + 1 for p in prompts)
    assert tiers["promoted_blocks"] == sum(len(p) // BLOCK for p in prompts)


def test_a_record_of_another_layout_or_a_finished_request_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    record = HandoffRecord(prompt_token_ids=(5,) * 20, first_token=7, first_logprobs=None,
                           params={"temperature": 0, "max_tokens": 4}, seed=1, counter=21, block_hashes=(),
                           namespace="00" * 16)
    assert HandoffRecord.from_json(record.to_json()) == record
    llm = LLM(llama_dir, **_engine_args(tmp_path))
    with pytest.raises(ConfigError, match="another model or cache layout"):
        admit_handoff(llm.engine, record)
    ns = llm.engine.kv_tiers.spec.namespace
    finished = HandoffRecord(**{**record.__dict__, "namespace": ns, "params": {"temperature": 0, "max_tokens": 1}})
    with pytest.raises(ValueError, match="already ends the request"):
        admit_handoff(llm.engine, finished)
    llm.shutdown()
    plain = LLM(llama_dir, **_engine_args(None))
    with pytest.raises(ConfigError, match=r"decode-role engine needs cache\.kv_store"):
        admit_handoff(plain.engine, record)
    plain.shutdown()
