"""Everything a GPU session measures, in one command: `python benchmarks/gpu_suite.py`.

    python benchmarks/gpu_suite.py [--out gpu_suite.json] [--only STAGE,...] [--dry-run]

Stages, in order (each prints `METRIC <name> <value>` / `RATIO <name> <value>` lines and
adds its figures to the JSON file `--out`; a stage that fails is recorded with its error
and the suite goes on):

  env          device kind, jax/jaxlib/flax versions, peak bf16 FLOP/s and memory bandwidth
  kernels      the kernel tests on the device: `pytest -m gpu tests/models` (Pallas
               kernels compiled by Triton against dense attention, values and gradients)
  attention    tree attention alone, forward + backward of one layer on an APPO-shaped
               tree: Pallas vs plain-JAX blockwise vs dense (dense only where [L, L] fits)
  tree_flat    the PPO update step on trees of ~8k and ~32k tokens against the same
               rollouts as packed flat rows (the strongest flat baseline: root-to-leaf paths
               packed first-fit, as verl and AReaL pack), both with the Pallas kernel;
               RATIO speedup_over_token_saving_<n>k = (flat time / tree time) /
               (flat tokens / tree tokens)
  mfu          update-step MFU of a 0.5B Qwen2-shaped bf16 model (Pallas attention),
               counting useful FLOPs only: 6 x layer parameters x tokens, the head over
               the scored tokens, and attention over visible (query, key) pairs; no
               padding, no masked pairs, no rematerialisation
  decode       JAX sampler decode tokens/s at batch 64 (SmolLM2-135M-shaped, bf16)
               against the card's memory-bandwidth bound
  grpo         a 3-step GRPO run of the trainer (`configs/grpo.py:runlocal`) with
               `model.attention=pallas`

Budget: sized for 8 minutes on one H100 or H200, compiles included (not yet timed on one). `--dry-run` runs every
stage on the CPU at tiny sizes (the kernels in interpret mode, blockwise in the trainer)
to prove the suite itself; CI runs it. Figures from GPU runs are in docs/performance.md.
An offline GPU machine lacks a few of tree_rl's dependencies:
`benchmarks/prepare_gpu_wheels.sh` downloads them into `gpu_wheels/` beforehand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import train_step  # noqa: E402
from advantages import appo_tree  # noqa: E402
from train_step import (advantages_for_layouts, flatten, pack_flat_rows, pack_rows,  # noqa: E402
                        round_up)
from tree_rl.algos import ppo  # noqa: E402
from tree_rl.lowering import QWEN2_0P5B, SMOLLM2_135M  # noqa: E402
from tree_rl.models import Decoder, ModelConfig  # noqa: E402
from tree_rl.models.attention import (AttentionConfig, TreeMask, attention,  # noqa: E402
                                      fit_attention)
from tree_rl.tree import Buckets, derived, pack  # noqa: E402

# train_step's packers round short rows to 8 tokens for its dense attention; every row
# here is a multiple of the attention block.
train_step.DENSE_MAX = 0

STAGES = ("env", "kernels", "attention", "tree_flat", "mfu", "decode", "grpo")
# Dense bf16 FLOP/s and HBM bytes/s by a substring of the device kind (SXM datasheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "L4": 0.3e12}


@dataclasses.dataclass
class Sizes:
  """What each stage runs at: the GPU sizes, or tiny ones for --dry-run."""

  block: int = 64
  tree_tokens: tuple[int, ...] = (8192, 32768)
  attention_tokens: int = 8192
  dense_max: int = 16384  # dense [L, L] attention only up to this many tokens
  flat_config: ModelConfig = dataclasses.replace(SMOLLM2_135M, dtype="bfloat16")
  mfu_config: ModelConfig = QWEN2_0P5B
  mfu_tokens: int = 8192
  mfu_trees: int = 4
  decode_config: ModelConfig = dataclasses.replace(SMOLLM2_135M, dtype="bfloat16")
  decode_batch: int = 64
  decode_prompt: int = 256
  decode_steps: int = 128
  repeats: int = 3
  attention_impl: str = "pallas"

  @staticmethod
  def dry() -> "Sizes":
    tiny = ModelConfig.tiny("llama", vocab_size=512, num_hidden_layers=1)
    return Sizes(block=16, tree_tokens=(512,), attention_tokens=512, dense_max=4096,
                 flat_config=tiny, mfu_config=dataclasses.replace(tiny, dtype="bfloat16"),
                 mfu_tokens=512, mfu_trees=2, decode_config=tiny, decode_batch=8,
                 decode_prompt=16, decode_steps=8, repeats=1, attention_impl="pallas")


class Report:
  """METRIC/RATIO lines on stdout and the same figures in a JSON file."""

  def __init__(self, path: str):
    self.path, self.data = path, {"stages": {}}
    self.stage = "setup"

  def begin(self, stage: str) -> None:
    self.stage = stage
    self.data["stages"][stage] = {"status": "running", "figures": {}}
    print(f"# == {stage} ==", flush=True)

  def figure(self, kind: str, name: str, value: float, note: str = "") -> None:
    print(f"{kind} {name} {value:.6g}" + (f"  # {note}" if note else ""), flush=True)
    self.data["stages"][self.stage]["figures"][name] = value

  def info(self, **kw) -> None:
    self.data["stages"][self.stage].update(kw)
    for k, v in kw.items():
      print(f"# {k}: {v}", flush=True)

  def end(self, status: str, seconds: float, error: str | None = None) -> None:
    entry = self.data["stages"][self.stage]
    entry.update(status=status, seconds=round(seconds, 1))
    if error:
      entry["error"] = error
    print(f"# {self.stage}: {status} in {seconds:.0f} s", flush=True)
    self.write()

  def write(self) -> None:
    with open(self.path, "w") as f:
      json.dump(self.data, f, indent=1)


def _lookup(table: dict, kind: str) -> float | None:
  return next((v for k, v in table.items() if k in kind), None)


def _timed(fn, *args, repeats: int) -> tuple[float, float]:
  """(best seconds of `repeats` calls, compile seconds) of a jitted `fn`."""
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    best = min(best, time.perf_counter() - t0)
  return best, compile_s


def _tree_of(tokens: int, seed: int):
  """An APPO-shaped tree (4 rollouts, 3 branches each, tool outputs inside) of ~`tokens`."""
  rng = np.random.default_rng(seed)
  return appo_tree(rng, n_init=4, n_branch=3, length=max(160, tokens // 10), prompt=64)


def _attention_config(impl: str, block: int, batch, dry: bool) -> AttentionConfig:
  if impl == "dense":
    return AttentionConfig()
  config = AttentionConfig(impl, block, 1 if impl == "blockwise" else 0,
                           interpret=True if dry and impl == "pallas" else None)
  return fit_attention(config, np.asarray(batch.node_of_token), np.asarray(batch.parent),
                       np.asarray(batch.subtree_end))


# ------------------------------------------------------------------- stages


def stage_env(report: Report, sizes: Sizes, dry: bool) -> None:
  import flax  # noqa: PLC0415
  import jaxlib  # noqa: PLC0415

  dev = jax.devices()[0]
  report.info(device=dev.device_kind, platform=dev.platform, devices=len(jax.devices()),
              jax=jax.__version__, jaxlib=jaxlib.__version__, flax=flax.__version__,
              python=sys.version.split()[0], dry_run=dry,
              peak_bf16_flops=_lookup(PEAK_FLOPS, dev.device_kind),
              hbm_bytes_per_s=_lookup(HBM, dev.device_kind))


def stage_kernels(report: Report, sizes: Sizes, dry: bool) -> None:
  # On a GPU: the tests marked gpu (kernels compiled by Triton). Dry: the interpret-mode
  # kernel tests of the same kernels (a subset), to prove the stage runs.
  args = (["-m", "gpu", "tests/models"] if not dry else
          ["tests/models/pallas_attention_test.py", "-k", "edge_cases and f32 and gpu"])
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
  report.info(pytest=" ".join(args), result=tail[0])
  if proc.returncode != 0:
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    raise RuntimeError(f"kernel tests failed (exit {proc.returncode}): {tail[0]}")
  passed = sum(int(w) for w, n in zip(tail[0].split(), tail[0].split()[1:]) if
               n.startswith("passed") and w.isdigit())
  report.figure("METRIC", "kernel_tests_passed", passed)


def stage_attention(report: Report, sizes: Sizes, dry: bool) -> None:
  tree = _tree_of(sizes.attention_tokens, seed=1)
  length = round_up(tree.num_tokens(), max(sizes.block, 256))
  batch = pack([tree], Buckets(tokens=(length,), nodes=(), leaves=(), path_tokens=(),
                               trees=None))
  st = derived.structure(batch)
  mask = TreeMask(batch.node_of_token, st.ancestor)
  c = sizes.flat_config
  ks = jax.random.split(jax.random.key(0), 4)
  shape_q = (1, length, c.num_attention_heads, c.head_dim)
  shape_k = (1, length, c.num_key_value_heads, c.head_dim)
  dt = jnp.bfloat16
  q, k, v = (jax.random.normal(kk, s, dt) for kk, s in zip(ks, (shape_q, shape_k, shape_k)))
  report.info(tokens=tree.num_tokens(), packed_length=length, heads=c.num_attention_heads,
              kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype="bfloat16")
  times = {}
  for impl in ("pallas", "blockwise", "dense"):
    if impl == "dense" and length > sizes.dense_max:
      print(f"# dense skipped: [L, L] scores at L={length} do not fit")
      continue
    cfg = _attention_config(impl, sizes.block, batch, dry)

    @jax.jit
    def fwd_bwd(q, k, v, mask=mask, cfg=cfg):
      out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, mask, cfg), q, k, v)
      return out, vjp(jnp.ones_like(out))

    times[impl], compile_s = _timed(fwd_bwd, q, k, v, repeats=sizes.repeats)
    report.figure("METRIC", f"attention_fwd_bwd_ms_{impl}", times[impl] * 1e3,
                  f"compile {compile_s:.1f} s")
  for base in ("blockwise", "dense"):
    if base in times:
      report.figure("RATIO", f"attention_{base}_over_pallas", times[base] / times["pallas"])


def _update_step_time(config: ModelConfig, batch, adv, impl: str, sizes: Sizes, dry: bool,
                      chunk: int = 256) -> tuple[float, float]:
  attn = _attention_config(impl, sizes.block, batch, dry)
  model = Decoder(config, rngs=nnx.Rngs(0), attention_config=attn, remat=True)
  optimizer = optax.adamw(1e-6)
  state = ppo.init_state(model, optimizer)
  del model
  step = jax.jit(ppo.make_update_step(ppo.PPOConfig(estimator=None, logprob_chunk=chunk),
                                      optimizer))
  out = _timed(step, state, batch, jax.random.key(0), adv, repeats=sizes.repeats)
  del state
  return out


def stage_tree_flat(report: Report, sizes: Sizes, dry: bool) -> None:
  for n, tokens in enumerate(sizes.tree_tokens):
    tree = _tree_of(tokens, seed=10 + n)
    chains = flatten([tree])
    tree_len = round_up(tree.num_tokens(), 256)
    tree_batch = pack([tree], Buckets(tokens=(tree_len,), nodes=(), leaves=(), path_tokens=(),
                                      trees=None))
    flat_batch, slots = pack_flat_rows(chains, 256)
    tree_adv, _, flat_adv = advantages_for_layouts(tree_batch, pack_rows(chains, 256),
                                                   flat_batch, slots)
    unique, flat = tree.num_tokens(), sum(c.num_tokens() for c in chains)
    label = f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)
    t_tree, c_tree = _update_step_time(sizes.flat_config, tree_batch, tree_adv,
                                       sizes.attention_impl, sizes, dry)
    t_flat, c_flat = _update_step_time(sizes.flat_config, flat_batch, flat_adv,
                                       sizes.attention_impl, sizes, dry)
    report.info(**{f"{label}_tree": f"{unique} tokens in 1 row of {tree_len}, step "
                                    f"{t_tree * 1e3:.1f} ms (compile {c_tree:.0f} s)",
                   f"{label}_flat": f"{len(chains)} paths, {flat} tokens in "
                                    f"{flat_batch.tokens.shape[0]} rows of "
                                    f"{flat_batch.tokens.shape[1]}, step {t_flat * 1e3:.1f} ms "
                                    f"(compile {c_flat:.0f} s)"})
    saving, speedup = flat / unique, t_flat / t_tree
    report.figure("RATIO", f"tokens_flat_over_tree_{label}", saving)
    report.figure("RATIO", f"step_time_flat_over_tree_{label}", speedup)
    report.figure("RATIO", f"speedup_over_token_saving_{label}", speedup / saving)


def useful_flops(config: ModelConfig, batch) -> float:
  """FLOPs of one update step's useful work (forward + backward = 3 x forward)."""
  valid = np.asarray(batch.node_of_token) >= 0
  tokens = int(valid.sum())
  scored = int(np.asarray(batch.loss_mask).sum())
  c = config
  layer_params = c.num_params - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings
                                                                 else 2)
  # Visible (query, key) pairs: a token sees its position + 1 keys of its own path.
  pairs = int(((np.asarray(batch.positions) + 1) * valid).sum())
  attn = 4 * pairs * c.head_dim * c.num_attention_heads * c.num_hidden_layers
  head = 2 * c.hidden_size * c.vocab_size * scored
  return 3 * (2 * layer_params * tokens + attn + head)


def stage_mfu(report: Report, sizes: Sizes, dry: bool) -> None:
  from train_step import _grpo  # noqa: PLC0415

  trees = [_tree_of(sizes.mfu_tokens, seed=20 + i) for i in range(sizes.mfu_trees)]
  length = round_up(max(t.num_tokens() for t in trees), 256)
  batch = pack(trees, Buckets(tokens=(length,), nodes=(), leaves=(), path_tokens=(),
                              trees=None))
  t, compile_s = _update_step_time(sizes.mfu_config, batch, _grpo(batch),
                                   sizes.attention_impl, sizes, dry, chunk=512)
  flops = useful_flops(sizes.mfu_config, batch)
  peak = _lookup(PEAK_FLOPS, jax.devices()[0].device_kind)
  report.info(model=f"{sizes.mfu_config.num_params / 1e6:.1f}M params, "
                    f"{sizes.mfu_config.dtype}", batch=f"{len(trees)} trees x {length} tokens",
              step_ms=round(t * 1e3, 1), compile_s=round(compile_s, 1),
              useful_tflops_per_step=round(flops / 1e12, 3))
  report.figure("METRIC", "update_step_useful_tflops_per_s", flops / t / 1e12)
  if peak is None:
    print(f"# MFU skipped: no peak FLOP/s known for {jax.devices()[0].device_kind!r}")
    return
  report.figure("RATIO", "mfu_0p5b_bf16", flops / t / peak)


def stage_decode(report: Report, sizes: Sizes, dry: bool) -> None:
  from tree_rl.rollout.engine import GenerationRequest, SamplingParams  # noqa: PLC0415
  from tree_rl.rollout.jax_sampler import JaxSampler  # noqa: PLC0415

  c = sizes.decode_config
  model = Decoder(c, rngs=nnx.Rngs(0))
  b, prompt, steps = sizes.decode_batch, sizes.decode_prompt, sizes.decode_steps
  eng = JaxSampler(model, rows=b, slots=1 << (prompt + steps).bit_length(), seed=0)
  rng = np.random.default_rng(1)

  def run(max_new: int) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    make = lambda: [GenerationRequest(tuple(int(x) for x in rng.integers(3, c.vocab_size,
                                                                         prompt)), params)
                    for _ in range(b)]
    eng.generate(make())  # compile this shape
    t0 = time.perf_counter()
    eng.generate(make())
    return time.perf_counter() - t0

  t_prefill, t_full = run(1), run(steps)
  if t_full - t_prefill > 0.1 * t_full:  # decode time: the call less its prefill
    rate, note = b * (steps - 1) / (t_full - t_prefill), f"batch {b}"
  else:  # too short to separate from the prefill (tiny sizes): the whole call, a lower bound
    rate, note = b * steps / t_full, f"batch {b}, prefill included"
  report.figure("METRIC", "decode_tokens_per_s", rate, note)
  bw = _lookup(HBM, jax.devices()[0].device_kind)
  if bw is None:
    print(f"# bandwidth bound skipped: unknown for {jax.devices()[0].device_kind!r}")
    return
  # A decode step reads the sampler's weights once (`decode_bytes`) and each row's live KV.
  act = jnp.dtype(c.dtype).itemsize
  weight_bytes = eng.weights.decode_bytes()
  kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * act
  bound = b * bw / (weight_bytes + b * (prompt + steps / 2) * kv)
  report.info(weights_mib=round(weight_bytes / 2**20), bound_tokens_per_s=round(bound))
  report.figure("RATIO", "decode_over_bandwidth_bound", rate / bound)


def stage_grpo(report: Report, sizes: Sizes, dry: bool) -> None:
  attention = "blockwise" if dry else "pallas"
  with tempfile.TemporaryDirectory() as work:
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"),
           "--config=" + os.path.join(ROOT, "configs", "grpo.py") + ":runlocal",
           "--config.num_steps=3", f"--config.model.attention={attention}",
           "--config.task.num_eval_tasks=2", f"--workdir={work}/run"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
      print(proc.stdout[-3000:], proc.stderr[-5000:])
      raise RuntimeError(f"the GRPO run failed (exit {proc.returncode})")
    rows = [json.loads(line) for line in open(os.path.join(work, "run", "metrics.jsonl"))]
  steps = [r for r in rows if r.get("phase", "rl") == "rl" and "loss" in r]
  report.info(attention=attention, steps=len(steps))
  if len(steps) != 3 or not all(np.isfinite(r["loss"]) for r in steps):
    raise RuntimeError(f"expected 3 RL steps with finite losses, got {steps}")
  report.figure("METRIC", "grpo_3_steps_wall_s", wall)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="gpu_suite.json")
  p.add_argument("--only", default="", help=f"comma-separated stages of {STAGES}")
  p.add_argument("--dry-run", action="store_true",
                 help="every stage on the CPU at tiny sizes (kernels in interpret mode)")
  args = p.parse_args()
  only = [s for s in args.only.split(",") if s] or list(STAGES)
  unknown = sorted(set(only) - set(STAGES))
  if unknown:
    p.error(f"unknown stages {unknown}; choose from {STAGES}")
  dry = args.dry_run
  if not dry and jax.default_backend() != "gpu":
    p.error(f"JAX's backend is {jax.default_backend()!r}, not a GPU: use --dry-run")
  sizes = Sizes.dry() if dry else Sizes()
  cache = os.path.join(ROOT, "gpu_wheels", "tree_rl_cache")  # prepare_gpu_wheels.sh's
  if "TREE_RL_CACHE" not in os.environ and os.path.isdir(cache):
    os.environ["TREE_RL_CACHE"] = cache
  report = Report(args.out)
  start, failed = time.perf_counter(), []
  for name in only:
    report.begin(name)
    t0 = time.perf_counter()
    try:
      globals()[f"stage_{name}"](report, sizes, dry)
      report.end("ok", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  (the next stages still run and are recorded)
      traceback.print_exc()
      report.end("failed", time.perf_counter() - t0, f"{type(e).__name__}: {e}")
      failed.append(name)
  report.data["total_s"] = round(time.perf_counter() - start, 1)
  report.write()
  print(f"# suite: {len(only) - len(failed)} of {len(only)} stages ok in "
        f"{report.data['total_s']:.0f} s; figures in {args.out}"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
