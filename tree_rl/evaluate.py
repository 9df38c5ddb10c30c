"""Evaluation harness: runs a policy on a task family and reports PORTool's metrics.

The metrics are PORTool's four (arXiv 2510.26020, §4.1, "Evaluation Metrics"):

  - accuracy: fraction of episodes counted correct (by the verifier, or by the judge's
    majority vote when one is given);
  - avg_tool_steps: mean number of steps with at least one tool call (capped by max_turns);
  - unanswerable_rate: fraction of episodes without an answer, truncated ones included;
  - avg_formatting_raw: mean of the raw [0, 1] formatting rubric over every step of every
    episode (the scale the paper reports);

and further:

  - mean_reward: mean outcome reward, on the family's (or the judge's) scale;
  - truncated_rate: fraction of episodes that hit the turn limit;
  - pass@k: the unbiased estimator 1 - C(n - c, k) / C(n, k) (arXiv 2107.03374, §2.1),
    averaged over tasks, with n = num_samples and c the task's correct samples;
  - num_tasks, num_episodes: the counts evaluated;
  - accuracy/difficulty_<d>: accuracy over the tasks of difficulty d.

`replay_oracle_policy` replays each task's oracle, so `evaluate(family, tasks,
replay_oracle_policy(tasks))` must give accuracy 1: a self-check of a family's tools,
verifier and oracles, and of this harness.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence

from tree_rl.envs.base import Message, Task
from tree_rl.envs.episode import EpisodeRecord, Family, Policy, run_episodes
from tree_rl.rewards.judge import LLMJudge


@dataclasses.dataclass(frozen=True)
class EpisodeSummary:
  """The per-episode line of a report."""

  task_id: str
  sample: int
  correct: bool
  reward: float
  steps: int  # assistant steps taken
  truncated: bool
  answered: bool
  difficulty: int


@dataclasses.dataclass(frozen=True)
class EvalReport:
  """Metrics and per-episode summaries of one evaluation.

  Attributes:
    metrics: name -> value (see the module docstring; judge/* counters when judged).
    episodes: one summary per episode, ordered by (task, sample).
    records: the full episodes (not serialised; empty for a report read from JSON).
  """

  metrics: dict[str, float]
  episodes: tuple[EpisodeSummary, ...]
  records: tuple[EpisodeRecord, ...] = ()

  def to_json(self, path: str) -> None:
    """Writes {"metrics": ..., "episodes": [...]} to `path` as indented JSON."""
    payload = {"metrics": self.metrics,
               "episodes": [dataclasses.asdict(e) for e in self.episodes]}
    with open(path, "w", encoding="utf-8") as f:
      json.dump(payload, f, indent=2, sort_keys=False)
      f.write("\n")

  def write_transcripts(self, path: str) -> None:
    """Writes what the model said, one JSON line per episode: task id, correct, reward,
    question, reference answer and the episode's messages.

    errors="replace": model text may hold a string no codec can write (a lone surrogate),
    and that must not end a run (or every resume, which redoes the same greedy eval).
    """
    with open(path, "w", encoding="utf-8", errors="replace") as f:
      for rec, ep in zip(self.records, self.episodes):
        f.write(json.dumps({"task_id": ep.task_id, "correct": ep.correct, "reward": ep.reward,
                            "question": rec.task.messages[-1]["content"],
                            "answer": rec.task.answer,
                            "episode": list(rec.messages[len(rec.task.messages):])},
                           default=str, ensure_ascii=False) + "\n")

  @classmethod
  def from_json(cls, path: str) -> EvalReport:
    """Reads a report written by `to_json` (without the full records)."""
    with open(path, encoding="utf-8") as f:
      payload = json.load(f)
    return cls(metrics={k: float(v) for k, v in payload["metrics"].items()},
               episodes=tuple(EpisodeSummary(**e) for e in payload["episodes"]))

  def table(self) -> str:
    """The metrics as an aligned two-column text table, one metric per line."""
    rows = [(name, _format_value(name, value)) for name, value in self.metrics.items()]
    width = max([len("metric")] + [len(name) for name, _ in rows])
    value_width = max([len("value")] + [len(v) for _, v in rows])
    lines = [f"{'metric':<{width}}  {'value':>{value_width}}",
             f"{'-' * width}  {'-' * value_width}"]
    lines += [f"{name:<{width}}  {value:>{value_width}}" for name, value in rows]
    return "\n".join(lines)


def _format_value(name: str, value: float) -> str:
  """Counts (num_*, judge/* counters) as integers, rates and means with 4 decimals."""
  is_count = name.startswith("num_") or (name.startswith("judge/") and not name.endswith("_s"))
  return str(int(value)) if is_count and float(value).is_integer() else f"{value:.4f}"


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k estimate of one task: 1 - C(n - c, k) / C(n, k).

  Args:
    n: samples drawn; c: correct samples among them; k: the k of pass@k (k <= n).

  Returns:
    The estimate, in [0, 1].

  Raises:
    ValueError: unless 0 <= c <= n and 1 <= k <= n.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:  # every k-subset holds a correct sample
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(values: Iterable[float]) -> float:
  values = list(values)
  return sum(values) / len(values) if values else 0.0


def compute_metrics(records: Sequence[EpisodeRecord], num_samples: int,
                    pass_k: Sequence[int] = (1,)) -> dict[str, float]:
  """The report's metrics of finished episodes (see the module docstring).

  Args:
    records: every episode, `num_samples` per task.
    num_samples: samples per task (n of pass@k).
    pass_k: the k values; each must be in [1, num_samples].

  Returns:
    {metric name: value}: the module docstring's metrics, with one "pass@<k>" per k.

  Raises:
    ValueError: a k outside [1, a task's episode count] (`pass_at_k`).
  """
  by_task: dict[str, list[EpisodeRecord]] = collections.defaultdict(list)
  for r in records:
    by_task[r.task.task_id].append(r)
  metrics = {
      "accuracy": _mean(float(r.outcome.correct) for r in records),
      "avg_tool_steps": _mean(r.num_tool_steps for r in records),
      # The family decides what counts as an answer: a truncated tool-world
      # episode is unanswered, but BFCL's single step *is* its answer even
      # though it ends at the turn limit.
      "unanswerable_rate": _mean(float(not r.outcome.answered) for r in records),
      "avg_formatting_raw": _mean(s.formatting_raw for r in records for s in r.steps),
      "mean_reward": _mean(r.outcome.reward for r in records),
      "truncated_rate": _mean(float(r.truncated) for r in records),
  }
  for k in pass_k:
    metrics[f"pass@{k}"] = _mean(
        pass_at_k(len(rs), sum(r.outcome.correct for r in rs), k) for rs in by_task.values())
  metrics["num_tasks"] = float(len(by_task))
  metrics["num_episodes"] = float(len(records))
  by_difficulty: dict[int, list[EpisodeRecord]] = collections.defaultdict(list)
  for r in records:
    by_difficulty[r.task.difficulty].append(r)
  for d in sorted(by_difficulty):
    metrics[f"accuracy/difficulty_{d}"] = _mean(float(r.outcome.correct)
                                                 for r in by_difficulty[d])
  return metrics


def evaluate(family: Family, tasks: Sequence[Task], policy: Policy, *, num_samples: int = 1,
             pass_k: Sequence[int] = (1,), judge: LLMJudge | None = None,
             max_turns: int | None = None, max_workers: int = 8,
             encode: Callable[[str], Sequence[int]] | None = None,
             progress: Callable[[int, int, int], None] | None = None) -> EvalReport:
  """Runs `num_samples` episodes per task and reports accuracy, tool steps, unanswerable
  rate, formatting, reward, pass@k and per-difficulty accuracy.

  Args:
    family: the task family.
    tasks: the evaluation tasks (task ids must be unique).
    policy: the batched policy (see `run_episodes`).
    num_samples: episodes per task.
    pass_k: the k values of pass@k, each in [1, num_samples].
    judge: score outcomes with this judge (its judge/* counters join the metrics).
    max_turns: None uses `family.max_turns`.
    max_workers: parallel tool execution and judging.
    encode: the policy's tokenizer, which tool replies are capped in (see `run_episodes`).
    progress: called after each turn with (turns done, episodes finished, episodes).

  Returns:
    The report.

  Raises:
    ValueError: a k outside [1, num_samples], or task ids that repeat.
  """
  bad_k = [k for k in pass_k if not 1 <= k <= num_samples]
  if bad_k:
    raise ValueError(f"pass@k needs 1 <= k <= num_samples={num_samples}, got k={bad_k}")
  ids = [t.task_id for t in tasks]
  if len(set(ids)) != len(ids):
    raise ValueError("task ids must be unique within an evaluation")
  records = run_episodes(family, tasks, policy, num_samples=num_samples, max_turns=max_turns,
                         judge=judge, max_workers=max_workers, encode=encode,
                         progress=progress)
  metrics = compute_metrics(records, num_samples, pass_k)
  if judge is not None:
    metrics.update(judge.metrics())
  episodes = tuple(EpisodeSummary(task_id=r.task.task_id, sample=r.sample_index,
                                  correct=bool(r.outcome.correct),
                                  reward=float(r.outcome.reward), steps=len(r.steps),
                                  truncated=r.truncated, answered=bool(r.outcome.answered),
                                  difficulty=r.task.difficulty) for r in records)
  return EvalReport(metrics=metrics, episodes=episodes, records=tuple(records))


def _prompt_key(messages: Sequence[Message]) -> str:
  return json.dumps(list(messages), sort_keys=True, ensure_ascii=False, default=str)


def replay_oracle_policy(tasks: Sequence[Task]) -> Policy:
  """A policy that replays each task's oracle assistant messages, one per turn.

  A conversation is matched to the task whose prompt messages start it and whose
  oracle messages equal what followed so far. Tasks may share a prompt (the tool
  world asks the same question at different dates and places): their oracles
  then agree until a tool reply tells them apart.

  Args:
    tasks: the tasks whose oracles to replay.

  Returns:
    The batched policy. It raises ValueError for a conversation of no known task, one
    that left every matching oracle (the replay disagrees with the tools), or one
    whose matching oracles want different next steps.
  """
  by_prompt: dict[str, list[Task]] = collections.defaultdict(list)
  for task in tasks:
    by_prompt[_prompt_key(task.messages)].append(task)
  lengths = sorted({len(t.messages) for t in tasks}, reverse=True)

  def next_step(conversation: Sequence[Message]) -> str:
    for n in lengths:
      candidates = by_prompt.get(_prompt_key(conversation[:n]))
      if candidates:
        break
    else:
      raise ValueError("replay_oracle_policy: the conversation's prompt matches no task")
    done = [(m.get("role"), m.get("content")) for m in conversation[n:]]
    steps = set()
    for task in candidates:
      oracle = [(m.get("role"), m.get("content")) for m in task.oracle]
      if oracle[:len(done)] != done:
        continue
      nxt = next((c for r, c in oracle[len(done):] if r == "assistant"), None)
      if nxt is not None:
        steps.add(nxt)
    if len(steps) != 1:
      raise ValueError(f"replay_oracle_policy: {len(steps)} oracle steps fit a conversation "
                       f"after {len(done)} messages (expected exactly 1)")
    return steps.pop()

  def policy(conversations: Sequence[Sequence[Message]]) -> list[str]:
    return [next_step(c) for c in conversations]

  return policy


def evaluate_policy_folder(model: str, *, task: str | None = None, num_tasks: int | None = None,
                           seed: int | None = None, max_new_tokens: int | None = None,
                           max_context_tokens: int = 4096, rows: int | None = None,
                           max_turns: int | None = None, num_samples: int = 0,
                           split: str = "eval", task_ids: Sequence[int] | None = None
                           ) -> EvalReport:
  """Evaluation of a run directory's latest checkpoint or of an HF folder on held-out tasks
  (or on a run's own training tasks), with the embedded JaxSampler.

  Run directories default to their own task family, held-out size, seed, step length,
  context and cache rows, so the numbers match the trainer's own evaluation of that
  checkpoint. Turns default to the family's own limit, as the trainer evaluates (not
  rollout.max_turns, which caps training rollouts).

  Args:
    model: a run directory (with checkpoints/) or an HF folder (with config.json).
    task: the task family (None: the run's, else "toolworld"); the run's family options
      apply only to its own family.
    num_tasks: held-out tasks (None: the run's num_eval_tasks, else 32).
    seed: the held-out tasks' seed (None: the run's eval seed, else 0).
    max_new_tokens: tokens per step (None: the run's, else 160).
    max_context_tokens: the sampler's context; a run directory uses its own.
    rows: the sampler's cache rows (None: the run's, else 16).
    max_turns: steps per episode (None: the family's own limit).
    num_samples: 0 decodes greedily, one episode per task. K > 0 (a run directory, on its
      own tasks and settings) samples K episodes per task as the run's rollouts are (its
      temperature, top-p, top-k and seed), and the report has pass@1..K.
    split: "eval", the held-out tasks; "train" (a run directory), the run's own training
      tasks (task.num_train_tasks drawn with task.seed), e.g. to measure what RL did on
      the prompts it trained on.
    task_ids: with split "train", the indices of the training tasks to score (None: the
      run's rollout.task_ids, else all of them).

  Returns:
    The report (`evaluate`).

  Raises:
    ValueError: num_samples < 0; num_samples > 0 with an HF folder, or with any of task,
      num_tasks, seed, max_new_tokens, max_turns given; an unknown split; split "train"
      with an HF folder, with task, num_tasks or seed given, or with a task id outside the
      run's train split; task_ids with split "eval".
    FileNotFoundError: `model` is neither a run directory nor an HF folder.
  """
  import pathlib

  from transformers import AutoTokenizer

  from tree_rl.checkpoint import restore_policy
  from tree_rl.envs import make_family
  from tree_rl.models import hf_io
  from tree_rl.rollout.chat import ChatFormat
  from tree_rl.rollout.engine import SamplingParams
  from tree_rl.rollout.engines import EngineSpec, make_engine
  from tree_rl.rollout.policy import engine_policy

  if num_samples < 0:
    raise ValueError(f"num_samples={num_samples} must be >= 0")
  if split not in ("eval", "train"):
    raise ValueError(f"split={split!r} must be 'eval' (held-out tasks) or 'train' (the run's "
                     f"own training tasks)")
  if task_ids is not None and split != "train":
    raise ValueError("task_ids selects training tasks: it needs split='train'")
  path = pathlib.Path(model)
  family_kwargs, engine_seed, params = {}, 0, None
  if (path / "checkpoints").is_dir():
    policy, tokenizer, cfg = restore_policy(model)
    if num_samples:
      given = {name: value for name, value in [
          ("task", task), ("num_tasks", num_tasks), ("seed", seed),
          ("max_new_tokens", max_new_tokens), ("max_turns", max_turns)]
          if value is not None}
      if given:
        raise ValueError(f"num_samples={num_samples} evaluates the run on its own tasks and "
                         f"settings; drop {sorted(given)}")
      params = SamplingParams.from_rollout(cfg.rollout)
      engine_seed = cfg.seed
    if split == "train":
      given = [n for n, v in (("task", task), ("num_tasks", num_tasks), ("seed", seed))
               if v is not None]
      if given:
        raise ValueError(f"split='train' scores the run's own training tasks; drop {given}")
      ids = list(cfg.rollout.task_ids if task_ids is None else task_ids)
      bad = [i for i in ids if not 0 <= i < cfg.task.num_train_tasks]
      if bad:
        raise ValueError(f"task_ids {bad} are outside the run's train split (indices 0.."
                         f"{cfg.task.num_train_tasks - 1})")
    task = task or cfg.task.family
    family_kwargs = dict(cfg.task.kwargs) if task == cfg.task.family else {}
    num_tasks = num_tasks or cfg.task.num_eval_tasks
    seed = cfg.task.eval_task_seed if seed is None else seed
    max_new_tokens = max_new_tokens or cfg.rollout.max_new_tokens
    max_context_tokens = cfg.rollout.max_context_tokens
    rows = rows or cfg.rollout.cache_rows
  elif num_samples or split == "train":
    raise ValueError(f"{'split=train' if split == 'train' else f'num_samples={num_samples}'} "
                     f"needs a run's settings: --model={model} must be a run directory "
                     f"(checkpoints/)")
  elif (path / "config.json").is_file():
    policy = hf_io.load_hf(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
  else:
    raise FileNotFoundError(f"--model={model} is neither a run directory (checkpoints/) nor an "
                            f"HF folder (config.json)")
  family = make_family(task or "toolworld", **family_kwargs)
  if split == "train":
    tasks = family.generate("train", cfg.task.num_train_tasks, cfg.task.seed)
    tasks = [tasks[i] for i in ids] if ids else tasks
  else:
    tasks = family.generate("eval", num_tasks or 32, 0 if seed is None else seed)
  chat = ChatFormat.from_tokenizer(tokenizer)
  engine = make_engine(EngineSpec(rows=rows or 16, slots=max_context_tokens, seed=engine_seed),
                       policy, tokenizer, chat.eos_ids)
  params = params or SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens or 160)
  k = max(num_samples, 1)
  return evaluate(family, tasks, engine_policy(engine, chat, params), num_samples=k,
                  pass_k=tuple(range(1, k + 1)), max_turns=max_turns, encode=chat.encode)
