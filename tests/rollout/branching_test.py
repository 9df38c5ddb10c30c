"""Branching strategies and fork mechanics, in token space with SmolLM2's real tokenizer.

Scripted engines drive a tiny in-test "add two numbers" family (an `add` tool
and a terminal `answer` tool) and PORTool's tool world: every strategy's trees
pass `check()`, keep their budget arithmetic (PORTool exactly n leaves, APPO
M = (B + 1) N, TRACE root counts in {0} U {2, ...} summing to M, random = its
reference, ARPO <= M), tag INIT/BRANCH leaves, and a token-position branch
sends exactly its parent's context up to the cut. With the tiny JAX model, forks
prefill a shared context once, and log-probs recorded on split nodes equal the
policy's recomputed ones. Bad inputs end flagged and lose no tree.
"""

import json
import re

import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from tree_rl.algos.appo import APPOConfig
from tree_rl.envs import make_family
from tree_rl.envs.base import Outcome, Task, Tool, render_tool_prompt
from tree_rl.envs.parsing import parse_step
from tree_rl.models import Decoder, ModelConfig, gguf_import
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import GenerationResult, SamplingParams, ScriptedEngine
from tree_rl.rollout.jax_sampler import JaxSampler
from tree_rl.rollout.strategies import (APPOStrategy, ARPOStrategy, PORToolStrategy,
                                        RandomStrategy, RunningMeanPredictor, TRACEStrategy,
                                        behaviour_scorer, make_strategy, model_scorer)
from tree_rl.tree.batch import Buckets, pack
from tree_rl.tree.rollout_tree import RolloutTree
from tree_rl.tree.types import LeafTag, NodeKind

HEADER = "<|im_start|>assistant\n"


# ----------------------------------------------------------------------------
# A tiny task family: add two numbers with `add`, then call `answer`.
# ----------------------------------------------------------------------------


class AddFamily:
  name = "add"
  max_turns = 4

  def generate(self, split, num_tasks, seed):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(num_tasks):
      a, b = (int(x) for x in rng.randint(1, 50, 2))
      system = render_tool_prompt(self.tools(None), "You add numbers.",
                                  "Give the final answer by calling answer.")
      out.append(Task(task_id=f"add/{split}/{i}", family="add", split=split,
                      messages=({"role": "system", "content": system},
                                {"role": "user", "content": f"What is {a} + {b}?"}),
                      tool_names=("add", "answer"), answer=a + b))
    return out

  def tools(self, task):
    num = {"type": "integer"}
    return [Tool("add", "Adds a and b.", {"type": "object", "properties": {"a": num, "b": num},
                                         "required": ["a", "b"]}, lambda a, b: a + b),
            Tool("answer", "Gives the final answer.", {"type": "object",
                 "properties": {"value": num}, "required": ["value"]}, lambda value: "ok",
                 terminal=True)]

  def score(self, task, episode, truncated):
    steps = [m for m in episode if m.get("role") == "assistant"]
    calls = parse_step(steps[-1]["content"]).calls if steps and not truncated else ()
    got = [c.arguments.get("value") for c in calls if c.name == "answer" and c.error is None]
    ok = bool(got) and got[-1] == task.answer
    return Outcome(1.0 if ok else -1.0, correct=ok, answered=bool(got))


def call(name, **arguments):
  return (f"<think>I call {name}.</think>\n<tool_call>\n"
          + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>")


def add_steps(text):
  """The oracle's steps for the add task in `text`: add, then answer."""
  a, b = (int(x) for x in re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1])
  return [call("add", a=a, b=b), call("answer", value=a + b)]


def scripted(chat, steps_of, choose=None):
  """Context -> the rest of the current step: the oracle's (steps_of(text)[turn]), or
  `choose(turn, text)`'s. A context that ends inside a step (a token-position branch)
  gets the remainder of the oracle step whose start it holds."""

  def script(context):
    text = chat.decode(context)
    turn = text.count(HEADER) - 1
    partial = text[text.rindex(HEADER) + len(HEADER):]
    steps = steps_of(text)
    step = choose(turn, text) if choose else steps[min(turn, len(steps) - 1)]
    if partial:
      step = steps[min(turn, len(steps) - 1)]
      assert step.startswith(partial), (step, partial)
      return step[len(partial):]
    return step

  return script


@pytest.fixture(scope="module")
def tokenizer():
  return AutoTokenizer.from_pretrained(str(gguf_import.default_model_dir()))


@pytest.fixture(scope="module")
def chat(tokenizer):
  return ChatFormat.from_tokenizer(tokenizer)


def run(chat, tokenizer, strategy, script, tasks, family=None, **config):
  engine = ScriptedEngine(script, tokenizer, eos_id=tokenizer.eos_token_id)
  cfg = dict(max_context_tokens=4096, sampling=SamplingParams(max_new_tokens=256))
  cfg.update(config)
  loop = AgentLoop(engine, chat, family or AddFamily(), AgentConfig(**cfg), strategy)
  trees = loop.rollout(tasks)
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))
  return trees, loop.last_stats, engine


def tags(tree):
  return [leaf.tag for leaf in tree.leaves]


# ----------------------------------------------------------------------------
# PORTool
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("n, f, t_max", [(4, 2, 3), (5, 3, 4), (3, 1, 2), (6, 2, 5)])
def test_portool_has_exactly_n_leaves(chat, tokenizer, n, f, t_max):
  rng = np.random.RandomState(n * 100 + f * 10 + t_max)

  def choose(turn, text):  # add or answer at random: trajectories finish at varied depths
    steps = add_steps(text)
    return steps[1] if rng.rand() < 0.35 else steps[0]

  tasks = AddFamily().generate("train", 3, seed=t_max)
  strategy = PORToolStrategy(n=n, fork_factor=f, t_max=t_max, seed=n)
  trees, stats, _ = run(chat, tokenizer, strategy, scripted(chat, add_steps, choose), tasks)
  assert len(trees) == 3
  for tree in trees:
    assert len(tree.leaves) == n
    kids = tree.children()
    assert len(kids[0]) <= n and all(len(k) <= f for k in kids[1:])
    for leaf, path in zip(tree.leaves, tree.leaf_paths()):
      steps = sum(tree.nodes[i].kind == NodeKind.POLICY for i in path)
      assert steps <= t_max
      assert leaf.truncated == (leaf.rewards["outcome"] == -1.0)  # the script never errs
      assert not leaf.truncated or steps == t_max
    if f == 1:  # nothing is ever duplicated: n chains under the root (GRPO sampling)
      assert len(kids[0]) == n and set(tags(tree)) == {LeafTag.INIT}
  assert stats.num_episodes == 3 * n and stats.num_dropped == 0


def test_portool_forks_share_the_tool_reply_and_discard_unkept(chat, tokenizer):
  tasks = AddFamily().generate("train", 2, seed=0)
  # Every trajectory adds twice before answering: nothing finishes before step 3.
  script = scripted(chat, lambda text: [add_steps(text)[0]] * 2 + [add_steps(text)[1]])
  trees, stats, _ = run(chat, tokenizer, PORToolStrategy(n=4, fork_factor=2, t_max=3, seed=1),
                        script, tasks)
  for tree in trees:
    assert len(tree.leaves) == 4 and all(l.rewards["outcome"] == 1.0 for l in tree.leaves)
    forks = [i for i, k in enumerate(tree.children()) if i > 0 and len(k) > 1]
    assert forks and all(tree.nodes[i].kind == NodeKind.ENV for i in forks)
    assert LeafTag.BRANCH in tags(tree)
  # DupAndSamp kept 4 of 8 copies twice (at steps 2 and 3); what was not kept is pruned.
  assert stats.num_discarded > 0 and stats.num_sampled_tokens > stats.num_policy_tokens


# ----------------------------------------------------------------------------
# APPO and token-position forks
# ----------------------------------------------------------------------------


def peaks_scorer(offsets):
  """Fake current policy: behaviour log-probs (so Omega = 1 and the entropy fallback ranks),
  entropy 1 everywhere except `offsets` of each rollout's first policy node."""

  def score(trees):
    out = behaviour_scorer(trees)
    for tree, arrays in zip(trees, out):
      for i, node in enumerate(tree.nodes):
        arrays.entropies[i] = np.ones(len(node.tokens))
        if node.kind == NodeKind.POLICY and tree.nodes[node.parent].kind == NodeKind.PROMPT:
          for rank, off in enumerate(offsets):
            if off < len(node.tokens):
              arrays.entropies[i][off] = 10.0 - rank
    return out

  return score


def test_appo_branches_at_top_b_positions_with_the_parent_context(chat, tokenizer):
  tasks = AddFamily().generate("train", 2, seed=3)
  strategy = APPOStrategy(APPOConfig(n_init=2, budget=8), current_logprobs=peaks_scorer([9, 4, 6]),
                          skip_punctuation=False)
  trees, stats, engine = run(chat, tokenizer, strategy, scripted(chat, add_steps), tasks)
  requests = {r.tokens for r in engine.requests}
  for tree in trees:
    assert len(tree.leaves) == 8  # M = (B + 1) N, B = 3
    assert tags(tree).count(LeafTag.INIT) == 2 and tags(tree).count(LeafTag.BRANCH) == 6
    prompt = len(tree.nodes[0].tokens)
    for leaf, path in zip(tree.leaves, tree.leaf_paths()):
      assert leaf.rewards["outcome"] == 1.0  # prefix + continuation parse as the oracle's step
      if leaf.tag == LeafTag.INIT:
        seq = tree.context(path[-1])
        for off in (9, 4, 6):  # the branch request is the parent's context up to the point
          assert tuple(seq[:prompt + off]) in requests
  # The continuation nodes hold only what was sampled; the shared prefix is one node.
  assert stats.num_branches == 12


def test_appo_per_minibatch_branching_uses_the_policy_of_the_moment(chat, tokenizer):
  # The trainer's order: initial rollouts of both prompts, then mini-batch 0 branched
  # and taken, then the "updated" policy (another scorer) branches mini-batch 1.
  tasks = AddFamily().generate("train", 2, seed=5)
  scorer = {"now": peaks_scorer([9, 4, 6])}
  strategy = APPOStrategy(APPOConfig(n_init=2, budget=8), skip_punctuation=False,
                          current_logprobs=lambda trees: scorer["now"](trees))
  engine = ScriptedEngine(scripted(chat, add_steps), tokenizer, eos_id=tokenizer.eos_token_id)
  loop = AgentLoop(engine, chat, AddFamily(), AgentConfig(
      max_context_tokens=4096, sampling=SamplingParams(max_new_tokens=256)), strategy)
  with loop.open_forest(tasks) as forest:
    strategy.initial(forest)
    assert [len(t.leaves) for t in forest.trees] == [2, 2]
    strategy.branch(forest, [0])
    first = forest.take([0])
    assert len(first) == 1 and len(first[0].leaves) == 8
    assert len(forest.trees[1].leaves) == 2  # mini-batch 1 is not branched yet
    n_requests = len(engine.requests)
    scorer["now"] = peaks_scorer([2, 3, 5])
    strategy.branch(forest, [1])
    trees = loop.close_forest(forest)
  assert [len(t.leaves) for t in trees] == [8, 8]
  assert loop.last_stats.num_branches == 12
  prompt = len(trees[1].nodes[0].tokens)
  later = {r.tokens for r in engine.requests[n_requests:]}
  for leaf, path in zip(trees[1].leaves, trees[1].leaf_paths()):
    if leaf.tag == LeafTag.INIT:  # branched at the second scorer's points
      seq = trees[1].context(path[-1])
      assert {tuple(seq[:prompt + off]) for off in (2, 3, 5)} <= later
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))


@pytest.mark.parametrize("n_init, budget", [(1, 3), (3, 6)])
def test_appo_budget_is_b_plus_one_times_n(chat, tokenizer, n_init, budget):
  tasks = AddFamily().generate("train", 2, seed=n_init)
  trees, _, _ = run(chat, tokenizer, APPOStrategy(APPOConfig(n_init=n_init, budget=budget)),
                    scripted(chat, add_steps), tasks)
  for tree in trees:
    assert len(tree.leaves) == budget and tags(tree).count(LeafTag.INIT) == n_init


def test_appo_with_loops_keeps_the_cap(chat, tokenizer):
  tasks = AddFamily().generate("train", 2, seed=7)
  strategy = APPOStrategy(APPOConfig(n_init=2, budget=8), loops=3)  # B = 3 per source
  trees, _, _ = run(chat, tokenizer, strategy, scripted(chat, add_steps), tasks)
  assert all(len(tree.leaves) == 8 for tree in trees)


# ----------------------------------------------------------------------------
# ARPO
# ----------------------------------------------------------------------------


class EntropyEngine(ScriptedEngine):
  """A scripted engine whose steps after a tool reply have entropy `after`, the first `first`."""

  def __init__(self, script, tokenizer, eos_id, first, after):
    super().__init__(script, tokenizer, eos_id)
    self.first, self.after = first, after

  def generate(self, requests):
    out = []
    for req, res in zip(requests, super().generate(requests)):
      h = self.after if "<|im_start|>tool" in self.tokenizer.decode(req.tokens) else self.first
      out.append(GenerationResult(res.tokens, res.logprobs, (h,) * len(res.tokens),
                                  res.finish_reason, prefill_tokens=res.prefill_tokens))
    return out


@pytest.mark.parametrize("alpha, beta, rise, want", [(0.0, 1.0, 2.0, 6), (0.0, 1.0, 0.0, 2),
                                                     (1.0, 0.0, 0.0, 6)])
def test_arpo_branches_when_entropy_rises_within_budget(chat, tokenizer, alpha, beta, rise, want):
  tasks = AddFamily().generate("train", 2, seed=5)
  engine = EntropyEngine(scripted(chat, add_steps), tokenizer, tokenizer.eos_token_id,
                         first=0.5, after=0.5 + rise)
  strategy = ARPOStrategy(budget=6, initial_rollouts=2, beam_size=3, alpha=alpha, beta=beta)
  loop = AgentLoop(engine, chat, AddFamily(), AgentConfig(max_context_tokens=4096), strategy)
  trees = loop.rollout(tasks)
  requests = {r.tokens for r in engine.requests}
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))
    assert len(tree.leaves) == want <= 6
    assert tags(tree).count(LeafTag.INIT) == 2
    for leaf, path in zip(tree.leaves, tree.leaf_paths()):
      assert leaf.rewards["outcome"] == 1.0
      if leaf.tag == LeafTag.BRANCH:  # a beam restarts the step after the tool reply
        env = path[-2]
        assert tree.nodes[env].kind == NodeKind.ENV and tuple(tree.context(env)) in requests


# ----------------------------------------------------------------------------
# TRACE
# ----------------------------------------------------------------------------


def test_trace_allocates_roots_and_prefixes(chat, tokenizer):
  tasks = AddFamily().generate("train", 5, seed=9)
  predictor = RunningMeanPredictor()
  for _ in range(50):  # task 0 always succeeds, task 1 always fails: no contrast to gain
    predictor.total[tasks[0].task_id] += 1.0
    predictor.count[tasks[0].task_id] += 1.0
    predictor.count[tasks[1].task_id] += 1.0
  strategy = TRACEStrategy(predictor=predictor)  # M = 2 * 5 = 10, N = 2
  loop = AgentLoop(ScriptedEngine(scripted(chat, add_steps), tokenizer, tokenizer.eos_token_id),
                   chat, AddFamily(), AgentConfig(max_context_tokens=4096), strategy)
  trees = loop.rollout(tasks)
  assert set(loop.last_stats.skipped_tasks) == {tasks[0].task_id, tasks[1].task_id}
  roots = {tree.meta["task_id"]: tags(tree).count(LeafTag.INIT) for tree in trees}
  counts = [roots.get(t.task_id, 0) for t in tasks]
  assert sum(counts) == 10 and all(c == 0 or c >= 2 for c in counts)
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))
    m = tree.meta["trace_roots"]
    assert tags(tree).count(LeafTag.INIT) == m and tags(tree).count(LeafTag.BRANCH) == 2 * m
    for leaf, path in zip(tree.leaves, tree.leaf_paths()):
      if leaf.tag == LeafTag.BRANCH:  # a continuation restarts turn 2 after turn 1's reply
        assert tree.nodes[path[-2]].kind == NodeKind.ENV
  assert predictor.count[tasks[2].task_id] == roots[tasks[2].task_id]  # updated on INIT leaves


def test_trace_without_anchors_spends_the_budget_on_roots(chat, tokenizer):
  tasks = AddFamily().generate("train", 2, seed=2)
  one_turn = scripted(chat, lambda text: [add_steps(text)[1]])  # answers at once: no anchor
  trees, _, _ = run(chat, tokenizer, TRACEStrategy(), one_turn, tasks)
  for tree in trees:
    assert tags(tree).count(LeafTag.INIT) == 2 and tags(tree).count(LeafTag.BRANCH) == 2


# ----------------------------------------------------------------------------
# Random (TreePO) at a reference budget
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("reference, want", [
    (PORToolStrategy(n=5), 5), (APPOStrategy(APPOConfig(n_init=2, budget=6)), 6),
    (TRACEStrategy(), 6), (None, 12)])
def test_random_matches_its_reference_budget(chat, tokenizer, reference, want):
  tasks = AddFamily().generate("train", 2, seed=4)
  strategy = RandomStrategy(reference=reference, seed=1)
  assert strategy.leaves_per_task() == want
  trees, _, _ = run(chat, tokenizer, strategy, scripted(chat, add_steps), tasks)
  for tree in trees:
    assert len(tree.leaves) == want
    assert tags(tree).count(LeafTag.INIT) == min(4, want)
    assert all(leaf.rewards["outcome"] == 1.0 for leaf in tree.leaves)


# ----------------------------------------------------------------------------
# The tool world with an oracle script
# ----------------------------------------------------------------------------


def test_toolworld_oracle_under_token_and_node_forks(chat, tokenizer):
  family = make_family("toolworld")
  tasks = family.generate("eval", 3, seed=2)
  by_question = {t.messages[-1]["content"]: t for t in tasks}

  def steps_of(text):
    task = next(t for q, t in by_question.items() if q in text)
    return [m["content"] for m in task.oracle if m["role"] == "assistant"]

  for strategy in (APPOStrategy(APPOConfig(n_init=2, budget=4)),
                   PORToolStrategy(n=4, fork_factor=2, t_max=6)):
    trees, _, _ = run(chat, tokenizer, strategy, scripted(chat, steps_of), tasks, family=family,
                      max_context_tokens=8192, sampling=SamplingParams(max_new_tokens=1024))
    assert len(trees) == 3
    for tree in trees:
      assert len(tree.leaves) == 4
      assert all(l.rewards["outcome"] == 1.0 and not l.truncated for l in tree.leaves)


# ----------------------------------------------------------------------------
# Bad input: every strategy ends flagged, nothing crashes, no tree is lost
# ----------------------------------------------------------------------------

SMALL = {"flat": {"n": 2}, "portool": {"n": 3, "t_max": 3},
         "appo": {"config": APPOConfig(n_init=2, budget=4)},
         "arpo": {"budget": 4, "initial_rollouts": 2, "alpha": 1.0}, "trace": {},
         "random": {"budget": 4, "n_init": 2}}
MALFORMED = '<think>x</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>'


@pytest.mark.parametrize("name", sorted(SMALL))
def test_bad_input_ends_flagged(chat, tokenizer, name):
  tasks = AddFamily().generate("eval", 2, seed=1)
  strategy = lambda: make_strategy(name, **SMALL[name])
  # A stop string that never comes: every step is cut at max_new_tokens.
  trees, stats, _ = run(chat, tokenizer, strategy(), lambda ctx: "<think>" + "la " * 50, tasks,
                        sampling=SamplingParams(max_new_tokens=8, stop=("</tool_call>",)))
  assert len(trees) == 2 and stats.num_length_cut_steps > 0
  assert all(leaf.truncated for tree in trees for leaf in tree.leaves)
  # A malformed call: the model reads a parse error and goes on until the turn limit.
  trees, _, _ = run(chat, tokenizer, strategy(), lambda ctx: MALFORMED, tasks, max_turns=2)
  assert len(trees) == 2
  for tree in trees:
    assert all(leaf.truncated and leaf.rewards["outcome"] == -1.0 for leaf in tree.leaves)
    assert any("Error [parse]" in chat.decode(n.tokens) for n in tree.nodes
               if n.kind == NodeKind.ENV)
  # A prompt longer than the context: one flagged leaf on the prompt.
  trees, stats, _ = run(chat, tokenizer, strategy(), scripted(chat, add_steps), tasks,
                        max_context_tokens=16)
  assert len(trees) == 2 and stats.num_policy_tokens == 0
  for tree in trees:
    assert tree.meta["prompt_too_long"] and len(tree.leaves) == 1
    assert tree.leaves[0].node == 0 and tree.leaves[0].truncated


# ----------------------------------------------------------------------------
# The tiny JAX model: prefix reuse and log-prob alignment on split nodes
# ----------------------------------------------------------------------------


class Recorder:
  """Wraps an engine and keeps every (request, result)."""

  def __init__(self, engine):
    self.engine, self.log = engine, []

  def generate(self, requests):
    results = self.engine.generate(requests)
    self.log.extend(zip(requests, results))
    return results

  def update_weights(self, params):
    self.engine.update_weights(params)


def test_jax_sampler_forks_prefill_once_and_split_logprobs_align(chat, tokenizer):
  cfg = ModelConfig.tiny(vocab_size=len(tokenizer), num_hidden_layers=1)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  engine = Recorder(JaxSampler(model, rows=16, slots=1024, tokenizer=tokenizer,
                               eos_ids=chat.eos_ids))
  tasks = AddFamily().generate("train", 2, seed=0)
  strategy = RandomStrategy(budget=5, n_init=2, seed=3)  # 3 token-position branches per tree
  loop = AgentLoop(engine, chat, AddFamily(), AgentConfig(
      max_turns=2, max_context_tokens=1024, sampling=SamplingParams(max_new_tokens=12)), strategy)
  trees = loop.rollout(tasks)
  for tree in trees:
    tree.check(vocab_size=len(tokenizer))
    assert len(tree.leaves) == 5
  # Turn 1: 2 identical prompts per task, prefilled once each (one lead row per context).
  first = engine.log[:4]
  prompts = {req.tokens for req, _ in first}
  assert len(prompts) == 2
  assert sum(res.prefill_tokens for _, res in first) == sum(len(p) for p in prompts)
  # Token-position branches continue a cached rollout: only the last context token runs
  # (0 for a second request with the same context in the same call).
  branch = [res for _, res in engine.log[4:]]
  assert len(branch) == 6 and all(res.prefill_tokens in (0, 1) for res in branch)
  assert sum(res.prefill_tokens for res in branch) == len({r.tokens for r, _ in engine.log[4:]})
  # Split nodes keep their log-probs aligned: the policy's log-probs recomputed on the
  # packed trees (model_scorer = pack + tree_logprobs, mapped back to each tree's node
  # order) equal the recorded behaviour log-probs on every policy token.
  assert any(n.kind == NodeKind.POLICY and t.nodes[n.parent].kind == NodeKind.POLICY
             for t in trees for n in t.nodes)  # some policy nodes were split
  for tree, arrays in zip(trees, model_scorer(model, Buckets.exact())(trees)):
    for i, node in enumerate(tree.nodes):
      if node.kind == NodeKind.POLICY:
        np.testing.assert_allclose(arrays.logprobs[i], node.logprobs, atol=1e-4)
        np.testing.assert_allclose(arrays.entropies[i], node.entropies, atol=1e-3)


def test_appo_scorer_fits_the_blockwise_bound_to_each_batch():
  # Many branches off a long shared prompt: every branch's block sees all the prompt's
  # blocks, so the batch needs a key-block bound far above the one the model carries.
  # The scorer fits the exact bound per packed batch, so it equals dense attention.
  from tree_rl.models.attention import AttentionConfig, max_visible_blocks

  rng = np.random.default_rng(0)
  toks = lambda n: [int(x) for x in rng.integers(3, 250, n)]
  trees = []
  for branches in (20, 12):
    tree = RolloutTree.new(toks(160))  # 10 blocks of 16
    for _ in range(branches):
      node = tree.add_node(0, NodeKind.POLICY, toks(12), logprobs=[-1.0] * 12)
      tree.add_leaf(node, {"outcome": 1.0})
    trees.append(tree)
  config = ModelConfig.tiny(vocab_size=256)
  blockwise = Decoder(config, rngs=nnx.Rngs(0),
                      attention_config=AttentionConfig("blockwise", 16, 2))
  dense = Decoder(config, rngs=nnx.Rngs(0))
  batch = pack(trees, Buckets())
  need = max_visible_blocks(np.asarray(batch.node_of_token), np.asarray(batch.parent), 16)
  assert need > 2 * blockwise.attention_config.max_kv_blocks
  got, want = model_scorer(blockwise)(trees), model_scorer(dense)(trees)
  for tree, g, w in zip(trees, got, want):
    for i, node in enumerate(tree.nodes):
      assert len(g.logprobs[i]) == len(node.tokens)
      np.testing.assert_allclose(g.logprobs[i], w.logprobs[i], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(g.entropies[i], w.entropies[i], rtol=1e-5, atol=1e-5)
  assert blockwise.attention_config.max_kv_blocks == 2  # the model itself is not refitted
