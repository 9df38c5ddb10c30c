"""Every compiled program of a run lowers for CUDA and TPU, on a CPU host (`jax.export`).

Lowering runs Pallas' Triton and Mosaic lowerings (block shapes, ops, layouts the
kernel language accepts); the final Triton and Mosaic compiles happen on the device.

Two shapes: the main job's (SmolLM2-135M with LoRA, float32) and a GPU user's (a 0.5B
Qwen2-shaped model in bfloat16, every weight trained). The update step, the SFT step
and the APPO scorer run the Pallas tree-attention kernel, whose custom call must be in
the lowered module; the sampler's admit and decode programs have no kernel.
"""

from __future__ import annotations

import re

import jaxtyping
import pytest

from configs import apppo
from tree_rl import lowering
from tree_rl.algos import ppo
from tree_rl.config_types import RunConfig
from tree_rl.models.attention import AttentionConfig

# Pallas kernels per program: the update and SFT steps run the forward kernel twice (once
# more in the rematerialised backward pass) and the two backward kernels; the scorer the
# forward kernel once.
KERNELS = {"update_step": 4, "sft_step": 4, "score": 1, "sampler_admit": 0,
           "sampler_decode": 0}


@pytest.fixture(autouse=True)
def _no_runtime_shape_checks():
  """jax.export rebuilds its arguments' pytrees with placeholder leaves, which the suite's
  runtime shape checks (conftest's jaxtyping hook, absent in real runs) would reject."""
  jaxtyping.config.update("jaxtyping_disable", True)
  yield
  jaxtyping.config.update("jaxtyping_disable", False)


def _main_job_ppo_config() -> ppo.PPOConfig:
  cfg = RunConfig.from_config_dict(apppo.get_config())
  return ppo.PPOConfig(loss=cfg.algo.loss_config(), estimator=cfg.algo.estimator,
                       estimator_config=cfg.estimator_config(), logprob_chunk=256)


@pytest.mark.parametrize("shape", sorted(lowering.SHAPES))
def test_every_program_lowers_with_the_pallas_kernel(shape):
  attention = AttentionConfig("pallas", block=64, interpret=False)
  lowered = lowering.export_programs(lowering.SHAPES[shape], lowering.PLATFORMS, attention,
                                     _main_job_ppo_config())
  assert sorted(lowered) == sorted(lowering.PLATFORMS)
  for platform, out in lowered.items():
    assert sorted(out) == sorted(lowering.PROGRAMS)
    other = next(p for p in lowering.PLATFORMS if p != platform)
    for name, exported in out.items():
      assert exported.platforms == (platform,)
      assert lowering.kernel_calls(exported, platform) == KERNELS[name], (platform, name)
      assert lowering.kernel_calls(exported, other) == 0, (platform, name)  # only its own
    # The kernels by name: forward, dq and dk/dv in the update step.
    text = out["update_step"].mlir_module()
    suffix = "_tpu" if platform == "tpu" else ""
    for kernel in ("tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv"):
      assert kernel + suffix in text, (platform, kernel)


def test_the_blockwise_update_lowers_with_its_backstop_on_device():
  """Blockwise attention's bound backstop is a device-side count, not a host callback
  (which cannot be lowered for another platform)."""
  shape = lowering.SHAPES["smollm2_135m_lora"]
  lowered = lowering.export_programs(shape, lowering.PLATFORMS,
                                     AttentionConfig("blockwise", 64, 8), _main_job_ppo_config(),
                                     programs=("update_step", "sft_step"))
  for platform, out in lowered.items():
    assert sorted(out) == ["sft_step", "update_step"]
    for exported in out.values():
      assert not re.search(r"custom_call @\w*callback", exported.mlir_module()), platform


def test_unknown_platforms_and_programs_fail_naming_them():
  shape, attn = lowering.SHAPES["smollm2_135m_lora"], AttentionConfig()
  with pytest.raises(ValueError, match="platforms=\\('cuda', 'rocm'\\)"):
    lowering.export_programs(shape, ("cuda", "rocm"), attn, _main_job_ppo_config())
  with pytest.raises(ValueError, match="platforms='cuda'; choose a sequence of"):
    lowering.export_programs(shape, "cuda", attn, _main_job_ppo_config())  # one, not a list
  with pytest.raises(ValueError, match=r"unknown programs \['eval'\]"):
    lowering.export_programs(shape, ("cuda",), attn, _main_job_ppo_config(), programs=("eval",))
