"""The paper notebooks' harness: arms as data, runs, and their tables and plots.

The notebooks in `notebooks/` (one per paper) are thin clients of this package: each lists
its arms (a config file under `configs/` plus overrides, and the warm-start arm it resumes
from), runs them at one of three scales, and rebuilds its tables and plots from what the
runs left on disk, so committed results re-plot without re-running anything
(docs/notebooks.md). A notebook puts `notebooks/` on `sys.path` and imports this package
as `lib`.

- `lib.arms`: `Arm`, the scales, the results root and each arm's config.
- `lib.running`: `run_arm` / `run_arms`, which train each (arm, seed) in its own folder as
  a `launch/train.py` process, and `screen`, a warm start's pass rate on training tasks.
- `lib.results`: `load_runs`, the tables over seeds, the paired tests and the plots.
- `lib.mechanisms`: arms' trees of the same prompts at one fixed policy
  (launch/measure_rollouts.py), paired prompt by prompt, with a power analysis
  (notebooks/mechanisms.py).
"""

from lib.arms import (GPU_MODEL_ENV, RESULTS_ENV, SCALES, Arm, build_config, check_arms,
                      checked_arms, results_root, unique_arms)
from lib.results import (PairedRow, Run, Spread, Stat, curve, is_finished, load_run, load_runs,
                         paired_row, paired_table, paired_tables, plot_bars, plot_columns,
                         plot_curves, show, summarize, summary_table, write_tables)
from lib.running import WARM_DIR, provenance, run_arm, run_arms, run_dir, screen

__all__ = ["GPU_MODEL_ENV", "RESULTS_ENV", "SCALES", "WARM_DIR", "Arm", "PairedRow", "Run", "Spread", "Stat",
           "build_config", "check_arms", "checked_arms", "curve", "is_finished", "load_run",
           "load_runs", "paired_row", "paired_table", "paired_tables", "plot_bars", "plot_columns",
           "plot_curves", "provenance", "results_root", "run_arm", "run_arms", "run_dir", "screen",
           "show",
           "summarize", "summary_table", "unique_arms", "write_tables"]
