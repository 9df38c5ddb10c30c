"""The sandbox isolation the tests run model code under.

"bwrap" wherever bubblewrap can run, and always in CI (`.ci/run` installs it, so a CI
machine without it fails the sandbox tests instead of skipping the boundary). A developer
machine without bubblewrap runs the same tests under "audit", the audit hook alone, and
skips the tests of the kernel boundary (`needs_bwrap`).
"""

import os

import pytest

from tree_rl.envs.sandbox import bwrap_problem

BWRAP_PROBLEM = bwrap_problem()
ISOLATION = "bwrap" if BWRAP_PROBLEM is None or os.environ.get("CI") else "audit"
needs_bwrap = pytest.mark.skipif(ISOLATION != "bwrap",
                                 reason=f"bubblewrap cannot run here: {BWRAP_PROBLEM}")
