"""Text-level policies over an engine, for the evaluation harness, and the oracle engine.

`engine_policy` turns a RolloutEngine into the batched `policy(conversations) ->
step texts` that `tree_rl.evaluate.evaluate` drives (the conversation is rendered
with the chat template each turn; the engine's prefix reuse keeps that cheap).
`oracle_engine` is a ScriptedEngine that writes each task's oracle steps: the
SFT warm start grows its training trees with it, so SFT trees are tokenized and
masked exactly like RL trees.
"""

from __future__ import annotations

from collections.abc import Sequence

from tree_rl.envs.base import Message, Task
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams, ScriptedEngine


def engine_policy(engine: RolloutEngine, chat: ChatFormat, params: SamplingParams):
  """The evaluation harness's policy: conversations -> one sampled step text each."""

  def policy(conversations: Sequence[Sequence[Message]]) -> list[str]:
    reqs = [GenerationRequest(tuple(chat.prompt_tokens(c)), params) for c in conversations]
    return [chat.content(chat.decode(res.tokens)) for res in engine.generate(reqs)]

  return policy


def oracle_engine(tasks: Sequence[Task], chat: ChatFormat) -> ScriptedEngine:
  """An engine whose step for a context is the oracle's next step for the task in it.

  The task is found by its user question in the decoded context, the turn by the
  number of assistant headers after the prompt.
  """
  by_question = {t.messages[-1]["content"]: t for t in tasks}
  header = chat.assistant_header
  prompt_turns = {t.task_id: chat.decode(chat.prompt_tokens(t.messages)).count(header)
                  for t in tasks}

  def script(context: tuple[int, ...]) -> str:
    text = chat.decode(context)
    task = next((t for q, t in by_question.items() if q in text), None)
    if task is None:
      raise ValueError("oracle_engine: the context holds no known task's question")
    turn = text.count(header) - prompt_turns[task.task_id]
    steps = [m["content"] for m in task.oracle if m["role"] == "assistant"]
    if turn >= len(steps):
      raise ValueError(f"oracle_engine: turn {turn} is past the {len(steps)} oracle steps of "
                       f"{task.task_id}")
    return steps[turn]

  eos = chat.tokenizer.eos_token_id
  return ScriptedEngine(script, chat.tokenizer, eos_id=eos)
