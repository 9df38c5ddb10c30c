"""The sampler and the learner compute the same policy: on-policy log-ratios are numerics.

`benchmarks/precision.py` measures them on SmolLM2 (figures in docs/gpu.md); here the
same measurement on a tiny model guards them: float32 agrees to float32 round-off, and
bfloat16 (the learner's f32 master weights cast per product, the sampler's pre-cast
matrices) stays within a few percent of ratio 1.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

from precision import mismatch  # noqa: E402
from tree_rl.config_types import ModelSpec  # noqa: E402
from tree_rl.policy import build_policy  # noqa: E402


@pytest.mark.parametrize("dtype, mean_bound, max_bound", [("float32", 1e-5, 1e-4),
                                                          ("bfloat16", 5e-3, 5e-2)])
def test_on_policy_log_ratios_are_round_off(dtype, mean_bound, max_bound):
  model, tokenizer = build_policy(ModelSpec(name="tiny", dtype=dtype, lora_rank=0), 0)
  prompts = [[1, 5, 9, 200, 31, 7], [1, 44, 45, 46]]
  m = mismatch(model, tokenizer, prompts, samples=3, max_new=12, temperature=1.0)
  assert m["tokens"] >= 12
  assert m["mean_abs_log_ratio"] < mean_bound and m["max_abs_log_ratio"] < max_bound, m
