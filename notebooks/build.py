"""Builds each `notebooks/<name>.ipynb` from its jupytext percent-format source `<name>.py`.

  python notebooks/build.py            # rewrites every notebooks/*.ipynb
  python notebooks/build.py --check    # exits 1 naming each .ipynb that is stale or missing

The `.py` is the source (reviewable diffs, runnable as a script); the `.ipynb` is generated,
deterministically, so a test can check that the two agree without jupytext installed.
Format: a line `# %%` starts a code cell, `# %% [markdown]` a markdown cell whose lines are
`# `-prefixed comments (a bare `#` is a blank line); blank lines around a cell are dropped.
Text between `# %%` and the type is the cell's title (jupytext keeps it in the cell's
metadata; Jupyter does not show it).
The notebook is nbformat 4.5 without outputs, cell ids `cell-<index>`, and jupytext's pairing
metadata, so `jupytext --sync` also works on it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
# "# %% [optional title] [[cell type]]", as jupytext writes it.
_MARKER = re.compile(r"^# %%(?:\s+(?P<title>.*?))?(?:\s*\[(?P<kind>\w+)\])?\s*$")

METADATA = {
    "jupytext": {
        "formats": "ipynb,py:percent",
        "text_representation": {"extension": ".py", "format_name": "percent",
                                "format_version": "1.3"},
    },
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def _trim(lines: list[str]) -> list[str]:
  while lines and not lines[0].strip():
    lines = lines[1:]
  while lines and not lines[-1].strip():
    lines = lines[:-1]
  return lines


def parse(text: str) -> list[tuple[str, str, list[str]]]:
  """(cell type, title, source lines) of each cell of a percent-format script."""
  cells: list[tuple[str, str, list[str]]] = []
  kind, title, lines = None, "", []
  for number, line in enumerate(text.splitlines(), 1):
    match = _MARKER.match(line)
    if match:
      if kind is not None:
        cells.append((kind, title, lines))
      kind, title, lines = match["kind"] or "code", match["title"] or "", []
      if kind not in ("code", "markdown"):
        raise ValueError(f"line {number}: cell type [{kind}]; only code and [markdown] cells")
      continue
    if kind is None:
      if line.strip():
        raise ValueError(f"line {number}: text before the first '# %%' cell marker")
      continue
    if kind == "markdown":
      if line.strip() and not (line == "#" or line.startswith("# ")):
        raise ValueError(f"line {number}: a markdown cell's lines are '# ' comments, got "
                         f"{line!r}")
      line = line[2:]
    lines.append(line)
  if kind is not None:
    cells.append((kind, title, lines))
  return [(k, t, _trim(ls)) for k, t, ls in cells]


def notebook(text: str) -> dict:
  """The nbformat 4.5 notebook of a percent-format script."""
  cells = []
  for index, (kind, title, lines) in enumerate(parse(text)):
    source = [line + "\n" for line in lines[:-1]] + lines[-1:]
    cell = {"cell_type": kind, "id": f"cell-{index}", "metadata": {"title": title} if title else {},
            "source": source}
    if kind == "code":
      cell.update(execution_count=None, outputs=[])
    cells.append(cell)
  return {"cells": cells, "metadata": METADATA, "nbformat": 4, "nbformat_minor": 5}


def render(source: pathlib.Path) -> str:
  """The .ipynb text of `source`, as nbformat writes it (1-space indent, sorted keys)."""
  nb = notebook(source.read_text(encoding="utf-8"))
  return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def sources(folder: pathlib.Path = HERE) -> list[pathlib.Path]:
  """The notebook sources: every .py in `folder` but this script."""
  return sorted(p for p in folder.glob("*.py") if p.name != pathlib.Path(__file__).name)


def stale(folder: pathlib.Path = HERE) -> list[pathlib.Path]:
  """The .ipynb files that are missing or differ from their source's rendering."""
  out = []
  for src in sources(folder):
    target = src.with_suffix(".ipynb")
    if not target.is_file() or target.read_text(encoding="utf-8") != render(src):
      out.append(target)
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 if any notebook is stale")
  parser.add_argument("--folder", type=pathlib.Path, default=HERE,
                      help="the folder of the sources (default: this script's)")
  args = parser.parse_args(argv)
  if args.check:
    bad = stale(args.folder)
    for path in bad:
      print(f"stale: {path} (run python notebooks/build.py)", file=sys.stderr)
    return 1 if bad else 0
  for src in sources(args.folder):
    target = src.with_suffix(".ipynb")
    text = render(src)
    if not target.is_file() or target.read_text(encoding="utf-8") != text:
      target.write_text(text, encoding="utf-8")
      print(f"wrote {target}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
