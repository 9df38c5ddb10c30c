"""The agent loop in token space, with SmolLM2's real tokenizer and chat template.

A scripted engine that writes each task's oracle steps shows the loop parses,
runs tools, glues turns and scores exactly like the text-level harness; a tiny
random policy under the JAX sampler shows that what it records is exactly what
was sampled: trees pass `check()`, the recorded log-probs equal the policy's
log-probs recomputed on the packed tree, and flagged truncations keep every leaf.
"""

import dataclasses

import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from tree_rl.envs import make_family
from tree_rl.models import Decoder, ModelConfig, gguf_import
from tree_rl.models.logprobs import tree_logprobs
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import GenerationRequest, SamplingParams, ScriptedEngine
from tree_rl.rollout.jax_sampler import JaxSampler
from tree_rl.rollout.policy import oracle_engine
from tree_rl.tree.batch import Buckets, pack
from tree_rl.tree.types import NodeKind


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  folder = gguf_import.default_model_dir()
  return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def chat(tokenizer):
  return ChatFormat.from_tokenizer(tokenizer)


def test_chat_format_glue_matches_the_template(chat, tokenizer):
  assert chat.end_of_turn == "<|im_end|>"
  assert tokenizer.eos_token_id in chat.eos_ids
  msgs = [{"role": "user", "content": "hi"}]
  tool = [{"role": "tool", "name": "x", "content": "42"}]
  step = "<think>t</think>\n<tool_call>\n{}\n</tool_call>"
  full = tokenizer.apply_chat_template(
      msgs + [{"role": "assistant", "content": step}] + tool, tokenize=False,
      add_generation_prompt=True)
  # Glue after a step that did not sample <|im_end|> vs one that did.
  for sampled in (step, step + "<|im_end|>"):
    text = chat.decode(chat.prompt_tokens(msgs)) + sampled + chat.decode(
        chat.glue_tokens(msgs, sampled, tool))
    assert text == full


def test_the_oracle_answers_by_task_id_when_a_question_contains_another(chat):
  # Found by searching the decoded context for its question, task 0 (whose question is
  # now part of task 1's) would also be found in task 1's context and answer it wrongly.
  family = make_family("toolworld")
  a, b = family.generate("eval", 2, seed=1)
  question = lambda t: t.messages[-1]["content"]
  b = dataclasses.replace(b, messages=(*b.messages[:-1], {
      "role": "user", "content": question(a) + " Then: " + question(b)}))
  loop = AgentLoop(oracle_engine([a, b], chat), chat, family, AgentConfig(
      samples_per_task=1, max_context_tokens=8192, sampling=SamplingParams(max_new_tokens=512)))
  trees = loop.rollout([a, b])
  assert [leaf.rewards["outcome"] for tree in trees for leaf in tree.leaves] == [1.0, 1.0]
  with pytest.raises(ValueError, match="task_id=None, which is not one of its 2 tasks"):
    oracle_engine([a, b], chat).generate([GenerationRequest(tuple(chat.prompt_tokens(
        a.messages)))])


@pytest.mark.parametrize("name", ["toolworld", "search_qa"])
def test_oracle_script_solves_tasks_in_token_space(chat, tokenizer, name):
  family = make_family(name)
  tasks = family.generate("eval", 6, seed=1)
  engine = oracle_engine(tasks, chat)
  loop = AgentLoop(engine, chat, family, AgentConfig(samples_per_task=2, max_context_tokens=8192,
                                                     sampling=SamplingParams(max_new_tokens=512)))
  trees = loop.rollout(tasks)
  assert len(trees) == len(tasks)
  for task, tree in zip(tasks, trees):
    tree.check(vocab_size=len(tokenizer))
    assert len(tree.leaves) == 2
    assert all(leaf.rewards["outcome"] == 1.0 and not leaf.truncated for leaf in tree.leaves)
    n_steps = sum(m["role"] == "assistant" for m in task.oracle)
    for path in tree.leaf_paths():
      policy = [i for i in path if tree.nodes[i].kind == NodeKind.POLICY]
      assert len(policy) == n_steps
      assert all(tree.nodes[i].rewards["format"] >= 0.2 for i in policy)
  # Every turn's request is the previous request + sampled step + glue: the
  # context only ever grows (nothing the model wrote is re-tokenized).
  reqs = engine.requests
  by_prefix = {r.tokens for r in reqs}
  for r in reqs:
    if len(r.tokens) > len(trees[0].nodes[0].tokens) + 50:
      assert any(r.tokens[:len(p)] == p for p in by_prefix if len(p) < len(r.tokens))


def test_random_policy_trees_record_exactly_what_was_sampled(chat, tokenizer):
  cfg = ModelConfig.tiny(vocab_size=len(tokenizer), num_hidden_layers=1)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  family = make_family("search_qa")
  tasks = family.generate("train", 2, seed=0)
  engine = JaxSampler(model, rows=8, slots=1024, tokenizer=tokenizer, eos_ids=chat.eos_ids)
  loop = AgentLoop(engine, chat, family, AgentConfig(
      samples_per_task=3, max_turns=2, max_context_tokens=1024,
      sampling=SamplingParams(max_new_tokens=12)))
  trees = loop.rollout(tasks)
  stats = loop.last_stats
  assert stats.num_episodes == 6 and stats.num_dropped == 0
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))
    assert len(tree.leaves) == 3
    # Random text is never a right answer.
    assert all(leaf.rewards["outcome"] == 0.0 for leaf in tree.leaves)
  batch = pack(trees, Buckets.exact())
  lp, _ = tree_logprobs(model, batch)
  policy = np.asarray(batch.loss_mask)
  assert policy.sum() == stats.num_policy_tokens
  np.testing.assert_allclose(np.asarray(lp)[policy], np.asarray(batch.behavior_logp)[policy],
                             atol=1e-4)


def test_bad_tool_calls_become_errors_and_truncated_leaves(chat, tokenizer):
  family = make_family("toolworld")
  tasks = family.generate("eval", 2, seed=0)
  bad = '<think>try</think>\n<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'
  engine = ScriptedEngine(lambda ctx: bad, tokenizer, eos_id=tokenizer.eos_token_id)
  loop = AgentLoop(engine, chat, family, AgentConfig(samples_per_task=2, max_turns=3,
                                                     max_context_tokens=8192))
  trees = loop.rollout(tasks)
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))
    assert all(leaf.truncated and leaf.rewards["outcome"] == -1.0 for leaf in tree.leaves)
    for path in tree.leaf_paths():
      kinds = [tree.nodes[i].kind for i in path]
      assert kinds == [NodeKind.PROMPT] + [NodeKind.POLICY, NodeKind.ENV] * 2 + [NodeKind.POLICY]
      env_text = chat.decode(tree.nodes[path[2]].tokens)
      assert "Error [unknown_tool]" in env_text and "no_such_tool" in env_text
      # think + tag + JSON + fields, but the call failed: 0.45 (PORTool's rubric).
      assert tree.nodes[path[1]].rewards["format"] == pytest.approx(0.45)


@pytest.mark.parametrize("name", ["bfcl", "toolworld"])
def test_leaf_rewards_scorer_adds_its_channel_to_every_leaf(chat, tokenizer, name):
  from tree_rl.rewards.reasoning import make_reasoning_scorer

  family = make_family(name)
  tasks = family.generate("train", 3, seed=0)
  # The oracle's own steps, sampled token by token, match the oracle: rubric score 1.
  loop = AgentLoop(oracle_engine(tasks, chat), chat, family,
                   AgentConfig(samples_per_task=2, max_context_tokens=8192,
                               sampling=SamplingParams(max_new_tokens=512)),
                   leaf_rewards=make_reasoning_scorer("rubric", family, tasks))
  for tree in loop.rollout(tasks):
    tree.check(vocab_size=len(tokenizer), reward_channels=("outcome", "reasoning"))
    assert [leaf.rewards["reasoning"] for leaf in tree.leaves] == [1.0, 1.0]
  # Without a scorer the leaf holds the outcome only.
  plain = AgentLoop(oracle_engine(tasks, chat), chat, family,
                    AgentConfig(samples_per_task=1, max_context_tokens=8192,
                                sampling=SamplingParams(max_new_tokens=512)))
  assert all(set(leaf.rewards) == {"outcome"} for t in plain.rollout(tasks) for leaf in t.leaves)
