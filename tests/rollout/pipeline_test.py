"""Asynchronous rollouts (tree_rl.rollout.pipeline): the admission rule bounds how far the
producer runs ahead, published weights load between generate calls and stamp every policy
node with its version (a tree can span versions), staleness is measured from those stamps,
producer errors reach the learner, and S > 0 refuses what it cannot correct."""

import threading
import time

import pytest
from transformers import AutoTokenizer

from tree_rl.envs import make_family
from tree_rl.models import gguf_import
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import GenerationRequest, SamplingParams
from tree_rl.rollout.pipeline import (Produced, RolloutInterrupted, RolloutPipeline,
                                      VersionedEngine, check_async, staleness)
from tree_rl.rollout.policy import oracle_engine
from tree_rl.tree import NodeKind, RolloutTree


class _Counting:
  """An engine whose 'weights' are a number; each result's one token is that number."""

  def __init__(self):
    self.weights, self.loads = 0, 0

  def generate(self, requests):
    from tree_rl.rollout.engine import GenerationResult  # noqa: PLC0415
    return [GenerationResult((self.weights,), (0.0,), (0.0,), "eos") for _ in requests]

  def update_weights(self, w):
    self.weights, self.loads = w, self.loads + 1


def _req():
  return [GenerationRequest((1, 2, 3), SamplingParams(max_new_tokens=1))]


def test_published_weights_load_at_the_next_generate_and_stamp_the_results():
  inner = _Counting()
  eng = VersionedEngine(inner)
  assert eng.generate(_req())[0].policy_version == 0
  eng.publish(1, lambda: inner.update_weights(11))
  eng.publish(2, lambda: inner.update_weights(22))  # newest wins: version 1 is never loaded
  assert (eng.version, eng.published, inner.loads) == (0, 2, 0)
  res = eng.generate(_req())[0]
  assert (res.tokens, res.policy_version, inner.loads) == ((22,), 2, 1)
  with pytest.raises(ValueError, match="must exceed the published 2"):
    eng.publish(2, lambda: None)
  eng.load_now(3, lambda: inner.update_weights(33))
  assert (eng.version, inner.weights) == (3, 33)
  eng.update_weights(44)  # the RolloutEngine protocol: the next version, loaded now
  assert (eng.version, eng.generate(_req())[0].tokens) == (4, (44,))
  eng.interrupt()
  with pytest.raises(RolloutInterrupted):
    eng.generate(_req())


def test_a_tree_spans_versions_and_each_policy_node_records_its_own():
  """The learner publishes while an episode's first turn is sampled: the later turns of
  the same trees are sampled, and stamped, by the new version."""
  tokenizer = AutoTokenizer.from_pretrained(str(gguf_import.default_model_dir()))
  chat = ChatFormat.from_tokenizer(tokenizer)
  family = make_family("toolworld")
  tasks = family.generate("eval", 3, seed=1)
  oracle = oracle_engine(tasks, chat)
  eng = VersionedEngine(oracle)
  scripted = oracle.generate

  def generate(requests):
    if eng.published == 0:
      eng.publish(1, lambda: None)  # lands at the next generate call, not inside this one
    return scripted(requests)

  oracle.generate = generate
  loop = AgentLoop(eng, chat, family, AgentConfig(samples_per_task=2, max_context_tokens=8192,
                                                  sampling=SamplingParams(max_new_tokens=512)))
  trees = loop.rollout(tasks)
  multi_turn = 0
  for tree in trees:
    tree.check()
    for path in tree.leaf_paths():
      versions = [tree.nodes[i].version for i in path if tree.nodes[i].kind == NodeKind.POLICY]
      assert versions[0] == 0 and all(v == 1 for v in versions[1:]), versions
      multi_turn += len(versions) > 1
    assert RolloutTree.from_json(tree.to_json()).nodes == tree.nodes  # versions serialised
  assert multi_turn > 0
  got = staleness([(trees, 1)])
  assert got["rollout/staleness_max"] == 1.0
  assert 0.0 < got["rollout/staleness_mean"] < 1.0


def _tree(versions_and_lengths):
  t = RolloutTree.new([1, 2])
  node = 0
  for v, n in versions_and_lengths:
    node = t.add_node(node, NodeKind.POLICY, [3] * n, [0.0] * n, version=v)
  t.add_leaf(node, {"outcome": 1.0})
  return t


def test_staleness_is_token_weighted_and_per_training_version():
  a, b = _tree([(3, 1), (5, 3)]), _tree([(4, 4)])
  got = staleness([([a], 5), ([b], 6)])  # ages: 2 (1 token), 0 (3 tokens); 2 (4 tokens)
  assert got == {"rollout/staleness_max": 2.0, "rollout/staleness_mean": (2 + 0 + 8) / 8}
  assert staleness([([_tree([(None, 2)])], 3)])["rollout/staleness_max"] == 0.0


class _Learner:
  """Drives a pipeline like the trainer: asks for each step, 'trains' for `train_s`,
  publishes; the producer records which update was published when each step began."""

  def __init__(self, staleness_bound, steps, produce_s=0.02, train_s=0.05, fail_at=None):
    self.published = 0
    self.log = []  # (step, updates published when its rollout started)
    self.produce_s, self.train_s, self.fail_at = produce_s, train_s, fail_at
    self.max_ahead = 0
    self.lock = threading.Lock()
    self.pipe = RolloutPipeline(self.produce, 1, steps, 100, staleness_bound)

  def produce(self, step, pos):
    with self.lock:
      self.log.append((step, self.published))
    if step == self.fail_at:
      raise KeyError("tool server gone")
    time.sleep(self.produce_s)
    return Produced(step, f"trees{step}", pos + 4)

  def run(self, steps):
    for step in range(1, steps + 1):
      got = self.pipe.get(step)
      assert (got.step, got.rollout, got.data_position) == (step, f"trees{step}", 100 + 4 * step)
      self.max_ahead = max(self.max_ahead, self.pipe.ahead())
      time.sleep(self.train_s)
      with self.lock:
        self.published += 1
    self.pipe.close()


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_the_producer_runs_at_most_s_steps_ahead(bound):
  """Admission: step j starts only after update j - S - 1 is published, so its trees are at
  most S updates stale when step j trains (after update j - 1)."""
  learner = _Learner(bound, steps=8)
  learner.run(8)
  assert [s for s, _ in learner.log] == list(range(1, 9))
  for step, published in learner.log:
    assert published >= step - bound - 1, learner.log
    assert (step - 1) - published <= bound
  if bound == 0:
    assert all(published == step - 1 for step, published in learner.log)  # synchronous
  else:  # with training slower than rollouts, the producer does run ahead
    assert any(published < step - 1 for step, published in learner.log)
  assert learner.max_ahead <= bound


def test_a_producer_error_reaches_the_learner_with_its_cause():
  learner = _Learner(1, steps=5, fail_at=3)
  with pytest.raises(RuntimeError, match="before step 3") as err:
    learner.run(5)
  assert isinstance(err.value.__cause__, KeyError)
  learner.pipe.close()


def test_steps_are_asked_for_in_order_and_close_stops_the_producer():
  learner = _Learner(2, steps=50, produce_s=0.01)
  learner.pipe.get(1)
  with pytest.raises(ValueError, match="in order"):
    learner.pipe.get(3)
  learner.pipe.close(timeout_s=5.0)
  assert not learner.pipe._thread.is_alive()
  assert len(learner.log) <= 1 + 2 + 1  # never beyond S steps past the last one asked for


def test_s_above_zero_refuses_what_it_cannot_correct():
  check_async(0, 5.0, per_minibatch=True)  # synchronous: anything goes
  check_async(2, 0.28, per_minibatch=False)
  check_async(2, None, per_minibatch=False)  # AWPO's own radius
  with pytest.raises(ValueError, match="unclipped importance weight"):
    check_async(1, 1.5, per_minibatch=False)
  with pytest.raises(ValueError, match="branch_timing='per_step'"):
    check_async(1, 0.2, per_minibatch=True)
  with pytest.raises(ValueError, match="must be an int >= 0"):
    check_async(-1, 0.2, per_minibatch=False)
