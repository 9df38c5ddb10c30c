"""Checkpoints of the whole run: train state, RNG, data position and method state.

Resume order (the trainer applies the first that exists; `tree_rl.resume.restore`):
  1. a checkpoint in `<workdir>/checkpoints`: the run continues where it stopped (its
     newest step that verifies);
  2. SFT progress in `<workdir>/checkpoints_sft`, before the first RL checkpoint: the SFT
     warm start continues (`tree_rl.phases`);
  3. `config.resume`: another run's checkpoint directory (its newest step that verifies),
     read only;
  4. the configured model with a fresh optimizer: the default SmolLM2 package
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

Orbax itself checks no data byte: a flipped bit restores as a different weight. So once
Orbax has finished a step, `save` records the size and sha256 of each of its files in
`<step>/tree_rl_digests.json`, reads the step back against it, and only then deletes the
steps past `keep_last` (Orbax's own `max_to_keep` is off), so the last step that verified
is never deleted before a newer one has. A restore verifies before it trusts a step; one
that does not verify is named with its bad files in a warning and the next older step is
tried (`RunCheckpointer`; the trainer logs the metric `checkpoint/rejected_steps`). If
none verifies, the error names each step, why, and the fix. Steps saved before digests
existed are restored with a warning that they are unverified.

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
import dataclasses
import hashlib
import itertools
import json
import logging as std_logging
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from tree_rl.algos import ppo
from tree_rl.config_types import RunConfig
from tree_rl.models import Decoder
from tree_rl.policy import build_run_policy, make_optimizer
from tree_rl.rollout.strategies.base import BranchingStrategy


def _leaf_dict(tree: Any) -> dict[str, Any]:
  return {f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


class _NoPreviousSaveWait(std_logging.Filter):
  """Drops Orbax's "Waiting for previous save to complete took N seconds" warning.

  `RunCheckpointer.save` waits for each save itself (its digests need the finished files),
  and Orbax adds that wait to the next save's "wait for the previous one", then warns that
  checkpointing is too frequent. Nothing waited on a previous save: the warning is noise.
  """

  def filter(self, record: std_logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Waiting for previous save to complete")


std_logging.getLogger("absl").addFilter(_NoPreviousSaveWait())  # where Orbax's absl logs go

DIGESTS_FILE = "tree_rl_digests.json"  # inside each step's directory, beside Orbax's files
DIGEST_FORMAT = "sha256-v1"
SEAL_KEY = "tree_rl_digests"  # in Orbax's _CHECKPOINT_METADATA: "this step gets a manifest"
REJECTED_DIR = "rejected"  # <directory>/rejected/<step>: damaged steps moved out of the way
REJECTED_METRIC = "checkpoint/rejected_steps"
_DELETING = ".tree_rl-deleting"  # a step being garbage-collected (a name Orbax ignores)
_CHUNK = 1 << 20


class ConfigMismatchError(ValueError):
  """The checkpoint is intact but was written by another configuration (never a fallback:
  every older step of the run has the same arrays)."""


class MissingItemError(FileNotFoundError):
  """The checkpoint has no such item because its configuration saved none (e.g. `extra`)."""


class CheckpointRejectedError(RuntimeError):
  """No checkpoint step (or not the one asked for) verifies; the message names each step
  and why it was rejected."""


class _Damaged(Exception):
  """A step's files cannot be read back as a checkpoint (unverified steps only)."""


def _hash_file(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _step_files(step_dir: pathlib.Path) -> list[str]:
  """Every file of a step, as sorted paths relative to it, except the manifest itself."""
  return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                if p.is_file() and not p.name.startswith(DIGESTS_FILE))


def write_digests(step_dir: pathlib.Path, step: int) -> None:
  """Writes `step_dir`'s manifest: the size and sha256 of each of its files. Called once
  Orbax has finished the step (renamed into place, metadata committed), so it covers the
  bytes a restore will read; written atomically (a temporary file, fsync, a rename)."""
  files = {rel: {"bytes": (step_dir / rel).stat().st_size, "sha256": _hash_file(step_dir / rel)}
           for rel in _step_files(step_dir)}
  tmp = step_dir / (DIGESTS_FILE + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"format": DIGEST_FORMAT, "step": step, "files": files}, f, indent=1,
              sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  tmp.replace(step_dir / DIGESTS_FILE)


def _is_sealed(step_dir: pathlib.Path) -> bool:
  """Whether the step was written by a tree_rl that writes digest manifests: it has one, or
  Orbax's step metadata carries the seal mark (the manifest went missing)."""
  if (step_dir / DIGESTS_FILE).exists():
    return True
  try:
    meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    return SEAL_KEY in (meta.get("custom_metadata") or {})
  except (OSError, ValueError, AttributeError):
    return False


def _listing(names: list[str], limit: int = 4) -> str:
  more = f" and {len(names) - limit} more" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def verify_digests(step_dir: pathlib.Path) -> str | None:
  """None if every file in `step_dir`'s manifest is there with its size and sha256, else
  why not, naming the files. Raises FileNotFoundError if the step has no manifest."""
  path = step_dir / DIGESTS_FILE
  try:
    manifest = json.loads(path.read_text(encoding="utf-8"))
    files, fmt = manifest["files"], manifest["format"]
  except FileNotFoundError:
    raise
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"its digest manifest {DIGESTS_FILE} is unreadable ({type(e).__name__}: {e})"
  if fmt != DIGEST_FORMAT:
    return f"its digest manifest has format {fmt!r}, this tree_rl reads {DIGEST_FORMAT!r}"
  missing, resized, differ = [], [], []
  for rel, want in sorted(files.items()):
    p = step_dir / rel
    if not p.is_file():
      missing.append(rel)
    elif p.stat().st_size != want["bytes"]:
      resized.append(f"{rel} ({p.stat().st_size} bytes, {want['bytes']} saved)")
    elif _hash_file(p) != want["sha256"]:
      differ.append(rel)
  problems = []
  if missing:
    gone = sorted({rel.split("/")[0] for rel in missing if "/" in rel
                   and not (step_dir / rel.split("/")[0]).exists()})
    rest = [rel for rel in missing if rel.split("/")[0] not in gone]
    problems += [f"directory {d}/ is missing" for d in gone]
    if rest:
      problems.append(f"file(s) {_listing(rest)} missing")
  if resized:
    problems.append(f"file(s) {_listing(resized)} changed size (truncated or appended to)")
  if differ:
    problems.append(f"file(s) {_listing(differ)} differ from what was saved (sha256)")
  extra = sorted(set(_step_files(step_dir)) - set(files))
  if extra and not problems:  # a stray file changes no saved byte: noted, not rejected
    logging.warning("checkpoint %s holds files its manifest does not list (ignored): %s",
                    step_dir, _listing(extra))
  return "; ".join(problems) or None


@dataclasses.dataclass(frozen=True)
class StepCheck:
  """What verifying one step found: "verified" (its digests match), "unverified" (written
  before tree_rl wrote digests: trusted with a warning) or "rejected" (with the reason)."""
  step: int
  status: str
  reason: str = ""


class RunCheckpointer:
  """Saves and restores (train state, JSON metadata) pairs by step, verified by digests.

  Each save, once Orbax has finished writing the step, records the size and sha256 of each
  of the step's files in `<step>/tree_rl_digests.json`, reads the step back to check them,
  and only then deletes steps past `keep_last` (so the last verified step is never deleted
  before a newer one has verified). A restore without a step takes the newest step that
  verifies: a step whose files differ, are missing or were cut short is rejected, named in a
  warning with the file, and the next older step is tried. Rejected steps of the run's own
  directory are moved to `<directory>/rejected/` (out of Orbax's way, so the run can save
  that step number again); a `read_only` checkpointer (another run's checkpoints) moves
  nothing. `rejected` lists what this checkpointer's restores rejected (the metric
  `checkpoint/rejected_steps`). A step saved before tree_rl wrote digests has no manifest
  and no seal mark: it is restored with a warning that it is unverified, as long as no
  older step has a manifest (then its own is missing: rejected).

  Args:
    directory: where checkpoints live (created if missing).
    keep_last: how many recent checkpoints to keep.
    read_only: restore only; rejected steps stay where they are.
  """

  def __init__(self, directory: str | pathlib.Path, keep_last: int = 2, read_only: bool = False):
    if keep_last < 1:
      raise ValueError(f"keep_last={keep_last} must be >= 1")
    self.directory = pathlib.Path(directory).absolute()
    self.keep_last, self.read_only = keep_last, read_only
    self.rejected: dict[int, str] = {}  # step -> why, over this checkpointer's restores
    self.restored_step: int | None = None
    self._checks: dict[int, StepCheck] = {}
    self._barriers = 0
    # Handlers are registered up front so a fresh process can read a checkpoint's
    # metadata before restoring it (the configuration check below). max_to_keep=None:
    # garbage collection is ours (_collect), after the new step has verified.
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler(),
                       "extra": ocp.StandardCheckpointHandler()})
    if self._primary and not read_only:  # a deletion a kill cut short
      for stale in self.directory.glob(f"*{_DELETING}"):
        shutil.rmtree(stale, ignore_errors=True)

  @property
  def _primary(self) -> bool:
    return jax.process_index() == 0

  def _sync(self, what: str) -> None:
    """A barrier over the run's processes (none alone): process 0 alone writes manifests,
    collects garbage and moves rejected steps, and the others then re-read the directory."""
    if jax.process_count() > 1:
      self._barriers += 1
      ocp.multihost.sync_global_processes(f"tree_rl_checkpoint_{what}_{self._barriers}")

  def _step_dir(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

  def latest_step(self) -> int | None:
    """The newest step on disk, verified or not (restores skip one that does not verify)."""
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any], extra: Any = None) -> None:
    """Writes step `step`, waits until it is on disk, records and checks its digests, then
    deletes the steps past `keep_last`.

    `extra` is an optional pytree of arrays saved beside the train state (method
    state, e.g. TRACE's predictor weights); `restore_extra` reads it back.

    Raises:
      ValueError: step `step` exists already (Orbax does not overwrite a step).
      OSError: the step read back differs from what was just written (the older steps are
        kept; a resume falls back to the newest one that verifies).
    """
    items = {"state": ocp.args.StandardSave(_leaf_dict(state)), "meta": ocp.args.JsonSave(meta)}
    if extra is not None:
      items["extra"] = ocp.args.StandardSave(_leaf_dict(extra))
    if not self.manager.save(step, args=ocp.args.Composite(**items),
                             custom_metadata={SEAL_KEY: DIGEST_FORMAT}):
      raise ValueError(f"checkpoint {self.directory}/{step} exists already; Orbax does not "
                       f"overwrite a step")
    # Digests only after Orbax's (possibly asynchronous) write has finished and the step is
    # renamed into place: then no byte of it changes any more.
    self.manager.wait_until_finished()
    failure = None
    if self._primary:
      step_dir = self._step_dir(step)
      try:
        write_digests(step_dir, step)
        problem = verify_digests(step_dir)  # read back from disk: the manifest and every file
      except OSError as e:
        problem = f"{type(e).__name__}: {e}"
      if problem is None:
        self._checks[step] = StepCheck(step, "verified")
        self._collect(step)
      else:
        failure = OSError(f"checkpoint {step_dir} does not read back as written: {problem}. "
                          f"The older steps are kept (none deleted); check the disk under "
                          f"{self.directory}, then resume: it falls back to the newest step "
                          f"that verifies")
    self._sync("sealed")
    self.manager.reload()  # process 0 may have deleted steps
    if failure is not None:
      raise failure

  def _collect(self, newest: int) -> None:
    """Deletes the steps older than the `keep_last` newest, once `newest` has verified."""
    steps = sorted(s for s in self.manager.all_steps() if s <= newest)
    for old in steps[:-self.keep_last]:
      path = self._step_dir(old)
      if not path.exists():
        continue
      doomed = path.with_name(path.name + _DELETING)  # out of Orbax's listing at once
      path.rename(doomed)
      shutil.rmtree(doomed)
      self._checks.pop(old, None)

  def check(self, step: int) -> StepCheck:
    """Verifies `step`'s files against its digest manifest (the result is cached)."""
    if step in self._checks:
      return self._checks[step]
    step_dir = self._step_dir(step)
    try:
      problem = verify_digests(step_dir)
      result = StepCheck(step, "verified" if problem is None else "rejected", problem or "")
    except FileNotFoundError:
      older = [s for s in self.manager.all_steps() if s < step and _is_sealed(self._step_dir(s))]
      if not step_dir.is_dir():
        result = StepCheck(step, "rejected", f"its directory {step_dir} is gone")
      elif _is_sealed(step_dir):
        result = StepCheck(step, "rejected", f"its digest manifest {DIGESTS_FILE} is missing "
                           f"(deleted, or the run was killed before writing it)")
      elif older:
        result = StepCheck(step, "rejected", f"its digest manifest {DIGESTS_FILE} is missing "
                           f"though older step {max(older)} has one")
      else:
        result = StepCheck(step, "unverified")
    self._checks[step] = result
    return result

  def _load_verified(self, step: int | None, what: str, load: Callable[[int], Any]
                     ) -> tuple[int, Any]:
    """(s, `load(s)`) for s = `step`, or (None) the newest step that verifies and loads.

    A rejected step is skipped for the next older one; an unverified (pre-digest) step
    whose load fails is too. A load that fails on a verified step is not damage, and a
    configuration mismatch is never a reason to fall back: both propagate.
    """
    steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    rejected: dict[int, str] = {}
    for s in steps:
      result = self.check(s)
      if result.status == "rejected":
        rejected[s] = result.reason
        continue
      try:
        out = load(s)
      except (ConfigMismatchError, MissingItemError):
        raise
      except Exception as e:  # noqa: BLE001 (any failure to read an unverified step)
        if result.status == "verified":
          raise
        reason = f"it cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
        self._checks[s] = StepCheck(s, "rejected", reason)
        rejected[s] = reason
        continue
      if result.status == "unverified":
        logging.warning("checkpoint %s/%d has no digest manifest (saved before tree_rl "
                        "verified checkpoints): %s restored unverified", self.directory, s, what)
      self._fell_back(rejected, s)
      return s, out
    self._fell_back(rejected, None)
    listing = "; ".join(f"step {s}: {why}" for s, why in rejected.items())
    if step is not None:
      raise CheckpointRejectedError(
          f"checkpoint {self.directory}/{step} does not verify ({listing}), so its {what} is "
          f"not restored. Restore another step (on disk: {sorted(self.manager.all_steps())}) "
          f"or leave the step out to take the newest one that verifies")
    raise CheckpointRejectedError(
        f"no checkpoint in {self.directory} verifies, so its {what} is not restored: "
        f"{listing}. Copy the damaged files back from a backup (each step's {DIGESTS_FILE} "
        f"lists their sizes and sha256), or start the run over: move {self.directory} "
        f"away and relaunch (the run then starts from the configured model)")

  def _fell_back(self, rejected: dict[int, str], restored: int | None) -> None:
    """Logs the rejected steps and, in the run's own directory, moves them to `rejected/`
    so that the resumed run can save those step numbers again."""
    if not rejected:
      return
    to = f"falling back to step {restored}" if restored is not None else "no step verifies"
    for s, why in rejected.items():
      logging.warning("checkpoint %s/%d rejected: %s; %s", self.directory, s, why, to)
    self.rejected.update(rejected)
    if self.read_only or restored is None:
      return
    self._sync("rejected")
    if self._primary:
      for s, why in rejected.items():
        src, dest = self._step_dir(s), self.directory / REJECTED_DIR / str(s)
        for i in itertools.count(1):
          if not dest.exists():
            break
          dest = self.directory / REJECTED_DIR / f"{s}.{i}"
        dest.parent.mkdir(exist_ok=True)
        if src.exists():
          src.rename(dest)
          (dest / "tree_rl_rejected.txt").write_text(why + "\n", encoding="utf-8")
          logging.warning("moved rejected checkpoint step %d to %s (delete it when it is no "
                          "longer needed)", s, dest)
    self._sync("moved")
    self.manager.reload()
    for s in rejected:
      self._checks.pop(s, None)

  def fallback_metrics(self) -> dict[str, float]:
    """The metrics row a resume writes when it rejected steps (empty when none)."""
    if not self.rejected:
      return {}
    return {REJECTED_METRIC: float(len(self.rejected)),
            "checkpoint/restored_step": float(self.restored_step if self.restored_step
                                              is not None else -1)}

  def _abstract(self, step: int, item: str, target: Any) -> dict[str, Any]:
    """`target`'s leaves as restore targets, after checking them against item `item` of `step`."""
    leaves = jax.tree.leaves(target)
    if item == "state" and not (self._step_dir(step) / item).is_dir():
      raise _Damaged(f"its {item}/ directory is missing")
    try:
      saved = self.manager.item_metadata(step)[item]
    except KeyError:
      saved = None
    if saved is None:
      raise MissingItemError(
          f"checkpoint {self.directory}/{step} holds no {item!r} item: it was written by "
          f"another configuration; use a fresh --workdir or the same config")
    if len(saved) != len(leaves):
      raise ConfigMismatchError(
          f"checkpoint {self.directory}/{step} holds {len(saved)} arrays but this configuration "
          f"has {len(leaves)}: it was written by another model, LoRA or optimizer setting; "
          f"use a fresh --workdir or the same config")
    for key, leaf in zip(sorted(saved), leaves):
      shape = tuple(getattr(saved[key], "shape", ()))
      if shape != tuple(np.shape(leaf)):
        raise ConfigMismatchError(
            f"checkpoint {self.directory}/{step}: array {key} has shape {shape}, this "
            f"configuration expects {tuple(np.shape(leaf))}; use a fresh --workdir or the "
            f"same config")
    return {k: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
            for k, x in _leaf_dict(target).items()}

  def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """(state with `target`'s structure and the saved leaves, metadata) of `step` (default:
    the newest step that verifies; see the class docstring).

    Raises:
      FileNotFoundError: no checkpoint in the directory (`MissingItemError`: the step holds
        no train state item).
      ValueError: the checkpoint was written by a different configuration
        (`ConfigMismatchError`).
      CheckpointRejectedError: no step verifies (or `step` does not), naming each and why.
    """
    treedef = jax.tree.structure(target)

    def load(s: int) -> tuple[Any, dict[str, Any]]:
      abstract = self._abstract(s, "state", target)
      out = self.manager.restore(s, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
      return (jax.tree.unflatten(treedef, [out["state"][k] for k in sorted(out["state"])]),
              dict(out["meta"]))

    self.restored_step, (state, meta) = self._load_verified(step, "train state", load)
    return state, meta

  def restore_meta(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata saved at `step` (default: the newest step that verifies).

    Raises:
      FileNotFoundError: no checkpoint in the directory.
      CheckpointRejectedError: no step verifies (or `step` does not).
    """
    self.restored_step, meta = self._load_verified(step, "metadata", lambda s: dict(
        self.manager.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]))
    return meta

  def restore_extra(self, target: Any, step: int | None = None) -> Any:
    """The `extra` arrays saved at `step` (default: the step the last `restore` read, else
    the newest that verifies), in `target`'s structure.

    Raises:
      FileNotFoundError: no checkpoint, or one saved without `extra` (`MissingItemError`).
      ValueError: the arrays do not match `target`'s (another configuration).
      CheckpointRejectedError: the step does not verify (or, without one, no step does).
    """
    def load(s: int) -> Any:
      abstract = self._abstract(s, "extra", target)
      out = self.manager.restore(s, args=ocp.args.Composite(
          extra=ocp.args.StandardRestore(abstract)))["extra"]
      return jax.tree.unflatten(jax.tree.structure(target), [out[k] for k in sorted(out)])

    return self._load_verified(self.restored_step if step is None else step, "method state",
                               load)[1]

  def close(self) -> None:
    """Waits for any save in flight, then closes the Orbax manager."""
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
    CheckpointRejectedError: no step verifies (or `step` does not).
  """
  workdir_path = pathlib.Path(workdir)
  if not (workdir_path / "config.json").is_file():
    raise FileNotFoundError(f"{workdir} is not a tree_rl run directory (no config.json)")
  cfg = RunConfig.from_config_dict(json.loads((workdir_path / "config.json").read_text()))
  model, tokenizer = build_run_policy(cfg)
  state = ppo.init_state(model, make_optimizer(cfg.optim.lr, cfg),
                         with_ref=cfg.algo.loss_config().kl_coef > 0)
  # read_only: the run may still be writing; a step it has not sealed yet is skipped, not moved.
  ckpt = RunCheckpointer(workdir_path / "checkpoints", keep_last=cfg.keep_checkpoints,
                         read_only=True)
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
  one outside RESUMABLE_FIELDS fails, unless `allow_change` (keys the saved file lacks do
  not count). `write=False` (processes other than 0) only checks.

  Raises:
    ValueError: resuming without `allow_change`, the config changed (each changed key is
      named with its old and new value), or the saved config.json is not valid JSON.
  """
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


def method_state(strategy: BranchingStrategy) -> dict[str, Any] | None:
  """A snapshot of a strategy's learned state (TRACE's predictor), or None."""
  return copy.deepcopy(strategy.state_dict())


def save_run(ckpt: RunCheckpointer, step: int, state: Any, meta: dict[str, Any],
             method: dict[str, Any] | None) -> None:
  """Saves the run. A strategy's learned state as of the step's rollout (`method_state`) is
  saved too: the JSON part in meta["method_state"], the arrays as the checkpoint's extra."""
  extra = None
  if method is not None:
    meta["method_state"], extra = method["meta"], method["arrays"] or None
  ckpt.save(step, state, meta, extra=extra)


def restore_method_state(strategy: BranchingStrategy, source: RunCheckpointer,
                         meta: dict[str, Any]) -> None:
  """Loads what `save_run` stored for the strategy (a checkpoint without it, or a strategy
  that learns nothing: nothing)."""
  fresh = strategy.state_dict()  # the structure to restore into
  if fresh is None or "method_state" not in meta:
    return
  arrays = fresh["arrays"]
  strategy.load_state_dict({"meta": meta["method_state"],
                            "arrays": source.restore_extra(arrays) if arrays else arrays})
