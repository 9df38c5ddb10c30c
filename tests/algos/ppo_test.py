"""update_step: tree loss/gradients equal the flattened ones, one compile per
bucket, sharded == single device, LoRA trains adapters only, and sampled updates
learn a bandit (the sign and scale of the whole update, per estimator)."""

from __future__ import annotations

import dataclasses
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tree_rl.algos import ppo, registry
from tree_rl.algos.losses import LossConfig, policy_loss
from tree_rl.algos.registry import compute_advantages
from tree_rl.models import Decoder, LoRAConfig, LoRAParam, ModelConfig
from tree_rl.models.attention import TreeMask
from tree_rl.models.logprobs import sequence_logprobs, tree_logprobs
from tree_rl import sharding
from tree_rl.tree import Buckets, LeafTag, NodeKind, RolloutTree, derived, pack

BUCKETS = Buckets(tokens=(256,), nodes=(64,), leaves=(16,), path_tokens=(64,), trees=(8,))
CFG = ModelConfig.tiny("qwen3", vocab_size=64)
_TRAINING_XLA = {"xla_cpu_use_fusion_emitters": True}


def random_tree(rng, vocab=64, appo=False) -> RolloutTree:
  """A prompt, then 2-3 levels of policy/env nodes with 1-3 children each."""
  tree = RolloutTree.new(rng.integers(3, vocab, int(rng.integers(3, 8))).tolist())
  frontier = [0]
  for depth in range(int(rng.integers(1, 4))):
    nxt = []
    for p in frontier:
      for _ in range(int(rng.integers(1, 3 if depth else 4))):
        n = int(rng.integers(2, 7))
        node = tree.add_node(p, NodeKind.POLICY, rng.integers(3, vocab, n).tolist(),
                             logprobs=(-rng.uniform(0.5, 4.0, n)).tolist())
        if rng.random() < 0.5:
          node = tree.add_node(node, NodeKind.ENV, rng.integers(3, vocab, 3).tolist())
        nxt.append(node)
    frontier = nxt
  for i, n in enumerate(frontier):
    tag = LeafTag.INIT if (not appo or i % 2 == 0) else LeafTag.BRANCH
    tree.add_leaf(n, {"outcome": float(rng.integers(0, 2))}, tag=tag)
  return tree


def batch_of(seed, n=8, appo=False):
  rng = np.random.default_rng(seed)
  return pack([random_tree(rng, appo=appo) for _ in range(n)], BUCKETS)


def flat_loss(model, batch, adv, mode):
  """The clipped surrogate summed over the K flattened sequences, each token
  once per sequence through it (independent of the tree code path)."""
  flat = derived.flatten_leaves(batch, mode, adv.leaf_mask)
  b, k, p = flat.tokens.shape
  valid = flat.token_index >= 0
  lp, _ = sequence_logprobs(model, flat.tokens.reshape(b * k, p), valid.reshape(b * k, p))
  lp = lp.reshape(b, k, p)
  node = derived.gather_tokens(batch.node_of_token, flat.token_index, 0)
  a = jnp.take_along_axis(jnp.swapaxes(adv.dense(batch), 1, 2), node, axis=2)  # [B, K, P]
  ratio = jnp.exp(jnp.where(flat.loss_mask, lp - flat.behavior_logp, 0.0))
  term = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a)
  return jnp.sum(flat.weights * term)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_tree_loss_and_param_grads_equal_flattened(mode):
  model = Decoder(CFG, rngs=nnx.Rngs(0))
  batch = batch_of(0)
  adv = compute_advantages("grpo", batch)
  cfg = LossConfig(aggregation=mode)

  def tree_loss(model):
    logp, _ = tree_logprobs(model, batch)
    return policy_loss(logp, batch, adv, cfg)[0]

  # Jitted: run eagerly, the two paths compile ~340 single-op programs.
  lt, gt = nnx.jit(nnx.value_and_grad(tree_loss))(model)
  lf, gf = nnx.jit(nnx.value_and_grad(lambda m: flat_loss(m, batch, adv, mode)))(model)
  np.testing.assert_allclose(lt, lf, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), gt, gf)
  assert float(jnp.abs(lt)) > 0


def _run(mesh=None, lora=None, steps=2, estimator="grpo", appo=False, opt=None):
  model = Decoder(CFG, rngs=nnx.Rngs(0), lora=lora)
  config = ppo.PPOConfig(estimator=estimator, num_epochs=2, num_minibatches=2,
                         loss=LossConfig(clip_eps_high=0.28), logprob_chunk=64)
  opt = opt or optax.adam(1e-2)
  state = ppo.init_state(model, opt)
  state_sh = batch_sh = None
  if mesh is not None:
    sharding.assert_params_sufficiently_sharded(model, mesh)
    state_sh = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                            state)
    state_sh = state_sh.replace(params=sharding.state_shardings(state.params, mesh),
                                frozen=sharding.state_shardings(state.frozen, mesh))
    state = jax.device_put(state, state_sh)
    batch_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  step = chex.assert_max_traces(ppo.make_update_step(config, opt), n=1)
  jitted = jax.jit(step, donate_argnums=0,
                   **({} if mesh is None else dict(in_shardings=(state_sh, batch_sh, None),
                                                   out_shardings=(state_sh, None))))
  history = []
  for i in range(steps):
    state, metrics = jitted(state, batch_of(i, appo=appo), jax.random.key(0))
    history.append(jax.device_get(metrics))
  return state, history


def test_update_step_one_compile_and_metrics():
  chex.clear_trace_counter()
  state, hist = _run()
  for key in ("loss", "clip_frac", "approx_kl", "entropy", "l2_grads", "l2_updates", "l2_params"):
    assert all(np.isfinite(h[key]) for h in hist), key
  assert hist[0]["l2_updates"] > 0 and int(state.step) == 2
  # Within a step, later minibatches see a moved policy: ratios leave 1.
  assert hist[1]["approx_kl"] > 0


def test_sharded_update_step_matches_single_device():
  chex.clear_trace_counter()
  # SGD: Adam's normalisation would magnify reduction-order noise in
  # near-zero gradients into visible parameter differences.
  single, h1 = _run(opt=optax.sgd(0.5))
  chex.clear_trace_counter()
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  sharded, h2 = _run(mesh, opt=optax.sgd(0.5))
  for a, b in zip(h1, h2):
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=1e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5),
               single.params, jax.device_get(sharded.params))
  # The parameters really are spread over the mesh.
  q = sharded.params["q_proj"].get_value()
  assert len({s.device for s in q.addressable_shards}) == 8


def test_lora_trains_adapters_only_and_appo_runs_inside_minibatches():
  chex.clear_trace_counter()
  state, hist = _run(lora=LoRAConfig(rank=4), estimator="appo", appo=True, steps=1)
  leaves = nnx.to_flat_state(state.params)
  assert leaves and all(isinstance(v, LoRAParam) for _, v in leaves)
  assert all(not isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(state.frozen))
  fresh = Decoder(CFG, rngs=nnx.Rngs(0), lora=LoRAConfig(rank=4))
  _, _, frozen = nnx.split(fresh, LoRAParam, ...)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.frozen), jax.device_get(frozen))
  assert np.isfinite(hist[0]["loss"]) and hist[0]["l2_updates"] > 0
  assert "adv/omega_mean" in hist[0]


def test_appo_minibatches_packed_alone_make_the_updates_of_one_padded_call():
  # APPO's advantages are per mini-batch (they read the current policy), so the trainer packs
  # and updates each mini-batch on its own (rl_step.rl_step with num_parts > 1): no tree is
  # padded to the step's longest. That must be the same update as one call over the padded
  # batch.
  from tree_rl import metrics as metrics_lib
  from tree_rl import rl_step
  from tree_rl.rollout.dynamic_sampling import StepRollout
  from tree_rl.rollout.pipeline import Produced
  from tree_rl.tree.batch import Packed

  def _update_by_minibatch(state, trees, parts, update, pack_fn, key, timer):
    learner = rl_step.Learner(update=lambda s, packed, k: update(s, packed.batch, k),
                              pack=lambda ts: Packed(pack_fn(ts), []), num_parts=parts)
    grown = StepRollout(trees=trees, train=trees, prompts=len(trees), episodes=0, truncated=0,
                        policy_tokens=0, strategy_metrics={})
    rollout = types.SimpleNamespace(engine=types.SimpleNamespace(published=0))
    state, result = rl_step.rl_step(learner, rollout, state, Produced(1, grown, 0), key, timer)
    return state, result.bad, result.metrics

  rng, trees = np.random.default_rng(3), []
  while len(trees) < 4:  # trees whose initial rollouts differ in reward: non-zero advantages
    tree = random_tree(rng, appo=True)
    if len({leaf.rewards["outcome"] for leaf in tree.leaves if leaf.tag == LeafTag.INIT}) > 1:
      trees.append(tree)
  opt = optax.sgd(0.5)
  model = Decoder(CFG, rngs=nnx.Rngs(0), lora=LoRAConfig(rank=4))
  config = ppo.PPOConfig(estimator="appo", num_epochs=1, num_minibatches=2, logprob_chunk=64)
  assert ppo.advantages_per_minibatch(config)
  assert not ppo.advantages_per_minibatch(ppo.PPOConfig(estimator="grpo"))
  one_call = jax.jit(ppo.make_update_step(config, opt))
  per_part = jax.jit(ppo.make_update_step(
      ppo.PPOConfig(estimator="appo", num_epochs=1, num_minibatches=1, logprob_chunk=64), opt))
  sizes = tuple(range(8, 257, 8))
  whole = pack(trees, Buckets(tokens=sizes, trees=(4,)))
  key = jax.random.key(7)
  state = ppo.init_state(model, opt)
  want, _ = one_call(state, whole, key)
  # The padded call's mini-batches, in its order: a permutation keyed by (key, state.step).
  order = np.asarray(jax.random.permutation(
      jax.random.split(jax.random.fold_in(key, state.step), 1)[0], 4))
  part_buckets = Buckets(tokens=sizes, trees=(2,))
  got, bad, m = _update_by_minibatch(
      ppo.init_state(model, opt), [trees[i] for i in order], 2, per_part,
      lambda ts: pack(ts, part_buckets), key, metrics_lib.PhaseTimer())
  assert not bad and np.isfinite(m["loss"]) and m["l2_updates"] > 0
  assert whole.tokens.shape[1] > min(  # the parts are packed smaller than the whole
      pack([trees[i] for i in order[:2]], part_buckets).tokens.shape[1],
      pack([trees[i] for i in order[2:]], part_buckets).tokens.shape[1])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jax.device_get(want.params), jax.device_get(got.params))
  # The order matters (the second mini-batch sees the first one's update), so the check
  # above would catch a trainer that updated the mini-batches in another order.
  swapped, _, _ = _update_by_minibatch(
      ppo.init_state(model, opt), [trees[i] for i in order[::-1]], 2, per_part,
      lambda ts: pack(ts, part_buckets), key, metrics_lib.PhaseTimer())
  assert max(jax.tree.leaves(jax.tree.map(
      lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
      jax.device_get(want.params), jax.device_get(swapped.params)))) > 1e-3


def test_wider_static_shapes_give_bitwise_the_same_update():
  # The trainer pads a batch's static sizes up to the largest it has compiled at the batch's
  # token length (rl_step.ShapeFitter: node bucket, blockwise bound, path and loss
  # widths), so that a run compiles once per length. That is only sound if the padding
  # changes no bit of the update.
  from tree_rl.models.attention import AttentionConfig, fit_attention
  rng, trees = np.random.default_rng(5), []
  while len(trees) < 2:
    tree = random_tree(rng, appo=True)
    if len({leaf.rewards["outcome"] for leaf in tree.leaves if leaf.tag == LeafTag.INIT}) > 1:
      trees.append(tree)
  opt = optax.sgd(0.5)
  config = ppo.PPOConfig(estimator="appo", num_epochs=1, num_minibatches=2, logprob_chunk=16)

  def update(nodes, extra_bound, path, loss):
    batch = pack(trees, Buckets(tokens=(256,), nodes=(nodes,), trees=(2,)))
    need = int(np.asarray(batch.loss_mask).sum(1).max())
    batch = batch.replace(max_path_len=batch.max_path_len * path,
                          max_loss_tokens=-(-need // 16) * 16 * loss)
    attn = fit_attention(AttentionConfig("blockwise", 16, 1), np.asarray(batch.node_of_token),
                         np.asarray(batch.parent), np.asarray(batch.subtree_end))
    attn = dataclasses.replace(attn, max_kv_blocks=attn.max_kv_blocks + extra_bound)
    model = Decoder(CFG, rngs=nnx.Rngs(0), lora=LoRAConfig(rank=4), attention_config=attn)
    # XLA's default CPU emitters, which training compiles with: the fast tier's older
    # emitters (tests/conftest.py) round some sums differently between the two widths.
    state, metrics = jax.jit(ppo.make_update_step(config, opt), compiler_options=_TRAINING_XLA)(
        ppo.init_state(model, opt), batch, jax.random.key(1))
    assert batch.max_loss_tokens < 256 and float(metrics["l2_updates"]) > 0
    return jax.device_get((state.params, metrics))

  # Each case is a compile of APPO's update (the slowest part of the fast tier): all four
  # sizes widened at once, the attention bound (the scan's padding) among them.
  jax.tree.map(np.testing.assert_array_equal, update(32, 0, 1, 1), update(64, 2, 2, 2))


def test_bad_config_names_valid_estimators():
  with pytest.raises(ValueError, match="grpo"):
    ppo.PPOConfig(estimator="gpro")


@jax.jit
def _next_token_probs(state, tokens):
  """The policy's distribution over the first response token of each prompt [P, V]."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits = state.model()(tokens, positions, TreeMask.causal(jnp.ones(tokens.shape, bool)))
  return jax.nn.softmax(logits[:, -1], axis=-1)


# The one-token bandit: a quarter of the vocabulary (tokens 3..18) is rewarded. Its trees
# are a 4-token prompt and 8 one-token replies, packed without padding to spare.
BANDIT_REWARDED = (np.arange(64) >= 3) & (np.arange(64) < 19)
BANDIT_BUCKETS = Buckets(tokens=(16,), nodes=(16,), leaves=(8,), path_tokens=(8,), trees=(8,))


def _bandit(estimator):
  """(initial state, jitted update step, its 8 prompts, the rng that drew them)."""
  model = Decoder(CFG, rngs=nnx.Rngs(0))
  opt = optax.adam(3e-3)
  # APPO's groups here are its N initial rollouts alone (a one-token reply has no branch point).
  est = registry.make_config("appo", n_init=8, budget=8) if estimator == "appo" else None
  config = ppo.PPOConfig(estimator=estimator, estimator_config=est, num_epochs=1,
                         num_minibatches=1, logprob_chunk=16)
  rng = np.random.default_rng(0)
  return (ppo.init_state(model, opt), jax.jit(ppo.make_update_step(config, opt),
                                              donate_argnums=0),
          rng.integers(3, 64, (8, 4)), rng)


def _bandit_trees(prompts, mass, rng, version=None):
  """One tree per prompt: 8 one-token replies drawn from `mass` [P, V], each with its
  behaviour log-prob, the sampling policy `version` and its reward."""
  trees = []
  for prompt, dist in zip(prompts, mass):
    tree = RolloutTree.new(prompt.tolist())
    for tok in rng.choice(64, size=8, p=dist / dist.sum()):
      node = tree.add_node(0, NodeKind.POLICY, [int(tok)], logprobs=[float(np.log(dist[tok]))],
                           version=version)
      tree.add_leaf(node, {"outcome": float(BANDIT_REWARDED[tok])})
    trees.append(tree)
  return trees


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "tree_grpo", "appo"])
def test_updates_move_the_policy_towards_rewarded_answers(estimator):
  """The update's sign and scale, end to end: a one-token bandit rewards a quarter of
  the vocabulary. Sampled from the policy each step, grouped per prompt, the updates
  must move most of the probability mass onto the rewarded tokens."""
  state, step, prompts, rng = _bandit(estimator)
  rewarded = BANDIT_REWARDED

  def mass():
    return np.asarray(_next_token_probs(state, prompts), np.float64)

  start = float(np.mean(mass()[:, rewarded].sum(-1)))
  for i in range(12):
    trees = _bandit_trees(prompts, mass(), rng)
    state, m = step(state, pack(trees, BANDIT_BUCKETS), jax.random.key(i))
    assert np.isfinite(float(m["loss"]))
  end = float(np.mean(mass()[:, rewarded].sum(-1)))
  assert 0.1 < start < 0.4, start
  assert end > 0.6, (start, end)


@pytest.mark.parametrize("estimator", ["grpo", "appo"])
def test_the_bandit_still_learns_from_a_staleness_one_pipeline(estimator):
  """The same bandit fed by `RolloutPipeline` with max_staleness=1: a producer thread
  samples each step from the newest *published* policy while the learner trains on the
  step before, so trees are one update old; the clipped ratio against their recorded
  behaviour log-probs corrects them and the policy still moves onto the rewarded tokens."""
  import threading  # noqa: PLC0415

  from tree_rl.rollout.pipeline import Produced, RolloutPipeline, staleness  # noqa: PLC0415

  state, step, prompts, _ = _bandit(estimator)
  rewarded = BANDIT_REWARDED
  lock = threading.Lock()
  published = {"version": 0, "mass": np.asarray(_next_token_probs(state, prompts), np.float64)}

  def produce(k, pos):  # the producer: the newest published policy, at its version
    with lock:
      version, mass = published["version"], published["mass"]
    trees = _bandit_trees(prompts, mass, np.random.default_rng(k), version)
    return Produced(k, trees, pos + len(trees))

  start = float(np.mean(published["mass"][:, rewarded].sum(-1)))
  pipe = RolloutPipeline(produce, 1, 12, 0, max_staleness=1)
  ages = []
  for k in range(1, 13):
    trees = pipe.get(k).rollout
    ages.append(staleness([(trees, published["version"])])["rollout/staleness_max"])
    state, m = step(state, pack(trees, BANDIT_BUCKETS), jax.random.key(k))
    assert np.isfinite(float(m["loss"]))
    mass = np.asarray(_next_token_probs(state, prompts), np.float64)
    with lock:
      published.update(version=k, mass=mass)
  pipe.close()
  end = float(np.mean(mass[:, rewarded].sum(-1)))
  assert max(ages) == 1 and ages.count(1) >= 6, ages  # it did train on stale trees
  assert 0.1 < start < 0.4, start
  assert end > 0.6, (start, end)
