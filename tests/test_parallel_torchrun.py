"""``LLM(model, expert_parallel_size=N)`` under ``torchrun`` (CPU, gloo): every process is one rank and
gets the single-process greedy tokens of every prompt, in input order — on one host, and on two
"hosts" (two torchrun agents on localhost meeting through a c10d rendezvous); statistics, expert
layouts, rebalancing and shutdown work as collectives, and the ``least_loaded`` router decides alike
everywhere; a ``WORLD_SIZE`` that differs from the configured size fails with a ``ConfigError`` naming
both. On two GPUs (``-m gpu``) the same over NCCL."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_parallel import BLOCK, KV, MAX_NEW, PROMPTS, _tokens
from tiny_deepseek import save_tiny_v3

from deepinfer import LLM
from deepinfer.errors import ConfigError
from deepinfer.parallel.launch import TorchrunLaunch, torchrun_launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

TIMEOUT_S = 240
EPLB = {"enabled": True, "policy": "greedy_multistep", "interval": 4, "window": 4, "num_redundant_experts": 2}
# NVLink multicast stays off on the lent GPU machines (tests/test_gpu_parallel.py).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Every process writes what it saw to OUT/rank<RANK>.json.
SCRIPT = """
import json, os, sys
from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError

model, out, ep, router, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
llm = LLM(model, kv_cache_bytes={kv}, block_size={block}, expert_parallel_size=ep, parallel={{"router": router}},
          plugins={{"eplb": {eplb!r}}}, device=device, dtype="float32")
params = SamplingParams(temperature=0, max_tokens={max_new}, ignore_eos=True)
outs = llm.generate({prompts!r}, params, use_tqdm=False)
stats = llm.get_stats()
llm.engine.rebalance()
again = llm.generate({prompts!r}, params, use_tqdm=False)
layout = llm.engine.expert_layout()
try:
    llm.engine.stream = True  # what AsyncLLM asks for
    refused = False
except ConfigError:
    refused = True
llm.shutdown()
with open(os.path.join(out, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({{"prompts": [o.prompt_token_ids for o in outs], "tokens": [o.outputs[0].token_ids for o in outs],
               "again": [o.outputs[0].token_ids for o in again], "parallel": stats["parallel"],
               "generated": stats["generated_tokens"], "rebalances": stats["eplb"]["rebalances"],
               "placements": [r["placement"] for r in layout], "local_rank": int(os.environ["LOCAL_RANK"]),
               "num_nodes": llm.engine.launch.num_nodes, "stream_refused": refused}}, f)
"""


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-torchrun"))


@pytest.fixture(scope="module")
def reference(tiny_v3) -> list[list[int]]:
    """The single-process greedy tokens on the CPU."""
    with LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK) as llm:
        return _tokens(llm)


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("torchrun-script") / "run.py"
    path.write_text(SCRIPT.format(kv=KV, block=BLOCK, eplb=EPLB, max_new=MAX_NEW, prompts=PROMPTS))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(launcher: list[str], script: Path, model: Path, out: Path, *, ep: int = 2,
              router: str = "round_robin", device: str = "cpu") -> subprocess.Popen:
    """Start ``torchrun LAUNCHER script ...`` in the caller's environment, less its config variables
    and any torchrun launch of its own."""
    inherited = {k: v for k, v in os.environ.items()
                 if k not in LAUNCH_VARIABLES and (not k.startswith("DEEPINFER_") or k == "DEEPINFER_CACHE_DIR")}
    env = {**NO_MULTICAST, **inherited, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher,
           str(script), str(model), str(out), str(ep), router, device]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _one_host(nproc: int) -> list[str]:
    return ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]


def _finish(procs: list[subprocess.Popen]) -> None:
    """Wait for every launch to succeed (killing them all if one hangs)."""
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log


def _results(out: Path, reference: list[list[int]], requests_per_rank: list[int]) -> list[dict]:
    """Every process's record; each holds every output in input order with the reference tokens."""
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(requests_per_rank))]
    for result in results:
        assert result["prompts"] == PROMPTS
        assert result["tokens"] == reference
        assert result["again"] == reference  # after an explicit rebalance
        assert result["parallel"]["requests_per_rank"] == requests_per_rank
        assert result["generated"] == len(PROMPTS) * MAX_NEW  # summed over the ranks
        assert result["rebalances"] >= 1
        assert result["stream_refused"]
        placements = result["placements"]
        assert len(placements) == len(requests_per_rank) and all(p == placements[0] for p in placements)
        assert result["placements"] == results[0]["placements"]  # every process saw the same layout
    return results


def test_torchrun_launch_reads_the_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    launch = torchrun_launch(env)
    assert launch == TorchrunLaunch(rank=3, world=4, local_rank=1, local_world=2) and launch.num_nodes == 2
    assert torchrun_launch({k: v for k, v in env.items() if k != "LOCAL_WORLD_SIZE"}).num_nodes == 1
    assert torchrun_launch({**env, "MASTER_PORT": ""}) is None
    assert torchrun_launch({}) is None


def test_one_host_two_processes(tiny_v3, reference, script, tmp_path):
    _finish([_torchrun(_one_host(2), script, tiny_v3, tmp_path)])
    results = _results(tmp_path, reference, requests_per_rank=[4, 4])  # round_robin
    assert [(r["local_rank"], r["num_nodes"]) for r in results] == [(0, 1), (1, 1)]


def test_two_hosts_through_a_c10d_rendezvous_least_loaded(tiny_v3, reference, script, tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [_torchrun(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", endpoint, "--rdzv-id", "deepinfer-test",
                         "--rdzv-conf", f"is_host={int(node == 0)}"],
                        script, tiny_v3, tmp_path, router="least_loaded") for node in (0, 1)]
    _finish(agents)
    # least_loaded, all 8 prompts (5, 40, 17, 3, 29, 11, 23, 8 tokens) queued before the first step:
    # ranks 0, 1, 0, 0, 0, 1, 1, 0 — decided alike on every process
    results = _results(tmp_path, reference, requests_per_rank=[5, 3])
    assert [(r["local_rank"], r["num_nodes"]) for r in results] == [(0, 2), (0, 2)]  # one process per "host"


def test_world_size_must_equal_the_configured_size(tiny_v3, monkeypatch):
    # torchrun's variables for a world of 2; the check comes before the process group is joined
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    for ep in (4, 1):
        with pytest.raises(ConfigError, match=rf"torchrun started WORLD_SIZE=2 processes but the config asks "
                                              rf"for {ep} rank\(s\) \(parallel.expert_parallel_size={ep}"):
            LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, expert_parallel_size=ep)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl(tiny_v3, script, tmp_path):
    with LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, device="cuda", dtype="float32") as llm:
        reference = _tokens(llm)
    _finish([_torchrun(_one_host(2), script, tiny_v3, tmp_path, device="cuda")])
    results = _results(tmp_path, reference, requests_per_rank=[4, 4])
    assert [r["local_rank"] for r in results] == [0, 1]
