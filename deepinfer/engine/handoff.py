"""Prefill/decode hand-off between engines (issue 34 item 3): the building block of PD disaggregation.

A **prefill-role** engine computes a prompt and samples its first token (``prefill_and_publish``), then
publishes the prompt's full KV blocks to its KV tiers (``cache.kv_store``; a store both engines reach, e.g.
``disk`` on a shared directory) and returns a ``HandoffRecord``: the prompt ids, the first token and its
logprobs, the sampling params, the request's seed and the RNG counter of its next draw, and the block
hashes. A **decode-role** engine — any process with the same model, cache layout and store — admits the
request from that record (``admit_handoff``): its prompt plus the first token; the admission promotes the
published blocks like any tier hit, so it computes only the prompt's last partial block and the first
token, then decodes on. Draws are counter-based (seed, position), so with the same seed and counter the
tokens equal a single engine's, greedy and seeded.

Not here: a network transport (the record is JSON; the blocks travel through the store), hand-off of
structured-output requests (the grammar matcher's state is not in the record), and a prefill-role engine
that streams blocks while it computes them (it publishes once the first token is sampled).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepinfer.errors import ConfigError
from deepinfer.kv.blocks import extend_chain
from deepinfer.sampling.params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.engine import LLMEngine
    from deepinfer.engine.request import Request
    from deepinfer.outputs import RequestOutput


@dataclass(frozen=True)
class HandoffRecord:
    """What a decode-role engine needs to continue a request a prefill-role engine started.

    ``params``: the request's ``SamplingParams`` fields (``max_tokens`` counts the first token too);
    ``seed``: the request's resolved seed; ``counter``: the RNG counter of its next draw (prompt length +
    1); ``block_hashes``: hex of the chained hashes of the prompt's full blocks, all in the store;
    ``namespace``: the prefill engine's ``KVStoreSpec.namespace`` (model identity and cache layout)."""

    prompt_token_ids: tuple[int, ...]
    first_token: int
    first_logprobs: dict[int, float] | None
    params: dict[str, Any]
    seed: int
    counter: int
    block_hashes: tuple[str, ...]
    namespace: str
    prompt: str | None = None

    def to_json(self) -> str:
        """The record as JSON (token-id keys of dicts become strings; ``from_json`` turns them back)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HandoffRecord:
        """A record from ``to_json``'s text; ``ValueError`` naming a missing or unknown field."""
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) - names or {f.name for f in dataclasses.fields(cls) if f.name != "prompt"} - set(data):
            raise ValueError(f"hand-off record: fields {sorted(data)} do not match {sorted(names)}")
        logprobs = data["first_logprobs"]
        params = dict(data["params"])
        if params.get("logit_bias"):
            params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
        return cls(prompt_token_ids=tuple(data["prompt_token_ids"]), first_token=int(data["first_token"]),
                   first_logprobs={int(k): float(v) for k, v in logprobs.items()} if logprobs is not None else None,
                   params=params, seed=int(data["seed"]), counter=int(data["counter"]),
                   block_hashes=tuple(data["block_hashes"]), namespace=data["namespace"], prompt=data.get("prompt"))

    def sampling_params(self) -> SamplingParams:
        """The request's ``SamplingParams``."""
        return SamplingParams(**self.params)


def _tiers(engine: LLMEngine, role: str) -> Any:
    if engine.kv_tiers is None:
        raise ConfigError(f"a {role}-role engine needs cache.kv_store (a store the other role reaches too, e.g. "
                          "'disk' with plugins.kv_store.disk_dir on a shared directory)")
    return engine.kv_tiers


def prefill_and_publish(engine: LLMEngine, prompt: str | list[int], params: SamplingParams
                        ) -> tuple[HandoffRecord, RequestOutput]:
    """Compute ``prompt`` and its first token on ``engine`` (prefill role), publish the prompt's full
    blocks to the engine's KV tiers and wait until they are saved. Returns the hand-off record and the
    prefill's output (its one token). Runs the engine until that request finishes (other requests queued
    on it step along)."""
    tiers = _tiers(engine, "prefill")
    if params.grammar_spec is not None:
        raise ValueError("SamplingParams.structured: a structured-output request cannot be handed off (the "
                         "grammar matcher's state is not in the record)")
    req = engine.make_request(prompt, dataclasses.replace(params, max_tokens=1))
    engine.add(req)
    output = None
    while output is None:
        output = next((o for o in engine.step() if o.request_id == req.request_id and o.finished), None)
    if output.outputs[0].finish_reason not in ("length", "stop") or not output.outputs[0].token_ids:
        raise RuntimeError(f"the prefill of the hand-off ended with {output.outputs[0].finish_reason!r}: "
                           f"{output.outputs[0].error}")
    ids = list(req.prompt_token_ids)
    bs = engine.kv.block_size
    hashes = extend_chain([], ids, bs, len(ids) // bs)
    pool = engine.kv.pool
    for h in hashes:
        block_id = pool.lookup(h)
        if block_id is not None:  # else it was evicted since, and demoted then
            tiers.save_block(block_id, h, wait=True)
    tiers.flush()
    held = tiers.contains(hashes)
    if held < len(hashes):
        raise RuntimeError(f"the hand-off's KV tiers hold {held} of the prompt's {len(hashes)} blocks (a store "
                           "full or failing: see the stores' statistics)")
    completion = output.outputs[0]
    first_logprobs = completion.logprobs[0] if completion.logprobs else None
    record = HandoffRecord(
        prompt_token_ids=tuple(ids), first_token=completion.token_ids[0],
        first_logprobs=dict(first_logprobs) if first_logprobs is not None else None,
        params=dataclasses.asdict(params), seed=req.seed, counter=len(ids) + 1,
        block_hashes=tuple(h.hex() for h in hashes), namespace=tiers.spec.namespace, prompt=req.prompt)
    return record, output


def admit_handoff(engine: LLMEngine, record: HandoffRecord) -> Request:
    """Queue the request of ``record`` on ``engine`` (decode role): its prompt and first token, its seed
    and params. The admission promotes the published blocks from the engine's KV tiers. Raises
    ``ConfigError`` when the engine's model or cache layout is not the prefill engine's, ``ValueError``
    when the first token already ends the request (nothing to decode) or the record is inconsistent."""
    tiers = _tiers(engine, "decode")
    if record.namespace != tiers.spec.namespace:
        raise ConfigError("hand-off record: it was made by an engine of another model or cache layout (namespace "
                          f"{record.namespace} against this engine's {tiers.spec.namespace}); both roles need the "
                          "same model folder, dtype, kv_dtype and block_size")
    params = record.sampling_params()
    first = record.first_token
    ends = (params.max_tokens <= 1 or first in params.stop_token_ids
            or (not params.ignore_eos and first in engine.eos_token_ids))
    if ends:
        raise ValueError(f"hand-off record: the first token {first} already ends the request (EOS, a stop "
                         "token or max_tokens 1); return the prefill's output instead")
    req = engine.make_request(list(record.prompt_token_ids), params, text=record.prompt)
    req.seed = record.seed
    req.all_token_ids.append(first)
    if req.logprobs is not None and record.first_logprobs is not None:
        req.logprobs.append(dict(record.first_logprobs))
    if req.num_tokens != record.counter:
        raise ValueError(f"hand-off record: counter {record.counter} but the request holds {req.num_tokens} tokens")
    engine.add(req)
    return req
