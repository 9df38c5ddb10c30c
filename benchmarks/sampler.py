"""The embedded JAX sampler against vLLM, and the prefill that forking saves on PORTool trees.

    python benchmarks/sampler.py [--batch 16] [--prompt-min 32] [--prompt-max 128]
        [--max-new 64] [--reps 2] [--trees 2] [--n 8] [--f 2] [--t-max 6]
        [--no-vllm] [--decode-bound] [--decode-batch 64] [--hbm-gbps X] [--smoke]

Model: SmolLM2-135M-Instruct in float32 (the folder of
`gguf_import.default_model_dir()`). Prints one line per figure:

  RATIO jax_over_vllm_tokens_per_s <x>
      JaxSampler and VLLMEngine on the same batch: `--batch` prompts of random
      token ids with lengths spread over [prompt-min, prompt-max], each
      sampling `--max-new` tokens at temperature 1 (EOS off, so every request
      generates the same count). Generated tokens over the wall time of a
      `generate` call (prefill + decode), best of `--reps` after one warm-up
      call of the same shapes, the engines taking turns on each batch (the
      machine may be shared); fresh prompts every batch, so neither engine
      reuses a cached prefix. vLLM runs in float32 with its CPU defaults here
      (all cores but one). JaxSampler gets `--batch` cache rows, so the whole
      batch decodes at once as in vLLM. Needs vLLM (`$TREE_RL_VLLM_PYTHON`);
      without it a line says so and the ratio is skipped.
  METRIC jax_prefill_tokens_per_s <p>
      JaxSampler's prefill rate on the same kind of batch: prompt tokens over
      the wall time of a `generate` with one new token per request (so one
      decode step is included), best of `--reps` after a warm-up call.
  RATIO prefill_tokens_naive_over_forked <y>
      PORTool-shaped trees (Algorithm 1: n first steps; then every unfinished
      trajectory is copied f ways and n - n_done copies continue; T_max steps)
      grown turn by turn with JaxSampler, a scripted tool reply after every
      step. Naive: every request prefilled from scratch (the sum of context
      lengths). Forked: what JaxSampler ran, `GenerationResult.prefill_tokens`.
      With vLLM, its count on trees grown the same way follows as a comment.
  RATIO tree_rollout_wall_vllm_over_jax <w>
      Wall time to grow those trees with VLLMEngine (prefix caching on) over
      the time with JaxSampler, each timed on a second growth after the
      counting one above (the warm-up: JAX compiles its shape buckets there).
      JaxSampler's timed run uses a fresh engine (empty row cache, same seed,
      so the same shapes); vLLM keeps its cache, so it starts with the
      prompt's blocks cached. Both wall times follow as comments.
  RATIO decode_tokens_per_s_over_bandwidth_bound <z>     (GPU, or --decode-bound)
      JaxSampler's decode rate at batch `--decode-batch` over the rate at
      which reading the parameters and the live KV once per step saturates the
      memory bandwidth (HBM: from the device name, or `--hbm-gbps`).

The default run takes ~8 minutes on a shared 2-core CPU (JAX compilation, one
program per prefill-length bucket, and the vLLM start-up included). `--smoke`
(CI's install check, about a minute without vLLM) measures the same figures
at the smallest sizes: 4 prompts of 8-16 tokens x 8 new tokens, one timed
batch; one PORTool tree with n=4, T_max=2 and steps of at most 8 tokens; and,
where it runs, the decode figure at batch 8.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tree_rl.models import ModelConfig, gguf_import, hf_io  # noqa: E402
from tree_rl.rollout.engine import GenerationRequest, SamplingParams  # noqa: E402
from tree_rl.rollout.jax_sampler import JaxSampler  # noqa: E402
from tree_rl.rollout.vllm_engine import VLLM_PYTHON_ENV, VLLMEngine, find_vllm_python  # noqa: E402

# Peak memory bandwidth, bytes/s, by a substring of jax's device_kind (vendor
# datasheets; SXM parts). `--hbm-gbps` overrides.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12,
                   "L4": 0.3e12, "A10": 0.6e12}

SYSTEM = """You are a helpful assistant with access to tools. To call one, write
<tool_call>{"name": ..., "arguments": {...}}</tool_call>. Tools:
{"name": "get_weather", "description": "Current weather for a city", "parameters":
 {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
 "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}
{"name": "search_flights", "description": "Flights between two airports on a date",
 "parameters": {"type": "object", "properties": {"origin": {"type": "string"},
 "destination": {"type": "string"}, "date": {"type": "string", "format": "date"}},
 "required": ["origin", "destination", "date"]}}
{"name": "convert_currency", "description": "Convert an amount between currencies",
 "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
 "from": {"type": "string"}, "to": {"type": "string"}}, "required": ["amount", "from", "to"]}}
Think step by step, call tools when needed, and finish with the final answer."""
QUESTION = ("I fly from Zurich to Lisbon next Friday. What will the weather be like there, "
            "and how much is 250 CHF in euros?")


def _tool_reply(step: int, k: int) -> str:
  """The scripted environment: a tool result, then the next assistant header."""
  return (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{{\"step\": {step}, \"result\": "
          f"{{\"temperature\": {12 + k % 9}, \"condition\": \"partly cloudy\", \"rate\": "
          f"0.{940 + k % 50}}}}}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------
# Throughput: the same batch through both engines
# ----------------------------------------------------------------------------


def _batch(rng, args, vocab):
  lengths = np.linspace(args.prompt_min, args.prompt_max, args.batch).astype(int)
  params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new)
  return [GenerationRequest(tuple(int(t) for t in rng.integers(100, vocab, n)), params)
          for n in lengths]


def _prefill_rate(engine, args, vocab) -> tuple[float, int, float]:
  """(prompt tokens per second, tokens, seconds) of one-token generations, best of --reps."""
  rng = np.random.default_rng(1)
  one = lambda: [GenerationRequest(r.tokens, SamplingParams(temperature=1.0, max_new_tokens=1))
                 for r in _batch(rng, args, vocab)]
  engine.generate(one())  # compile / warm up
  best = (0.0, 0, float("inf"))
  for _ in range(args.reps):
    reqs = one()
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    dt = time.perf_counter() - t0
    n = sum(r.prefill_tokens for r in res)
    if n / dt > best[0]:
      best = (n / dt, n, dt)
  return best


def _throughput(engines: dict, args, vocab) -> dict[str, tuple[float, float]]:
  """{name: (generated tokens per second, seconds)}, best of --reps after a warm-up call.

  The engines take turns on each batch, so a change in the machine's load
  (it is shared) hits both alike.
  """
  rng = np.random.default_rng(0)
  for eng in engines.values():
    eng.generate(_batch(rng, args, vocab))  # compile / warm up on the same shapes
  best = dict.fromkeys(engines, float("inf"))
  for _ in range(args.reps):
    reqs = _batch(rng, args, vocab)
    for name, eng in engines.items():
      t0 = time.perf_counter()
      res = eng.generate(reqs)
      dt = time.perf_counter() - t0
      n = sum(len(r.tokens) for r in res)
      if n != args.batch * args.max_new:
        raise RuntimeError(f"{name}: expected {args.batch * args.max_new} tokens, got {n}")
      best[name] = min(best[name], dt)
  return {name: (args.batch * args.max_new / dt, dt) for name, dt in best.items()}


# ----------------------------------------------------------------------------
# PORTool trees: naive vs forked prefill
# ----------------------------------------------------------------------------


def grow_portool_trees(engine, prompt, tokenizer, *, trees, n, f, t_max, max_new, p_finish,
                       seed) -> tuple[int, int, int]:
  """Grows `trees` PORTool trees with `engine`; returns (naive, actual, requests).

  Algorithm 1 of PORTool: step 1 samples n trajectories of the prompt; at each
  later step every unfinished trajectory gets a scripted tool reply, is copied
  f ways, and n - n_done of the copies continue (chosen at random). A
  trajectory ends after a step with probability `p_finish` (a scripted final
  answer), so the trees keep forking until T_max.
  """
  rng = np.random.default_rng(seed)
  params = SamplingParams(temperature=1.0, max_new_tokens=max_new)
  # One context per live trajectory; all trees advance together, one batch per step.
  live = [(tree, tuple(prompt)) for tree in range(trees) for _ in range(n)]
  done = [0] * trees
  naive = actual = requests = 0
  for step in range(1, t_max + 1):
    res = engine.generate([GenerationRequest(ctx, params) for _, ctx in live])
    naive += sum(len(ctx) for _, ctx in live)
    actual += sum(r.prefill_tokens for r in res)
    requests += len(live)
    survivors = []
    for k, ((tree, ctx), r) in enumerate(zip(live, res)):
      if rng.random() < p_finish or step == t_max:
        done[tree] += 1
        continue
      reply = tokenizer.encode(_tool_reply(step, k), add_special_tokens=False)
      survivors.append((tree, ctx + r.tokens + tuple(reply)))
    if not survivors:
      break
    live = []
    for tree in range(trees):
      pool = [ctx for t, ctx in survivors if t == tree for _ in range(f)]
      keep = rng.choice(len(pool), n - done[tree], replace=False) if pool else []
      live += [(tree, pool[i]) for i in sorted(keep)]
  return naive, actual, requests


# ----------------------------------------------------------------------------
# GPU: decode rate against the memory-bandwidth bound
# ----------------------------------------------------------------------------


def decode_vs_bandwidth(model, config: ModelConfig, args):
  dev = jax.devices()[0]
  bw = args.hbm_gbps * 1e9 if args.hbm_gbps else next(
      (v for k, v in HBM_BYTES_PER_S.items() if k in dev.device_kind), None)
  if bw is None:
    print(f"# decode bound skipped: unknown bandwidth for {dev.device_kind!r}; pass --hbm-gbps")
    return
  b, prompt, steps = args.decode_batch, args.decode_prompt, args.decode_steps
  eng = JaxSampler(model, rows=b, slots=1 << (prompt + steps).bit_length(), seed=0)
  rng = np.random.default_rng(1)

  def reqs(max_new):
    p = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    return [GenerationRequest(tuple(int(t) for t in rng.integers(100, config.vocab_size, prompt)),
                              p) for _ in range(b)]

  def timed(max_new):
    eng.generate(reqs(max_new))  # compile
    t0 = time.perf_counter()
    eng.generate(reqs(max_new))
    return time.perf_counter() - t0

  t_prefill, t_full = timed(1), timed(steps)
  rate = b * (steps - 1) / (t_full - t_prefill)
  # Bytes one decode step must read: the sampling weights once (`decode_bytes`: matrices
  # in the model's dtype) and each row's live KV (its mean length over the decode).
  act = 2 if config.dtype == "bfloat16" else 4
  param_bytes = eng.weights.decode_bytes()
  kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * act
  kv_bytes = b * (prompt + steps / 2) * kv_per_token
  bound = b * bw / (param_bytes + kv_bytes)
  print(f"# decode on {dev.device_kind}: batch {b}, {rate:.0f} tokens/s; bound {bound:.0f} tokens/s"
        f" ({param_bytes / 2**20:.0f} MiB params + {kv_bytes / 2**20:.0f} MiB KV per step at"
        f" {bw / 1e9:.0f} GB/s)")
  print(f"RATIO decode_tokens_per_s_over_bandwidth_bound {rate / bound:.3f}")


# ----------------------------------------------------------------------------


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--prompt-min", type=int, default=32)
  parser.add_argument("--prompt-max", type=int, default=128)
  parser.add_argument("--max-new", type=int, default=64)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--trees", type=int, default=2)
  parser.add_argument("--n", type=int, default=8)
  parser.add_argument("--f", type=int, default=2)
  parser.add_argument("--t-max", type=int, default=6)
  parser.add_argument("--step-tokens", type=int, default=48, help="max new tokens per tree step")
  parser.add_argument("--p-finish", type=float, default=0.3)
  parser.add_argument("--no-vllm", action="store_true", help="JaxSampler figures only")
  parser.add_argument("--decode-bound", action="store_true",
                      help="run the decode-vs-bandwidth figure off GPU too")
  parser.add_argument("--decode-batch", type=int, default=64)
  parser.add_argument("--decode-prompt", type=int, default=128)
  parser.add_argument("--decode-steps", type=int, default=256)
  parser.add_argument("--hbm-gbps", type=float, default=None)
  parser.add_argument("--smoke", action="store_true",
                      help="quickest run: every figure at the smallest sizes")
  args = parser.parse_args()
  if args.smoke:
    for k, v in dict(batch=4, prompt_min=8, prompt_max=16, max_new=8, reps=1, trees=1, n=4,
                     t_max=2, step_tokens=8, decode_batch=8, decode_prompt=16,
                     decode_steps=16).items():
      setattr(args, k, v)

  from transformers import AutoTokenizer  # noqa: PLC0415

  folder = str(gguf_import.default_model_dir())
  model = hf_io.load_hf(folder)  # float32
  config = model.config
  tokenizer = AutoTokenizer.from_pretrained(folder)
  eos = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
  prompt = tokenizer.apply_chat_template(
      [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
      tokenize=True, add_generation_prompt=True)
  prompt = list(getattr(prompt, "input_ids", prompt))
  dev = jax.devices()[0]
  print(f"# SmolLM2-135M-Instruct float32, jax {jax.__version__} on {dev.platform}"
        f" ({dev.device_kind}), {os.cpu_count()} CPUs")

  # --- Throughput: both engines on the same batches ------------------------
  slots = 1 << (args.prompt_max + args.max_new - 1).bit_length()
  tree_len = len(prompt) + args.t_max * (args.step_tokens + 64)
  tree_slots = 1 << (tree_len - 1).bit_length()
  python = None if args.no_vllm else find_vllm_python()
  vllm = None
  if python is None:
    if args.no_vllm:
      why = "--no-vllm"
    elif os.environ.get(VLLM_PYTHON_ENV):
      why = f"${VLLM_PYTHON_ENV}={os.environ[VLLM_PYTHON_ENV]!r} is not an executable file"
    else:
      why = f"no interpreter with vLLM: set ${VLLM_PYTHON_ENV}"
    print(f"# vLLM not available ({why}): skipping RATIO jax_over_vllm_tokens_per_s")
  else:
    t0 = time.perf_counter()
    vllm = VLLMEngine(folder, python=python, max_model_len=max(slots, tree_slots), eos_ids=(),
                      seed=0)
    print(f"# vLLM {vllm.info['vllm_version']} up in {time.perf_counter() - t0:.0f}s"
          f" (block size {vllm.info['block_size']}) [{_elapsed()}]")
  try:
    engines = {"JaxSampler": JaxSampler(model, rows=args.batch, slots=slots, seed=0)}
    if vllm is not None:
      engines["VLLMEngine"] = vllm
    rates = _throughput(engines, args, config.vocab_size)
    for name, (rate, sec) in rates.items():
      print(f"# {name}: {rate:.1f} tokens/s ({args.batch} x {args.max_new} tokens in {sec:.2f}s;"
            f" prompts {args.prompt_min}-{args.prompt_max}) [{_elapsed()}]")
    if vllm is not None:
      print(f"RATIO jax_over_vllm_tokens_per_s"
            f" {rates['JaxSampler'][0] / rates['VLLMEngine'][0]:.3f}")
    jax_rate, n_pre, t_pre = _prefill_rate(engines["JaxSampler"], args, config.vocab_size)
    print(f"# JaxSampler prefill: {n_pre} prompt tokens of {args.batch} requests in {t_pre:.2f}s"
          f" [{_elapsed()}]")
    print(f"METRIC jax_prefill_tokens_per_s {jax_rate:.1f}")
    del engines

    # --- PORTool trees: prefill with and without forking ---------------------
    # One row per live trajectory is enough: a call gathers every source row
    # before it writes any, so a trajectory's row can be reused by its copies.
    rows = args.trees * args.n
    tree_kw = dict(trees=args.trees, n=args.n, f=args.f, t_max=args.t_max,
                   max_new=args.step_tokens, p_finish=args.p_finish, seed=0)
    jax_tree = JaxSampler(model, rows=rows, slots=tree_slots, eos_ids=eos, seed=0)
    naive, forked, nreq = grow_portool_trees(jax_tree, prompt, tokenizer, **tree_kw)
    jax_tree = JaxSampler(model, rows=rows, slots=tree_slots, eos_ids=eos, seed=0)
    t0 = time.perf_counter()
    grow_portool_trees(jax_tree, prompt, tokenizer, **tree_kw)
    jax_wall = time.perf_counter() - t0
    del jax_tree
    print(f"# PORTool trees ({args.trees} x n={args.n}, f={args.f}, T_max={args.t_max},"
          f" prompt {len(prompt)} tokens, steps <= {args.step_tokens} tokens): {nreq} requests,"
          f" naive prefill {naive} tokens, JaxSampler {forked} [{_elapsed()}]")
    print(f"RATIO prefill_tokens_naive_over_forked {naive / forked:.2f}")
    if vllm is not None:
      vllm.eos_ids = eos  # the trees' steps end at <|im_end|>, as JaxSampler's did
      naive_v, cached_v, _ = grow_portool_trees(vllm, prompt, tokenizer, **tree_kw)
      print(f"# vLLM prefix caching on trees grown the same way: naive {naive_v}, vLLM"
            f" {cached_v} tokens ({naive_v / cached_v:.2f}x; it caches whole"
            f" {vllm.info['block_size']}-token blocks only) [{_elapsed()}]")
      t0 = time.perf_counter()
      grow_portool_trees(vllm, prompt, tokenizer, **tree_kw)
      vllm_wall = time.perf_counter() - t0
    print(f"# tree rollout wall (second growth): JaxSampler {jax_wall:.2f}s"
          + (f", VLLMEngine {vllm_wall:.2f}s" if vllm is not None else "") + f" [{_elapsed()}]")
    if vllm is not None:
      print(f"RATIO tree_rollout_wall_vllm_over_jax {vllm_wall / jax_wall:.3f}")
  finally:
    if vllm is not None:
      vllm.close()

  if jax.default_backend() == "gpu" or args.decode_bound:
    decode_vs_bandwidth(model, config, args)


_START = time.perf_counter()


def _elapsed() -> str:
  return f"{time.perf_counter() - _START:.0f}s"


if __name__ == "__main__":
  main()
