"""Rollout scaling: Ray workers, asynchronous rollouts and the weight sync, with slow tools.

    python benchmarks/scaling.py [--smoke] [--latency 0.5] [--tasks 8] [--samples 4]
        [--turns 3] [--reps 2] [--steps 9] [--prompts 4] [--async-latency 0.3]
        [--async-turns 2] [--versions 3]

Real agent tools are remote: a search API or a code sandbox answers in 0.2-2 s, most of it
waiting. Every rollout here calls the search_qa family's `search` tool with
`task.kwargs.tool_latency_s` of latency per call (`tree_rl.envs.LatencyFamily`). The policy
is a scripted tool caller (`scripted_tool_caller`): a one-layer Decoder with the SmolLM2
tokenizer whose weights are set by hand so that every turn it writes one valid
`<tool_call>` of `search` (about 30 tokens) and ends the turn; a random tiny model never
writes a parsable call, so with it no tool would run. Episodes therefore last `--turns`
turns, each one policy step and one tool call. Prints:

  RATIO ray2_over_ray1_rollout_throughput <x>
      Trees per second of a RayFleet of 2 workers over one of 1 worker (1 CPU each; Ray
      started here with num_cpus=2 and shut down at the end), on the same `--tasks` tasks,
      `--samples` episodes each, from the same key; best of `--reps` rollouts after one
      warm-up rollout of the same tasks (its compilation). Latency `--latency` s per call
      (default 0.5 s: the low end of a hosted search API or sandbox round trip, where the
      generation time of this small policy is not negligible next to it). Within a worker
      the calls of one turn already overlap on its tool threads, so 2 workers save
      generation time and one latency wait per turn is paid by both. Every rollout follows
      a weight sync (untimed; as in training, it empties the prefix cache).
  RATIO sync_over_async_step_time <x>
      Mean wall time of a training step (train_and_evaluate on configs/grpo.py:runlocal
      with the scripted policy loaded as model=hf, LoRA rank 8, `--prompts` tasks of
      `--samples` episodes of `--async-turns` turns a step; steps 3..`--steps` - 1, as
      steps 1 and 2 compile and the last has no next rollout to overlap) with
      rollout.max_staleness=0 over the same run with max_staleness=1, whose rollout of
      step k+1 overlaps the update of step k. The S=0 run's mean time/rollout and
      time/update are printed with it, and the ideal ratio (rollout + update) /
      max(rollout, update) that a perfect overlap would give. `--async-latency` (0.3 s)
      makes both phases take comparable time on a 2-core CPU. Needs no Ray.
  weight_sync_seconds_per_version <local|ray2> <s>, weight_sync_bytes_per_version <n>
  RATIO ray_sync_over_local_sync_seconds <x>
      The mean time of `fleet.update_weights(model, version)` over `--versions` versions for
      one local worker (LocalFleet: an in-process engine) and for a 2-worker RayFleet (one
      `ray.put` of the parameters, every actor loads them); the bytes are those of the
      parameters published per version.

Without Ray (`import ray` fails) the Ray lines are skipped with a line that says so. The
default run takes about 3 minutes on a 2-core CPU; `--smoke` (CI's install check, about
a minute) measures every figure at the smallest sizes: 2 tasks x 2 episodes of one
turn, one timed rollout, 5 training steps of 2 tasks, one version.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tree_rl import metrics as metrics_lib  # noqa: E402
from tree_rl.envs import make_family  # noqa: E402
from tree_rl.models import Decoder, ModelConfig, gguf_import, hf_io  # noqa: E402
from tree_rl.rollout import fleet as fleet_lib  # noqa: E402
from tree_rl.rollout.agent_loop import AgentConfig  # noqa: E402
from tree_rl.rollout.chat import ChatFormat  # noqa: E402
from tree_rl.rollout.engine import SamplingParams  # noqa: E402
from tree_rl.rollout.engines import EngineSpec  # noqa: E402

FAMILY = "search_qa"
# What the scripted policy writes every turn (no newlines: the chat header ends in one, and
# the policy's first token is chosen by the header's last token).
CALL = '<tool_call>{"name": "search", "arguments": {"query": "river city"}}</tool_call>'
MAX_NEW = 40  # the call is about 30 tokens, then EOS


# ----------------------------------------------------------------------------
# The policy
# ----------------------------------------------------------------------------


# The scripted tool caller: a one-layer Decoder whose weights are set by hand so that, after
# any prompt, it writes one fixed <tool_call> and ends its turn. A random tiny model never
# writes a parsable call, so no tool would ever run and the tool latency would not show.
# Its next token is a function of the current and the previous token only: the embedding
# holds the token's identity, one attention head per 16 identity dimensions looks exactly
# one position back (RoPE: a query and key phased so that the score peaks at distance 1),
# and the LM head adds a vote from each. With the previous token in the state, a chain of
# tokens may repeat a token ("_" of "<tool_call>" and "</tool_call>") as long as no (previous,
# current) pair repeats with another successor.
_ID_DIMS = 64  # identity one-hots: chain tokens 0..62, every other token 63
_OTHER = _ID_DIMS - 1
_CONST = _ID_DIMS  # a dimension that is 1 for every token (the attention's query and key)
_PREV = _ID_DIMS + 1  # the previous token's identity, written by the attention layer
_HIDDEN = _PREV + _ID_DIMS + 3  # 132: HF configs want a multiple of the head count
_HEADS, _HEAD_DIM = 4, 16  # 4 x 16 value dimensions carry the 64 identity dimensions
_ROPE_THETA = 100.0  # sum of cos((d - 1) theta_p) <= 8 - 0.68 for every d != 1 below 16k
_SCORE = 400.0  # the attention score at distance 1; every other distance scores >= 34 less
_VOTE = 10.0  # a logit vote; the final norm multiplies it by ~sqrt(HIDDEN / 3)


def _chain_votes(chain: list[int]) -> tuple[dict, dict] | None:
  """(current-token votes, previous-token votes) {(identity, token): count} of a chain,
  or None when some (previous, current) pair of the chain has two successors."""
  ids = {t: i for i, t in enumerate(dict.fromkeys(chain))}
  ident = lambda k: ids[chain[k]] if k >= 0 else _OTHER
  successors: dict[int, set] = {}
  for k in range(len(chain) - 1):
    successors.setdefault(chain[k], set()).add(chain[k + 1])
  cur, prev, seen = {(_OTHER, chain[0]): 2}, {}, {}
  for k in range(len(chain) - 1):
    nxt = chain[k + 1]
    if len(successors[chain[k]]) == 1:
      cur[(ident(k), nxt)] = 2
    else:  # an ambiguous token: its predecessor decides
      if seen.setdefault((ident(k - 1), ident(k)), nxt) != nxt:
        return None
      cur[(ident(k), nxt)] = 1
      prev[(ident(k - 1), nxt)] = 1
  return cur, prev


def _segment(tokenizer: Any, text: str, banned: set[int], eos: int) -> tuple[list[int], tuple]:
  """Token ids spelling `text` whose chain votes are unambiguous (longest pieces first)."""
  pieces: dict[str, list[int]] = {}
  for i in range(len(tokenizer)):
    s = tokenizer.decode([i])
    if s and s in text and i not in banned:
      pieces.setdefault(s, []).append(i)

  def search(pos: int, chain: list[int]):
    if pos == len(text):
      votes = _chain_votes(chain + [eos])
      return (chain, votes) if votes is not None else None
    if len(set(chain)) >= _OTHER:
      return None
    for s in sorted((s for s in pieces if text.startswith(s, pos)), key=len, reverse=True):
      for i in pieces[s]:
        found = search(pos + len(s), chain + [i])
        if found:
          return found
    return None

  found = search(0, [])
  if found is None:
    raise ValueError(f"no token chain of the tokenizer spells {text!r} unambiguously")
  return found


def scripted_tool_caller(tokenizer: Any, chat: ChatFormat, text: str) -> Decoder:
  """A 1-layer Decoder that answers every prompt of `chat` with `text`, then its EOS."""
  header = chat.prompt_tokens([{"role": "user", "content": "x"}])
  eos = chat.eos_ids[0]
  chain, (cur, prev) = _segment(tokenizer, text, {header[-1], *chat.eos_ids}, eos)
  ids = {t: i for i, t in enumerate(dict.fromkeys(chain + [eos]))}
  config = ModelConfig.tiny(vocab_size=len(tokenizer), num_hidden_layers=1,
                            hidden_size=_HIDDEN, intermediate_size=16,
                            num_attention_heads=_HEADS, num_key_value_heads=_HEADS,
                            head_dim=_HEAD_DIM, rope_theta=_ROPE_THETA,
                            tie_word_embeddings=False)
  model = Decoder(config, rngs=nnx.Rngs(0))
  vocab = len(tokenizer)
  embed = np.zeros((vocab, _HIDDEN), np.float32)
  embed[:, _OTHER] = 1.0
  for t, i in ids.items():
    embed[t, _OTHER], embed[t, i] = 0.0, 1.0
  embed[:, _CONST] = 1.0
  norm_in = np.sqrt(_HIDDEN / 2)  # every embedding row has two ones: input_norm's scale
  inv = np.asarray(config.inv_frequencies())
  half = _HEAD_DIM // 2
  q = np.zeros((_HIDDEN, _HEADS * _HEAD_DIM), np.float32)
  k = np.zeros_like(q)
  v = np.zeros_like(q)
  o = np.zeros((_HEADS * _HEAD_DIM, _HIDDEN), np.float32)
  r = np.sqrt(_SCORE * np.sqrt(_HEAD_DIM) / half)  # per-pair norm of q and of k
  for h in range(_HEADS):
    base = h * _HEAD_DIM
    # Rotate-half pairs (p, p + half): q = r (cos theta, -sin theta), k = r (1, 0), so after
    # RoPE q_i . k_j = r^2 cos((i - j - 1) theta) per pair, largest at i - j = 1.
    q[_CONST, base:base + half] = r * np.cos(inv) / norm_in
    q[_CONST, base + half:base + _HEAD_DIM] = -r * np.sin(inv) / norm_in
    k[_CONST, base:base + half] = r / norm_in
    for s in range(_HEAD_DIM):
      v[base + s, base + s] = 1.0 / norm_in
      o[base + s, _PREV + base + s] = 1.0
  head = np.zeros((_HIDDEN, vocab), np.float32)
  for (i, t), n in cur.items():
    head[i, t] += n * _VOTE
  for (i, t), n in prev.items():
    head[_PREV + i, t] += n * _VOTE
  new = {"embed": embed, "lm_head": head, "q_proj": q[None], "k_proj": k[None],
         "v_proj": v[None], "o_proj": o[None]}
  for name, value in new.items():
    getattr(model, name).set_value(jnp.asarray(value))
  model.down_proj.set_value(jnp.zeros_like(model.down_proj.get_value()))
  return model


# ----------------------------------------------------------------------------
# Ray: rollout throughput and the weight sync
# ----------------------------------------------------------------------------


def _spec(folder: str, args, latency: float) -> fleet_lib.WorkerSpec:
  return fleet_lib.WorkerSpec(
      tokenizer=folder, family=FAMILY, family_kwargs={"tool_latency_s": latency},
      strategy="flat", strategy_kwargs={"n": args.samples},
      agent=AgentConfig(samples_per_task=args.samples, max_turns=args.turns,
                        max_context_tokens=2048, sampling=SamplingParams(max_new_tokens=MAX_NEW)),
      engine=EngineSpec(rows=args.tasks * args.samples, slots=2048))


def _trees_per_second(fleet, model, tasks, reps: int) -> tuple[float, float, int]:
  """(trees/s, seconds, policy tokens) of the best of `reps` rollouts after a warm-up one.

  Each rollout follows a new policy version (as each training step's does), which empties
  the engines' prefix caches: the timed rollouts prefill what the warm-up did, with the same
  shapes, and none reuses the KV of the one before.
  """
  key = jax.random.key(0)
  best, tokens = float("inf"), 0
  for rep in range(reps + 1):
    fleet.update_weights(model, fleet.version + 1)
    fleet.reseed(key)  # the same key every time: the same trees, the same shapes
    t0 = time.perf_counter()
    trees = fleet.rollout(tasks)
    dt = time.perf_counter() - t0
    stats = fleet.last_stats
    if len(trees) != len(tasks) or stats.num_truncated != stats.num_episodes:
      # Every episode calls a tool every turn, so all of them run to the turn limit.
      raise RuntimeError(f"{len(trees)} trees for {len(tasks)} tasks, {stats.num_truncated} of "
                         f"{stats.num_episodes} episodes at the turn limit: the scripted "
                         f"policy did not call a tool every turn")
    tokens = fleet.last_stats.num_policy_tokens
    if rep:
      best = min(best, dt)
  return len(tasks) / best, best, tokens


def _sync_seconds(fleet, model, versions: int) -> float:
  """Mean seconds of `fleet.update_weights` over `versions` new versions."""
  times = []
  for _ in range(versions):
    t0 = time.perf_counter()
    fleet.update_weights(model, fleet.version + 1)
    times.append(time.perf_counter() - t0)
  return float(np.mean(times))


def bench_ray(ray, model, folder: str, args, local_sync: float) -> None:
  tasks = make_family(FAMILY).generate("train", args.tasks, seed=0)
  spec = _spec(folder, args, args.latency)
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  try:
    rates = {}
    for workers in (1, 2):
      fleet = fleet_lib.make_fleet("ray", spec, model, workers, num_cpus=1.0, timeout_s=600.0)
      try:
        rate, sec, tokens = _trees_per_second(fleet, model, tasks, args.reps)
        rates[workers] = rate
        print(f"# RayFleet x{workers}: {rate:.2f} trees/s ({len(tasks)} trees of {args.samples}"
              f" episodes x {args.turns} turns, {tokens} policy tokens, in {sec:.2f}s)"
              f" [{_elapsed()}]")
        if workers == 2:
          ray_sync = _sync_seconds(fleet, model, args.versions)
          assert fleet.versions() == [fleet.version] * 2
      finally:
        fleet.close()
    print(f"RATIO ray2_over_ray1_rollout_throughput {rates[2] / rates[1]:.3f}")
    print(f"weight_sync_seconds_per_version ray2 {ray_sync:.4f}")
    print(f"RATIO ray_sync_over_local_sync_seconds {ray_sync / local_sync:.3f}")
  finally:
    ray.shutdown()


# ----------------------------------------------------------------------------
# Synchronous against asynchronous rollouts in the trainer
# ----------------------------------------------------------------------------


def _train(folder: str, args, staleness: int, workdir: str) -> tuple[list[dict], list[float]]:
  """(the train rows, the wall seconds) of steps 3..N-1 of one train_and_evaluate run.

  Step 1 compiles the sampler and the update; step 2, the first rollout after a weight sync,
  still compiles some sampler shapes (its rollout took ~2x the later ones on 2 cores); with
  max_staleness=1 the last step has no next rollout to overlap. All three are left out. A
  step's wall time runs from the previous step's metrics row to its own.
  """
  from tree_rl import train  # noqa: PLC0415  (slow import, only this part needs it)

  c = importlib.import_module("configs.grpo").get_config("runlocal")
  c.model.name, c.model.hf_folder = "hf", folder
  c.task.family, c.task.kwargs = FAMILY, {"tool_latency_s": args.async_latency}
  c.task.num_train_tasks, c.task.num_eval_tasks = max(8, args.prompts * args.steps), 1
  c.rollout.max_turns, c.rollout.max_new_tokens = args.async_turns, MAX_NEW
  c.rollout.samples_per_task, c.rollout.cache_rows = args.samples, args.prompts * args.samples
  c.rollout.max_context_tokens = 2048
  c.rollout.max_staleness = staleness
  c.prompts_per_step, c.num_steps, c.ckpt_every_steps = args.prompts, args.steps, args.steps
  # Wall time per step: when the trainer writes each step's row (its metrics are complete).
  stamps: list[float] = []
  write = metrics_lib.MetricWriter.write

  def stamped(self, step, metrics, phase="rl"):
    write(self, step, metrics, phase)
    if "reward/outcome_mean" in metrics:
      stamps.append(time.perf_counter())

  metrics_lib.MetricWriter.write = stamped
  try:
    out = train.train_and_evaluate(c, workdir)
  finally:
    metrics_lib.MetricWriter.write = write
  rows = [r for r in out["history"] if "reward/outcome_mean" in r]
  if len(rows) != args.steps or len(stamps) != args.steps:
    raise RuntimeError(f"max_staleness={staleness}: {len(rows)} steps, expected {args.steps}")
  if any(r["rollout/truncated_frac"] != 1.0 for r in rows):  # a tool call every turn
    raise RuntimeError(f"max_staleness={staleness}: the scripted policy stopped calling tools")
  return rows[2:-1], list(np.diff(stamps)[1:-1])


def _fmt(xs) -> str:
  return " ".join(f"{x:.2f}" for x in xs)


def bench_async(folder: str, args) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    sync_rows, sync_steps = _train(folder, args, 0, os.path.join(tmp, "s0"))
    print(f"# max_staleness=0: {np.mean(sync_steps):.2f}s/step; steps 3..N-1: "
          f"{_fmt(sync_steps)}s, time/rollout "
          f"{_fmt(r['time/rollout'] for r in sync_rows)}s [{_elapsed()}]")
    async_rows, async_steps = _train(folder, args, 1, os.path.join(tmp, "s1"))
    print(f"# max_staleness=1: {np.mean(async_steps):.2f}s/step; steps 3..N-1: "
          f"{_fmt(async_steps)}s, time/rollout "
          f"{_fmt(r['time/rollout'] for r in async_rows)}s [{_elapsed()}]")
  mean = lambda rows, k: float(np.mean([r[k] for r in rows]))
  rollout, update = mean(sync_rows, "time/rollout"), mean(sync_rows, "time/update")
  print(f"# max_staleness=0 steps 3..{args.steps - 1}: time/rollout {rollout:.3f}s, time/update "
        f"{update:.3f}s, time/weight_sync {mean(sync_rows, 'time/weight_sync'):.3f}s; "
        f"max_staleness=1: time/rollout {mean(async_rows, 'time/rollout'):.3f}s (in the "
        f"producer), time/rollout_wait {mean(async_rows, 'time/rollout_wait'):.3f}s, "
        f"time/update {mean(async_rows, 'time/update'):.3f}s; "
        f"{mean(sync_rows, 'rollout/policy_tokens'):.0f} policy tokens a step")
  print(f"# ideal sync_over_async_step_time {(rollout + update) / max(rollout, update):.3f}"
        f" ((rollout + update) / max(rollout, update) of the max_staleness=0 run)")
  print(f"RATIO sync_over_async_step_time {np.mean(sync_steps) / np.mean(async_steps):.3f}")


# ----------------------------------------------------------------------------


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true",
                      help="every figure at the smallest sizes (CI's install check)")
  parser.add_argument("--latency", type=float, default=0.5,
                      help="seconds per tool call in the Ray throughput figure")
  parser.add_argument("--tasks", type=int, default=8, help="tasks per rollout (Ray figure)")
  parser.add_argument("--samples", type=int, default=4, help="episodes per task")
  parser.add_argument("--turns", type=int, default=3, help="turns per episode (Ray figure)")
  parser.add_argument("--reps", type=int, default=2, help="timed rollouts per fleet (best kept)")
  parser.add_argument("--steps", type=int, default=9, help="training steps per run (>= 5)")
  parser.add_argument("--prompts", type=int, default=4, help="tasks per training step")
  parser.add_argument("--async-latency", type=float, default=0.3,
                      help="seconds per tool call in the training runs")
  parser.add_argument("--async-turns", type=int, default=2, help="turns per training episode")
  parser.add_argument("--versions", type=int, default=3, help="weight syncs timed per fleet")
  args = parser.parse_args()
  if args.smoke:
    args.tasks, args.samples, args.turns, args.reps = 2, 2, 1, 1
    args.steps, args.prompts, args.async_turns, args.versions = 5, 2, 1, 1
  if args.steps < 5:
    parser.error(f"--steps must be >= 5 (steps 1, 2 and the last are not timed), got "
                 f"{args.steps}")
  print(f"# jax {jax.__version__} on {jax.devices()[0].platform}; {os.cpu_count()} CPUs; "
        f"search_qa tool latency {args.latency}s (Ray), {args.async_latency}s (training)")
  folder = str(gguf_import.default_model_dir())
  from transformers import AutoTokenizer  # noqa: PLC0415

  tokenizer = AutoTokenizer.from_pretrained(folder)
  chat = ChatFormat.from_tokenizer(tokenizer)
  model = scripted_tool_caller(tokenizer, chat, CALL)

  # --- The weight sync of one local worker (the trainer's in-process engine) -----------
  local = fleet_lib.make_fleet("local", _spec(folder, args, args.latency), model, 1)
  local_sync = _sync_seconds(local, model, args.versions)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(jax.device_get(nnx.state(model))))
  print(f"weight_sync_bytes_per_version {nbytes}")
  print(f"weight_sync_seconds_per_version local {local_sync:.4f}")
  del local

  # --- Ray --------------------------------------------------------------------------
  try:
    import ray  # noqa: PLC0415
  except ImportError as e:
    print(f"# Ray not available ({e}): skipping RATIO ray2_over_ray1_rollout_throughput, "
          f"weight_sync_seconds_per_version ray2 and RATIO ray_sync_over_local_sync_seconds")
  else:
    bench_ray(ray, model, folder, args, local_sync)

  # --- Asynchronous rollouts --------------------------------------------------------
  with tempfile.TemporaryDirectory() as tmp:
    hf_folder = os.path.join(tmp, "scripted")
    hf_io.save_hf(model, hf_folder, tokenizer_from=folder)
    bench_async(hf_folder, args)


_START = time.perf_counter()


def _elapsed() -> str:
  return f"{time.perf_counter() - _START:.0f}s"


if __name__ == "__main__":
  main()
