"""Test setup: 8 fake CPU devices (sharding tests) and runtime shape checks.

Both must happen before JAX and tree_rl are imported.
"""

import os
import shutil

# The fast tier's tests compile thousands of small programs and run most of them once or
# twice. On a CPU two of XLA's compile stages cost more there than they save:
# - LLVM's optimisation passes (level 0: -22% wall time on the compile-heavy files);
# - the MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`, XLA's older
#   emitters: the PPO update step of tests/algos/ppo_test.py compiles in 1.2 s, not 3.2 s).
# Training keeps XLA's defaults, and so do CI (CI=true), whose end-to-end runs execute long
# programs, and a machine with a GPU. TREE_RL_TEST_XLA_OPT=<level> sets the level (and
# keeps the fusion emitters when it is not 0).
_DEFAULT_LEVEL = os.environ.get("CI") == "true" or shutil.which("nvidia-smi")
_OPT = os.environ.get("TREE_RL_TEST_XLA_OPT", "" if _DEFAULT_LEVEL else "0")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    + (f" --xla_backend_optimization_level={_OPT}" if _OPT else "")
    + (" --xla_cpu_use_fusion_emitters=false" if _OPT == "0" else "")
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Compiled programs persist between test runs and are shared by the xdist workers of one,
# so a rerun of the suite compiles only what changed (about half the fast tier's time is XLA
# compiling), and a program one worker compiled is loaded, not compiled, by the other (16%
# less wall time on the training tests of a fresh CI run). The folder is small (45 MB after
# the whole suite) and has no size cap: JAX's LRU eviction, on with a cap, races between
# the workers (an entry's access-time file read before it is written) and drops entries
# with a warning. Old entries stay until the folder is deleted. TREE_RL_TEST_JAX_CACHE names
# another folder, "" turns it off.
# Processes the tests launch compile on their own (nothing of a killed child can reach it),
# except those that ask for it (`jax_cache_env`) and are never killed.
_CACHE = os.environ.get("TREE_RL_TEST_JAX_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_test_cache"))
if _CACHE:
  jax.config.update("jax_compilation_cache_dir", _CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# jaxtyping + beartype check every annotated shape in tree_rl during tests
# (off in training, where the hook is not installed).
import importlib.util  # noqa: E402

from jaxtyping import _import_hook as _jaxtyping_hook  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

# While the hook runs a tree_rl module it points every import at the instrumented
# bytecode's file name (jaxtyping 0.3), so each library first imported from tree_rl
# (flax, orbax, scipy, sympy: about 2,400 modules) missed its installed .pyc and was
# compiled from source, in each xdist worker. Only tree_rl's own files take that name.
_TREE_RL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "tree_rl") + os.sep
_instrumented_cache_path = getattr(_jaxtyping_hook, "_optimized_cache_from_source", None)


def _cache_from_source(typechecker_hash, /, path, debug_override=None):
  if os.path.abspath(path).startswith(_TREE_RL_DIR):
    return _instrumented_cache_path(typechecker_hash, path, debug_override)
  return importlib.util.cache_from_source(path, debug_override)


if _instrumented_cache_path is not None:  # (a jaxtyping without it needs nothing here)
  _jaxtyping_hook._optimized_cache_from_source = _cache_from_source
install_import_hook("tree_rl", "beartype.beartype")


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.fixture
def jax_cache_env() -> dict[str, str]:
  """Environment variables that give a child process the tests' compilation cache (empty
  when it is off). Only for children that are never killed: a write cut short leaves a
  broken entry, which JAX then reads, warns about and recompiles."""
  if not _CACHE:
    return {}
  return {"JAX_COMPILATION_CACHE_DIR": _CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@pytest.fixture(scope="module")
def ray_local():
  """A local Ray of 2 CPUs for one test module (skipped without the ray extra)."""
  ray = pytest.importorskip("ray")
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  yield ray
  ray.shutdown()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marks
def pytest_collection_modifyitems(config, items):
  # A test that starts Ray or a vLLM worker launches processes: `e2e`, like the tests that
  # run the pipeline (marked where they are written).
  for item in items:
    if "vllm" in item.keywords or "ray_local" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.e2e)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
