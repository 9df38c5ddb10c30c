"""Jitted advantage estimators against their pure-Python references.

    python benchmarks/advantages.py [--trees 512] [--quick | --smoke]

Builds 512 PORTool-shaped trees (n=8, f=2, T_max=6, grown by Algorithm 1)
and 512 APPO-shaped trees (N=4 initial rollouts of ~2k tokens, B=3 branches
each), times every estimator after compilation against the slow reference
kept in tests/algos/, and the reverse-scan future value against the O(L^2)
decay-matrix form at L=4096. Prints one line per figure:

    RATIO <name> <reference_time / kernel_time>

and two METRIC lines: GRPO on 512 flat groups of 8 (depth-1 trees) through the general
tree kernels, `adv.tree_rl.grpo_jit.G512_n8.median_us` (the name the peers' benchmarks
use; a whole TreeBatch in, the whole estimator output out), followed by
`RATIO grpo_flat_groups_tree_over_flat_reference`, its time over the textbook GRPO on a
[G, n] reward array timed the same way in this run; and the host `pack` time of the
PORTool-shaped trees.

Both sides are timed in this process, so the ratio is meaningful on a noisy
shared machine; absolute times are printed for context only. `--quick` (32
trees, 256-token APPO rollouts) takes about half a minute on 2 cores;
`--smoke` (4 trees, Omega at L=1024, CI's install check) measures every figure
at the smallest sizes, where compilation dominates and the ratios are noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.algos import ref_appo, ref_awpo, ref_baselines, ref_portool  # noqa: E402
from tree_rl import algos  # noqa: E402
from tree_rl.algos import registry  # noqa: E402
from tree_rl.tree import Buckets, LeafTag, NodeKind, RolloutTree, pack  # noqa: E402
from tree_rl.tree.segment import discounted_reverse_cumsum  # noqa: E402

# ----------------------------------------------------------------------------
# Tree shapes
# ----------------------------------------------------------------------------


def _policy(rng, tree, parent, n_tok, step=None):
  toks = rng.integers(1, 1000, n_tok).tolist()
  lps = (-rng.exponential(1.0, n_tok)).tolist()
  fm = float(rng.choice([0.2, 0.45, 0.725, 1.0]))
  return tree.add_node(parent, NodeKind.POLICY, toks, logprobs=lps, step=step,
                       rewards={"format": fm})


def portool_tree(rng, n=8, f=2, t_max=6, p_finish=0.3) -> RolloutTree:
  """Algorithm 1 of PORTool: n independent first steps, then every unfinished
  trajectory is duplicated f times and n - n_c copies are kept."""
  finished_step = []

  def new_step():
    finished_step.append(bool(rng.random() < p_finish))
    return len(finished_step) - 1

  traj = [[new_step()] for _ in range(n)]
  done = []
  for _ in range(2, t_max + 1):
    done += [t for t in traj if finished_step[t[-1]]]
    traj = [t for t in traj if not finished_step[t[-1]]]
    if len(done) == n:
      break
    pool = [t for t in traj for _ in range(f)]
    keep = rng.choice(len(pool), n - len(done), replace=False)
    traj = [pool[i] + [new_step()] for i in sorted(keep)]
  done += traj

  tree = RolloutTree.new(rng.integers(1, 1000, 128).tolist())
  after = {(): 0}
  for tr in done:
    for t in range(len(tr)):
      key = tuple(tr[: t + 1])
      if key in after:
        continue
      pol = _policy(rng, tree, after[key[:-1]], int(rng.integers(32, 96)), step=t + 1)
      if finished_step[tr[t]] and t == len(tr) - 1:
        after[key] = pol
      else:
        env = rng.integers(1, 1000, int(rng.integers(16, 48))).tolist()
        after[key] = tree.add_node(pol, NodeKind.ENV, env, step=t + 1)
  for tr in done:
    ok = finished_step[tr[-1]]
    tree.add_leaf(after[tuple(tr)], {
        "outcome": float(rng.choice([-1.0, 0.0, 1.0])) if ok else -1.0,
        "reasoning": float(rng.choice([0.2, 0.6, 1.0]))}, truncated=not ok)
  return tree


def appo_tree(rng, n_init=4, n_branch=3, length=2048, prompt=64) -> RolloutTree:
  """N initial rollouts of `length` tokens (a few tool-output spans inside),
  B branches each resampled at random policy positions (paper convention: a
  branch at p shares positions < p), each branch running to `length`."""
  tree = RolloutTree.new(rng.integers(1, 1000, prompt).tolist())
  leaves = []
  for _ in range(n_init):
    kinds = np.full(length, int(NodeKind.POLICY))
    for start in rng.integers(64, length - 64, 3):
      kinds[start:start + int(rng.integers(16, 48))] = int(NodeKind.ENV)
    policy_pos = np.flatnonzero(kinds == int(NodeKind.POLICY))
    cuts = sorted(int(c) for c in rng.choice(policy_pos[1:], n_branch, replace=False))
    env_edges = (np.flatnonzero(np.diff(kinds) != 0) + 1).tolist()
    bounds = sorted(set([0, length] + cuts + env_edges))
    parent, hang = 0, {}
    for a, b in zip(bounds[:-1], bounds[1:]):
      hang[a] = parent
      if kinds[a] == int(NodeKind.POLICY):
        parent = _policy(rng, tree, parent, b - a)
      else:
        parent = tree.add_node(parent, NodeKind.ENV, rng.integers(1, 1000, b - a).tolist())
    leaves.append((parent, LeafTag.INIT))
    for c in cuts:
      leaves.append((_policy(rng, tree, hang[c], length - c), LeafTag.BRANCH))
  for node, tag in leaves:
    tree.add_leaf(node, {"outcome": float(rng.random() < 0.5)}, tag=tag)
  return tree


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def _time(fn, repeats):
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def bench_estimator(label, name, config, trees, batch, reference, inputs, repeats):
  """`reference(canonical_trees, config)` computes the same advantages in Python."""
  run = lambda: registry.compute_advantages(name, batch, config, **inputs)
  jax.block_until_ready(run())  # compile
  kernel = _time(run, repeats)
  canon = [t.canonical() for t in trees]
  t0 = time.perf_counter()
  reference(canon, config)
  ref = time.perf_counter() - t0
  print(f"# {label}: kernel {kernel * 1e3:.2f} ms, reference {ref * 1e3:.1f} ms", flush=True)
  print(f"RATIO {label} {ref / kernel:.1f}", flush=True)


def per_tree(reference):
  return lambda trees, config: [reference(t, config) for t in trees]


def appo_reference(logp):
  """APPO's reference: A_base from tests/algos/ref_appo.py, and the future term
  Omega by the O(L) reverse recursion in plain Python (the test reference uses
  the O(L^2) definition, which is too slow for 2k-token rollouts)."""

  def run(trees, config):
    gamma = 2.0 ** (-1.0 / config.tau_half)
    lo, hi = config.fut_clip
    out = []
    for b, tree in enumerate(trees):
      base = ref_appo.reference(tree, config)
      start, acc = [], 0
      for node in tree.nodes:
        start.append(acc)
        acc += len(node.tokens)
      scale = np.ones(acc)
      for leaf in tree.leaves:
        if leaf.tag != LeafTag.INIT:
          continue
        toks = [(start[n] + j, n, j) for n in tree.path(leaf.node)
                for j in range(len(tree.nodes[n].tokens))]
        s = 0.0
        for t, n, j in reversed(toks):
          node = tree.nodes[n]
          x = float(logp[b, t]) - node.logprobs[j] if node.kind == NodeKind.POLICY else 0.0
          s = x + gamma * s
          if node.kind == NodeKind.POLICY:
            om = np.exp(min(max(s, -20.0), 20.0))
            scale[t] = 1.0 + config.b * min(max(om, lo), hi)
      out.append((base, scale))
    return out

  return run


def flat_group_batch(rng, groups, n):
  """`groups` prompts with `n` independent rollouts each: depth-1 trees, GRPO's own shape."""
  trees = []
  for _ in range(groups):
    tree = RolloutTree.new(rng.integers(1, 1000, 16).tolist())
    for _ in range(n):
      node = tree.add_node(0, NodeKind.POLICY, rng.integers(1, 1000, 8).tolist(),
                           logprobs=[-1.0] * 8)
      tree.add_leaf(node, {"outcome": float(rng.random() < 0.5)})
    trees.append(tree)
  return pack(trees, Buckets(trees=None))


def bench_flat_grpo(rng, groups, n, repeats):
  """GRPO on flat groups through the general tree kernels, timed as the peers time theirs
  (median of jitted calls after compilation, here after as many untimed calls), printed
  under the peers' metric name.

  The reference, timed the same way in this process: the textbook form on a [G, n] reward
  array (mean and unbiased std per row), which is what a flat-rollout trainer runs. The
  tree side gets a whole TreeBatch and returns the full estimator output (leaf advantages,
  the trained-leaf mask, the group metrics)."""
  batch = flat_group_batch(rng, groups, n)
  config = registry.get("grpo").config_cls()
  tree = jax.jit(lambda b: registry.compute_advantages("grpo", b, config))
  rewards = batch.leaf_rewards("outcome")

  @jax.jit
  def flat(r):
    mean = r.mean(-1, keepdims=True)
    std = jnp.sqrt(((r - mean) ** 2).sum(-1, keepdims=True) / (r.shape[-1] - 1))
    return (r - mean) / (std + config.std_eps)

  np.testing.assert_allclose(tree(batch).leaf_values, flat(rewards), atol=1e-5)

  def median(fn, arg):
    # As many untimed calls first: for a few hundred calls after a compile, XLA:CPU's
    # dispatch to its worker thread can take tens of microseconds longer, which would
    # bias whichever side is timed first.
    calls = max(repeats, 200)
    for _ in range(calls):
      jax.block_until_ready(fn(arg))
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(arg))
      times.append(time.perf_counter() - t0)
    return float(np.median(times))

  t_tree, t_flat = median(tree, batch), median(flat, rewards)
  print(f"METRIC adv.tree_rl.grpo_jit.G{groups}_n{n}.median_us {t_tree * 1e6:.1f}", flush=True)
  print(f"# flat [G, n] reference: {t_flat * 1e6:.1f} us", flush=True)
  print(f"RATIO grpo_flat_groups_tree_over_flat_reference {t_tree / t_flat:.2f}", flush=True)


def bench_pack(trees, repeats):
  """Host packing of the PORTool-shaped trees (checks included, as the trainer runs it)."""
  pack(trees[:2], Buckets(trees=None))
  best = _time(lambda: pack(trees, Buckets(trees=None)).tokens, repeats)
  print(f"METRIC pack.portool_trees.T{len(trees)}.ms {best * 1e3:.1f}", flush=True)


def bench_omega(length, rows, repeats):
  gamma = 2 ** (-1 / 32)
  x = jnp.asarray(np.random.default_rng(0).normal(0, 0.05, (rows, length)), jnp.float32)

  def quadratic(x):
    i = jnp.arange(x.shape[-1])
    decay = jnp.where(i[None, :] >= i[:, None],
                      gamma ** (i[None, :] - i[:, None]).astype(jnp.float32), 0.0)
    return x @ decay.T

  scan = jax.jit(lambda x: discounted_reverse_cumsum(x, gamma))
  quad = jax.jit(quadratic)
  np.testing.assert_allclose(scan(x), quad(x), rtol=1e-3, atol=1e-3)
  t_scan, t_quad = _time(lambda: scan(x), repeats), _time(lambda: quad(x), repeats)
  m_scan = scan.lower(x).compile().memory_analysis()
  m_quad = quad.lower(x).compile().memory_analysis()
  print(f"# omega L={length} rows={rows}: scan {t_scan * 1e3:.2f} ms, O(L^2) {t_quad * 1e3:.2f} ms")
  print(f"RATIO omega_scan_vs_quadratic_L{length} {t_quad / t_scan:.1f}")
  if m_scan is not None and m_quad is not None:
    ms = m_scan.temp_size_in_bytes + m_scan.output_size_in_bytes
    mq = m_quad.temp_size_in_bytes + m_quad.output_size_in_bytes
    print(f"# omega memory: scan {ms / 2**20:.1f} MiB, O(L^2) {mq / 2**20:.1f} MiB")
    print(f"RATIO omega_memory_quadratic_over_scan_L{length} {mq / ms:.1f}")
    # Linear in L: doubling L doubles the scan's memory.
    x2 = jnp.concatenate([x, x], axis=-1)
    m2 = scan.lower(x2).compile().memory_analysis()
    ms2 = m2.temp_size_in_bytes + m2.output_size_in_bytes
    print(f"# omega scan memory at 2L / at L: {ms2 / ms:.2f} (linear in L: 2.0)")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trees", type=int, default=512)
  parser.add_argument("--rollout-tokens", type=int, default=2048)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--omega-length", type=int, default=4096, help="L of the Omega figure")
  parser.add_argument("--omega-rows", type=int, default=64, help="rows of the Omega figure")
  parser.add_argument("--quick", action="store_true", help="32 trees, 256-token rollouts")
  parser.add_argument("--smoke", action="store_true",
                      help="quickest run: 4 trees, 256-token rollouts, Omega at L=1024 x 16 rows")
  args = parser.parse_args()
  if args.quick and args.smoke:
    parser.error("--quick and --smoke are exclusive")
  if args.quick:
    args.trees, args.rollout_tokens = 32, 256
  if args.smoke:
    args.trees, args.rollout_tokens, args.omega_length, args.omega_rows = 4, 256, 1024, 16
  if args.rollout_tokens <= 128:
    # appo_tree puts its tool-output spans in [64, length - 64).
    parser.error(f"--rollout-tokens must exceed 128, got {args.rollout_tokens}")
  print(f"# jax {jax.__version__} on {jax.devices()[0].platform}; {args.trees} trees per shape")
  rng = np.random.default_rng(0)

  bench_flat_grpo(rng, 512 if args.trees >= 512 else 8, 8, args.repeats)
  pt = [portool_tree(rng) for _ in range(args.trees)]
  bench_pack(pt, args.repeats)
  pt_batch = pack(pt, Buckets(trees=None))
  print(f"# portool-shaped batch {pt_batch.shape}")
  refs = dict(ref_baselines.REFERENCES, portool=ref_portool.reference, awpo=ref_awpo.reference)
  for name in ("grpo", "dr_grpo", "dapo", "rloo", "arpo", "tree_grpo", "tree_rpo", "portool",
               "awpo"):
    bench_estimator(f"{name}_portool_trees", name, registry.get(name).config_cls(), pt, pt_batch,
                    per_tree(refs[name]), {}, args.repeats)

  ap = [appo_tree(rng, length=args.rollout_tokens) for _ in range(args.trees)]
  ap_batch = pack(ap, Buckets(trees=None))
  print(f"# appo-shaped batch {ap_batch.shape}")
  shape = ap_batch.tokens.shape
  inputs = {"logp": ap_batch.behavior_logp + jnp.asarray(rng.normal(0, 0.05, shape), jnp.float32),
            "entropy": jnp.asarray(rng.uniform(0, 3, shape), jnp.float32)}
  cfg = algos.make_config("appo")
  bench_estimator("appo_appo_trees", "appo", cfg, ap, ap_batch,
                  appo_reference(np.asarray(inputs["logp"])), inputs, args.repeats)
  for name in ("grpo", "tree_rpo"):
    bench_estimator(f"{name}_appo_trees", name, registry.get(name).config_cls(), ap, ap_batch,
                    per_tree(refs[name]), {}, args.repeats)

  bench_omega(args.omega_length, args.omega_rows, args.repeats)


if __name__ == "__main__":
  main()
