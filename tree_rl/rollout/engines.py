"""The one place a sampling engine is built (`make_engine`).

The trainer's `session.Rollout`, each fleet worker (`fleet.WorkerSpec.build`) and the
held-out evaluation (`evaluate.evaluate_policy_folder`) all build their engine from an
`EngineSpec`: the embedded `JaxSampler`, or a vLLM worker process (`VLLMEngine`) that
loads the policy from an HF folder written here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

ENGINES = ("jax", "vllm")
# What an EngineSpec sets on a VLLMEngine itself (its vllm_kwargs may not override them).
VLLM_OWN = ("python", "max_model_len", "dtype", "seed", "eos_ids", "gpu_memory_utilization")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """How to build a sampling engine.

  Attributes:
    kind: "jax" (the embedded JaxSampler) or "vllm" (a VLLMEngine worker process).
    rows: the JaxSampler's KV-cache rows (sequences decoded side by side).
    slots: the context window in tokens (JaxSampler slots; vLLM's max_model_len, at most
      the model's max_position_embeddings).
    seed: the engine's sampling seed.
    vllm_python: the interpreter with vLLM ("": this one).
    dtype: the vLLM worker's dtype.
    gpu_memory_utilization: the vLLM worker's share of GPU memory.
    vllm_kwargs: further VLLMEngine arguments (kv_cache_gb, block_size, log_file, ...).
  """

  kind: str = "jax"
  rows: int = 16
  slots: int = 2048
  seed: int = 0
  vllm_python: str = ""
  dtype: str = "float32"
  gpu_memory_utilization: float = 0.5
  vllm_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.kind not in ENGINES:
      raise ValueError(f"engine={self.kind!r} must be one of {ENGINES}")
    if self.kind == "jax" and self.vllm_kwargs:
      raise ValueError(f"vllm_kwargs={dict(self.vllm_kwargs)} with engine='jax': only a vLLM "
                       f"worker reads them")
    clash = sorted(set(self.vllm_kwargs) & set(VLLM_OWN))
    if clash:
      raise ValueError(f"vllm_kwargs sets {clash}, which the engine spec sets itself "
                       f"(vllm_python, slots, dtype, seed, the chat's eos ids, "
                       f"gpu_memory_utilization)")

  @classmethod
  def from_run(cls, cfg: Any, vllm_python: str | None = None, **vllm_kwargs) -> "EngineSpec":
    """The engine a RunConfig's rollouts use (rollout.engine, cache_rows,
    max_context_tokens, the seed; for vLLM model.dtype, generator_memory_fraction and
    `vllm_python`, else rollout.vllm_python)."""
    r = cfg.rollout
    return cls(kind=r.engine, rows=r.cache_rows, slots=r.max_context_tokens, seed=cfg.seed,
               vllm_python=vllm_python or r.vllm_python, dtype=cfg.model.dtype,
               gpu_memory_utilization=r.generator_memory_fraction, vllm_kwargs=vllm_kwargs)


def make_engine(spec: EngineSpec, model: Any, tokenizer: Any, eos_ids: Sequence[int] = (),
                folder: str | pathlib.Path | None = None):
  """An engine serving `model` (a Decoder) as `spec` says.

  Args:
    spec: which engine, and its sizes.
    model: the policy.
    tokenizer: its HF tokenizer (the JaxSampler's stop strings; vLLM's folder gets its files
      from `tokenizer.name_or_path`).
    eos_ids: the chat format's end-of-turn ids.
    folder: vLLM only: where the policy is written as an HF folder (LoRA merged), kept;
      None: a temporary folder, removed when the engine goes.
  """
  if spec.kind == "jax":
    from tree_rl.rollout.jax_sampler import JaxSampler  # noqa: PLC0415

    return JaxSampler(model, rows=spec.rows, slots=spec.slots, tokenizer=tokenizer,
                      eos_ids=tuple(eos_ids), seed=spec.seed)
  from tree_rl.models import hf_io  # noqa: PLC0415
  from tree_rl.rollout.vllm_engine import VLLMEngine  # noqa: PLC0415

  tmp = None if folder is not None else tempfile.mkdtemp(prefix="tree_rl_vllm_")
  try:
    path = hf_io.save_hf(model, folder if folder is not None else pathlib.Path(tmp) / "policy",
                         tokenizer_from=tokenizer.name_or_path)
    # vLLM refuses a window past the model's trained positions; requests that outgrow it
    # end with finish reason "context", as they would at the spec's slots.
    window = min(spec.slots, model.config.max_position_embeddings)
    if window < spec.slots:
      logging.warning("vLLM context window %d (the model's max_position_embeddings), below "
                      "the %d slots asked for", window, spec.slots)
    engine = VLLMEngine(path, python=spec.vllm_python or None, max_model_len=window,
                        dtype=spec.dtype, seed=spec.seed, eos_ids=tuple(eos_ids),
                        gpu_memory_utilization=spec.gpu_memory_utilization,
                        **dict(spec.vllm_kwargs))
  except BaseException:
    if tmp is not None:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  if tmp is not None:
    weakref.finalize(engine, shutil.rmtree, tmp, True)
  return engine
