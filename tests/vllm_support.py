"""The vLLM interpreter for tests marked `vllm`, or a skip that says how to provide one."""

import os

import pytest

from tree_rl.rollout.vllm_engine import VLLM_PYTHON_ENV, find_vllm_python


def vllm_python_or_skip() -> str:
  """`find_vllm_python()`, or skips the test naming $TREE_RL_VLLM_PYTHON's problem."""
  python = find_vllm_python()
  if python is None:
    given = os.environ.get(VLLM_PYTHON_ENV)
    why = f"{given!r} is not an executable" if given else "is unset"
    pytest.skip(f"no interpreter with vLLM (${VLLM_PYTHON_ENV} {why};"
                " see third_party/vllm_worker/README.md)")
  return python
