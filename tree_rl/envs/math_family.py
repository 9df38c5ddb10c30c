"""Math word problems and arithmetic, solved with a calculator and a Python tool.

Problems come from reasoning-gym's procedural datasets (by default
gsm_symbolic, basic_arithmetic and chain_sum), so any number of train and eval
tasks can be drawn from a seed without downloads. The policy may call
`calculator` (`evaluate_to_text` of `tree_rl.envs.calculator`, a safe `ast`
evaluator with exact arithmetic) and `python` (the sandbox of
`tree_rl.envs.sandbox`), and ends with <answer>...</answer>. The verifier is
the dataset's own `score_answer`, with math-verify as the fallback.

Splits. Each (split, dataset) pair draws from its own reasoning-gym seed,
derived from the family seed by hashing, so train and eval are different
streams. Reasoning-gym seeds entry i with `seed + i`, so streams with nearby
seeds overlap, and small datasets repeat questions; as a guarantee, train drops
every question of the eval *pool* (the first `eval_pool_size` entries of each
dataset's eval stream for the same seed), and eval tasks are only ever drawn
from that pool. So no eval question is ever a train question, whatever
`num_tasks` either side asks for. Entries whose reference answer the dataset's
own scorer does not give full marks are skipped on both sides.
"""

from __future__ import annotations

import functools
import json
import random
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import reasoning_gym

from tree_rl.envs.base import Message, Outcome, Task, Tool, render_tool_output, render_tool_prompt
from tree_rl.envs.calculator import evaluate_to_text
from tree_rl.envs.parsing import format_tool_call
from tree_rl.envs.sandbox import SandboxLimits, check_isolation, run_python

# ---------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------


def make_tools(limits: SandboxLimits = SandboxLimits(), isolation: str = "bwrap") -> list[Tool]:
  """The family's tools: `calculator` and `python` (run in the sandbox with `limits`, under
  `isolation`: see `tree_rl.envs.sandbox`)."""

  def python(code: str) -> str:
    result = run_python(code, limits, isolation)
    if not result.ok:
      message = result.error or "the code failed"
      if result.stdout:
        message += f"\nstdout:\n{result.stdout}"
      if result.stderr:
        message += f"\nstderr:\n{result.stderr[-1500:]}"  # the traceback's end matters most
      raise ValueError(message)
    return result.stdout or "(no output: print() the values you need)"

  calculator = Tool(
      name="calculator",
      description=("Evaluates an arithmetic expression exactly and returns its value. Supports "
                   "+ - * / // % ** (or ^), parentheses, sqrt, abs, round, min, max, floor, "
                   "ceil, log, exp, pi and e."),
      parameters={"type": "object",
                  "properties": {"expression": {"type": "string",
                                                "description": "e.g. (12 + 30) * 4 / 7"}},
                  "required": ["expression"]},
      fn=evaluate_to_text, timeout_s=5.0)
  python_tool = Tool(
      name="python",
      description=("Runs a Python 3 script in a sandbox without network or file access and "
                   "returns what it printed. Use print() to show results."),
      parameters={"type": "object",
                  "properties": {"code": {"type": "string",
                                          "description": "the script, e.g. print(sum(range(10)))"}},
                  "required": ["code"]},
      fn=python, timeout_s=float(limits.wall_s) + 5.0)
  return [calculator, python_tool]


# ---------------------------------------------------------------------------
# Answers and scoring
# ---------------------------------------------------------------------------


def _last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} in `text` (braces matched), or None."""
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 0, start + len("\\boxed")
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1:j]
  return None


def extract_answer(text: str) -> str | None:
  """The final answer of one assistant step, or None when it gives none.

  The answer is the first <answer>...</answer> block outside the first
  <think>...</think> block (tags inside it are reasoning, as in
  `tree_rl.envs.parsing`), else the last \\boxed{...}; a \\boxed{...} inside
  the answer block is unwrapped.
  """
  start = text.find("<think>")
  end = text.find("</think>", start + 1) if start >= 0 else -1
  if end >= 0:
    text = text[:start] + "\n" + text[end + len("</think>"):]
  match = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
  candidate = match.group(1) if match else None
  boxed = _last_boxed(candidate if candidate is not None else text)
  if boxed is not None:
    candidate = boxed
  candidate = candidate.strip() if candidate is not None else ""
  return candidate or None


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str) -> Any:
  """A reasoning-gym dataset object, kept for its `score_answer` (cheap: size 1)."""
  return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json))


def score_answer(dataset: str, config: Mapping[str, Any], entry: Mapping[str, Any],
                 answer: str) -> tuple[float, str]:
  """(score in [0, 1], scorer name) of `answer` for one reasoning-gym entry.

  Uses the dataset's own `score_answer`; falls back to math-verify when the
  dataset is unknown or its scorer fails on the stored entry.
  """
  try:
    scorer = _dataset(dataset, json.dumps(dict(config), sort_keys=True))
    return min(1.0, max(0.0, float(scorer.score_answer(answer, dict(entry))))), "reasoning_gym"
  except Exception:  # noqa: BLE001 (unregistered dataset, or a scorer that needs more metadata)
    pass
  from math_verify import parse, verify  # local: slow import, only for the fallback
  # math-verify's timeouts use SIGALRM, which only the main thread may set.
  timeout = 5 if threading.current_thread() is threading.main_thread() else None
  try:
    same = verify(parse(str(entry["answer"]), parsing_timeout=timeout),
                  parse(answer, parsing_timeout=timeout), timeout_seconds=timeout)
  except Exception:  # noqa: BLE001 (math-verify raises on unparsable input in some versions)
    same = False
  return (1.0 if same else 0.0), "math_verify"


# ---------------------------------------------------------------------------
# Oracle expressions
# ---------------------------------------------------------------------------

_OPERATION = re.compile(r"[\d)]\s*(\*\*|[-+*/])\s*[-\d(]")


def _cot_equations(cot: str) -> list[tuple[str, str]]:
  """(reasoning before it, left-hand side) of every `expr = value` in a worked solution.

  Units and words are dropped ("76 students - 46 girls" gives "76 - 46"); a
  left-hand side that is not then a plain arithmetic expression is skipped.
  """
  lines = [line for line in cot.strip().splitlines() if not line.strip().startswith("####")]
  found = []
  for n, line in enumerate(lines):
    line = re.sub(r"(?<=\d),(?=\d{3})", "", line)  # thousands separators: 310,000
    pos = 0
    for match in re.finditer("=", line):
      segment = re.split(r"[:;,]|\.\s", line[pos:match.start()])[-1]
      pos = match.end()
      segment = re.sub(r"\bx\b", "*", segment.replace("×", "*").replace("÷", "/"))
      expression = " ".join(re.sub(r"[^\d.+\-*/() ]", " ", segment).split())
      # Dropped words can leave two numbers side by side ("6 7 - 1" from "6 friends
      # because 7 - 1"): the expression is what follows the last such gap.
      expression = re.split(r"(?<=[\d)])\s+(?=[\d(])", expression)[-1]
      expression = re.sub(r"^[^\d(]+", "", expression)
      if _OPERATION.search(expression):
        found.append(("\n".join(lines[:n]).strip(), expression))
  return found


def _oracle_candidates(entry: Mapping[str, Any]) -> list[tuple[str, str]]:
  """(think, calculator expression) pairs to try, best first."""
  metadata = entry.get("metadata") or {}
  expression = metadata.get("expression")
  if isinstance(expression, str) and expression:
    pairs = [("I will evaluate the expression with the calculator.", expression)]
    if "/" in expression:  # basic_arithmetic's answers use integer (floor) division
      pairs.append(("The problem uses integer division, so I write / as //.",
                    expression.replace("/", "//")))
    return pairs
  cot = metadata.get("answer_cot")
  if isinstance(cot, str):
    pairs = []
    for before, lhs in reversed(_cot_equations(cot)):
      lead = f"{before}\n" if before else ""
      pairs.append((f"{lead}The answer is {lhs}; I compute it with the calculator.", lhs))
    return pairs
  return []


# ---------------------------------------------------------------------------
# The family
# ---------------------------------------------------------------------------

DEFAULT_DATASETS = ("gsm_symbolic", "basic_arithmetic", "chain_sum")
PREAMBLE = ("You are a careful math assistant. Solve the user's problem. Use the calculator "
            "for arithmetic and the python tool for longer computations (print what you need).")
FINISH = "When you know the answer, reply with <answer>...</answer> and no tool call."


def _stream_seed(seed: int, split: str, dataset: str) -> int:
  """The reasoning-gym seed of one (split, dataset) stream: a hash, so streams are far apart."""
  return random.Random(f"math/{split}/{dataset}/{seed}").randrange(2**31)


def _json_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
  """'question', 'answer' and 'metadata' of an entry as plain JSON (for Task.metadata)."""
  keep = {k: entry[k] for k in ("question", "answer", "metadata") if k in entry}
  try:
    return json.loads(json.dumps(keep))
  except (TypeError, ValueError):  # scorers read 'answer'; odd metadata values become text
    return json.loads(json.dumps(keep, default=repr))


class MathFamily:
  """Reasoning-gym math problems with `calculator` and `python` tools (see the module doc)."""

  name = "math"

  def __init__(self, datasets: Sequence[str] = DEFAULT_DATASETS,
               dataset_configs: Mapping[str, Mapping[str, Any]] | None = None,
               max_turns: int = 4, eval_pool_size: int = 500,
               sandbox_limits: SandboxLimits = SandboxLimits(), sandbox: str = "bwrap"):
    """Args:
      datasets: reasoning-gym dataset names; tasks cycle through them in order.
      dataset_configs: per-dataset keyword arguments of `create_dataset`
        (difficulty knobs); `seed` and `size` are the family's.
      max_turns: assistant steps per episode.
      eval_pool_size: entries per dataset in the eval pool (see the module doc).
      sandbox_limits: the limits of the `python` tool.
      sandbox: the `python` tool's isolation (`task.kwargs.sandbox`): "bwrap", a kernel
        boundary (refused at once where bubblewrap cannot run), or "audit", the audit hook
        alone, which is no boundary and must be asked for (see `tree_rl.envs.sandbox`).
    """
    check_isolation(sandbox)
    self.sandbox = sandbox
    if not datasets:
      raise ValueError("at least one dataset is needed")
    if eval_pool_size < 1:
      raise ValueError(f"eval_pool_size must be >= 1, got {eval_pool_size}")
    self.datasets = tuple(datasets)
    configs = dict(dataset_configs or {})
    unknown = sorted(set(configs) - set(self.datasets))
    if unknown:
      raise ValueError(f"dataset_configs names datasets not in {self.datasets}: {unknown}")
    self.dataset_configs = {n: dict(configs.get(n, {})) for n in self.datasets}
    json.dumps(self.dataset_configs)  # stored in Task.metadata and keys the scorer cache
    self.max_turns = max_turns
    self.eval_pool_size = eval_pool_size
    self._tools = {t.name: t for t in make_tools(sandbox_limits, sandbox)}
    self._system = render_tool_prompt(list(self._tools.values()), preamble=PREAMBLE,
                                      finish=FINISH)
    self._eval_pools: dict[int, dict[str, list[tuple[int, dict[str, Any]]]]] = {}

  # -- task generation -------------------------------------------------------

  def _create(self, dataset: str, split: str, seed: int, size: int) -> Any:
    return reasoning_gym.create_dataset(dataset, size=size, seed=_stream_seed(seed, split, dataset),
                                        **self.dataset_configs[dataset])

  def _usable(self, name: str, entry: Mapping[str, Any]) -> bool:
    """Whether the dataset's scorer gives its own reference answer full marks.

    Not always so: gsm_symbolic's scorer reads "-1" as 1 (its regex wants a word
    boundary before the minus sign), so such tasks could never be solved.
    """
    entry = _json_entry(entry)
    return score_answer(name, self.dataset_configs[name], entry,
                        str(entry["answer"]))[0] >= 1.0 - 1e-9

  def _eval_pool(self, seed: int) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Per dataset, the (index, entry) of each distinct, usable question of its eval pool."""
    if seed not in self._eval_pools:
      pools, seen = {}, set()
      for name in self.datasets:
        data = self._create(name, "eval", seed, self.eval_pool_size)
        pools[name] = []
        for i in range(self.eval_pool_size):
          entry = data[i]
          if entry["question"] not in seen:
            seen.add(entry["question"])
            if self._usable(name, entry):
              pools[name].append((i, entry))
      self._eval_pools[seed] = pools
    return self._eval_pools[seed]

  def _train_entries(self, name: str, seed: int, count: int,
                     banned: set[str]) -> list[tuple[int, dict[str, Any]]]:
    """`count` (index, entry) of distinct train questions not in `banned` (which grows)."""
    size = 2 * count + 64
    while True:
      data, chosen, seen = self._create(name, "train", seed, size), [], set(banned)
      for i in range(size):
        entry = data[i]
        if entry["question"] not in seen:
          seen.add(entry["question"])
          if not self._usable(name, entry):
            continue
          chosen.append((i, entry))
          if len(chosen) == count:
            banned.update(seen)
            return chosen
      if size > 64 * (count + 64):
        raise ValueError(f"{name} has too few distinct questions for {count} train tasks")
      size *= 4

  def generate(self, split: str, num_tasks: int, seed: int) -> list[Task]:
    """`num_tasks` tasks of `split`, deterministic in (split, num_tasks, seed).

    Task i comes from dataset i mod len(datasets). Eval tasks are the first
    distinct questions of each dataset's eval pool; train tasks are distinct
    questions of the train streams that are in no eval pool of this seed.

    Raises:
      ValueError: an unknown split, or more eval tasks than the pool holds.
    """
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    k = len(self.datasets)
    counts = {name: len(range(d, num_tasks, k)) for d, name in enumerate(self.datasets)}
    pools = self._eval_pool(seed)
    chosen = {}
    if split == "eval":
      for name, count in counts.items():
        if count > len(pools[name]):
          raise ValueError(f"{count} eval tasks of {name} asked, its pool has "
                           f"{len(pools[name])} distinct questions; raise eval_pool_size")
        chosen[name] = pools[name][:count]
    else:
      banned = {entry["question"] for pool in pools.values() for _, entry in pool}
      for name, count in counts.items():
        chosen[name] = self._train_entries(name, seed, count, banned)
    tasks = []
    for i in range(num_tasks):
      name = self.datasets[i % k]
      index, entry = chosen[name][i // k]
      tasks.append(self._task(split, i, name, seed, index, _json_entry(entry)))
    return tasks

  def _task(self, split: str, i: int, name: str, seed: int, index: int,
            entry: dict[str, Any]) -> Task:
    config = self.dataset_configs[name]
    oracle = self._oracle(name, config, entry)
    return Task(
        task_id=f"math/{split}/{i}", family=self.name, split=split,
        messages=({"role": "system", "content": self._system},
                  {"role": "user", "content": entry["question"]}),
        tool_names=tuple(self._tools), answer=str(entry["answer"]), oracle=oracle,
        difficulty=sum(1 for m in oracle if m["role"] == "tool"),
        metadata={"dataset": name, "dataset_config": config, "index": index,
                  "stream_seed": _stream_seed(seed, split, name), "entry": entry})

  def _oracle(self, name: str, config: Mapping[str, Any],
              entry: Mapping[str, Any]) -> tuple[Message, ...]:
    """One calculator step on an expression whose value scores correct, then the answer.

    Falls back to a single answer step (reasoning: the worked solution when the
    entry has one) when no candidate expression gives the reference answer.
    """
    calculator = self._tools["calculator"]
    for think, expression in _oracle_candidates(entry):
      try:
        value = calculator.fn(expression=expression)
      except ValueError:
        continue
      content = render_tool_output(value)
      if score_answer(name, config, entry, content)[0] >= 1.0 - 1e-9:
        call = format_tool_call(calculator.name, {"expression": expression})
        return ({"role": "assistant", "content": f"<think>{think}</think>\n{call}"},
                {"role": "tool", "name": calculator.name, "content": content},
                {"role": "assistant",
                 "content": f"<think>The calculator gives {content}.</think>\n"
                            f"<answer>{content}</answer>"})
    cot = str((entry.get("metadata") or {}).get("answer_cot", "")).split("####")[0].strip()
    think = cot or "I can answer this directly."
    return ({"role": "assistant",
             "content": f"<think>{think}</think>\n<answer>{entry['answer']}</answer>"},)

  # -- tools and verifier ----------------------------------------------------

  def tools(self, task: Task) -> list[Tool]:
    """The tools named in `task.tool_names` (stateless: shared by every task)."""
    return [self._tools[name] for name in task.tool_names]

  def score(self, task: Task, episode: Sequence[Message], truncated: bool) -> Outcome:
    """Reward = the dataset's score of the last assistant message's answer (0 if none).

    Args:
      task: a task of this family.
      episode: the full episode, prompt messages included.
      truncated: the episode hit the turn limit (it then scores 0, unanswered).

    Returns:
      The Outcome; `details` has the extracted answer, the score and the scorer.
    """
    if truncated:
      return Outcome(reward=0.0, correct=False, answered=False,
                     details={"extracted": None, "reason": "truncated"})
    last = next((m for m in reversed(episode) if m.get("role") == "assistant"), None)
    extracted = extract_answer(str(last.get("content") or "")) if last is not None else None
    if extracted is None:
      return Outcome(reward=0.0, correct=False, answered=False,
                     details={"extracted": None, "reason": "no answer"})
    meta = task.metadata
    value, scorer = score_answer(meta["dataset"], meta.get("dataset_config", {}),
                                 meta["entry"], extracted)
    return Outcome(reward=value, correct=value >= 1.0 - 1e-9, answered=True,
                   details={"extracted": extracted, "score": value, "scorer": scorer})
