"""The policy a run trains, built from its configuration: model, tokenizer and optimizer.

The trainer (`tree_rl.train`) and everything that reloads a run's checkpoint
(`tree_rl.checkpoint.restore_policy`: evaluation, HF export) build the policy
here, so a checkpoint's train state is always restored into the structure that
wrote it. This module imports neither the trainer nor the evaluator.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import jax
import optax
from flax import nnx

from tree_rl.config_types import ModelSpec, RunConfig
from tree_rl.models import Decoder, LoRAConfig, ModelConfig


# A hub id: "owner/name", optionally "@revision" (a branch, tag or commit).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# What tree_rl reads of a hub model: its config, weights and tokenizer.
HUB_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja")


def resolve_hf_folder(value: str, field: str = "config.model.hf_folder") -> pathlib.Path:
  """The local HF folder `value` names: a folder on disk, or a Hugging Face hub id
  ("owner/name" or "owner/name@revision") fetched with huggingface_hub into its cache
  (`$HF_HOME`; with `HF_HUB_OFFLINE=1` only the cache is read). Only the config, weights
  and tokenizer files are fetched; the folder is then loaded like any local one.

  Raises:
    FileNotFoundError: neither a folder with a config.json nor a hub model that could be
      fetched (the message names `field`, and why the hub did not answer).
  """
  local = pathlib.Path(value).expanduser()
  if local.is_dir() or value.startswith((".", "/", "~")) or not _HUB_ID.match(value):
    if not (local / "config.json").is_file():
      raise FileNotFoundError(f"{field}={value!r} holds no config.json (a local HF model "
                              f"folder, or a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct')")
    return local
  import huggingface_hub  # noqa: PLC0415  (only for a hub id)
  from huggingface_hub import constants  # noqa: PLC0415

  match = _HUB_ID.match(value)
  try:
    folder = pathlib.Path(huggingface_hub.snapshot_download(
        repo_id=match["repo"], revision=match["revision"], allow_patterns=list(HUB_FILES)))
  except Exception as e:  # noqa: BLE001  (offline, unknown repo, gated, network down)
    offline = (" HF_HUB_OFFLINE is set, and the model is not in the local cache "
               f"({constants.HF_HUB_CACHE})." if constants.HF_HUB_OFFLINE else "")
    raise FileNotFoundError(
        f"{field}={value!r} is not a local folder, and fetching it from the Hugging Face "
        f"hub failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}."
        f"{offline} Download it once with network access (or point {field} at a local "
        f"folder)") from e
  if not (folder / "config.json").is_file():
    raise FileNotFoundError(f"{field}={value!r}: the hub model has no config.json "
                            f"(fetched into {folder})")
  return folder


def build_policy(spec: ModelSpec, seed: int, max_path_tokens: int = 4096, max_depth: int = 16
                 ) -> tuple[Decoder, Any]:
  """(model, tokenizer) for the model section; fails before any compile when unavailable.

  `max_path_tokens` and `max_depth` bound a root-to-leaf path (the rollout's context
  window and node depth). They set the model's default blockwise bound on the key
  blocks one query block sees: packing is depth-first, so those blocks hold tokens
  of the ancestors-or-self of the block's first node, and a node of n tokens
  touches at most ceil(n / block) + 1 blocks: ceil(path / block) + 2 depth. The
  trainer and the APPO scorer refit the exact bound per batch (`AttentionFitter`);
  a call with a bound too small for its batch raises (`check_attention_bound`).
  """
  from transformers import AutoTokenizer  # noqa: PLC0415  (slow import, only when building)

  from tree_rl.models import gguf_import, hf_io  # noqa: PLC0415
  from tree_rl.models.attention import AttentionConfig  # noqa: PLC0415

  lora = (LoRAConfig(rank=spec.lora_rank, alpha=spec.lora_alpha,
                     target_modules=tuple(spec.lora_targets)) if spec.lora_rank else None)
  if spec.name == "hf":
    folder = resolve_hf_folder(spec.hf_folder)
  else:
    # smollm2 and tiny both use SmolLM2's tokenizer and chat template.
    folder = gguf_import.default_model_dir()
  tokenizer = AutoTokenizer.from_pretrained(str(folder))
  attn = AttentionConfig()
  path_bound = -(-max_path_tokens // spec.attention_block) + 2 * max_depth
  if spec.attention == "blockwise":
    attn = AttentionConfig(impl="blockwise", block=spec.attention_block, max_kv_blocks=path_bound)
  elif spec.attention == "pallas":  # a bound only for the TPU kernels' static grid
    attn = AttentionConfig(impl="pallas", block=spec.attention_block,
                           max_kv_blocks=path_bound if jax.default_backend() == "tpu" else 0)
  if spec.name == "tiny":
    config = ModelConfig.tiny(vocab_size=len(tokenizer), dtype=spec.dtype,
                              **dict(spec.tiny_overrides))
    model = Decoder(config, rngs=nnx.Rngs(seed), lora=lora, remat=spec.remat,
                    attention_config=attn)
  else:
    model = hf_io.load_hf(folder, dtype=spec.dtype, lora=lora, remat=spec.remat, seed=seed,
                          attention_config=attn)
  return model, tokenizer


def path_bounds(cfg: RunConfig) -> tuple[int, int]:
  """(tokens, nodes) a root-to-leaf path can hold: the context window, and a prompt
  node plus a policy and an env node per turn (token-position branches split nodes:
  counted twice)."""
  turns = cfg.rollout.max_turns or 8
  return cfg.rollout.max_context_tokens, 2 * (2 * turns + 1)


def build_run_policy(cfg: RunConfig) -> tuple[Decoder, Any]:
  """(model, tokenizer) of a run: `build_policy` with the run's seed and path bounds."""
  return build_policy(cfg.model, cfg.seed, *path_bounds(cfg))


def make_optimizer(lr: float, cfg: RunConfig) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW at `lr`, with the optim section's linear warm-up."""
  o = cfg.optim
  schedule = (optax.linear_schedule(0.0, lr, o.warmup_steps) if o.warmup_steps else lr)
  return optax.chain(optax.clip_by_global_norm(o.grad_clip),
                     optax.adamw(schedule, weight_decay=o.weight_decay))
