"""LLM-as-a-judge client for any OpenAI-compatible chat endpoint (vLLM, OpenAI, ...).

Two rubrics:

  - outcome (PORTool, arXiv 2510.26020, §3.1 and §3.2 Step 2): the judge reads the question
    and the whole trajectory, tool outputs included, builds its own reference answer
    (preferring the knowledge found in the trajectory, since tools return time-sensitive
    facts) and labels the final answer "true" (+1), "false" (-1) or "unable_to_answer" (0:
    valid reasoning, but the tools did not return what was needed). PORTool reports
    accuracy as the majority of 5 votes (§4.1).
  - reasoning (AWPO, arXiv 2512.19126, Eq. 20 and App. B, Fig. 2): a "tool-use consistency
    evaluator" rates four dimensions, Reasoning Path 35%, Tool Selection 30%, Parameter
    Setting 25%, Execution Strategy 10%, each on a six-tier scale, and the score is the
    weighted sum of the tier values. The paper's prompt and tier values are in an image that
    is not available; the mapping Tier VI..I = 0.0, 0.2, 0.4, 0.6, 0.8, 1.0 and the
    per-dimension weighting are our choice (docs/methods/awpo.md).

Why the machinery: the judge runs inside the RL loop, so it must not stall it. Requests retry
with capped exponential backoff on timeouts, connection errors, HTTP 429/5xx and unparseable
replies (never on other 4xx, which a retry cannot fix); every request has a wall-clock limit
(`timeout_s`, enforced by a watchdog that closes the socket, so a server trickling bytes
cannot hold it open) and every judge call, its votes, retries and backoff together, a total
one (`JudgeConfig.total_timeout_s`); a reply body is read in chunks up to
`JudgeConfig.max_reply_bytes` (a bigger one is a failed request, like an unparseable one, so
a hostile server cannot fill the host's memory), and reading, decoding and parsing the reply
all count inside the request's limit (a reply that is complete only past it is refused, and
its size cap bounds how long the parse can take); replies are cached by a hash of the
request, so re-judging the same episode is free; and when no endpoint is configured, or a
judgement still fails, the verdict falls back to the task family's own verifier and says so
(`source="verifier"`, `judge/fallback_verifier`). A caller that prefers to drop the query
(docs/methods/portool.md#judge-failures) or, for AWPO, to mask the judge score
(docs/methods/awpo.md) checks `source`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from absl import logging

from tree_rl.envs.base import Message, Outcome, Task
from tree_rl.envs.parsing import valid_text

# base.TaskFamily is a plain (not @runtime_checkable) Protocol, which the test-time beartype
# hook cannot check, so families are typed loosely here.
Family = Any

LABELS = ("true", "false", "unable_to_answer")
LABEL_REWARD = {"true": 1.0, "false": -1.0, "unable_to_answer": 0.0}
# Majority-vote ties go to the first tied label in this order: a disputed answer is never
# counted correct, and a split judge signals uncertainty rather than a wrong answer, so the
# neutral label wins (with one vote of each it is also the median reward).
TIE_ORDER = ("unable_to_answer", "false", "true")
TRUNCATED_LABELS = ("judge", "false", "unable_to_answer")
# The default cap of one reply body: a chat completion of a few thousand tokens is tens of
# kilobytes, JSON escapes included; 4 MiB leaves room for long reasoning replies and parses
# in tens of milliseconds. A server that sends more is misbehaving.
MAX_REPLY_BYTES = 4 << 20
_READ_CHUNK = 64 << 10  # bytes per read of a reply body


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  """Where and how to ask the judge.

  Attributes:
    base_url: the OpenAI-compatible API root, e.g. "http://127.0.0.1:8000/v1" (requests go
      to `{base_url}/chat/completions`). None: no judge, every verdict is the verifier's.
    model: the served model name; required with a base_url.
    api_key_env: environment variable holding the bearer token; unset sends no token.
    timeout_s: per-request wall-clock limit, from connecting to the last byte of the reply
      (not per socket read: a server that trickles bytes is cut off at timeout_s too).
    max_retries: retries after the first attempt (so at most 1 + max_retries requests).
    backoff_s, backoff_max_s: retry i sleeps min(backoff_max_s, backoff_s * 2**i).
    total_timeout_s: wall-clock limit of one judge call (`judge_outcome`,
      `judge_reasoning_verdict`): all its votes, retries and backoff sleeps. A call that
      runs out stops asking, counts the votes it did not get as failed and falls back like
      any failed judgement (`judge/deadline_hits` counts such calls). None: the time the
      call takes when every request runs to timeout_s, `call_budget_s()`.
    votes: judgements per episode (k); PORTool's accuracy uses 5. Votes only differ with
      temperature > 0 (or a non-deterministic server).
    temperature, max_tokens: decoding settings of the judge.
    cache: reuse replies of identical requests (same model, messages, temperature, vote).
    cache_path: optional JSONL file the cache is loaded from and appended to.
    truncated_label: verdict of a truncated episode: "false" (PORTool's suggested default,
      R_out = -1: there is no final answer), "unable_to_answer", or "judge" (ask anyway).
    include_answer: show the task's ground-truth answer to the judge as a hint. Off by
      default: PORTool's judge builds its own reference.
    max_reply_bytes: the largest reply body read; a bigger one fails the request (retried,
      counted in `judge/parse_errors`) after at most this many bytes were read.
  """

  base_url: str | None = None
  model: str = ""
  api_key_env: str = "OPENAI_API_KEY"
  timeout_s: float = 30.0
  max_retries: int = 3
  backoff_s: float = 1.0
  backoff_max_s: float = 8.0
  total_timeout_s: float | None = None
  votes: int = 1
  temperature: float = 0.0
  max_tokens: int = 512
  cache: bool = True
  cache_path: str | None = None
  truncated_label: str = "false"
  include_answer: bool = False
  max_reply_bytes: int = MAX_REPLY_BYTES

  def __post_init__(self):
    if self.base_url is not None:
      if not re.match(r"^https?://", self.base_url):
        raise ValueError(f"JudgeConfig.base_url must start with http:// or https://, "
                         f"got {self.base_url!r}")
      if not self.model:
        raise ValueError("JudgeConfig.model is required when base_url is set")
    checks = [(self.timeout_s > 0, "timeout_s must be > 0"),
              (self.max_retries >= 0, "max_retries must be >= 0"),
              (self.backoff_s >= 0, "backoff_s must be >= 0"),
              (self.backoff_max_s >= self.backoff_s, "backoff_max_s must be >= backoff_s"),
              (self.total_timeout_s is None or self.total_timeout_s > 0,
               "total_timeout_s must be > 0 (or None: derived)"),
              (self.votes >= 1, "votes must be >= 1"),
              (self.temperature >= 0, "temperature must be >= 0"),
              (self.max_tokens >= 1, "max_tokens must be >= 1"),
              (self.max_reply_bytes >= 1, "max_reply_bytes must be >= 1")]
    for ok, message in checks:
      if not ok:
        raise ValueError(f"JudgeConfig: {message}, got {self}")
    if self.truncated_label not in TRUNCATED_LABELS:
      raise ValueError(f"JudgeConfig.truncated_label must be one of {TRUNCATED_LABELS}, "
                       f"got {self.truncated_label!r}")

  def backoff(self, retry: int) -> float:
    """The sleep before retry `retry` (1-based)."""
    return min(self.backoff_max_s, self.backoff_s * 2 ** (retry - 1))

  def call_budget_s(self) -> float:
    """The wall-clock limit of one judge call: total_timeout_s, else the worst case of a
    server that answers every request just inside timeout_s, votes * ((1 + max_retries) *
    timeout_s + the backoff sleeps); so the total only ever cuts a call that the
    per-request limits would not."""
    if self.total_timeout_s is not None:
      return self.total_timeout_s
    per_vote = ((1 + self.max_retries) * self.timeout_s
                + sum(self.backoff(i) for i in range(1, self.max_retries + 1)))
    return self.votes * per_vote


@dataclasses.dataclass(frozen=True)
class JudgeVerdict:
  """The outcome verdict on one episode.

  Attributes:
    label: "true", "false" or "unable_to_answer".
    reward: PORTool's R_out of the label: +1, -1 or 0.
    votes: the label of every judgement that succeeded (empty unless source is judge/cache).
    source: "judge" (at least one fresh request), "cache" (every vote from the cache),
      "verifier" (no endpoint, or every vote failed) or "rule" (truncated episode, see
      JudgeConfig.truncated_label).
    failed_votes: judgements that failed after all retries.
    verifier_outcome: the family's Outcome when the verifier was consulted.
  """

  label: str
  reward: float
  votes: tuple[str, ...] = ()
  source: str = "judge"
  failed_votes: int = 0
  verifier_outcome: Outcome | None = None

  def to_outcome(self, truncated: bool) -> Outcome:
    """An Outcome on the judge's scale (+1/0/-1); a truncated episode is never answered."""
    return Outcome(reward=self.reward, correct=self.label == "true",
                   answered=self.label != "unable_to_answer" and not truncated,
                   details={"label": self.label, "votes": list(self.votes),
                            "source": self.source, "failed_votes": self.failed_votes})


@dataclasses.dataclass(frozen=True)
class ReasoningVerdict:
  """AWPO's reasoning score of one episode.

  Attributes:
    score: in [0, 1], the mean over successful votes of the weighted tier values.
    votes: the score of every successful vote.
    dimensions: mean tier value per dimension over the votes (empty for the verifier).
    source: "judge", "cache" or "verifier" (then score is 1.0 if the verifier says
      correct, else 0.0: a proxy, not a reasoning grade; AWPO training masks it instead,
      docs/methods/awpo.md).
  """

  score: float
  votes: tuple[float, ...] = ()
  dimensions: dict[str, float] = dataclasses.field(default_factory=dict)
  source: str = "judge"


def verifier_label(outcome: Outcome) -> str:
  """The judge label of a verifier's Outcome.

  Correct -> "true". A negative reward (the tool world's -1, wrong or truncated) -> "false".
  Otherwise not answered -> "unable_to_answer" and answered -> "false" (math/QA's 0).
  """
  if outcome.correct:
    return "true"
  if outcome.reward < 0 or outcome.answered:
    return "false"
  return "unable_to_answer"


def majority_label(votes: Sequence[str]) -> str:
  """The most frequent label; ties go to the first in TIE_ORDER (see its comment)."""
  counts = collections.Counter(votes)
  best = max(counts.values())
  return next(label for label in TIE_ORDER if counts.get(label, 0) == best)


# ------------------------------------------------------------------ prompts and parsers

OUTCOME_SYSTEM = """You are an evaluation agent for a tool-using assistant.
You receive a user question and the assistant's trajectory: its reasoning steps, its tool calls and the tool outputs. The final answer is the text of the last step that calls no tool, or the arguments of the final-answer tool (such as response_gen).

1. First build your own reference answer through your own reasoning. Prioritise the knowledge that exists in the trajectory (tool outputs are the source of truth for real-time and time-sensitive facts) over your prior knowledge.
2. Then compare the assistant's final answer with your reference answer and choose one label:
   - "true": the final answer is correct and answers the question.
   - "false": the final answer is wrong, incomplete, contradicts the tool outputs, or is missing.
   - "unable_to_answer": the assistant reasoned validly and called the tools in the right format, but the tools did not return the information needed, and the assistant said it cannot answer.

End your reply with a JSON object on its own line: {"reference_answer": "<your answer>", "label": "true" | "false" | "unable_to_answer"}"""

REASONING_SYSTEM = """You are a Tool-use Consistency Evaluator. You grade the chain of thought and the tool calls of an assistant against the ground-truth tool trajectory (a hard constraint: the ground-truth tools and arguments are correct) and, when given, a reference reasoning.

Rate each of four dimensions on a six-tier scale:
- reasoning_path (weight 35%): is the reasoning coherent, logically sound, complete and factually accurate, and does it lead to the ground-truth actions?
- tool_selection (weight 30%): are the right tools called, and no unnecessary ones?
- parameter_setting (weight 25%): are the arguments correct, complete and well-typed?
- execution_strategy (weight 10%): are the calls ordered, batched and sequenced sensibly?

Tiers: Tier I = fully correct; Tier II = minor flaws; Tier III = noticeable flaws that do not change the result; Tier IV = significant errors; Tier V = severe errors, mostly wrong; Tier VI = absent or entirely wrong.
When a dimension scores Tier IV or lower, assess how far the reasoning deviates from the reference reasoning and the ground-truth trajectory before choosing the tier.

End your reply with a JSON object on its own line: {"reasoning_path": "Tier <I-VI>", "tool_selection": "Tier <I-VI>", "parameter_setting": "Tier <I-VI>", "execution_strategy": "Tier <I-VI>"}"""

# AWPO App. B (Fig. 2) weights; the tier values are ours (the paper's are in an image).
REASONING_WEIGHTS = {"reasoning_path": 0.35, "tool_selection": 0.30,
                     "parameter_setting": 0.25, "execution_strategy": 0.10}
TIER_VALUES = {"I": 1.0, "II": 0.8, "III": 0.6, "IV": 0.4, "V": 0.2, "VI": 0.0}


def _prompt_length(task: Task, episode: Sequence[Message]) -> int:
  n = len(task.messages)
  return n if list(episode[:n]) == list(task.messages) else 0


def render_messages(messages: Sequence[Message]) -> str:
  """Assistant steps and tool outputs as numbered plain-text sections the judge reads."""
  parts, step = [], 0
  for m in messages:
    role = m.get("role")
    if role == "assistant":
      step += 1
      parts.append(f"[Step {step}: assistant]\n{m.get('content', '')}")
    elif role == "tool":
      parts.append(f"[Step {step}: output of tool {m.get('name', '?')}]\n{m.get('content', '')}")
    elif role == "user":
      parts.append(f"[user]\n{m.get('content', '')}")
  return "\n\n".join(parts) if parts else "(empty)"


def _question(task: Task) -> str:
  return "\n\n".join(str(m.get("content", "")) for m in task.messages if m.get("role") == "user")


def outcome_messages(task: Task, episode: Sequence[Message], truncated: bool,
                     include_answer: bool = False) -> list[Message]:
  """The chat request of PORTool's outcome judgement of one episode."""
  steps = list(episode[_prompt_length(task, episode):])
  user = f"## Question\n{_question(task)}\n\n## Trajectory\n{render_messages(steps)}"
  if truncated:
    user += "\n\n(The trajectory hit the step limit before a final answer.)"
  if include_answer:
    user += f"\n\n## Ground-truth hint\n{json.dumps(task.answer, ensure_ascii=False)}"
  return [{"role": "system", "content": OUTCOME_SYSTEM}, {"role": "user", "content": user}]


def reasoning_messages(task: Task, episode: Sequence[Message],
                       reference_cot: str | None) -> list[Message]:
  """The chat request of AWPO's reasoning judgement of one episode."""
  steps = list(episode[_prompt_length(task, episode):])
  user = (f"## Question\n{_question(task)}\n\n## Available tools\n{', '.join(task.tool_names)}"
          f"\n\n## Ground-truth trajectory\n{render_messages(task.oracle)}")
  if reference_cot:
    user += f"\n\n## Reference reasoning\n{reference_cot}"
  user += f"\n\n## Assistant's response\n{render_messages(steps)}"
  return [{"role": "system", "content": REASONING_SYSTEM}, {"role": "user", "content": user}]


def _json_objects(text: str) -> list[dict]:
  """Every flat JSON object in `text`, last one last (judges put the verdict at the end)."""
  found = []
  for match in re.finditer(r"\{[^{}]*\}", text):
    try:
      obj = json.loads(match.group(0))
    except (ValueError, RecursionError):  # not JSON, an int too long, or "[[[..." too deep
      continue
    if isinstance(obj, dict):
      found.append(obj)
  return found


def _strip_think(text: Any) -> str:
  if not isinstance(text, str):
    raise ValueError(f"reply content is not text: {text!r}")
  return re.sub(r"<think>.*?(</think>|$)", "", text, flags=re.S)


def _norm_label(value: Any) -> str | None:
  if not isinstance(value, (str, bool)):
    return None
  label = str(value).strip().lower().replace(" ", "_").replace("-", "_")
  return label if label in LABELS else None


def parse_outcome_label(text: Any) -> str:
  """The label of an outcome reply: the last JSON object's "label"; as a last resort the
  label written in prose ("label: false", or the only label word present). ValueError if none.
  """
  text = _strip_think(text)
  for obj in reversed(_json_objects(text)):
    label = _norm_label(obj.get("label"))
    if label:
      return label
  words = r"(unable[ _-]to[ _-]answer|true|false)"
  after = re.findall(r"label\W{0,5}" + words, text, flags=re.I)
  if after:
    return _norm_label(after[-1])
  present = {_norm_label(w) for w in re.findall(r"\b" + words + r"\b", text, flags=re.I)}
  if len(present) == 1:
    return present.pop()
  raise ValueError(f"no label in judge reply {text[:200]!r}")


def _tier(value: Any) -> float | None:
  match = re.fullmatch(r"\s*(?:tier\s*)?(VI|IV|V|III|II|I)\s*", str(value), flags=re.I)
  return TIER_VALUES[match.group(1).upper()] if match else None


def parse_reasoning_tiers(text: Any) -> dict[str, float]:
  """The tier value of each of the four dimensions of a reasoning reply (JSON first, then
  "<dimension> ... Tier <roman>" in prose). ValueError unless all four are found."""
  text = _strip_think(text)
  for obj in reversed(_json_objects(text)):
    tiers = {k: _tier(obj.get(k)) for k in REASONING_WEIGHTS}
    if all(v is not None for v in tiers.values()):
      return tiers
  tiers = {}
  for name in REASONING_WEIGHTS:
    pattern = name.replace("_", r"[ _]") + r"\W{0,8}tier\s*(VI|IV|V|III|II|I)\b"
    found = re.findall(pattern, text, flags=re.I)
    if not found:
      raise ValueError(f"no tier for {name} in judge reply {text[:200]!r}")
    tiers[name] = TIER_VALUES[found[-1].upper()]
  return tiers


def weighted_score(tiers: dict[str, float]) -> float:
  """AWPO's score: sum over dimensions of weight * tier value, in [0, 1]."""
  return sum(REASONING_WEIGHTS[k] * tiers[k] for k in REASONING_WEIGHTS)


# ------------------------------------------------------------------ client

class _ReplyError(Exception):
  """A request that failed; `retry` says whether another attempt can help."""

  def __init__(self, message: str, retry: bool, parse: bool = False, cut: bool = False):
    super().__init__(message)
    self.retry = retry
    self.parse = parse
    self.cut = cut  # ran out of time (its limit, or the call's)


class LLMJudge:
  """A thread-safe judge with retries, a reply cache, voting and a verifier fallback."""

  def __init__(self, config: JudgeConfig, fallback: Family | None = None):
    """Args:
      config: the endpoint and decoding settings.
      fallback: the task family whose `score` is the verifier used when there is no
        endpoint or a judgement fails. Without one, such a judgement raises RuntimeError.
    """
    self.config = config
    self.fallback = fallback
    self._lock = threading.Lock()
    self._cache: dict[str, str] = {}
    self._counts = collections.Counter()
    self._latency_total = 0.0
    if config.cache and config.cache_path and os.path.exists(config.cache_path):
      # errors="replace": a line torn inside a multibyte character is one bad entry, not a
      # run that cannot start.
      with open(config.cache_path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
          line = line.strip()
          if line:  # a torn line (killed writer) is skipped, not fatal
            try:
              entry = json.loads(line)
              key, content = entry["key"], entry["content"]
              if not isinstance(key, str) or not isinstance(content, str):
                raise TypeError("key and content must be strings")
              self._cache[key] = content
            except (ValueError, RecursionError, KeyError, TypeError):
              logging.warning("judge cache %s line %d is not an entry; skipped",
                              config.cache_path, number)

  # ---------------------------------------------------------------- public API

  def judge_outcome(self, task: Task, episode: Sequence[Message], truncated: bool) -> JudgeVerdict:
    """PORTool's outcome verdict on one episode: the majority of `votes` judgements.

    Args:
      task: the task (its prompt messages give the question).
      episode: the full episode, prompt messages included.
      truncated: the episode hit the turn limit without a final answer.

    Returns:
      The verdict; from the verifier when there is no endpoint or every vote failed.
    """
    if truncated and self.config.truncated_label != "judge":
      label = self.config.truncated_label
      return JudgeVerdict(label=label, reward=LABEL_REWARD[label], source="rule")
    if self.config.base_url is None:
      return self._outcome_from_verifier(task, episode, truncated, failed_votes=0)
    messages = outcome_messages(task, episode, truncated,
                                include_answer=self.config.include_answer)
    deadline = _Deadline(self.config.call_budget_s())
    labels, fresh, failed = [], False, 0
    for vote in range(self.config.votes):
      result = self._ask(messages, vote, parse_outcome_label, deadline)
      if result is None:
        failed += 1
      else:
        labels.append(result[0])
        fresh |= not result[1]
    if deadline.hit:
      self._count("deadline_hits")
    if not labels:
      return self._outcome_from_verifier(task, episode, truncated, failed_votes=failed)
    label = majority_label(labels)
    return JudgeVerdict(label=label, reward=LABEL_REWARD[label], votes=tuple(labels),
                        source="judge" if fresh else "cache", failed_votes=failed)

  def judge_reasoning_verdict(self, task: Task, episode: Sequence[Message],
                              reference_cot: str | None = None) -> ReasoningVerdict:
    """AWPO's reasoning score with its details; see `judge_reasoning`."""
    if self.config.base_url is not None:
      messages = reasoning_messages(task, episode, reference_cot)
      deadline = _Deadline(self.config.call_budget_s())
      scores, dims, fresh = [], collections.defaultdict(list), False
      for vote in range(self.config.votes):
        result = self._ask(messages, vote, parse_reasoning_tiers, deadline)
        if result is not None:
          tiers, cached = result
          scores.append(weighted_score(tiers))
          for name, value in tiers.items():
            dims[name].append(value)
          fresh |= not cached
      if deadline.hit:
        self._count("deadline_hits")
      if scores:
        return ReasoningVerdict(score=sum(scores) / len(scores), votes=tuple(scores),
                                dimensions={k: sum(v) / len(v) for k, v in dims.items()},
                                source="judge" if fresh else "cache")
    outcome = self._verifier(task, episode, truncated=False)
    return ReasoningVerdict(score=1.0 if outcome.correct else 0.0, source="verifier")

  def judge_reasoning(self, task: Task, episode: Sequence[Message],
                      reference_cot: str | None = None) -> float:
    """AWPO's R_reason in [0, 1]: the mean over votes of sum_k weight_k * tier_value_k.

    The mean (not the median) because AWPO uses R_reason as a continuous reward and voting
    is there to lower its variance. Without an endpoint, or when every vote fails, the score
    is 1.0 if the verifier says the episode is correct, else 0.0, and
    `judge/fallback_verifier` counts it; use `judge_reasoning_verdict` to tell these apart.

    Args:
      task: the task; its oracle messages are the ground-truth trajectory the judge sees.
      episode: the full episode, prompt messages included.
      reference_cot: a reference rationale (AWPO's GPT-4o CoT), None if there is none.
    """
    return self.judge_reasoning_verdict(task, episode, reference_cot).score

  def judge_many(self, items: Sequence[tuple[Task, Sequence[Message], bool]],
                 max_workers: int = 8) -> list[JudgeVerdict]:
    """`judge_outcome` on each (task, episode, truncated), concurrently, in order."""
    if not items:
      return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
      return list(pool.map(lambda item: self.judge_outcome(*item), items))

  def metrics(self) -> dict[str, float]:
    """Counters since construction: requests, retries, failures (judgements that failed
    after all retries), fallback_verifier (verdicts from the verifier), cache_hits,
    parse_errors, deadline_hits (judge calls cut short by total_timeout_s) and the mean
    request latency."""
    with self._lock:
      c = self._counts
      names = ("requests", "retries", "failures", "fallback_verifier", "cache_hits",
               "parse_errors", "deadline_hits")
      out = {f"judge/{name}": float(c[name]) for name in names}
      out["judge/mean_latency_s"] = self._latency_total / c["requests"] if c["requests"] else 0.0
    return out

  # ---------------------------------------------------------------- internals

  def _count(self, name: str, n: int = 1, latency: float = 0.0):
    with self._lock:
      self._counts[name] += n
      self._latency_total += latency

  def _verifier(self, task: Task, episode: Sequence[Message], truncated: bool) -> Outcome:
    if self.fallback is None:
      raise RuntimeError("LLMJudge: no judge endpoint answered and no fallback family is set; "
                         "pass fallback=<the task family> to score with its verifier")
    self._count("fallback_verifier")
    return self.fallback.score(task, episode, truncated)

  def _outcome_from_verifier(self, task, episode, truncated, failed_votes: int) -> JudgeVerdict:
    outcome = self._verifier(task, episode, truncated)
    label = verifier_label(outcome)
    return JudgeVerdict(label=label, reward=LABEL_REWARD[label], source="verifier",
                        failed_votes=failed_votes, verifier_outcome=outcome)

  def _cache_key(self, messages: list[Message], vote: int) -> str:
    cfg = self.config
    blob = json.dumps({"model": cfg.model, "messages": messages, "temperature": cfg.temperature,
                       "max_tokens": cfg.max_tokens, "vote": vote},
                      sort_keys=True, ensure_ascii=False)
    # surrogatepass: a lone surrogate from the model's text must not fail the key.
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()

  def _ask(self, messages: list[Message], vote: int, parse,
           deadline: _Deadline) -> tuple[Any, bool] | None:
    """One judgement: (parsed reply, from_cache), or None after all retries failed or the
    call's deadline passed (no request is started, nor backoff slept, past it)."""
    cfg = self.config
    key = self._cache_key(messages, vote)
    if cfg.cache:
      with self._lock:
        content = self._cache.get(key)
      if content is not None:
        try:
          parsed = parse(content)
          self._count("cache_hits")
          return parsed, True
        except ValueError:
          pass  # a cached reply the current parser rejects: ask again
    for attempt in range(cfg.max_retries + 1):
      if attempt:
        if deadline.left() <= cfg.backoff(attempt):
          deadline.hit = True  # no time for the backoff and another request
          break
        self._count("retries")
        time.sleep(cfg.backoff(attempt))
      limit = min(cfg.timeout_s, deadline.left())
      if limit <= 0:
        deadline.hit = True
        break
      try:
        start = time.monotonic()
        content = self._post(messages, limit)
        try:
          parsed = parse(content)
        except ValueError as e:
          raise _ReplyError(f"unparseable judge reply: {e}", retry=True, parse=True) from e
        if time.monotonic() - start > limit:  # the parse counts inside the request's limit
          raise _ReplyError(f"reply parsed only after the {limit:.1f}s limit", retry=True,
                            cut=True)
      except _ReplyError as e:
        if e.parse:
          self._count("parse_errors")
        if e.cut and limit < cfg.timeout_s:
          deadline.hit = True  # cut by the call's total, not the request's own limit
        if not e.retry:
          break
        continue
      if cfg.cache:
        self._store(key, content)
      return parsed, False
    self._count("failures")
    return None

  def _store(self, key: str, content: str):
    content = valid_text(content)  # a lone surrogate in a reply could not be written
    with self._lock:
      self._cache[key] = content
      if self.config.cache_path:
        with open(self.config.cache_path, "a", encoding="utf-8") as f:
          f.write(json.dumps({"key": key, "content": content}, ensure_ascii=False) + "\n")

  def _post(self, messages: list[Message], limit: float) -> str:
    """One chat-completion request, all of it (connect, send, headers, body) within `limit`
    seconds; the reply's text, or _ReplyError."""
    cfg = self.config
    body = json.dumps({"model": cfg.model, "messages": messages, "temperature": cfg.temperature,
                       "max_tokens": cfg.max_tokens, "n": 1}).encode("utf-8")
    headers = {"Content-Type": "application/json"}
    api_key = os.environ.get(cfg.api_key_env)
    if api_key:
      headers["Authorization"] = f"Bearer {api_key}"
    url = cfg.base_url.rstrip("/") + "/chat/completions"
    start = time.monotonic()
    cut = threading.Event()
    conn, watchdog = None, None
    try:
      conn, target = _connection(url, limit)
      conn.connect()  # bounded by the socket timeout (limit)
      left = limit - (time.monotonic() - start)
      # The watchdog bounds the rest, however slowly the server sends: once `limit` has
      # passed it shuts the socket down, which ends any read blocked on it.
      watchdog = threading.Timer(max(0.0, left), _shut, args=(conn, cut))
      watchdog.daemon = True
      watchdog.start()
      conn.request("POST", target, body=body, headers=headers)
      response = conn.getresponse()
      status = response.status
      # An error status needs no body (the connection is closed below); a reply body is read
      # up to the cap only.
      raw = _read_capped(response, cfg.max_reply_bytes) if status < 300 else b""
      if cut.is_set():
        raise OSError("cut by the watchdog")
    except _ReplyError:
      self._count("parse_errors")
      raise
    except (OSError, http.client.HTTPException, ValueError) as e:
      if cut.is_set() or isinstance(e, TimeoutError):
        raise _ReplyError(f"no complete reply within {limit:.1f}s", retry=True, cut=True) from e
      raise _ReplyError(f"request failed: {e!r}", retry=True) from e
    finally:
      if watchdog is not None:
        watchdog.cancel()
      if conn is not None:
        conn.close()
      self._count("requests", latency=time.monotonic() - start)
    if status >= 300:
      retry = status == 429 or status >= 500
      raise _ReplyError(f"HTTP {status}", retry=retry)
    if time.monotonic() - start > limit:  # read in time, but no time is left to parse it
      raise _ReplyError(f"no complete reply within {limit:.1f}s", retry=True, cut=True)
    try:
      # The size cap bounds this parse; its time still counts (see _ask).
      content = json.loads(raw)["choices"][0]["message"]["content"]
      if not isinstance(content, str):
        raise TypeError(f"the message content is {type(content).__name__}, not text")
      return content
    except (ValueError, RecursionError, KeyError, IndexError, TypeError) as e:
      self._count("parse_errors")
      raise _ReplyError(f"not a chat completion ({e!r}): {raw[:200]!r}", retry=True) from e


def _read_capped(response: http.client.HTTPResponse, cap: int) -> bytes:
  """The body of `response`, read in chunks; _ReplyError once it is known to exceed `cap`
  bytes (from its Content-Length before any read, else after reading cap + 1 bytes)."""
  if response.length is not None and response.length > cap:
    raise _ReplyError(f"reply body of {response.length} bytes is over the "
                      f"{cap}-byte limit (JudgeConfig.max_reply_bytes)", retry=True)
  body = bytearray()
  while len(body) <= cap:
    chunk = response.read(min(_READ_CHUNK, cap + 1 - len(body)))
    if not chunk:
      return bytes(body)
    body += chunk
  raise _ReplyError(f"reply body is over the {cap}-byte limit (JudgeConfig.max_reply_bytes)",
                    retry=True)


class _Deadline:
  """The end of one judge call's time budget; `hit` records that it cut the call short."""

  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds
    self.hit = False

  def left(self) -> float:
    return self.end - time.monotonic()


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
  """(an unconnected connection for `url`, the request target), through the proxy that the
  environment names for it (`https_proxy`, `http_proxy`, `no_proxy`), as urllib would."""
  parts = urllib.parse.urlsplit(url)
  port = parts.port or (443 if parts.scheme == "https" else 80)
  path = parts.path or "/"
  if parts.query:
    path += "?" + parts.query
  proxy = urllib.request.getproxies().get(parts.scheme)
  if proxy and urllib.request.proxy_bypass(parts.hostname):
    proxy = None
  if proxy is None:
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, port, timeout=timeout), path
  p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
  if parts.scheme == "https":  # a CONNECT tunnel through the proxy
    conn = http.client.HTTPSConnection(p.hostname, p.port or 80, timeout=timeout)
    conn.set_tunnel(parts.hostname, port)
    return conn, path
  return http.client.HTTPConnection(p.hostname, p.port or 80, timeout=timeout), url


def _shut(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
  """The watchdog's action: end every blocked read of `conn` now."""
  cut.set()
  sock = conn.sock
  if sock is not None:
    try:
      sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
