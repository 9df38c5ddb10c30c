"""The sandbox setting: "bwrap" is refused at once where bubblewrap cannot run, naming the
setting and the fix; "audit" must be asked for, and a run that uses it says so in its log
and in every metric row."""

import importlib
import pathlib
import sys

import pytest
from absl import logging as absl_logging

from tree_rl import train
from tree_rl.envs import make_family
from tree_rl.envs.math_family import MathFamily
from tree_rl.envs.sandbox import bwrap_problem, check_isolation, run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
  """A PATH without bubblewrap (the probe's cached answer is dropped either side)."""
  monkeypatch.setenv("PATH", str(tmp_path))
  bwrap_problem.cache_clear()
  yield
  monkeypatch.undo()
  bwrap_problem.cache_clear()


def test_missing_bubblewrap_refuses_model_code_naming_the_setting_and_the_fix(no_bwrap):
  assert bwrap_problem() == "the bwrap (bubblewrap) executable is not on PATH"
  for build in (MathFamily, lambda: make_family("math")):
    with pytest.raises(ValueError, match=r"task\.kwargs\.sandbox='bwrap' runs model-written "
                       r"code under bubblewrap, but the bwrap \(bubblewrap\) executable is "
                       r"not on PATH\. Install it \(Debian and Ubuntu: apt-get install "
                       r"bubblewrap\).*set task\.kwargs\.sandbox=audit"):
      build()
  with pytest.raises(ValueError, match="isolation='bwrap'"):
    run_python("print(1)")
  # The fallback runs, when asked for.
  family = MathFamily(sandbox="audit")
  assert family.sandbox == "audit"
  assert run_python("print(6 * 7)", isolation="audit").stdout == "42\n"


def test_an_unknown_isolation_lists_the_valid_ones():
  with pytest.raises(ValueError, match=r"task\.kwargs\.sandbox='docker' is not an isolation; "
                     r"valid: \['bwrap', 'audit'\]"):
    check_isolation("docker")
  with pytest.raises(ValueError, match="'docker' is not an isolation"):
    MathFamily(sandbox="docker")


class _AuditWorld:
  """The tool world, declaring that its code tool runs under the audit hook alone."""

  sandbox = "audit"

  def __init__(self, inner):
    self.inner = inner

  def __getattr__(self, name):
    return getattr(self.inner, name)


@pytest.mark.e2e
def test_a_run_under_the_audit_hook_alone_says_so_in_its_log_and_every_row(tmp_path,
                                                                           monkeypatch):
  make = train.make_family
  monkeypatch.setattr(train, "make_family", lambda name, **kw: _AuditWorld(make(name, **kw)))
  warnings = []
  monkeypatch.setattr(absl_logging, "warning",
                      lambda msg, *args: warnings.append(msg % args if args else msg))
  c = importlib.import_module("configs.grpo").get_config("runlocal,steps=2")
  c.sft.steps = 0
  out = train.train_and_evaluate(c, str(tmp_path / "run"))
  rows = [r for r in out["history"] if "loss" in r or "reward/outcome_mean" in r]
  assert len(rows) == 2 and all(r["sandbox/kernel_enforced"] == 0.0 for r in rows), rows
  assert any("NOT a security boundary" in w for w in warnings), warnings
