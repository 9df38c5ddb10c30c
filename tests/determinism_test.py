"""The same seed gives the same run, with the default model where tool calls and prefix
reuse happen: RL right after SFT in the same process, RL resumed from that warm start's
checkpoint in another run, and runs that differ only in `eval_every_steps` train on
bitwise-equal trees and log equal metric rows (timers aside).

The mechanism under test: an evaluation samples on its own stream, and every rollout
stream starts from an empty prefix cache (`JaxSampler.reseed`), so nothing the sampler ran
before (SFT's evaluation, a periodic evaluation, or nothing at all in a resumed process)
changes what a step samples.
"""

import importlib
import pathlib
import shutil
import sys

import pytest

from tree_rl import train
from tree_rl.rollout import jax_sampler
from tree_rl.tree import NodeKind

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))



def _config(eval_every: int):
  c = importlib.import_module("configs.apppo").get_config("steps=2,prompts=1")
  c.task.num_eval_tasks = 1
  c.sft.steps, c.sft.tasks_per_step = 2, 2  # enough for the RL trees to call tools
  c.eval_every_steps = eval_every
  c.keep_checkpoints = 3  # the warm start (step 0) stays for the resumed run
  return c


def _run(c, workdir: pathlib.Path, monkeypatch) -> tuple[list, list, int]:
  """(the RL rows without timers, every packed tree as (kind, tokens) nodes, tokens the
  sampler reused from cached prefixes)."""
  trees, reused = [], [0]
  pack = train.pack_sound

  def recording_pack(batch_trees, *args, **kwargs):
    trees.extend([(int(n.kind), tuple(int(x) for x in n.tokens)) for n in t.nodes]
                 for t in batch_trees)
    return pack(batch_trees, *args, **kwargs)

  generate = jax_sampler.JaxSampler.generate

  def counting_generate(self, requests):
    before = self.stats["reused_tokens"]
    out = generate(self, requests)
    reused[0] += self.stats["reused_tokens"] - before
    return out

  monkeypatch.setattr(train, "pack_sound", recording_pack)
  monkeypatch.setattr(jax_sampler.JaxSampler, "generate", counting_generate)
  out = train.train_and_evaluate(c, str(workdir))
  monkeypatch.undo()
  rows = [{k: v for k, v in r.items() if not k.startswith("time/")}
          for r in out["history"] if r["phase"] == "rl"]
  return rows, trees, reused[0]


@pytest.mark.e2e
def test_rl_after_sft_resumed_and_with_evals_between_steps_trains_alike(tmp_path, monkeypatch):
  # A: SFT then RL in one process, an evaluation after step 1.
  rows_a, trees_a, reused_a = _run(_config(eval_every=1), tmp_path / "a", monkeypatch)
  # B: RL resumed from A's warm start (its step-0 checkpoint), no evaluation between steps.
  warm = tmp_path / "warm"
  shutil.copytree(tmp_path / "a" / "checkpoints", warm)
  for step in warm.iterdir():
    if step.name.isdigit() and int(step.name) > 0:
      shutil.rmtree(step)
  c = _config(eval_every=0)
  c.resume = str(warm)
  rows_b, trees_b, _ = _run(c, tmp_path / "b", monkeypatch)

  # The case the guarantee is about: tool replies and reused prefixes in the RL trees.
  rl_trees = trees_a[-len(trees_b):]
  assert any(kind == NodeKind.ENV for tree in rl_trees for kind, _ in tree)
  assert reused_a > 0
  assert len(rows_a) == len(rows_b) == 2
  assert rl_trees == trees_b
  assert rows_a == rows_b
