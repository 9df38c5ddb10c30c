"""A step's trees do not depend on how its requests are batched.

Every request the agent loop sends carries a seed from (task, branch, turn), and
the JAX sampler draws each row from its own key stream, (reseed key, request
seed, decode position). So rolling a step's tasks out in one engine, split
across two engines reseeded with the same key (as on a fleet of rollout
workers), or in another order gives the same trees, token for token.

Log-probs match to float rounding only: XLA's CPU kernels round a row's
results differently with the number of rows in the program (e.g. the LM-head
matmul of one row vs several: ~1 ulp of the logits, ~1e-6 in the log-probs),
and the runs differ in work rows (16 for the whole batch's 12 first requests, 8
for a half's 6). Such a difference could only change a token when two
Gumbel-perturbed logits tie to within ~1e-6; the engine has rows enough that
each turn is one call, so every request starts from the same cached prefix in
every run and nothing else differs.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from tree_rl.algos.appo import APPOConfig
from tree_rl.envs import make_family
from tree_rl.models import Decoder, ModelConfig, gguf_import
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import GenerationRequest, SamplingParams, request_seed
from tree_rl.rollout.jax_sampler import JaxSampler
from tree_rl.rollout.strategies import APPOStrategy, FlatStrategy
from tree_rl.tree.types import NodeKind

STRATEGIES = {
    "flat": lambda: FlatStrategy(n=3),
    "appo_per_step": lambda: APPOStrategy(APPOConfig(n_init=2, budget=4),
                                          branch_timing="per_step"),
}


@pytest.fixture(scope="module")
def setup():
  tokenizer = AutoTokenizer.from_pretrained(str(gguf_import.default_model_dir()))
  chat = ChatFormat.from_tokenizer(tokenizer)
  model = Decoder(ModelConfig.tiny(vocab_size=len(tokenizer), num_hidden_layers=1),
                  rngs=nnx.Rngs(0))
  return tokenizer, chat, model


def _grow(setup, tasks, strategy, key=7):
  """{task id: (nodes, leaves, log-probs)} of `tasks` grown by a fresh engine reseeded at `key`."""
  tokenizer, chat, model = setup
  engine = JaxSampler(model, rows=16, slots=1024, tokenizer=tokenizer, eos_ids=chat.eos_ids)
  engine.reseed(jax.random.key(key))
  loop = AgentLoop(engine, chat, make_family("search_qa"), AgentConfig(
      max_turns=2, max_context_tokens=1024, sampling=SamplingParams(max_new_tokens=12)),
      STRATEGIES[strategy]())
  out = {}
  for tree in loop.rollout(tasks):
    tree.check(vocab_size=len(tokenizer))
    nodes = [(n.parent, int(n.kind), tuple(n.tokens)) for n in tree.nodes]
    leaves = [(leaf.node, int(leaf.tag), leaf.truncated) for leaf in tree.leaves]
    logprobs = np.concatenate([np.asarray(n.logprobs, np.float64) for n in tree.nodes
                               if n.kind == NodeKind.POLICY])
    out[tree.meta["task_id"]] = (nodes, leaves, logprobs)
  return out


def _assert_same(got, want):
  assert sorted(got) == sorted(want)
  for task_id, (nodes, leaves, logprobs) in want.items():
    assert got[task_id][:2] == (nodes, leaves), task_id  # structure and every token, exactly
    np.testing.assert_allclose(got[task_id][2], logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_trees_do_not_depend_on_the_split_or_the_order(setup, strategy):
  tasks = make_family("search_qa").generate("train", 4, seed=0)
  whole = _grow(setup, tasks, strategy)
  assert len(whole) == 4
  split = {**_grow(setup, tasks[:2], strategy), **_grow(setup, tasks[2:], strategy)}
  reordered = _grow(setup, [tasks[2], tasks[0], tasks[3], tasks[1]], strategy)
  _assert_same(split, whole)
  _assert_same(reordered, whole)
  # Not vacuous: the episodes of one tree differ from each other, and another key
  # gives other trees.
  for nodes, _, _ in whole.values():
    steps = [tokens for _, kind, tokens in nodes[1:]]
    assert len(set(steps)) == len(steps)
  other = _grow(setup, tasks, strategy, key=8)
  assert all(other[k][0] != whole[k][0] for k in whole)


def test_a_seeded_request_samples_the_same_in_any_batch(setup):
  _, _, model = setup
  rng = np.random.RandomState(0)
  ctx = [tuple(int(x) for x in rng.randint(3, 1000, n)) for n in (5, 9, 14)]
  params = SamplingParams(max_new_tokens=10, top_k=50)
  req = lambda c, s: GenerationRequest(c, params, seed=request_seed("task", s, 0))

  def engine():
    e = JaxSampler(model, rows=4, slots=64)
    e.reseed(jax.random.key(3))
    return e

  (alone,) = engine().generate([req(ctx[0], 0)])
  e = engine()
  e.generate([req(ctx[2], 5)])  # an earlier call: the call count does not matter either
  # Batched with others, at another index, next to a same-context request (a fork
  # of the same lead row) and over more rows than the call fits (two chunks).
  batch = e.generate([req(ctx[1], 1), req(ctx[0], 2), req(ctx[2], 3), req(ctx[0], 4),
                      req(ctx[0], 0)])
  got = batch[4]
  assert (got.tokens, got.finish_reason) == (alone.tokens, alone.finish_reason)
  # Not bitwise: batch[4] runs in the second chunk, where its context is cached
  # (from batch[1]'s row) but for the last token, while `alone` prefills it in one
  # pass; the attention sums then round differently (~1e-6 measured on CPU).
  np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=1e-5)
  np.testing.assert_allclose(got.entropies, alone.entropies, atol=1e-5)
  # The seed is what makes the streams differ: same context, other seeds, other tokens.
  assert len({batch[1].tokens, batch[3].tokens, batch[4].tokens}) == 3


def test_request_seed_is_stable_and_checks_its_input():
  a = request_seed("search_qa/train/0/3", 0, 2, 1)
  assert a == request_seed("search_qa/train/0/3", 0, 2, 1) and 0 <= a < 2**64
  assert a != request_seed("search_qa/train/0/3", 0, 2, 2)
  assert request_seed(1, 2) != request_seed(12)  # parts are kept apart, not concatenated
  with pytest.raises(TypeError, match="1.5"):
    request_seed("t", 1.5)
  with pytest.raises(ValueError, match="seed"):
    GenerationRequest((1, 2), seed=-1)
  with pytest.raises(ValueError, match="seed"):
    GenerationRequest((1, 2), seed=2**64)
