"""The priority and shortest-prompt-first policies, alone and inside the engine."""

from __future__ import annotations

from deepinfer_scheduling.policies import PriorityPolicy, ShortestPromptFirst
from fakes import FakeRequest
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams


def test_priority_orders_by_level_then_arrival():
    reqs = [FakeRequest("a", 1.0, priority=2), FakeRequest("b", 2.0, priority=0),
            FakeRequest("c", 0.5, priority=2), FakeRequest("d", 3.0)]
    policy = PriorityPolicy()
    assert [r.request_id for r in policy.order(reqs, 9.0)] == ["b", "d", "c", "a"]
    assert policy.preemption_victim(reqs).request_id == "a"


def test_spf_orders_by_prompt_length():
    reqs = [FakeRequest("a", 1.0, num_prompt_tokens=50), FakeRequest("b", 2.0, num_prompt_tokens=5),
            FakeRequest("c", 0.5, num_prompt_tokens=5)]
    policy = ShortestPromptFirst()
    assert [r.request_id for r in policy.order(reqs, 9.0)] == ["c", "b", "a"]
    assert policy.preemption_victim(reqs).request_id == "a"


def _first_token_order(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [i for i, _ in sorted(enumerate(outs), key=lambda x: x[1].metrics.first_token_time)]


def test_policies_change_admission_in_the_engine(tmp_path):
    folder = save_tiny("llama", tmp_path)[1]
    prompts = [[1] * 30, [2] * 5, [3] * 17]
    params = [SamplingParams(temperature=0, max_tokens=2, priority=p) for p in (1, 2, 0)]
    kw = {"block_size": 16, "kv_cache_bytes": 1 << 20, "max_num_seqs": 1, "plugins": {"scheduling": {"enabled": True}}}
    assert _first_token_order(LLM(folder, **kw), prompts, params) == [0, 1, 2]  # fcfs
    assert _first_token_order(LLM(folder, scheduler={"policy": "priority"}, **kw), prompts, params) == [2, 0, 1]
    assert _first_token_order(LLM(folder, scheduler={"policy": "spf"}, **kw), prompts, params) == [1, 2, 0]
