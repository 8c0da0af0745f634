"""Structured output (API.md §4 ``structured`` / ``so_args``) with xgrammar on the real SmolLM2.

JSON outputs must parse and validate against their schema; regex outputs must fullmatch; EBNF and
choice outputs must be in the grammar's language; a schema that does not compile fails its request
alone. Strings with ``minLength``/``maxLength`` may contain raw control characters (xgrammar #800,
reference/kernels.md §8), which a strict JSON parser rejects: those outputs are parsed with
``strict=False`` and the bug is pinned by its own test, so a fixed xgrammar shows up here.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.structured.spec import GrammarSpec, parse_spec

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"]}),
    ("a color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                 "required": ["color"]}),
    ("a yes/no answer", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    ("a temperature", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50,
                                                                    "maximum": 60}},
                       "required": ["celsius"]}),
    ("three scores", {"type": "object", "properties": {"scores": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 3}},
        "required": ["scores"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                                  "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("a nested address", {"type": "object", "properties": {"address": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}}, "required": ["address"]}),
    ("a status", {"type": "object", "properties": {"status": {"enum": ["active", "inactive"]},
                                                   "code": {"type": "integer", "minimum": 100, "maximum": 599}},
                  "required": ["status", "code"]}),
    ("a tag list", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}, "required": ["tags"]}),
    ("a short word", {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 6}},
                      "required": ["word"]}),
    ("an optional nickname", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                      "maximum": 999},
                                                               "nickname": {"type": "string", "maxLength": 8}},
                              "required": ["id"]}),
    ("a null or number", {"type": "object", "properties": {"value": {"type": ["number", "null"]}},
                          "required": ["value"]}),
    ("a pair", {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 50},
                                                 {"type": "boolean"}], "items": False, "minItems": 2}),
    ("a matrix", {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "minItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}}},
        "required": ["rows"]}),
    ("a grade", {"type": "string", "enum": ["A", "B", "C", "D", "F"]}),
    ("a count", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("a ratio", {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}},
                 "required": ["ratio"]}),
    ("a flag set", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"},
                                                     "c": {"type": "boolean"}},
                    "required": ["a", "b", "c"], "additionalProperties": False}),
    ("a product", {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "stock": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["sku", "price", "stock"]}),
    ("a const", {"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
                 "required": ["version", "ok"]}),
    ("an event", {"type": "object", "properties": {
        "kind": {"enum": ["click", "view"]},
        "meta": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["n"]}}, "required": ["kind", "meta"]}),
    ("an anyOf id", {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                        "maximum": 99},
                                                                       {"enum": ["none"]}]}},
                     "required": ["id"]}),
]

MAX_TOKENS = 48


def _chat(description: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with JSON only: {description}."}]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def smol_overlap(smollm2_dir):
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=1024, plugins={"scheduling": {"enabled": True}},
              scheduler={"executor": "overlap"})
    yield llm
    llm.shutdown()


def _check_json(text: str, schema: dict) -> None:
    # strict=False: xgrammar #800 lets raw control characters into strings with length bounds.
    value = json.loads(text, strict=False)
    jsonschema.validate(value, schema)


def test_json_schemas_parse_and_validate_in_one_batch(smol):
    assert len(SCHEMAS) >= 20
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured={"json_schema": schema})
              for _, schema in SCHEMAS]
    outs = smol.chat([_chat(desc) for desc, _ in SCHEMAS], params, use_tqdm=False)
    for (desc, schema), out in zip(SCHEMAS, outs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (desc, completion.text)
        _check_json(completion.text, schema)


def test_sampled_json_with_a_seed_validates_under_the_overlapped_executor(smol_overlap):
    picked = SCHEMAS[:6]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, structured={"json_schema": schema})
              for i, (_, schema) in enumerate(picked)]
    assert type(smol_overlap.engine.executor).__name__ == "OverlapExecutor"
    outs = smol_overlap.chat([_chat(desc) for desc, _ in picked], params, use_tqdm=False)
    for (_, schema), out in zip(picked, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        _check_json(out.outputs[0].text, schema)


@pytest.mark.parametrize("executor", ["sync", "overlap"])
def test_regex_ebnf_and_choice(smol, smol_overlap, executor):
    llm = smol if executor == "sync" else smol_overlap
    regexes = [r"[0-9]{3}-[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,6} [0-9]{1,2}"]
    ebnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    choices = ["Paris", "London", "Rome"]
    params = [SamplingParams(temperature=0, max_tokens=24, structured={"regex": r}) for r in regexes]
    params += [SamplingParams(temperature=0.7, seed=5, max_tokens=24, structured={"ebnf": ebnf}),
               SamplingParams(temperature=0, max_tokens=8, structured={"choice": choices}),
               SamplingParams(temperature=0, max_tokens=24, so_args={"schema_type": "regex", "schema": regexes[0]})]
    outs = llm.chat([_chat("answer briefly")] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    for pattern, text in zip(regexes, texts, strict=False):
        assert re.fullmatch(pattern, text), (pattern, text)
    assert re.fullmatch(r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))*\)", texts[3]), texts[3]
    assert texts[4] in choices
    assert re.fullmatch(regexes[0], texts[5])


@pytest.mark.parametrize("executor", ["sync", "overlap"])
def test_an_invalid_schema_fails_only_its_request(smol, smol_overlap, executor):
    llm = smol if executor == "sync" else smol_overlap
    good = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured={"json_schema": SCHEMAS[1][1]})
    bad = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured={"json_schema": '{"type": "object", '})
    plain = SamplingParams(temperature=0, max_tokens=5)
    outs = llm.chat([_chat(SCHEMAS[1][0]), _chat("anything"), _chat("hello")], [good, bad, plain], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "failed to compile" in outs[1].outputs[0].error and outs[1].outputs[0].token_ids == []
    _check_json(outs[0].outputs[0].text, SCHEMAS[1][1])
    assert outs[0].outputs[0].error is None and outs[2].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_structured_outputs_under_speculative_decoding(smol, smollm2_dir, tmp_path, drafter):
    """Verification masks every draft position: greedy structured outputs are the ones of plain
    decoding (lossless), sampled ones still validate, and the oracle's planted wrong drafts (which
    the grammar refuses) are rejected rather than emitted."""
    pytest.importorskip("deepinfer_spec_decode")
    picked = SCHEMAS[:8]
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured={"json_schema": schema})
              for _, schema in picked]
    chats = [_chat(desc) for desc, _ in picked]
    reference = smol.chat(chats, greedy, use_tqdm=False)
    oracle = tmp_path / "oracle.jsonl"
    oracle.write_text("\n".join(json.dumps({"token_ids": o.prompt_token_ids + o.outputs[0].token_ids})
                                for o in reference))
    spec = {"enabled": True, "drafter": drafter, "plan": "fixed", "max_draft": 4, "oracle_file": str(oracle),
            "oracle_corruption": 0.5}
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=1024, plugins={"spec_decode": spec})
    try:
        sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, structured={"json_schema": schema})
                   for i, (_, schema) in enumerate(picked)]
        outs = llm.chat(chats + chats, greedy + sampled, use_tqdm=False)
        stats = llm.get_stats()["spec_decode"]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs[:len(picked)]] == [o.outputs[0].token_ids for o in reference]
    for (_, schema), out in zip(picked + picked, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        _check_json(out.outputs[0].text, schema)
    assert stats["verify_steps"] > 0
    if drafter == "oracle":  # half the drafts are planted errors: some are rejected, some accepted
        assert 0 < stats["acceptance_per_position"][0] < 1


def test_logprobs_stay_the_raw_distribution(smol):
    """The mask changes which token is drawn, not the reported distribution (API.md §4)."""
    chat = _chat("say a number")
    free = smol.chat(chat, SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)[0]
    forced = smol.chat(chat, SamplingParams(temperature=0, max_tokens=1, logprobs=3,
                                            structured={"choice": ["zebra"]}), use_tqdm=False)[0]
    free_row, forced_row = free.outputs[0].logprobs[0], forced.outputs[0].logprobs[0]
    top3 = dict(sorted(free_row.items(), key=lambda kv: -kv[1])[:3])
    assert all(forced_row[t] == lp for t, lp in top3.items())  # the same raw top-3
    chosen = forced.outputs[0].token_ids[0]
    assert smol.tokenizer.decode([chosen]) in ("z", "zebra", "ze", "zeb") and chosen not in top3


def test_matcher_fills_draft_masks_and_rolls_back(smol):
    """The speculative-decoding helpers: one mask per draft position, and the matcher left at the
    committed tokens."""
    compiler = smol.engine._grammar_compiler()
    grammar = compiler.request(GrammarSpec("regex", "abc[0-9]"))
    grammar.future.result(timeout=30)
    assert grammar.poll()
    matcher = grammar.matcher
    tok = smol.tokenizer
    a, b, c, seven = (tok.token_id(ch) for ch in ("a", "b", "c", "7"))
    assert matcher.accept(a) and matcher.num_accepted == 1
    bitmask = compiler.allocate_bitmask(4)
    filled = matcher.fill_draft_masks([b, c, seven], bitmask, 0)
    assert filled == 4 and matcher.num_accepted == 1

    def allowed(row: int, token: int) -> bool:
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

    assert allowed(0, b) and not allowed(0, c)
    assert allowed(1, c) and not allowed(1, b)
    assert allowed(2, seven) and not allowed(2, a)
    assert matcher.accept(b)  # the state after fill_draft_masks is the committed one
    assert matcher.advance([c, a]) == 1  # "a" is refused after "abc"
    matcher.rollback(2)
    assert matcher.num_accepted == 1 and matcher.accept(b)
    rejected = compiler.allocate_bitmask(3)
    assert matcher.fill_draft_masks([a, c], rejected, 0) == 1  # "a" is refused: later rows unreachable


def test_trigger_starts_the_grammar_and_the_bound_forces_the_trigger(smol):
    """so_args trigger_token_ids / bound_token_id on the real model: golden tokens drive the free part,
    the engine does the rest. After the trigger the grammar (three digits) holds; after the bound token
    the trigger itself is forced, then the grammar."""
    tok = smol.tokenizer
    trigger = tok.encode(" Answer:")
    bound = tok.encode("\n")[0]
    free = tok.encode("Let me think")
    so_args = {"schema_type": "regex", "schema": "[0-9]{3}", "trigger_token_ids": trigger}
    prompt = tok.encode("Question: pick a number.")
    p = SamplingParams(temperature=0, max_tokens=len(free) + len(trigger) + 8, so_args=so_args,
                       golden_token_ids=free + trigger)
    out = smol.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    eos = smol.engine.eos_token_ids
    after = [t for t in out.token_ids[len(free) + len(trigger):] if t not in eos]
    assert out.finish_reason == "stop" and re.fullmatch("[0-9]{3}", tok.decode(after)), out
    bounded = SamplingParams(temperature=0, max_tokens=len(free) + 1 + len(trigger) + 8,
                             so_args={**so_args, "bound_token_id": bound}, golden_token_ids=[*free, bound])
    out = smol.generate([prompt], bounded, use_tqdm=False)[0].outputs[0]
    rest = [t for t in out.token_ids[len(free) + 1:] if t not in eos]
    assert rest[:len(trigger)] == trigger, tok.decode(rest)
    assert re.fullmatch("[0-9]{3}", tok.decode(rest[len(trigger):])) and out.finish_reason == "stop"


def test_compile_timeout_fails_the_request_with_a_clear_error(smol):
    compiler = smol.engine._grammar_compiler()
    from deepinfer.structured.grammar import RequestGrammar

    never: Future = Future()
    grammar = RequestGrammar(GrammarSpec("regex", "x+"), never, time.monotonic() + 1.0, compiler)
    assert not grammar.poll() and grammar.error is None  # still compiling, before the deadline
    assert not grammar.poll(now=time.monotonic() + 2.0)
    assert "did not compile within" in grammar.error and "grammar_timeout_s" in grammar.error


def test_params_check_the_form_at_construction():
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured={"regex": "a", "ebnf": "root ::= \"a\""})
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured={"regex": "a"}, so_args={"schema_type": "regex", "schema": "a"})
    with pytest.raises(ValueError, match="schema_type"):
        SamplingParams(so_args={"schema_type": "xml", "schema": "<a/>"})
    with pytest.raises(ValueError, match="choice"):
        SamplingParams(structured={"choice": []})
    spec = parse_spec(None, {"schema_type": "json", "schema": {"type": "integer"}})
    assert spec == GrammarSpec("json", '{"type": "integer"}')
    assert SamplingParams(structured={"json_schema": {"type": "integer"}}).grammar_spec == spec


def test_without_xgrammar_generate_names_the_extra(smollm2_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *args, **kwargs)

    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 26, max_model_len=256)
    try:
        monkeypatch.setattr(builtins, "__import__", no_xgrammar)
        with pytest.raises(ValueError, match=r"deepinfer\[structured\]"):
            llm.generate("hi", SamplingParams(structured={"regex": "a"}), use_tqdm=False)
        assert not llm.engine.has_unfinished()  # nothing was queued
    finally:
        llm.shutdown()


def test_xgrammar_800_bounded_strings_accept_control_characters(smol):
    """Pins the upstream bug the JSON checks work around: when this fails, xgrammar fixed #800 and the
    ``strict=False`` parsing above can go."""
    compiler = smol.engine._grammar_compiler()
    bounded = compiler.submit(GrammarSpec("json", json.dumps({"type": "string", "maxLength": 4}))).result(30)
    plain = compiler.submit(GrammarSpec("json", json.dumps({"type": "string"}))).result(30)
    assert xgr.GrammarMatcher(bounded).accept_string('"\x01')
    assert not xgr.GrammarMatcher(plain).accept_string('"\x01')
