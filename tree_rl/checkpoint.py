"""Checkpoints of the whole run: train state, RNG, data position and method state.

Resume order (the trainer applies the first that exists):
  1. a checkpoint in `<workdir>/checkpoints`: the run continues where it stopped;
  2. `config.resume`: another run's checkpoint directory (its latest step);
  3. the configured model with a fresh optimizer: the default SmolLM2 package
     (`config.model.name="smollm2"`), an HF folder's weights
     (`config.model.name="hf"` with `config.model.hf_folder`), or a tiny random
     model for `runlocal` (`"tiny"`).

The train state is saved as its flat list of array leaves (keys `00000`,
`00001`, ...) and restored into the leaves of a freshly built state of the same
configuration, so the NNX graph, the optimizer's pytree structure and the
shardings come from code, not from the checkpoint. A checkpoint written by a
different configuration (other model, LoRA rank, optimizer) fails with an
error that names the first mismatching leaf. Everything that is not an array
(RNG key data, data position, metrics) travels as JSON. Method state (TRACE's
success predictor) is split the same way: its JSON part in the metadata, its
arrays as an optional `extra` item saved and restored like the train state.
Orbax writes each step to a temporary directory and renames it when complete,
so a crash mid-save leaves the previous checkpoint intact.

Over several processes (`tree_rl.distributed`) every process calls `save`,
`restore` and `close` with the same arguments: Orbax synchronises them, each
process writes the array shards its devices hold and process 0 the metadata. The
restore target's shardings come from the restoring run, so a checkpoint written by
N processes restores on any mesh, one process included.

`restore_policy(workdir)` reloads a finished or running run's policy outside the
trainer (evaluation, HF export): it rebuilds the run's state from its saved
config.json (`tree_rl.policy`) and restores the checkpoint into it.
"""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from tree_rl.algos import ppo
from tree_rl.config_types import RunConfig
from tree_rl.models import Decoder
from tree_rl.policy import build_run_policy, make_optimizer


def _leaf_dict(tree: Any) -> dict[str, Any]:
  return {f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


class RunCheckpointer:
  """Saves and restores (train state, JSON metadata) pairs by step.

  Args:
    directory: where checkpoints live (created if missing).
    keep_last: how many recent checkpoints to keep.
  """

  def __init__(self, directory: str | pathlib.Path, keep_last: int = 2):
    if keep_last < 1:
      raise ValueError(f"keep_last={keep_last} must be >= 1")
    self.directory = pathlib.Path(directory).absolute()
    # Handlers are registered up front so a fresh process can read a checkpoint's
    # metadata before restoring it (the configuration check below).
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep_last, create=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler(),
                       "extra": ocp.StandardCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any], extra: Any = None) -> None:
    """Writes step `step` and waits until it is on disk.

    `extra` is an optional pytree of arrays saved beside the train state (method
    state, e.g. TRACE's predictor weights); `restore_extra` reads it back.
    """
    items = {"state": ocp.args.StandardSave(_leaf_dict(state)), "meta": ocp.args.JsonSave(meta)}
    if extra is not None:
      items["extra"] = ocp.args.StandardSave(_leaf_dict(extra))
    if not self.manager.save(step, args=ocp.args.Composite(**items)):
      raise ValueError(f"checkpoint {self.directory}/{step} exists already; Orbax does not "
                       f"overwrite a step")
    self.manager.wait_until_finished()

  def _abstract(self, step: int, item: str, target: Any) -> dict[str, Any]:
    """`target`'s leaves as restore targets, after checking them against item `item` of `step`."""
    leaves = jax.tree.leaves(target)
    try:
      saved = self.manager.item_metadata(step)[item]
    except KeyError:
      saved = None
    if saved is None:
      raise FileNotFoundError(f"checkpoint {self.directory}/{step} holds no {item!r} item: it was "
                              f"written by another configuration; use a fresh --workdir or the "
                              f"same config")
    if len(saved) != len(leaves):
      raise ValueError(
          f"checkpoint {self.directory}/{step} holds {len(saved)} arrays but this configuration "
          f"has {len(leaves)}: it was written by another model, LoRA or optimizer setting; "
          f"use a fresh --workdir or the same config")
    for key, leaf in zip(sorted(saved), leaves):
      shape = tuple(getattr(saved[key], "shape", ()))
      if shape != tuple(np.shape(leaf)):
        raise ValueError(f"checkpoint {self.directory}/{step}: array {key} has shape {shape}, "
                         f"this configuration expects {tuple(np.shape(leaf))}; use a fresh "
                         f"--workdir or the same config")
    return {k: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
            for k, x in _leaf_dict(target).items()}

  def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """(state with `target`'s structure and the saved leaves, metadata) of `step` (default latest).

    Raises:
      FileNotFoundError: no checkpoint in the directory.
      ValueError: the checkpoint was written by a different configuration.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    abstract = self._abstract(step, "state", target)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    treedef = jax.tree.structure(target)
    state = jax.tree.unflatten(treedef, [out["state"][k] for k in sorted(out["state"])])
    return state, dict(out["meta"])

  def restore_meta(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata saved at `step` (default latest), without the arrays."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    return dict(self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"])

  def restore_extra(self, target: Any, step: int | None = None) -> Any:
    """The `extra` arrays saved at `step` (default latest), in `target`'s structure.

    Raises:
      FileNotFoundError: no checkpoint, or one saved without `extra`.
      ValueError: the arrays do not match `target`'s (another configuration).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    abstract = self._abstract(step, "extra", target)
    out = self.manager.restore(step, args=ocp.args.Composite(
        extra=ocp.args.StandardRestore(abstract)))["extra"]
    return jax.tree.unflatten(jax.tree.structure(target), [out[k] for k in sorted(out)])

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def restore_policy(workdir: str | pathlib.Path, step: int | None = None
                   ) -> tuple[Decoder, Any, RunConfig]:
  """(policy at `step` (default: latest), tokenizer, run config) of a training run's workdir.

  The state is built exactly as the trainer builds it (model, optimizer, reference
  when the KL term is on) so that the checkpoint's leaves line up with it.

  Raises:
    FileNotFoundError: `workdir` has no config.json, or no checkpoint.
    ValueError: the checkpoint does not match the run's config.
  """
  workdir_path = pathlib.Path(workdir)
  if not (workdir_path / "config.json").is_file():
    raise FileNotFoundError(f"{workdir} is not a tree_rl run directory (no config.json)")
  cfg = RunConfig.from_config_dict(json.loads((workdir_path / "config.json").read_text()))
  model, tokenizer = build_run_policy(cfg)
  state = ppo.init_state(model, make_optimizer(cfg.optim.lr, cfg),
                         with_ref=cfg.algo.loss_config().kl_coef > 0)
  ckpt = RunCheckpointer(workdir_path / "checkpoints", keep_last=cfg.keep_checkpoints)
  try:
    state, _ = ckpt.restore(state, step)
  finally:
    ckpt.close()
  return state.model(), tokenizer, cfg


# What a resumed run may change without `allow_config_change`: how long it runs, how often it
# evaluates and saves, what it profiles, and where its processes and vLLM live. Anything
# else would make the resumed run a different experiment than the one it continues.
RESUMABLE_FIELDS = ("num_steps", "eval_every_steps", "ckpt_every_steps", "keep_checkpoints",
                    "sft.ckpt_every_steps",
                    "profile", "distributed", "rollout.worker_timeout_s", "rollout.vllm_python")


def flatten_dotted(values: Any, prefix: str = "") -> dict[str, Any]:
  """A nested dict as {"a.b.c": leaf}."""
  if not isinstance(values, dict):
    return {prefix: values}
  out: dict[str, Any] = {}
  for k, v in values.items():
    out.update(flatten_dotted(v, f"{prefix}{k}."))
  return {k.rstrip("."): v for k, v in out.items()}


def write_run_config(workdir: pathlib.Path, values: dict[str, Any], resuming: bool,
                     allow_change: bool = False, write: bool = True) -> None:
  """Writes the run's config to `workdir/config.json` atomically (a temporary file, then a
  rename). When `resuming` the run's own checkpoint, a config that differs from the saved
  one outside RESUMABLE_FIELDS fails, naming each changed key with its old and new value,
  unless `allow_change` (keys the saved file lacks, added by a later tree_rl, do not count).
  `write=False` (processes other than 0) only checks."""
  path = workdir / "config.json"
  text = json.dumps(values, indent=2, default=str, sort_keys=True)
  if resuming and path.exists() and not allow_change:
    try:
      saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path} is not valid JSON ({e}), so this run's config cannot be "
                       f"compared with the one that wrote the checkpoint: restore the file, or "
                       f"resume with --allow_config_change (train_and_evaluate(..., "
                       f"allow_config_change=True)) to write it anew from this config") from None
    old, new = flatten_dotted(saved), flatten_dotted(json.loads(text))
    changed = sorted(k for k in old if old[k] != new.get(k, old[k]) and not any(
        k == f or k.startswith(f + ".") for f in RESUMABLE_FIELDS))
    if changed:
      diff = "; ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in changed)
      raise ValueError(f"{workdir} holds a run with another config ({diff}). Resume it with "
                       f"its saved config.json, use another workdir, or allow the change "
                       f"explicitly (train_and_evaluate(..., allow_config_change=True), "
                       f"launch/train.py --allow_config_change)")
  if write:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def method_state(strategy: Any) -> dict[str, Any] | None:
  """A snapshot of a strategy's learned state (TRACE's predictor), or None."""
  return copy.deepcopy(strategy.state_dict()) if hasattr(strategy, "state_dict") else None


def save_run(ckpt: RunCheckpointer, step: int, state: Any, meta: dict[str, Any],
             method: dict[str, Any] | None) -> None:
  """Saves the run. A strategy's learned state as of the step's rollout (`method_state`) is
  saved too: the JSON part in meta["method_state"], the arrays as the checkpoint's extra."""
  extra = None
  if method is not None:
    meta["method_state"], extra = method["meta"], method["arrays"] or None
  ckpt.save(step, state, meta, extra=extra)


def restore_method_state(strategy: Any, source: RunCheckpointer, meta: dict[str, Any]) -> None:
  """Loads what `save_run` stored for the strategy (a checkpoint without it: nothing)."""
  if not hasattr(strategy, "load_state_dict") or "method_state" not in meta:
    return
  arrays = strategy.state_dict()["arrays"]  # a fresh state: the structure to restore into
  strategy.load_state_dict({"meta": meta["method_state"],
                            "arrays": source.restore_extra(arrays) if arrays else arrays})
