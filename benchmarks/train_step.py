"""PPO update step on packed rollout trees against the same rollouts flattened.

    python benchmarks/train_step.py [--quick | --smoke] [--repeats 3] [--smol-layers 30]
        [--smol-keep 1] [--appo-length 1024] [--block 128]   (the GPU defaults)

For PORTool-shaped trees (n=8 trajectories, fork factor f=2, a few tool
steps) and APPO-shaped trees (N=4 initial rollouts, B=3 branches each), and
for a tiny model and a SmolLM2-135M-sized model (random init), runs the same
jitted `update_step` on

  * tree:  one packed row per tree, every shared prefix stored once, tree
           attention;
  * packed flat: the baseline, one segment per root-to-leaf path (the prompt and
           every shared prefix copied into each path), paths packed first-fit
           into rows as long as the longest path, causal attention inside each
           path, as verl and AReaL pack sequences;
  * padded flat: one row per path, padded to the longest path (a second line
           only: no trainer pads like that).

Every layout attends densely over rows of up to 512 tokens and blockwise
(visible key blocks only) over longer rows.

All layouts get identical initial parameters and identical GRPO advantages
(computed once from the tree and passed in), so their first-step losses agree;
that is printed as a check. Prints, per tree shape and model:

    RATIO tokens_flat_over_tree_<case> <flattened tokens / unique tokens>
    RATIO step_time_flat_over_tree_<case> <packed flat step time / tree step time>
    RATIO step_time_padded_flat_over_tree_<case> <padded flat step time / tree step time>
    RATIO peak_memory_flat_over_tree_<case> <packed flat / tree compiled peak bytes>

Step times are the best of --repeats runs after compilation, all layouts in
this process (the ratio is what is meaningful on a noisy machine). On CPU the
defaults fit 8 minutes on 2 cores: SmolLM2 keeps 2 of its 30 layers and
every node of its trees is cut to a quarter of its tokens (`shrink`), APPO
rollouts are 256 tokens, and the blockwise attention block is 32; every such
reduction is named in the printed context lines. Peak memory
is the compiled executable's memory_analysis() (CPU has no device peak
counter); on GPU the allocator's peak_bytes_in_use is printed as well, and so
is the update step's MFU for a 0.5B-parameter bf16 model.

`--smoke` (CI's install check, 1-3 minutes on 2 cores, nearly all of it
compilation) measures the tiny model only, with 1 layer, on one tree per shape
(PORTool T_max=2, 192-token APPO rollouts) and one timed call per layout: the
same code and the same RATIO lines for the `*_tiny` cases, at sizes where the
ratios are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from advantages import appo_tree, portool_tree  # noqa: E402
from tree_rl.algos import ppo  # noqa: E402
from tree_rl.algos.grpo import tree_zscore  # noqa: E402
from tree_rl.algos.registry import Advantages, compute_advantages  # noqa: E402
from tree_rl.models import Decoder, ModelConfig  # noqa: E402
from tree_rl.models.attention import AttentionConfig, max_visible_blocks  # noqa: E402
from tree_rl.tree import Buckets, RolloutTree, derived, pack  # noqa: E402
from tree_rl.tree.batch import _policy_width, padded_arrays  # noqa: E402

DENSE_MAX = 512  # rows up to this many tokens use dense attention, longer ones blockwise
PEAK_BF16_FLOPS = 989e12  # dense bf16 FLOP/s of an H100 SXM; an H200 has the same


def tiny_config(layers: int = 2) -> ModelConfig:
  return ModelConfig.tiny("llama", vocab_size=1024, num_hidden_layers=layers)


def smollm2_config(layers: int = 30) -> ModelConfig:
  return ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, tie_word_embeddings=True)


def half_b_config() -> ModelConfig:
  """A Qwen2-0.5B-sized model (random init) in bf16, for the MFU figure."""
  return ModelConfig(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                     num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     head_dim=64, tie_word_embeddings=True, attention_bias=True,
                     dtype="bfloat16")


# ----------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------


def shrink(tree: RolloutTree, keep: float) -> RolloutTree:
  """The same branching with every node cut to its first ceil(keep * len) tokens.

  advantages.py fixes the per-node token counts of real rollouts; CPU runs
  scale them down this way so that the sharing ratio (which only depends on
  the shape) stays roughly the same while the step gets cheaper.
  """
  if keep >= 1.0:
    return tree
  cut = lambda xs: None if xs is None else xs[:max(1, int(np.ceil(keep * len(xs))))]
  out = RolloutTree.new(cut(tree.nodes[0].tokens))
  for node in tree.nodes[1:]:
    out.add_node(node.parent, node.kind, cut(node.tokens), logprobs=cut(node.logprobs),
                 step=node.step, rewards=node.rewards)
  for leaf in tree.leaves:
    out.add_leaf(leaf.node, leaf.rewards, truncated=leaf.truncated, tag=leaf.tag)
  return out


def flatten(trees: list[RolloutTree]) -> list[RolloutTree]:
  """One chain tree per root-to-leaf path: nothing is shared between chains.

  Chains come tree by tree in the canonical leaf order that `pack` uses, i.e.
  in the order of the valid leaves of the packed tree batch.
  """
  chains = []
  for tree in trees:
    canon = tree.canonical()
    for leaf in canon.leaves:
      path = canon.path(leaf.node)
      chain = RolloutTree.new(canon.nodes[path[0]].tokens)
      last = 0
      for i in path[1:]:
        node = canon.nodes[i]
        last = chain.add_node(last, node.kind, node.tokens, logprobs=node.logprobs,
                              step=node.step, rewards=node.rewards)
      chain.add_leaf(last, leaf.rewards, truncated=leaf.truncated, tag=leaf.tag)
      chains.append(chain)
  return chains


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def pack_rows(trees: list[RolloutTree], block: int):
  """One row per tree, padded to its longest tree (exact node/leaf counts).

  Rows longer than DENSE_MAX use blockwise attention, which needs a multiple
  of the block; shorter rows (flattened paths, small trees) stay dense.
  """
  longest = max(t.num_tokens() for t in trees)
  length = round_up(longest, block if longest > DENSE_MAX else 8)
  return pack(trees, Buckets(tokens=(length,), nodes=(), leaves=(), path_tokens=(), trees=None))


def pack_flat_rows(chains: list[RolloutTree], block: int):
  """The packed flat baseline: root-to-leaf paths placed first-fit (longest first) into rows
  as long as the longest path, several paths per row, each its own causal segment.

  This is sequence packing as verl and AReaL do it (no padding to the longest path per
  path). A row is a forest: every path keeps its own root and positions, so a token sees
  only its own path (the ancestor mask is block-diagonal causal, and blockwise attention
  skips the blocks between paths). Only for this benchmark: the group estimators take a
  row to be one tree, so advantages are passed in, not estimated on these rows.
  """
  one = pack(chains, Buckets.exact())
  arr = {f.name: np.asarray(getattr(one, f.name)) for f in dataclasses.fields(one)
         if f.metadata.get("pytree_node", True)}  # the array fields
  n_tok = (arr["node_of_token"] >= 0).sum(1)
  n_node = (arr["node_kind"] >= 0).sum(1)
  longest = int(n_tok.max())
  length = round_up(longest, block if longest > DENSE_MAX else 8)
  rows: list[list[int]] = []
  room: list[int] = []
  for c in np.argsort(-n_tok, kind="stable"):
    r = next((i for i, free in enumerate(room) if free >= n_tok[c]), len(rows))
    if r == len(rows):
      rows.append([])
      room.append(length)
    rows[r].append(int(c))
    room[r] -= int(n_tok[c])
  for row in rows:
    row.sort()  # chain order inside a row, so leaves keep the chains' relative order
  n_rows, n_nodes = len(rows), max(int(n_node[row].sum()) for row in rows)
  k = max(len(row) for row in rows)
  out = padded_arrays(n_rows, length, n_nodes, k, arr["node_reward"].shape[-1])
  order = []  # (row, leaf slot) of every chain, in chain order
  for r, row in enumerate(rows):
    o = q = 0
    for j, c in enumerate(row):
      t, n = int(n_tok[c]), int(n_node[c])
      for f in ("tokens", "positions", "loss_mask", "behavior_logp"):
        out[f][r, o:o + t] = arr[f][c, :t]
      out["node_of_token"][r, o:o + t] = arr["node_of_token"][c, :t] + q
      for f in ("node_kind", "step", "node_reward", "node_tokens", "node_policy_tokens"):
        out[f][r, q:q + n] = arr[f][c, :n]
      par = arr["parent"][c, :n]
      out["parent"][r, q:q + n] = np.where(par >= 0, par + q, -1)
      out["subtree_end"][r, q:q + n] = arr["subtree_end"][c, :n] + q
      out["leaf_node"][r, j] = arr["leaf_node"][c, 0] + q
      out["leaf_reward"][r, j] = arr["leaf_reward"][c, 0]
      out["leaf_tag"][r, j] = arr["leaf_tag"][c, 0]
      order.append((c, r, j))
      o, q = o + t, q + n
  # max_loss_tokens: the policy-only vocabulary projection, sized as pack() sizes it.
  batch = one.replace(**{f: jnp.asarray(v) for f, v in out.items()},
                      max_loss_tokens=_policy_width(int(out["loss_mask"].sum(1).max()), length,
                                                    True))
  slots = [(r, j) for _, r, j in sorted(order)]
  return batch, slots


def attention_for(batch, block: int) -> AttentionConfig:
  # Dense is the cheapest exact attention for short rows (a flattened path is
  # plain causal); past DENSE_MAX the [L, L] scores of a packed tree are
  # mostly cross-branch pairs that blockwise attention skips.
  if batch.tokens.shape[1] <= DENSE_MAX:
    return AttentionConfig("dense")
  m = max_visible_blocks(np.asarray(batch.node_of_token), np.asarray(batch.parent), block,
                         np.asarray(batch.subtree_end))
  return AttentionConfig("blockwise", block, m)


def logprob_chunk(length: int) -> int:
  """The largest divisor of the row length <= 512 that is a multiple of 8.

  chunked_logprobs pads rows to a multiple of the chunk; a divisor keeps
  either layout from projecting padding onto the vocabulary.
  """
  return max(c for c in range(8, min(length, 512) + 1, 8) if length % c == 0)


def advantages_for_layouts(tree_batch, flat_batch, packed_batch, packed_slots):
  """GRPO over each tree's leaves, then each path gets its leaf's value in both flat layouts.

  Passed to update_step explicitly: with the estimator run per layout, every
  one-leaf chain would be its own GRPO group (advantage 0), and the losses could
  not be compared.
  """
  tree_adv, leaf_adv, leaf_valid = _tree_side(tree_batch)
  per_chain = np.asarray(leaf_adv)[np.asarray(leaf_valid)]  # = chain order
  packed = np.zeros(packed_batch.leaf_node.shape, np.float32)
  for value, (r, j) in zip(per_chain, packed_slots):
    packed[r, j] = value
  return (tree_adv, _flat_side(flat_batch, jnp.asarray(per_chain)[:, None]),
          _flat_side(packed_batch, jnp.asarray(packed)))


# Jitted: run eagerly, the derived arrays and the estimator dispatch (and
# compile) op by op, ~20 s on a loaded 2-core CPU against ~2 s as one program.
@jax.jit
def _grpo(batch) -> Advantages:
  return compute_advantages("grpo", batch)


@jax.jit
def _tree_side(tree_batch):
  st = derived.structure(tree_batch)
  leaf_adv = tree_zscore(tree_batch.leaf_rewards("outcome"), st.leaf_valid, ddof=1,
                         eps=1e-6)  # [B, K]
  return compute_advantages("grpo", tree_batch), leaf_adv, st.leaf_valid


@jax.jit
def _flat_side(flat_batch, leaf_adv) -> Advantages:
  """leaf_adv: [R, K], each row's paths' values in leaf-slot order."""
  return Advantages.from_leaf_values(flat_batch.leaf_node >= 0, leaf_adv)


# ----------------------------------------------------------------------------
# One layout
# ----------------------------------------------------------------------------


def mem_parts(compiled) -> dict[str, int] | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  parts = dict(arg=m.argument_size_in_bytes, out=m.output_size_in_bytes,
               alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
  # The state is donated: outputs aliased to inputs share one buffer, count it once.
  parts["peak"] = parts["arg"] + parts["out"] - parts["alias"] + parts["temp"]
  return parts


def run_layout(config: ModelConfig, batch, adv, block: int, repeats: int) -> dict:
  """Compiles update_step for `batch`, then times `repeats` calls (best is kept)."""
  attention = attention_for(batch, block)
  model = Decoder(config, rngs=nnx.Rngs(0), attention_config=attention)
  optimizer = optax.adam(1e-6)
  state = ppo.init_state(model, optimizer)
  del model
  ppo_config = ppo.PPOConfig(estimator=None, logprob_chunk=logprob_chunk(batch.tokens.shape[1]))
  step = jax.jit(ppo.make_update_step(ppo_config, optimizer), donate_argnums=0)
  rng = jax.random.key(0)
  t0 = time.perf_counter()
  # One compile serves memory_analysis and every timed call.
  compiled = step.lower(state, batch, rng, adv).compile()
  t_compile = time.perf_counter() - t0
  mem = mem_parts(compiled)
  times, loss = [], None
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch, rng, adv)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
    if loss is None:
      loss = float(metrics["loss"])  # at the shared initial parameters
  gpu_peak = None
  dev = jax.devices()[0]
  if dev.platform == "gpu":
    gpu_peak = (dev.memory_stats() or {}).get("peak_bytes_in_use")
  del state
  return dict(time=min(times), compile=t_compile, mem=mem, loss=loss, gpu_peak=gpu_peak,
              attention=attention)


def mib(x):
  return f"{x / 2**20:.1f} MiB"


def pairs(batch) -> int:
  """Causal (query, key) pairs exact attention needs: a token at position p sees p + 1."""
  valid = np.asarray(batch.node_of_token) >= 0
  return int(((np.asarray(batch.positions) + 1) * valid).sum())


def describe(attn: AttentionConfig) -> str:
  if attn.impl == "dense":
    return "dense"
  return f"blockwise {attn.block}x{attn.max_kv_blocks}"


def bench_case(name, trees, config, note, block, repeats):
  chains = flatten(trees)
  unique = sum(t.num_tokens() for t in trees)
  flat_tokens = sum(c.num_tokens() for c in chains)
  tree_batch, flat_batch = pack_rows(trees, block), pack_rows(chains, block)
  packed_batch, slots = pack_flat_rows(chains, block)
  tree_adv, flat_adv, packed_adv = advantages_for_layouts(tree_batch, flat_batch, packed_batch,
                                                          slots)
  print(f"# {name}: {len(trees)} trees, {len(chains)} paths, {config.num_hidden_layers} layers"
        f" ({config.num_params / 1e6:.1f}M params){note}", flush=True)
  layouts = {"tree": (tree_batch, tree_adv), "packed flat": (packed_batch, packed_adv),
             "padded flat": (flat_batch, flat_adv)}
  res = {label: run_layout(config, b, a, block, repeats) for label, (b, a) in layouts.items()}
  print(f"# {name}: tokens unique {unique}, flattened {flat_tokens}; rows x length:"
        + ",".join(f" {label} {tuple(b.tokens.shape)} {describe(res[label]['attention'])}"
                   for label, (b, _) in layouts.items()))
  # Shared prefixes are the early, cheap-to-attend positions, so attention
  # work shrinks by less than the token count does.
  print(f"# {name}: causal (query, key) pairs flat/tree"
        f" {pairs(flat_batch) / pairs(tree_batch):.2f}")
  for label, r in res.items():
    m = r["mem"]
    mem = ("memory_analysis unavailable" if m is None else
           f"peak {mib(m['peak'])} = args {mib(m['arg'])} + out {mib(m['out'])}"
           f" - aliased {mib(m['alias'])} + temp {mib(m['temp'])}")
    gpu = "" if r["gpu_peak"] is None else f"; device peak_bytes_in_use {mib(r['gpu_peak'])}"
    print(f"# {name} {label}: step {r['time'] * 1e3:.1f} ms (compile {r['compile']:.1f} s),"
          f" first loss {r['loss']:.6f}; {mem}{gpu}")
  if res["tree"]["gpu_peak"] is not None:
    print(f"# {name}: peak_bytes_in_use is a running maximum over the process (tree ran first)")
  tree, packed, padded = res["tree"], res["packed flat"], res["padded flat"]
  print(f"RATIO tokens_flat_over_tree_{name} {flat_tokens / unique:.2f}")
  print(f"RATIO step_time_flat_over_tree_{name} {packed['time'] / tree['time']:.2f}")
  print(f"RATIO step_time_padded_flat_over_tree_{name} {padded['time'] / tree['time']:.2f}")
  if tree["mem"] is not None and packed["mem"] is not None:
    z = packed["mem"]["peak"] / tree["mem"]["peak"]
    print(f"RATIO peak_memory_flat_over_tree_{name} {z:.2f}")
  sys.stdout.flush()


def bench_mfu(trees, block, repeats, layers=None, peak=PEAK_BF16_FLOPS):
  """MFU = 6 * params * tokens / step time / peak bf16 FLOP/s, tree layout.

  tokens: the unique (unpadded) tokens of the packed trees, each run forward
  and backward once; attention FLOPs are left out, as is usual for MFU.
  `layers` (default all 24) and `peak` let `--mfu` exercise it off GPU.
  """
  config = half_b_config()
  if layers is not None:
    config = dataclasses.replace(config, num_hidden_layers=layers)
  batch = pack_rows(trees, block)
  r = run_layout(config, batch, _grpo(batch), block, repeats)
  tokens = sum(t.num_tokens() for t in trees)
  mfu = 6 * config.num_params * tokens / r["time"] / peak
  print(f"# mfu: {config.num_params / 1e6:.0f}M params bf16, {config.num_hidden_layers} layers,"
        f" {len(trees)} PORTool trees, {tokens} tokens, step {r['time'] * 1e3:.1f} ms,"
        f" peak {peak:.3g} FLOP/s")
  print(f"RATIO mfu_portool_0p5b {mfu:.3f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer trees (compile-bound)")
  parser.add_argument("--smoke", action="store_true",
                      help="quickest run: tiny model only, one small tree per shape, one call")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per layout (best kept)")
  parser.add_argument("--tiny-trees", type=int, default=8)
  parser.add_argument("--tiny-layers", type=int, default=2)
  parser.add_argument("--smol-trees", type=int, default=2, help="0 skips the SmolLM2 cases")
  parser.add_argument("--smol-layers", type=int, default=None,
                      help="SmolLM2 layers (default: 30 on GPU, 2 on CPU)")
  parser.add_argument("--smol-keep", type=float, default=None,
                      help="fraction of every node's tokens kept for SmolLM2 (default: 1 on GPU,"
                           " 0.25 on CPU)")
  parser.add_argument("--t-max", type=int, default=4, help="PORTool tool steps")
  parser.add_argument("--appo-length", type=int, default=None,
                      help="APPO rollout tokens (default: 1024 on GPU, 256 on CPU)")
  parser.add_argument("--block", type=int, default=None,
                      help="blockwise attention block (default: 128 on GPU, 32 on CPU)")
  parser.add_argument("--mfu", action="store_true",
                      help="measure the MFU figure off GPU too (with --mfu-layers, --peak-flops)")
  parser.add_argument("--mfu-layers", type=int, default=None,
                      help="layers of the 0.5B model for the MFU figure (default 24)")
  parser.add_argument("--mfu-trees", type=int, default=8)
  parser.add_argument("--peak-flops", type=float, default=PEAK_BF16_FLOPS,
                      help="the device's peak bf16 FLOP/s (default: H100 SXM dense)")
  parser.add_argument("--only-mfu", action="store_true", help="skip the tree/flat cases")
  args = parser.parse_args()
  if args.quick and args.smoke:
    parser.error("--quick and --smoke are exclusive")
  if args.smoke:
    args.tiny_trees, args.tiny_layers, args.smol_trees, args.repeats, args.t_max = 1, 1, 0, 1, 2
    args.appo_length = args.appo_length or 192
  if args.appo_length is not None and args.appo_length <= 128:
    # appo_tree puts its tool-output spans in [64, length - 64).
    parser.error(f"--appo-length must exceed 128, got {args.appo_length}")
  gpu = jax.devices()[0].platform == "gpu"
  # CPU defaults keep the whole run under 8 minutes on 2 cores. The SmolLM2 step
  # costs ~5 ms of CPU per token even at 2 layers (the 49k-word vocabulary
  # projection is 28M of its 35M parameters), so it runs on shrunk trees. A
  # CPU has no matrix-unit tile to fill, so small attention blocks win there:
  # they skip more masked pairs (APPO tiny tree step: block 128 1.6 s, 32 0.64 s).
  defaults = dict(smol_layers=30, smol_keep=1.0, appo_length=1024, block=128) if gpu else \
      dict(smol_layers=2, smol_keep=0.25, appo_length=256, block=32)
  for k, v in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  if args.quick:
    args.tiny_trees, args.smol_trees = 2, 1
  print(f"# jax {jax.__version__} on {jax.devices()[0].platform}; best of {args.repeats} calls"
        f" after compilation; blockwise block {args.block}")
  rng = np.random.default_rng(0)
  smol = smollm2_config(args.smol_layers)
  smol_note = ""
  if args.smol_layers != 30:
    smol_note += f"; SmolLM2-sized but {args.smol_layers} of 30 layers to fit the time budget"
  if args.smol_keep < 1:
    smol_note += f"; every node cut to {args.smol_keep:g} of its tokens"
  shapes = (
      ("portool", lambda: portool_tree(rng, n=8, f=2, t_max=args.t_max)),
      ("appo", lambda: appo_tree(rng, n_init=4, n_branch=3, length=args.appo_length, prompt=64)),
  )
  for shape, make in shapes if not args.only_mfu else ():
    for size, config, n_trees, keep, note in (
        ("tiny", tiny_config(args.tiny_layers), args.tiny_trees, 1.0, ""),
        ("smollm2", smol, args.smol_trees, args.smol_keep, smol_note)):
      if n_trees == 0:
        print(f"# {shape}_{size}: skipped (0 trees)")
        continue
      trees = [shrink(make(), keep) for _ in range(n_trees)]
      bench_case(f"{shape}_{size}", trees, config, note, args.block, args.repeats)
  if gpu or args.mfu:
    bench_mfu([portool_tree(rng, n=8, f=2, t_max=6) for _ in range(args.mfu_trees)], args.block,
              args.repeats, args.mfu_layers, args.peak_flops)
  else:
    print("# no GPU: MFU not measured (--mfu measures it here)")


if __name__ == "__main__":
  main()
