"""Tool replies are capped in tokens, the same way in the rollout and in evaluation, and no
env node ever carries a path past the context window.

A tiny in-test family has one `dump` tool that returns `size` characters of text (1 MB in
the main case) and a terminal `answer` tool; a scripted engine (SmolLM2's real tokenizer
and chat template) calls `dump` and then answers. The agent loop's env node and the
evaluation harness's tool message must both hold the same capped reply, ending with the
truncation marker; a window that cannot hold the capped reply ends the episode truncated
on its policy node, every path within `max_context_tokens` and every tree passing check().
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

import pytest
from transformers import AutoTokenizer

from tests.isolation import ISOLATION
from tree_rl.envs import LatencyFamily, make_family
from tree_rl.envs.base import (DEFAULT_MAX_TOOL_OUTPUT_TOKENS, Outcome, Task, Tool,
                               ToolOutputCap, family_max_tool_output_tokens, render_tool_prompt,
                               truncation_marker)
from tree_rl.envs.episode import run_episodes
from tree_rl.models import gguf_import
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import SamplingParams, ScriptedEngine
from tree_rl.rollout.strategies import FlatStrategy
from tree_rl.tree.types import NodeKind

HEADER = "<|im_start|>assistant\n"
MEGABYTE = 1 << 20
_MARKER = re.compile(r"\n\.\.\. \[truncated: (\d+) more characters\]$")


def _text(size: int) -> str:
  """`size` characters of varied text (numbered lines, so every cut point differs)."""
  lines, n, i = [], 0, 0
  while n < size:
    line = f"record {i}: the value of item {i} is {i * 7919 % 10007}\n"
    lines.append(line)
    n, i = n + len(line), i + 1
  return "".join(lines)[:size]


class DumpFamily:
  """Ask for `size` characters from `dump`, then `answer` with 1."""

  name = "dump"
  max_turns = 3

  def __init__(self, sizes, max_tool_output_tokens=None):
    self.sizes = list(sizes)
    if max_tool_output_tokens is not None:
      self.max_tool_output_tokens = max_tool_output_tokens

  def tools(self, task):
    del task
    size = {"type": "integer"}
    return [Tool("dump", "Returns `size` characters of records.",
                 {"type": "object", "properties": {"size": size}, "required": ["size"]},
                 _text),
            Tool("answer", "Gives the final answer.",
                 {"type": "object", "properties": {"value": size}, "required": ["value"]},
                 lambda value: "ok", terminal=True)]

  def generate(self, split, num_tasks, seed):
    del seed
    system = render_tool_prompt(self.tools(None), "You read records.",
                                "Give the final answer by calling answer.")
    return [Task(task_id=f"dump/{split}/{i}", family="dump", split=split,
                 messages=({"role": "system", "content": system},
                           {"role": "user", "content": f"Dump {self.sizes[i]} characters."}),
                 tool_names=("dump", "answer"), answer=1)
            for i in range(num_tasks)]

  def score(self, task, episode, truncated):
    del task
    ok = not truncated and any(m.get("name") == "answer" for m in episode)
    return Outcome(1.0 if ok else -1.0, correct=ok, answered=ok)


def _call(name, **arguments):
  return (f"<think>I call {name}.</think>\n<tool_call>\n"
          + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>")


def _steps(size):
  return [_call("dump", size=size), _call("answer", value=1)]


def _size_of(text):
  return int(re.findall(r"Dump (\d+) characters\.", text)[-1])


@pytest.fixture(scope="module")
def tokenizer():
  return AutoTokenizer.from_pretrained(str(gguf_import.default_model_dir()))


@pytest.fixture(scope="module")
def chat(tokenizer):
  return ChatFormat.from_tokenizer(tokenizer)


class WindowedEngine(ScriptedEngine):
  """A scripted engine that, like the JAX sampler and vLLM, never samples past its window:
  a step that would is cut there with finish reason "context"."""

  def __init__(self, script, tokenizer, window):
    super().__init__(script, tokenizer, eos_id=tokenizer.eos_token_id)
    self.window = window

  def generate(self, requests):
    out = []
    for req, res in zip(requests, super().generate(requests)):
      room = max(0, self.window - len(req.tokens))
      if len(res.tokens) > room:
        res = dataclasses.replace(res, tokens=res.tokens[:room], logprobs=res.logprobs[:room],
                                  entropies=res.entropies[:room], finish_reason="context")
      out.append(res)
    return out


def _rollout(chat, tokenizer, family, tasks, n=1, **config):
  def script(context):
    text = chat.decode(context)
    turn = text.count(HEADER) - 1
    return _steps(_size_of(text))[min(turn, 1)]

  cfg = dict(max_context_tokens=8192, sampling=SamplingParams(max_new_tokens=256))
  cfg.update(config)
  engine = WindowedEngine(script, tokenizer, cfg["max_context_tokens"])
  loop = AgentLoop(engine, chat, family, AgentConfig(**cfg), FlatStrategy(n=n))
  trees = loop.rollout(tasks)
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))
  return trees, loop.last_stats


def _assert_capped(chat, content, size, max_tokens):
  """`content` is a prefix of the reply, ends with a marker counting exactly what was cut,
  and encodes to at most `max_tokens` tokens."""
  full = _text(size)
  match = _MARKER.search(content)
  assert match, content[-200:]
  kept = content[:match.start()]
  assert full.startswith(kept) and len(kept) > 0
  assert len(kept) + int(match.group(1)) == size
  assert len(chat.encode(content)) <= max_tokens


def test_a_megabyte_reply_is_capped_alike_in_the_agent_loop_and_in_evaluation(chat, tokenizer):
  family = DumpFamily([MEGABYTE])
  tasks = family.generate("eval", 1, 0)
  (tree,), stats = _rollout(chat, tokenizer, family, tasks)
  assert stats.num_truncated == 0 and tree.leaves[0].rewards["outcome"] == 1.0
  env_texts = [chat.decode(n.tokens) for n in tree.nodes if n.kind == NodeKind.ENV]
  assert len(env_texts) == 1  # the dump's reply (the answer ends the episode)
  # The env node: the capped reply plus a few tokens of chat glue, far below 1 MB.
  env_tokens = [len(n.tokens) for n in tree.nodes if n.kind == NodeKind.ENV][0]
  assert env_tokens <= DEFAULT_MAX_TOOL_OUTPUT_TOKENS + 16
  assert "[truncated: " in env_texts[0]

  # Evaluation with the same tokenizer: the tool message is the env node's reply, verbatim.
  def policy(conversations):
    return [_steps(_size_of(c[1]["content"]))[sum(m["role"] == "assistant" for m in c)]
            for c in conversations]

  (record,) = run_episodes(family, tasks, policy, encode=chat.encode)
  assert record.finished and record.outcome.correct
  reply = record.messages[3]
  assert reply["role"] == "tool" and reply["name"] == "dump"
  _assert_capped(chat, reply["content"], MEGABYTE, DEFAULT_MAX_TOOL_OUTPUT_TOKENS)
  assert reply["content"] in env_texts[0]
  assert record.steps[0].results[0].ok  # a capped reply is still a successful call


def test_the_cap_is_a_family_option_and_small_replies_pass_unchanged(chat):
  assert make_family("toolworld").max_tool_output_tokens == DEFAULT_MAX_TOOL_OUTPUT_TOKENS
  assert make_family("math", max_tool_output_tokens=64, sandbox=ISOLATION).max_tool_output_tokens == 64
  slow = make_family("toolworld", tool_latency_s=0.01, max_tool_output_tokens=100)
  assert isinstance(slow, LatencyFamily) and family_max_tool_output_tokens(slow) == 100
  for bad in (0, 31, "512", True, 64.0, None):
    with pytest.raises(ValueError, match="max_tool_output_tokens"):
      make_family("toolworld", max_tool_output_tokens=bad)
  with pytest.raises(ValueError, match="DumpFamily.max_tool_output_tokens"):
    family_max_tool_output_tokens(DumpFamily([1], max_tool_output_tokens=-3))
  # A family-specific cap reaches the evaluation harness (the marker counts what was cut).
  family = DumpFamily([5000], max_tool_output_tokens=64)
  tasks = family.generate("eval", 1, 0)
  policy = lambda cs: [_steps(5000)[sum(m["role"] == "assistant" for m in c)] for c in cs]
  (record,) = run_episodes(family, tasks, policy, encode=chat.encode)
  _assert_capped(chat, record.messages[3]["content"], 5000, 64)
  # Without a tokenizer: 4 characters a token.
  (record,) = run_episodes(family, tasks, policy)
  content = record.messages[3]["content"]
  assert len(content) <= 64 * 4 and _MARKER.search(content)
  # Short replies are untouched, with or without a tokenizer.
  for cap in (ToolOutputCap(64, chat.encode), ToolOutputCap(64)):
    assert cap("ok") == "ok" and cap("") == ""


@pytest.mark.parametrize("text", ["x" * MEGABYTE, " " * MEGABYTE, "é" * MEGABYTE,
                                  "<tool_call>" * 100_000, _text(10_000)])
def test_cap_keeps_a_prefix_and_counts_the_cut(chat, text):
  out = ToolOutputCap(128, chat.encode)(text)
  match = _MARKER.search(out)
  assert match and text.startswith(out[:match.start()])
  assert match.start() + int(match.group(1)) == len(text)
  assert len(chat.encode(out)) <= 128
  assert out.endswith(truncation_marker(len(text) - match.start()))


def test_an_oversized_reply_near_the_window_ends_the_episode_on_its_policy_node(chat, tokenizer):
  family = DumpFamily([MEGABYTE, 60, MEGABYTE, 5000])
  tasks = family.generate("train", 4, 0)
  prompt = max(len(chat.prompt_tokens(t.messages)) for t in tasks)
  step = len(chat.encode(_steps(MEGABYTE)[0])) + 1
  # Room for the prompt, two steps and a short reply; not for a capped (512-token) one.
  window = prompt + 2 * step + 120
  trees, stats = _rollout(chat, tokenizer, family, tasks, n=3, max_context_tokens=window)
  assert len(trees) == 4 and stats.num_episodes == 12
  for tree, task in zip(trees, tasks):
    size = _size_of(task.messages[1]["content"])
    for leaf in tree.leaves:
      assert len(tree.context(leaf.node)) <= window
      if size == 60:  # a small reply fits: the episode answers
        assert not leaf.truncated and leaf.rewards["outcome"] == 1.0
      else:  # the capped reply does not: truncated on the dump step, no env node
        assert leaf.truncated and leaf.rewards["outcome"] == -1.0
        assert tree.nodes[leaf.node].kind == NodeKind.POLICY
        assert all(n.kind != NodeKind.ENV for n in tree.nodes)


def test_every_path_stays_within_the_window_over_many_reply_sizes(chat, tokenizer):
  sizes = [10, 900, 2500, 6000, 20_000, MEGABYTE, 3000, 700]
  family = DumpFamily(sizes, max_tool_output_tokens=200)
  tasks = family.generate("train", len(sizes), 0)
  prompt = max(len(chat.prompt_tokens(t.messages)) for t in tasks)
  step = len(chat.encode(_steps(MEGABYTE)[0])) + 1
  seen = collections.Counter()
  for extra in (-5, 0, 40, 120, 200, 260, 400):  # a window the first step overruns, too
    window = prompt + step + extra
    trees, _ = _rollout(chat, tokenizer, family, tasks, n=2, max_context_tokens=window)
    for tree in trees:
      for leaf in tree.leaves:
        assert len(tree.context(leaf.node)) <= window
        seen["answered" if leaf.rewards["outcome"] == 1.0 else "truncated"] += 1
        seen["truncated_on_policy"] += (leaf.truncated
                                        and tree.nodes[leaf.node].kind == NodeKind.POLICY)
        for node in tree.path(leaf.node):
          if tree.nodes[node].kind == NodeKind.ENV:  # a reply plus a few tokens of glue
            assert len(tree.nodes[node].tokens) <= 200 + 16
  # Both endings happen: small replies fit and answer, capped ones end on the policy node.
  assert seen["answered"] > 0 and seen["truncated"] > 0 and seen["truncated_on_policy"] > 0
