"""The three timestamp tools: comparator, converter and interval calculator.

A timestamp without an explicit offset is read in the user's time zone (the
task's `Context`), as a person asking "is 18:00 before the flight?" means
local time. See `timeutil.py` for the accepted timestamp and zone spellings.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from tree_rl.envs.toolworld.timeutil import (WEEKDAYS, human, iso_minutes, parse_stamp,
                                             resolve_zone, to_utc)
from tree_rl.envs.toolworld.world import City, World, offset_text

FORMATS = ("iso", "date", "time", "unix", "human")


def _schema(properties: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
  return {"type": "object", "properties": properties, "required": list(required)}


_STAMP_HELP = "YYYY-MM-DD or YYYY-MM-DDTHH:MM (optionally +HH:MM); no offset = user's zone"

# name -> (description, parameters schema) of the three timestamp tools.
TIME_TOOL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "timestamp_comparator": (
        "Compare two timestamps: whether timestamp_a is before, after or equal to "
        "timestamp_b, and the gap in minutes.",
        _schema({"timestamp_a": {"type": "string", "description": _STAMP_HELP},
                 "timestamp_b": {"type": "string", "description": _STAMP_HELP},
                 "timezone": {"type": "string", "description": "zone of timestamps without offset"}},
                ("timestamp_a", "timestamp_b"))),
    "timestamp_converter": (
        "Convert a timestamp between time zones (zone names like Europe/Lunhaven, UTC offsets "
        "like UTC+05:30, or city names) and formats.",
        _schema({"timestamp": {"type": "string", "description": _STAMP_HELP},
                 "to_timezone": {"type": "string"},
                 "from_timezone": {"type": "string",
                                   "description": "zone of a timestamp without offset"},
                 "format": {"type": "string", "enum": list(FORMATS)}},
                ("timestamp",))),
    "timestamp_interval_calculator": (
        "The interval between start and end (days, hours, minutes), or start shifted by "
        "days/hours/minutes (negative to go back).",
        _schema({"start": {"type": "string", "description": _STAMP_HELP},
                 "end": {"type": "string"}, "days": {"type": "number"},
                 "hours": {"type": "number"}, "minutes": {"type": "number"}},
                ("start",))),
}


class TimeTools:
  """The timestamp tools as methods; `ToolBox` supplies `world` and `home`.

  A mixin rather than closures: tools are bound methods, so building a task's
  tools creates no new functions (cheap even under the test suite's
  type-checking import hook).
  """

  world: World
  home: City

  def timestamp_comparator(self, timestamp_a: str, timestamp_b: str,
                           timezone: str | None = None) -> dict[str, Any]:
    """How timestamp_a relates to timestamp_b, and the gap in minutes."""
    offset = (self.home.utc_offset_min if timezone is None
              else resolve_zone(self.world, timezone)[1])
    a = to_utc(parse_stamp(timestamp_a), offset)
    b = to_utc(parse_stamp(timestamp_b), offset)
    relation = "before" if a < b else "after" if a > b else "equal"
    earlier, later = (timestamp_a, timestamp_b) if a <= b else (timestamp_b, timestamp_a)
    return {"comparison": f"timestamp_a is {relation} timestamp_b" if relation != "equal"
            else "timestamp_a equals timestamp_b",
            "earlier": earlier, "later": later,
            "difference_minutes": round(abs((b - a).total_seconds()) / 60, 2)}

  def timestamp_converter(self, timestamp: str, to_timezone: str | None = None,
                          from_timezone: str | None = None,
                          format: str = "iso"  # noqa: A002 (the schema's name)
                          ) -> dict[str, Any]:
    """The timestamp in another zone and format; an explicit offset wins over from_timezone."""
    stamp = parse_stamp(timestamp)
    if stamp.offset_min is not None:
      source = stamp.offset_min
      source_name = "UTC" if source == 0 else f"UTC{offset_text(source)}"
    elif from_timezone is not None:
      source_name, source = resolve_zone(self.world, from_timezone)
    else:
      source_name, source = self.home.timezone, self.home.utc_offset_min
    name, target = ((source_name, source) if to_timezone is None
                    else resolve_zone(self.world, to_timezone))
    utc = to_utc(stamp, source)
    local = utc + dt.timedelta(minutes=target)
    rendered = {"iso": iso_minutes(local) + offset_text(target),
                "date": local.date().isoformat(), "time": f"{local:%H:%M}",
                "unix": str(int((utc - dt.datetime(1970, 1, 1)).total_seconds())),
                "human": human(local)}[format]
    return {"timestamp": rendered, "timezone": name, "utc_offset": offset_text(target),
            "date": local.date().isoformat(), "time": f"{local:%H:%M}",
            "weekday": WEEKDAYS[local.weekday()]}

  def timestamp_interval_calculator(self, start: str, end: str | None = None,
                                    days: float | int | None = None,
                                    hours: float | int | None = None,
                                    minutes: float | int | None = None) -> dict[str, Any]:
    """end - start broken into days/hours/minutes, or start shifted by the given amounts."""
    shift = [x for x in (days, hours, minutes) if x is not None]
    s = parse_stamp(start)
    if end is not None:
      if shift:
        raise ValueError("give either end (a difference) or days/hours/minutes (a shift), "
                         "not both")
      e = parse_stamp(end)
      if not s.has_time and not e.has_time and s.offset_min is None and e.offset_min is None:
        total = (e.wall.date() - s.wall.date()).days * 1440  # calendar days, no zone needed
      else:
        delta = to_utc(e, self.home.utc_offset_min) - to_utc(s, self.home.utc_offset_min)
        total = round(delta.total_seconds() / 60)
      size = abs(total)
      return {"start": start, "end": end, "days": size // 1440, "hours": size % 1440 // 60,
              "minutes": size % 60, "total_minutes": total, "total_hours": round(total / 60, 2),
              "total_days": round(total / 1440, 4), "end_is_before_start": total < 0}
    if not shift:
      raise ValueError("give end (for a difference) or days/hours/minutes (to shift start)")
    try:
      delta = dt.timedelta(days=days or 0, hours=hours or 0, minutes=minutes or 0)
      result = s.wall + delta
    except OverflowError:
      raise ValueError("the shifted time is out of range") from None
    if not s.has_time and delta % dt.timedelta(days=1) == dt.timedelta(0):
      text = result.date().isoformat()
    else:
      text = iso_minutes(result) + (offset_text(s.offset_min) if s.offset_min is not None else "")
    return {"start": start, "result": text, "weekday": WEEKDAYS[result.weekday()]}
