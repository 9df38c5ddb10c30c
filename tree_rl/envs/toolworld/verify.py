"""Rule-based verifier of tool-world answers: the final answer text against a typed truth.

PORTool (arXiv 2510.26020, §3.1 and §3.2 Step 2) scores trajectories with a GPT-4o judge: +1 true, -1
false, 0 "unable to answer". Our ground truths are typed (see `oracle.py`),
so a deterministic check replaces the judge:

  - number: any number in the answer (dates and clock times removed first;
    "1.2 million" understood) within rel_tol * |truth| of the truth, or less than
    half a unit of the answer's own last digit from it, i.e. "541" matches 541.3
    but "14" does not match 14.5;
  - string: the normalised truth occurs in the normalised answer; with
    options (the candidates the question names), the first option the answer
    mentions must be the truth, so "A beat B" is not read as "B";
  - yes_no: the answer's first yes/no word;
  - date / time: any date (ISO, "June 14, 2025", "14 June") or clock time
    ("14:30", "2:30 pm") in the answer equals the truth;
  - list: every item present, in order when ordered; all: every part matches.

An answer that says it cannot answer scores 0 before any of these checks.
"Any number/date/time" would reward hedging ("it is 1, 2, 3, ... or 900 km")
in RL, so an answer naming more than MAX_CANDIDATES distinct values of the
checked kind does not match.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tree_rl.envs.toolworld.timeutil import MONTHS

_UNABLE = re.compile(
    r"\bunable to answer\b"
    r"|\b(?:unable to|not able to|cannot|can ?not|can't|could not|couldn't)\s+"
    r"(?:answer|find|determine|provide|retrieve|access|get|obtain|locate|verify)\b"
    r"|\bno (?:data|information|results?) (?:is |are |was |were )?(?:available|found)\b"
    r"|\b(?:don't|do not) have (?:enough |sufficient |the |any )?(?:data|information|access)\b"
    r"|\binsufficient (?:data|information)\b", re.IGNORECASE)
_STAMP_LIKE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2})?)?(?:Z|[+-]\d{2}:\d{2})?"
                         r"|(?<!\d)\d{1,2}:\d{2}(?::\d{2})?(?!\d)")
_NUMBER = re.compile(r"(?<![\w.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?"
                     r"(?:\s*(thousand|million|billion)\b)?", re.IGNORECASE)
_SCALE = {"thousand": 1e3, "million": 1e6, "billion": 1e9}
MAX_CANDIDATES = 8  # distinct numbers (dates, times) an answer may name and still match
_MONTH = {m.lower(): i + 1 for i, m in enumerate(MONTHS)}
_MONTH.update({m.lower()[:3]: i + 1 for i, m in enumerate(MONTHS)})
_MONTH_RE = "|".join(sorted(_MONTH, key=len, reverse=True))
_ISO_DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})")
_MONTH_DAY = re.compile(rf"\b({_MONTH_RE})\.?\s+(\d{{1,2}})(?:st|nd|rd|th)?\b(?:,?\s+(\d{{4}}))?",
                        re.IGNORECASE)
_DAY_MONTH = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTH_RE})\b\.?"
                        r"(?:,?\s+(\d{4}))?", re.IGNORECASE)
_CLOCK = re.compile(r"(?<!\d)(\d{1,2}):(\d{2})(?::\d{2})?(?!\d)(?:\s*([ap])\.?\s?m\b\.?)?",
                    re.IGNORECASE)


def _clean(text: str) -> str:
  """Unicode minus and curly apostrophes as ASCII, so the patterns see one spelling."""
  return text.replace("\u2212", "-").replace("\u2019", "'").replace("\u2018", "'")


def normalize(text: str) -> str:
  """Lower case, letters and digits only, single spaces."""
  return " ".join(re.sub(r"[^a-z0-9]+", " ", _clean(text).lower()).split())


def is_unable(text: str) -> bool:
  """Whether the answer says it cannot answer (PORTool's "unable_to_answer", reward 0)."""
  return bool(_UNABLE.search(_clean(text)))


def numbers_in(text: str) -> list[tuple[float, float]]:
  """(value, half a unit of its last stated digit) of each number outside dates and times."""
  found = []
  for m in _NUMBER.finditer(_STAMP_LIKE.sub(" ", _clean(text))):
    sign, whole, frac, scale = m.groups()
    value = float(whole.replace(",", "") + ("." + frac if frac else ""))
    factor = _SCALE[scale.lower()] if scale else 1.0
    half_unit = 0.5 * 10.0 ** -(len(frac) if frac else 0) * factor
    found.append(((-value if sign else value) * factor, half_unit))
  return found


def _number_ok(truth: Mapping[str, Any], text: str) -> bool:
  target = float(truth["value"])
  rel_tol = float(truth.get("rel_tol", 1e-2))
  found = numbers_in(text)
  if len({value for value, _ in found}) > MAX_CANDIDATES:
    return False
  for value, half_unit in found:
    if truth.get("abs"):
      value, target = abs(value), abs(target)
    # Rounding to the answer's precision is strict at the tie: 14.5 rounds to 15, so
    # "14" (half a unit away) does not match it; rel_tol is inclusive.
    err = abs(value - target)
    if err <= rel_tol * abs(target) + 1e-9 or err < half_unit - 1e-9:
      return True
  return False


def _position(needle: str, haystack: str) -> int:
  """Index of the normalised `needle` as whole words in normalised `haystack`, or -1."""
  needle = normalize(needle)
  return f" {haystack} ".find(f" {needle} ") if needle else -1


def _string_ok(truth: Mapping[str, Any], text: str) -> bool:
  answer = normalize(text)
  if _position(truth["value"], answer) < 0:
    return False
  options = [o for o in truth.get("options", ()) if _position(o, answer) >= 0]
  if not options:
    return True
  first = min(options, key=lambda o: _position(o, answer))
  return normalize(first) == normalize(truth["value"])


def _yes_no_ok(truth: Mapping[str, Any], text: str) -> bool:
  words = [w for w in normalize(text).split() if w in ("yes", "no")]
  return bool(words) and words[0] == truth["value"]


def _month(name: str) -> int | None:
  """The number of a month name the patterns matched. Unicode case-insensitive matching
  also takes letters whose lower case is not ASCII (the long s in "ſeptember", a dotless or
  dotted i), which casefold maps back where it can; None for the others."""
  return _MONTH.get(name.lower(), _MONTH.get(name.casefold()))


def dates_in(text: str) -> list[tuple[int | None, int, int]]:
  """(year or None, month, day) of each date written in the answer."""
  found: list[tuple[int | None, int, int]] = []
  for y, mo, d in _ISO_DATE.findall(text):
    found.append((int(y), int(mo), int(d)))
  for mo, d, y in _MONTH_DAY.findall(text):
    if _month(mo) is not None:
      found.append((int(y) if y else None, _month(mo), int(d)))
  for d, mo, y in _DAY_MONTH.findall(text):
    if _month(mo) is not None:
      found.append((int(y) if y else None, _month(mo), int(d)))
  return found


def _date_ok(truth: Mapping[str, Any], text: str) -> bool:
  year, month, day = (int(x) for x in truth["value"].split("-"))
  found = dates_in(text)
  if len(set(found)) > MAX_CANDIDATES:
    return False
  return any(m == month and d == day and y in (None, year) for y, m, d in found)


def times_in(text: str) -> list[str]:
  """Each clock time in the answer as HH:MM on the 24-hour clock."""
  found = []
  for h, mi, half in _CLOCK.findall(text):
    hour = int(h)
    if half:
      hour = hour % 12 + (12 if half.lower() == "p" else 0)
    found.append(f"{hour:02d}:{mi}")
  return found


def _list_ok(truth: Mapping[str, Any], text: str) -> bool:
  answer = normalize(text)
  positions = [_position(item, answer) for item in truth["value"]]
  if any(p < 0 for p in positions):
    return False
  return not truth.get("ordered") or positions == sorted(positions)


def matches(truth: Mapping[str, Any], text: str) -> bool:
  """Whether the answer text agrees with the typed ground truth (see the module docstring)."""
  kind = truth["type"]
  if kind == "number":
    return _number_ok(truth, text)
  if kind == "string":
    return _string_ok(truth, text)
  if kind == "yes_no":
    return _yes_no_ok(truth, text)
  if kind == "date":
    return _date_ok(truth, text)
  if kind == "time":
    found = times_in(text)
    return len(set(found)) <= MAX_CANDIDATES and truth["value"] in found
  if kind == "list":
    return _list_ok(truth, text)
  if kind == "all":
    return all(matches(part, text) for part in truth["value"])
  raise ValueError(f"unknown answer type {kind!r}")
