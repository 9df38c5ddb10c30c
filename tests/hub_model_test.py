"""config.model.hf_folder takes a Hugging Face hub id beside a local folder: the model is
fetched with huggingface_hub (here from a local hub cache the test builds, offline) and
loaded through the same loader as a folder on disk."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from tree_rl.config_types import ModelSpec
from tree_rl.models import Decoder, ModelConfig, gguf_import, hf_io
from tree_rl.policy import build_policy, resolve_hf_folder

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> pathlib.Path:
  """$HF_HOME holding tree-rl-test/tiny at `main` (= COMMIT) in the hub cache's layout."""
  home = tmp_path_factory.mktemp("hf_home")
  repo = home / "hub" / "models--tree-rl-test--tiny"
  snapshot = repo / "snapshots" / COMMIT
  tokenizer = str(gguf_import.default_model_dir())
  config = ModelConfig.tiny(vocab_size=49152)
  hf_io.save_hf(Decoder(config, rngs=nnx.Rngs(3)), snapshot, tokenizer_from=tokenizer)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(COMMIT)
  return home


def _load_offline(home: pathlib.Path, hf_folder: str) -> subprocess.CompletedProcess:
  """Builds the policy in a fresh process with only the local hub cache and no network."""
  script = ("import json, sys\n"
            "from tree_rl.config_types import ModelSpec\n"
            "from tree_rl.policy import build_policy\n"
            f"model, tok = build_policy(ModelSpec(name='hf', hf_folder={hf_folder!r}, "
            "lora_rank=0), seed=0)\n"
            "emb = model.embed.get_value()\n"
            "print(json.dumps([float(emb.sum()), list(emb.shape), len(tok)]))\n")
  env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
         "JAX_PLATFORMS": "cpu", "HOME": str(home)}
  return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.e2e
def test_a_hub_id_loads_offline_from_the_cache_like_the_folder(hub_home):
  snapshot = hub_home / "hub" / "models--tree-rl-test--tiny" / "snapshots" / COMMIT
  local, _ = build_policy(ModelSpec(name="hf", hf_folder=str(snapshot), lora_rank=0), seed=0)
  want = np.asarray(local.embed.get_value())
  for hub_id in ("tree-rl-test/tiny", f"tree-rl-test/tiny@{COMMIT}"):
    proc = _load_offline(hub_home, hub_id)
    assert proc.returncode == 0, proc.stderr[-3000:]
    total, shape, vocab = json.loads(proc.stdout.splitlines()[-1])
    assert shape == list(want.shape) and vocab == 49152
    assert total == pytest.approx(float(want.sum()), rel=1e-6)


@pytest.mark.e2e
def test_an_uncached_hub_id_offline_names_the_field_and_the_cache(hub_home):
  proc = _load_offline(hub_home, "tree-rl-test/not-there")
  assert proc.returncode != 0
  assert ("config.model.hf_folder='tree-rl-test/not-there' is not a local folder, and "
          "fetching it from the Hugging Face hub failed") in proc.stderr
  assert "HF_HUB_OFFLINE is set" in proc.stderr and str(hub_home / "hub") in proc.stderr


def test_a_path_that_is_not_a_model_folder_is_not_taken_for_a_hub_id(tmp_path):
  for value in (str(tmp_path / "missing"), "./models/tiny", "~/nothing/here"):
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
      resolve_hf_folder(value)
