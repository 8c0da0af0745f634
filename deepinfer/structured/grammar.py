"""Grammar compilation off the scheduling path, and the per-request matcher (xgrammar).

- ``GrammarCompiler`` owns one ``xgrammar.GrammarCompiler`` built from the model's tokenizer, a thread
  pool that compiles specs in the background, and a cache of compiled grammars keyed by the spec
  (``GrammarSpec.key``). The cache holds futures, so requests that ask for the same schema while it
  compiles share one compilation; a spec that failed to compile stays failed (compiling it again would
  fail again).
- ``RequestGrammar`` is one request's view: compiling until its future resolves, then ready (it owns a
  ``TokenMatcher``) or failed (``error`` says why: the compiler's message, or the timeout). The engine
  polls it before scheduling; the scheduler does not admit the request until it is ready.
- ``TokenMatcher`` wraps ``xgrammar.GrammarMatcher`` (``structured/trigger.py`` wraps it in turn for a
  grammar that starts after a trigger token sequence). It always reflects exactly the request's
  *committed* output tokens (``num_accepted`` of them): tokens are accepted when the host commits
  them (``EngineCore.process``), never when they are merely sampled. Masks for speculative positions
  are filled by accepting the drafts tentatively and rolling them back (``fill_draft_masks``), so the
  matcher is back at the committed tokens when it returns.

xgrammar is optional (the ``structured`` extra; on CPU install it with ``--no-deps`` plus
``apache-tvm-ffi``, reference/oracles.md §4); it is imported only when the first structured request
arrives.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.structured.spec import GrammarSpec

if TYPE_CHECKING:
    from deepinfer.structured.trigger import TriggeredMatcher

logger = logging.getLogger(__name__)

MISSING_XGRAMMAR = (
    "structured output (SamplingParams.structured / so_args) needs the optional package xgrammar, which is "
    "not installed; install the extra: pip install 'deepinfer[structured]' (CPU-only, without triton: "
    "pip install --no-deps xgrammar apache-tvm-ffi)"
)


def import_xgrammar() -> Any:
    """The xgrammar module; ``ImportError`` with ``MISSING_XGRAMMAR`` when it is not installed."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(MISSING_XGRAMMAR) from exc
    return xgrammar


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``. JSON string literals are valid EBNF
    string literals in xgrammar (same escapes), so any text, quotes and newlines included, is safe."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles ``GrammarSpec``s on a thread pool, with a bounded cache of compiled grammars.

    ``tokenizer_file`` is the model's ``tokenizer.json``; ``vocab_size`` the model's (padded) vocabulary,
    so bitmasks cover every logit column; ``stop_token_ids`` end the grammar (the model's EOS ids).
    ``timeout_s`` is how long a request may wait for its grammar before it fails. ``max_rollback``
    bounds how many tokens a matcher can roll back (speculative decoding needs max draft + 1).
    """

    def __init__(self, tokenizer_file: Path, vocab_size: int, stop_token_ids: Iterable[int], *,
                 threads: int = 2, timeout_s: float = 20.0, cache_entries: int = 256,
                 max_rollback: int = 8) -> None:
        self.xgr = import_xgrammar()
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self.max_rollback = max_rollback
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deepinfer-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._compiler: Any = None  # built by the first compilation, in a pool thread (it takes ~0.2-0.5 s)
        self.compile_seconds: list[float] = []  # wall time of each compilation (cache misses only)

    @property
    def words_per_row(self) -> int:
        """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    def request(self, spec: GrammarSpec) -> RequestGrammar:
        """Start (or join) the compilation of ``spec`` for one new request."""
        return RequestGrammar(spec, self.submit(spec), time.monotonic() + self.timeout_s, self)

    def submit(self, spec: GrammarSpec) -> Future:
        """The future compiled grammar of ``spec``: the cached one, or a new background compilation."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.cache_entries:
                oldest = next(iter(self._cache))
                if not self._cache[oldest].done():
                    break  # never evict a compilation in progress; the cap is met again later
                del self._cache[oldest]
            return future

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                from transformers import PreTrainedTokenizerFast  # xgrammar requires transformers

                hf = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_file))
                info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                # xgrammar's own cache is off: ours (keyed by spec, holding futures) dedupes in-flight work.
                self._compiler = self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._xgr_compiler()
        start = time.perf_counter()
        if spec.kind == "json":
            compiled = compiler.compile_json_schema(spec.source, any_whitespace=False)
        elif spec.kind == "regex":
            compiled = compiler.compile_regex(spec.source)
        elif spec.kind == "ebnf":
            compiled = compiler.compile_grammar(spec.source)
        else:
            compiled = compiler.compile_grammar(choice_ebnf(spec.choices()))
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def matcher(self, compiled: Any) -> TokenMatcher:
        # xgrammar >= 0.2.9 keeps an unlimited rollback history (its max_rollback_tokens is deprecated), so
        # ``max_rollback`` is not passed; TokenMatcher.rollback checks the bound itself.
        return TokenMatcher(self.xgr.GrammarMatcher(compiled), self)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """``[rows, words_per_row]`` int32, all tokens allowed."""
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the disallowed logits of ``rows`` to −inf in place (``bitmask`` row i masks logits row i)."""
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab_size, indices=rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TokenMatcher:
    """One request's grammar state over its committed output tokens (see the module docstring).

    Speculative decoding uses two calls per step: ``fill_draft_masks(drafts, bitmask, first_row)``
    before verification (one mask per draft position plus the bonus position; the matcher is left at
    the committed tokens), then ``accept`` for each token that verification committed. ``advance`` and
    ``rollback`` serve a caller that prefers to advance through the drafts first and roll back the
    rejected ones afterwards (at most ``max_rollback`` tokens).
    """

    def __init__(self, matcher: Any, compiler: GrammarCompiler) -> None:
        self._m = matcher
        self._compiler = compiler
        self.num_accepted = 0

    def accept(self, token: int) -> bool:
        """Commit one token; False (state unchanged) when the grammar does not allow it."""
        if not self._m.accept_token(int(token)):
            return False
        self.num_accepted += 1
        return True

    def advance(self, tokens: Sequence[int]) -> int:
        """Accept ``tokens`` in order until the grammar refuses one; returns how many were accepted."""
        for i, token in enumerate(tokens):
            if not self.accept(token):
                return i
        return len(tokens)

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens (after verification rejected them)."""
        limit = min(self.num_accepted, self._compiler.max_rollback)
        if k < 0 or k > limit:
            raise ValueError(f"TokenMatcher.rollback: k={k} outside [0, {limit}] (committed tokens, max_rollback)")
        if k:
            self._m.rollback(k)
            self.num_accepted -= k

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may be generated."""
        return bool(self._m.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens after the committed ones, into ``bitmask[row]``."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def fill_draft_masks(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Masks for the positions after the committed tokens and after each draft prefix.

        Row ``first_row + j`` gets the tokens allowed after the committed tokens plus ``drafts[:j]``,
        for j = 0..len(drafts). Stops at the first draft the grammar refuses: that draft gets target
        probability 0 through row ``first_row + j``, so it is rejected and the rows after it are
        unreachable (they stay as they were, all-allowed in a fresh bitmask). The drafts are accepted
        only tentatively and rolled back before returning. Returns the number of rows filled.
        """
        self.fill_mask(bitmask, first_row)
        filled, taken = 1, 0
        for token in drafts:
            if not self._m.accept_token(int(token)):
                break
            taken += 1
            if self._m.is_terminated():
                break  # the draft was a stop token: no position follows it
            self.fill_mask(bitmask, first_row + taken)
            filled += 1
        if taken:
            self._m.rollback(taken)
        return filled


class RequestGrammar:
    """A request's grammar: compiling, then ready (``matcher``) or failed (``error``)."""

    def __init__(self, spec: GrammarSpec, future: Future, deadline: float, compiler: GrammarCompiler) -> None:
        self.spec = spec
        self.future = future
        self.deadline = deadline
        self.compiler = compiler
        self.matcher: TokenMatcher | TriggeredMatcher | None = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def poll(self, now: float | None = None) -> bool:
        """Resolve the compilation without blocking. Returns True once the request can go on (ready),
        False while it must wait; sets ``error`` when it failed or timed out."""
        if self.matcher is not None:
            return True
        if self.error is not None:
            return False
        if self.future.done():
            exc = self.future.exception()
            if exc is None:
                matcher = self.compiler.matcher(self.future.result())
                if self.spec.trigger:
                    from deepinfer.structured.trigger import TriggeredMatcher  # it imports this module

                    matcher = TriggeredMatcher(matcher, self.spec.trigger, self.spec.bound, self.compiler.max_rollback)
                self.matcher = matcher
                return True
            self.error = f"grammar ({self.spec.describe()}) failed to compile: {type(exc).__name__}: {str(exc).strip()}"
        elif (time.monotonic() if now is None else now) > self.deadline:
            self.error = (f"grammar ({self.spec.describe()}) did not compile within "
                          f"{self.compiler.timeout_s:g} s (sampling.grammar_timeout_s)")
        return False
