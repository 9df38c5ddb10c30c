"""The training-inference mismatch: the sampler's recorded log-probs against the learner's.

    python benchmarks/precision.py [--tasks 16] [--samples 4] [--max-new 96]
        [--temperature 0.6] [--model smollm2|tiny] [--smoke]

On-policy, the PPO ratio pi_learner / pi_sampler is 1 at every sampled token; any
difference is numerics (two programs computing the same policy: the sampler's
cached decode and the learner's packed tree forward). For each dtype of
`config.model.dtype` (float32, bfloat16), the same weights sample `--samples`
answers to each of `--tasks` tool-world prompts (the main job's tasks, chat format
and temperature; the sampler records the untempered policy's log-probs) with the
JAX sampler, then the learner scores the packed trees as the update step does
(`tree_logprobs`, blockwise attention fitted to the batch). Per dtype it prints,
over every sampled token:

  METRIC mismatch_mean_abs_log_ratio_<dtype> <mean |log pi_learner - log pi_sampler|>
  METRIC mismatch_frac_ratio_off_0.2_<dtype> <fraction of tokens with |ratio - 1| > 0.2>
  METRIC mismatch_max_abs_log_ratio_<dtype> <max>
  METRIC mismatch_tokens_<dtype> <tokens>
  RATIO mismatch_bf16_over_f32 <mean |log ratio| in bf16 over f32>

Default model: SmolLM2-135M-Instruct (the main job's). `--smoke` (CI): 2 tasks,
2 samples, 16 new tokens. The figures in docs/gpu.md are from the default run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tree_rl.config_types import ModelSpec  # noqa: E402
from tree_rl.envs import make_family  # noqa: E402
from tree_rl.policy import build_policy  # noqa: E402
from tree_rl.rollout.chat import ChatFormat  # noqa: E402
from tree_rl.rollout.engine import GenerationRequest, SamplingParams  # noqa: E402
from tree_rl.rollout.jax_sampler import JaxSampler  # noqa: E402
from tree_rl.tree import Buckets, NodeKind, RolloutTree, pack  # noqa: E402


def mismatch(model, tokenizer, prompts: list[list[int]], samples: int, max_new: int,
             temperature: float, seed: int = 0) -> dict[str, float]:
  """Sampler vs learner log-probs of `samples` answers to each prompt (one tree each)."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from tree_rl.models.attention import AttentionFitter  # noqa: PLC0415
  from tree_rl.models.logprobs import tree_logprobs  # noqa: PLC0415

  chat = ChatFormat.from_tokenizer(tokenizer)
  longest = max(map(len, prompts)) + max_new + 1
  sampler = JaxSampler(model, rows=max(4, samples), slots=1 << (longest - 1).bit_length(),
                       tokenizer=tokenizer, eos_ids=chat.eos_ids, seed=seed)
  params = SamplingParams(max_new_tokens=max_new, temperature=temperature)
  trees = []
  for prompt in prompts:
    results = sampler.generate([GenerationRequest(tuple(prompt), params)] * samples)
    tree = RolloutTree.new(list(prompt))
    for r in results:
      if not r.tokens:
        continue
      node = tree.add_node(0, NodeKind.POLICY, list(r.tokens), logprobs=list(r.logprobs))
      tree.add_leaf(node, {"outcome": 0.0})
    if tree.leaves:
      trees.append(tree)
  batch = pack(trees, Buckets(tokens=tuple(256 * i for i in range(1, 65)), trees=None))
  # The learner as the trainer runs it: its attention fitted to the batch (blockwise).
  fitted = nnx.merge(AttentionFitter(model).graphdef(batch), nnx.state(model))
  graphdef, state = nnx.split(fitted)
  learner, _ = jax.jit(lambda s, b: tree_logprobs(nnx.merge(graphdef, s), b))(state, batch)
  policy = np.asarray(batch.loss_mask)
  log_ratio = (np.asarray(learner, np.float64) - np.asarray(batch.behavior_logp, np.float64)
               )[policy]
  if not np.isfinite(log_ratio).all():
    raise FloatingPointError(f"{int((~np.isfinite(log_ratio)).sum())} non-finite log-ratios")
  ratio = np.exp(log_ratio)
  return {"mean_abs_log_ratio": float(np.abs(log_ratio).mean()),
          "frac_ratio_off_0.2": float((np.abs(ratio - 1) > 0.2).mean()),
          "max_abs_log_ratio": float(np.abs(log_ratio).max()), "tokens": int(policy.sum())}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tasks", type=int, default=16)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--max-new", type=int, default=96)
  p.add_argument("--temperature", type=float, default=0.6)
  p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args()
  if args.smoke:
    args.tasks, args.samples, args.max_new = 2, 2, 16
  # The main job's tasks (configs/apppo.py): 3 tools a task, difficulty-1 questions.
  family = make_family("toolworld", tools_per_task=3, difficulties=(1,))
  tasks = family.generate("eval", args.tasks, 0)
  figures = {}
  for dtype in ("float32", "bfloat16"):
    start = time.perf_counter()
    spec = ModelSpec(name=args.model, dtype=dtype, lora_rank=0, attention="blockwise")
    model, tokenizer = build_policy(spec, 0)
    chat = ChatFormat.from_tokenizer(tokenizer)
    prompts = [chat.prompt_tokens(t.messages) for t in tasks]
    m = mismatch(model, tokenizer, prompts, args.samples, args.max_new, args.temperature)
    figures[dtype] = m
    for name, value in m.items():
      print(f"METRIC mismatch_{name}_{dtype} {value:.6g}", flush=True)
    print(f"# {dtype}: {time.perf_counter() - start:.0f} s", flush=True)
  f32, bf16 = (figures[d]["mean_abs_log_ratio"] for d in ("float32", "bfloat16"))
  print(f"RATIO mismatch_bf16_over_f32 {bf16 / max(f32, 1e-12):.1f}")


if __name__ == "__main__":
  main()
