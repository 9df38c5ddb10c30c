"""Text-level policies over an engine, for the evaluation harness, and the oracle engine.

`engine_policy` turns a RolloutEngine into the batched `policy(conversations) ->
step texts` that `tree_rl.evaluate.evaluate` drives (the conversation is rendered
with the chat template each turn; the engine's prefix reuse keeps that cheap).
`oracle_engine` is a TextEngine that writes each task's oracle steps: the
SFT warm start grows its training trees with it, so SFT trees are tokenized and
masked exactly like RL trees.
"""

from __future__ import annotations

from collections.abc import Sequence

from tree_rl.envs.base import Message, Task
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams, TextEngine


def engine_policy(engine: RolloutEngine, chat: ChatFormat, params: SamplingParams):
  """The evaluation harness's policy: conversations -> one sampled step text each."""

  def policy(conversations: Sequence[Sequence[Message]]) -> list[str]:
    reqs = [GenerationRequest(tuple(chat.prompt_tokens(c)), params) for c in conversations]
    return [chat.content(chat.decode(res.tokens)) for res in engine.generate(reqs)]

  return policy


def oracle_engine(tasks: Sequence[Task], chat: ChatFormat) -> TextEngine:
  """An engine whose step for a request is the oracle's next step for the request's task.

  The task is the request's `task_id` (the agent loop sets it), the turn the number of
  assistant headers after the task's prompt in the context.
  """
  return _OracleEngine(tasks, chat)


class _OracleEngine(TextEngine):
  """`oracle_engine`'s engine: answers each request by its task id."""

  def __init__(self, tasks: Sequence[Task], chat: ChatFormat):
    super().__init__(chat.tokenizer, eos_id=chat.tokenizer.eos_token_id)
    self.chat = chat
    self.by_id = {str(t.task_id): t for t in tasks}
    self.prompt_turns = {str(t.task_id): chat.decode(chat.prompt_tokens(t.messages)).count(
        chat.assistant_header) for t in tasks}

  def text(self, req: GenerationRequest) -> str:
    task = self.by_id.get(req.task_id) if req.task_id is not None else None
    if task is None:
      raise ValueError(f"oracle_engine: request for task_id={req.task_id!r}, which is not one "
                       f"of its {len(self.by_id)} tasks (the agent loop sets task_id)")
    turn = self.chat.decode(req.tokens).count(self.chat.assistant_header) - self.prompt_turns[
        req.task_id]
    steps = [m["content"] for m in task.oracle if m["role"] == "assistant"]
    if turn >= len(steps):
      raise ValueError(f"oracle_engine: turn {turn} is past the {len(steps)} oracle steps of "
                       f"{task.task_id}")
    return steps[turn]
