"""Every compiled program of a run, lowered for a GPU or a TPU without one.

`jax.export.export(jitted, platforms=[...])` lowers a program for a platform from
abstract shapes, on any host: a program that would fail on a user's first GPU or
TPU run (an op only the CPU backend has, a host callback, a block shape Triton or
Mosaic refuses) fails here instead. `export_programs` lowers the five programs a
run compiles, for each platform, at a model's real shapes and without allocating its
weights:

* `update_step`: the PPO update (`tree_rl.algos.ppo.make_update_step`);
* `sft_step`: the SFT warm start's step (`tree_rl.algos.sft.make_sft_step`);
* `score`: the APPO Branching-Score scorer's log-probs
  (`tree_rl.rollout.strategies.appo.score_program`);
* `sampler_admit`, `sampler_decode`: the JAX sampler's two programs
  (`tree_rl.rollout.jax_sampler`).

The sampler's inputs (its slot state and an admission) are recorded from a real
`generate` call of a tiny model with the same vocabulary, then put beside the real
model's abstract weights and KV cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from unittest import mock

import jax
import optax
from flax import nnx
from jax import export

from tree_rl.algos import ppo, sft
from tree_rl.models import Decoder, LoRAConfig, ModelConfig
from tree_rl.models.attention import AttentionConfig
from tree_rl.models.decoder import KVCache
from tree_rl.tree import Buckets, NodeKind, RolloutTree, pack

PLATFORMS = ("cuda", "tpu")
# The custom call a Pallas kernel becomes on each platform (Triton on GPUs, Mosaic on TPUs).
KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
PROGRAMS = ("update_step", "sft_step", "score", "sampler_admit", "sampler_decode")

# HF config.json values of the two shapes the lowering tests use.
SMOLLM2_135M = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
QWEN2_0P5B = ModelConfig(
    family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
    tie_word_embeddings=True, attention_bias=True, bos_token_id=151643,
    eos_token_id=151645, pad_token_id=151643, dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class Shape:
  """A model and the batch sizes its programs are lowered at."""

  config: ModelConfig
  lora: LoRAConfig | None = None
  trees: int = 2  # packed trees per update
  tokens: int = 2048  # packed tokens per tree
  nodes: int = 64
  leaves: int = 16
  sampler_rows: int = 16  # KV cache rows (config.rollout.cache_rows)
  sampler_slots: int = 2048  # tokens a row holds (config.rollout.max_context_tokens)


SHAPES = {
    # The main job's policy: SmolLM2-135M, LoRA on attention and MLP, float32.
    "smollm2_135m_lora": Shape(SMOLLM2_135M, LoRAConfig(rank=8, alpha=16.0, target_modules=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))),
    # A GPU user's: a 0.5B Qwen2-shaped model in bfloat16, every weight trained.
    "qwen2_0p5b_bf16": Shape(QWEN2_0P5B, trees=4, tokens=8192, nodes=256, leaves=64),
}


def _model(shape: Shape, attention: AttentionConfig, remat: bool = True) -> Decoder:
  return Decoder(shape.config, rngs=nnx.Rngs(0), lora=shape.lora, attention_config=attention,
                 remat=remat)


def abstract_state(shape: Shape, attention: AttentionConfig,
                   optimizer: optax.GradientTransformation) -> ppo.TrainState:
  """The TrainState of `shape`'s model, as shapes only (no weights are allocated)."""
  return jax.eval_shape(lambda: ppo.init_state(_model(shape, attention), optimizer))


def batch_of(shape: Shape) -> Any:
  """A TreeBatch of `shape.trees` trees padded to `shape.tokens` tokens each."""
  tree = RolloutTree.new(list(range(3, 35)))
  for b in range(3):
    node = tree.add_node(0, NodeKind.POLICY, [40 + b] * 16, logprobs=[-1.0] * 16)
    tree.add_leaf(node, {"outcome": float(b % 2)})
  buckets = Buckets(tokens=(shape.tokens,), nodes=(shape.nodes,), leaves=(shape.leaves,),
                    path_tokens=(shape.tokens,), trees=(shape.trees,))
  # Every token may be a policy token: the loss's gathered width is the whole row. (The
  # batch is small and concrete: the export reads only its shapes.)
  return pack([tree], buckets).replace(max_loss_tokens=shape.tokens)


def _export(fn, platform: str, *args) -> export.Exported:
  checks = [export.DisabledSafetyCheck.custom_call(KERNEL_CALLS[platform])]
  return export.export(fn, platforms=[platform], disabled_checks=checks)(*args)


def _sampler_inputs(shape: Shape, max_new_tokens: int):
  """(admit args, decode args) of `shape`'s sampler programs: the slot state and
  admission recorded from a tiny model's `generate` (same vocabulary), the loop's model,
  the weights and the KV cache the real model's, as shapes."""
  from tree_rl.rollout import jax_sampler  # noqa: PLC0415
  from tree_rl.rollout.engine import GenerationRequest, SamplingParams  # noqa: PLC0415

  tiny = Decoder(ModelConfig.tiny(vocab_size=shape.config.vocab_size, dtype=shape.config.dtype),
                 rngs=nnx.Rngs(0))
  sampler = jax_sampler.JaxSampler(tiny, rows=4, slots=64)
  seen: dict[str, tuple] = {}

  def recorder(name, program):
    def record(*args):
      seen.setdefault(name, args)  # small, concrete: the export reads only their shapes
      return program(*args)
    return record

  params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
  with mock.patch.object(jax_sampler, "_seat_program",
                         recorder("seat", jax_sampler._seat_program)), \
       mock.patch.object(jax_sampler, "_decode_program",
                         recorder("decode", jax_sampler._decode_program)):
    sampler.generate([GenerationRequest(tokens=(3, 4, 5, 6), params=params),
                      GenerationRequest(tokens=(3, 4, 7), params=params)])
  model = nnx.eval_shape(lambda: _model(shape, AttentionConfig(), remat=False))
  weights = jax.eval_shape(lambda: _model(shape, AttentionConfig(), remat=False)
                           .sampling_weights())
  cache = jax.eval_shape(lambda: KVCache.zeros(shape.config, shape.sampler_rows,
                                               shape.sampler_slots))
  tiny_loop, _, state, adm, _, rng = seen["seat"]
  loop = dataclasses.replace(tiny_loop, model=model.cached())
  admit = (loop, weights, cache, state, adm, rng)
  decode = (loop, weights, cache) + seen["decode"][3:]
  return admit, decode


def export_programs(shape: Shape, platforms: Sequence[str], attention: AttentionConfig,
                    ppo_config: ppo.PPOConfig, programs: Sequence[str] = PROGRAMS,
                    logprob_chunk: int = 256) -> dict[str, dict[str, export.Exported]]:
  """`programs` of a run of `shape`'s model, lowered for each of `platforms` ("cuda",
  "tpu"): `{platform: {program: Exported}}`.

  Each program is traced once and lowered per platform. `attention` is the update's (and
  SFT's and the scorer's) tree attention; give a Pallas config `interpret=False`, so the
  kernel is lowered for the platform, not interpreted. Raises whatever blocks a lowering.
  """
  if isinstance(platforms, str) or not platforms or not set(platforms) <= set(PLATFORMS):
    raise ValueError(f"platforms={platforms!r}; choose a sequence of {PLATFORMS}")
  unknown = sorted(set(programs) - set(PROGRAMS))
  if unknown:
    raise ValueError(f"unknown programs {unknown}; choose from {PROGRAMS}")
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
  jitted: dict[str, tuple] = {}  # program -> (jitted function, its arguments)
  state = batch = None
  if {"update_step", "sft_step", "score"} & set(programs):
    state, batch = abstract_state(shape, attention, optimizer), batch_of(shape)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  if "update_step" in programs:
    step = jax.jit(ppo.make_update_step(ppo_config, optimizer), donate_argnums=0)
    jitted["update_step"] = (step, (state, batch, rng))
  if "sft_step" in programs:
    step = jax.jit(sft.make_sft_step(optimizer, logprob_chunk), donate_argnums=0)
    jitted["sft_step"] = (step, (state, batch))
  if "score" in programs:
    from tree_rl.rollout.strategies.appo import score_program  # noqa: PLC0415

    graphdef, model_state = nnx.split(nnx.merge(state.graphdef, state.params, state.frozen))
    jitted["score"] = (score_program, (graphdef, model_state, batch))
  if {"sampler_admit", "sampler_decode"} & set(programs):
    from tree_rl.rollout import jax_sampler  # noqa: PLC0415

    admit, decode = _sampler_inputs(shape, max_new_tokens=32)
    if "sampler_admit" in programs:
      # An admission's four programs (prefix copies, prefill, fork copies, seat) as one.
      jitted["sampler_admit"] = (jax.jit(jax_sampler.SamplerLoop.admit, static_argnums=0),
                                 admit)
    if "sampler_decode" in programs:
      jitted["sampler_decode"] = (jax_sampler._decode_program, decode)
  # The same jitted function for every platform: the second lowering reuses the trace.
  return {platform: {name: _export(fn, platform, *args) for name, (fn, args) in jitted.items()}
          for platform in platforms}


def kernel_calls(exported: export.Exported, platform: str) -> int:
  """How many Pallas kernel calls the lowered module holds."""
  return exported.mlir_module().count(f"@{KERNEL_CALLS[platform]}")
