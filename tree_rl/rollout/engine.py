"""The RolloutEngine protocol: token ids in, token ids + log-probs out.

Both engines, the embedded JAX sampler and vLLM, take the *whole* context of
every request as token ids and reuse cached prefixes themselves (the JAX
sampler's row cache, vLLM's automatic prefix caching). So the agent loop never
manages KV state: branching k ways from a node is k requests with the node's
context, and continuing after a tool call is one request whose context extends
the previous one. Either way the shared prefix is computed once.

The recorded log-probs and entropies are those of the policy itself
(temperature 1, no top-k/top-p truncation): they are what the trainer
recomputes, so importance ratios start at 1 when sampling at temperature 1.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "eos", "length", "context")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample one continuation.

  Attributes:
    temperature: 0 means greedy (argmax).
    top_p: nucleus sampling threshold in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens; 0 disables it.
    max_new_tokens: generation stops after this many tokens (finish "length").
    stop: stop strings (e.g. "</tool_call>"); generation ends right after the
      first token that completes one, and that token is kept.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 256
  stop: tuple[str, ...] = ()

  @classmethod
  def from_rollout(cls, rollout: Any) -> SamplingParams:
    """A run's rollout sampling: `config.rollout`'s (a RolloutSpec's) temperature, top-p,
    top-k and per-step token limit."""
    return cls(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
               max_new_tokens=rollout.max_new_tokens)

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """One continuation of `tokens` (the full context, prompt included).

  Attributes:
    tokens: the context.
    params: how to sample.
    seed: the request's identity for sampling, an int in [0, 2**64), or None.
      A seeded request's random stream is a function of (the engine's reseed
      key, seed) alone, so its tokens do not depend on which other requests
      share the `generate` call, on its index there, or on how many calls came
      before: a step's requests can be split across engines or reordered and
      sample the same continuations (`request_seed` derives it; the agent loop
      seeds every request from (task, branch, turn)). None (direct engine users,
      evaluation) keeps the batch-dependent stream: (reseed key, call count,
      index in the call).
    task_id: the task whose episode the context continues (the agent loop sets it;
      None elsewhere). Sampling engines ignore it; a scripted one (the SFT teacher,
      `tree_rl.rollout.policy.oracle_engine`) answers by it.
  """

  tokens: tuple[int, ...]
  params: SamplingParams = SamplingParams()
  seed: int | None = None
  task_id: str | None = None

  def __post_init__(self):
    if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
      raise ValueError(f"GenerationRequest.seed={self.seed!r} must be None or an int in [0, 2**64)")


def request_seed(*parts: int | str) -> int:
  """A 64-bit request seed from an identity tuple (e.g. task id, branch, turn).

  A stable hash (BLAKE2b of the parts' reprs), unlike Python's `hash`, which is
  salted per process: the same identity gives the same seed in every process
  and on every worker.
  """
  for p in parts:
    if not isinstance(p, (int, str)) or isinstance(p, bool):
      raise TypeError(f"request_seed: part {p!r} is a {type(p).__name__}; use ints and strings")
  digest = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """What one request produced.

  Attributes:
    tokens: the sampled tokens, exactly (never re-tokenized).
    logprobs: the policy's log-prob of each sampled token.
    entropies: the policy's entropy at each sampled position.
    finish_reason: "stop" (a stop string), "eos", "length" (max_new_tokens) or
      "context" (the context window is full; also when the prompt alone does
      not fit, with no tokens).
    stop: the stop string that ended it, if any.
    prefill_tokens: context tokens this request had to run through the model
      (0 for a branch that shares a context prefilled for another request).
    policy_version: the policy version that sampled it (set by a
      `tree_rl.rollout.pipeline.VersionedEngine`; None from a bare engine).
  """

  tokens: tuple[int, ...]
  logprobs: tuple[float, ...]
  entropies: tuple[float, ...]
  finish_reason: str
  stop: str | None = None
  prefill_tokens: int = 0
  policy_version: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
  """Generates continuations; receives the policy's weights after each update."""

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    ...

  def update_weights(self, params: Any) -> None:
    ...


class TextEngine(abc.ABC):
  """A RolloutEngine that writes each step as text (`text(request)`), with no model.

  The text is tokenized and followed by `eos_id` (when given). Log-probs are
  those of a policy that is certain of its text (0), entropies 0.
  """

  def __init__(self, tokenizer: Any, eos_id: int | None = None):
    self.tokenizer, self.eos_id = tokenizer, eos_id
    self.requests: list[GenerationRequest] = []
    self.weight_updates = 0

  @abc.abstractmethod
  def text(self, req: GenerationRequest) -> str:
    """The step `req` gets."""

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    out = []
    for req in requests:
      self.requests.append(req)
      tokens = list(self.tokenizer.encode(self.text(req), add_special_tokens=False))
      tokens = tokens[:req.params.max_new_tokens]
      finish = "length"
      if self.eos_id is not None and len(tokens) < req.params.max_new_tokens:
        tokens.append(self.eos_id)
        finish = "eos"
      n = len(tokens)
      out.append(GenerationResult(tuple(tokens), (0.0,) * n, (0.0,) * n, finish,
                                  prefill_tokens=len(req.tokens)))
    return out

  def update_weights(self, params: Any) -> None:
    del params  # no weights; the count lets tests check the sync happened
    self.weight_updates += 1


class ScriptedEngine(TextEngine):
  """A mock RolloutEngine for tests: `script(context tokens) -> text` decides each step."""

  def __init__(self, script: Callable[[tuple[int, ...]], str], tokenizer: Any,
               eos_id: int | None = None):
    super().__init__(tokenizer, eos_id)
    self.script = script

  def text(self, req: GenerationRequest) -> str:
    """`script(req.tokens)`."""
    return self.script(req.tokens)
