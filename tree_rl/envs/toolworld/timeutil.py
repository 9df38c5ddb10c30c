"""Timestamps and time zones of the tool world, without the system clock or tz database.

Zones are fixed UTC offsets (the world has no daylight saving time), so a zone
is a name plus minutes and all arithmetic is exact with `datetime`. The task's
"now" is data (`Context`), never `datetime.now()`.

Accepted timestamps: "YYYY-MM-DD", "YYYY-MM-DD HH:MM[:SS]" or with "T",
optionally followed by "Z" or "+HH:MM"/"-HH:MM"; or a Unix time in seconds.
Accepted zones: "UTC", "UTC+05:30"/"UTC-6"/"+01:00", a zone name of the world
("Europe/Lunhaven") or the name of one of its cities.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

from tree_rl.envs.toolworld.world import World, norm, offset_text

_STAMP = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(?:[T ](\d{1,2}):(\d{2})(?::(\d{2}))?)?"
                    r"\s*(Z|[+-]\d{2}:?\d{2})?$")
_OFFSET = re.compile(r"^(?:utc|gmt)?\s*([+-])(\d{1,2})(?::?(\d{2}))?$")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")


@dataclasses.dataclass(frozen=True)
class Context:
  """The task's present: local date and time at the user's location (a city)."""
  now: dt.datetime  # naive, local time of `city`
  city: str


@dataclasses.dataclass(frozen=True)
class Stamp:
  """A parsed timestamp: naive wall time, its offset if stated, whether a time was given."""
  wall: dt.datetime
  offset_min: int | None
  has_time: bool


def parse_date(text: str) -> dt.date:
  """A "YYYY-MM-DD" date, or a ValueError naming the expected format."""
  try:
    return dt.date.fromisoformat(text.strip())
  except ValueError:
    raise ValueError(f"invalid date '{text}': use YYYY-MM-DD") from None


def parse_stamp(text: str) -> Stamp:
  """Parses one timestamp (see the module docstring for the accepted forms)."""
  text = text.strip()
  if re.fullmatch(r"-?\d{9,11}", text):
    wall = dt.datetime(1970, 1, 1) + dt.timedelta(seconds=int(text))
    return Stamp(wall, 0, True)
  m = _STAMP.match(text)
  if not m:
    raise ValueError(f"invalid timestamp '{text}': use YYYY-MM-DD, YYYY-MM-DDTHH:MM "
                     "(optionally with +HH:MM or Z) or Unix seconds")
  year, month, day, hour, minute, second, zone = m.groups()
  try:
    wall = dt.datetime(int(year), int(month), int(day), int(hour or 0), int(minute or 0),
                       int(second or 0))
  except ValueError as e:
    raise ValueError(f"invalid timestamp '{text}': {e}") from None
  offset = None
  if zone == "Z":
    offset = 0
  elif zone:
    digits = zone[1:].replace(":", "")
    offset = (int(digits[:2]) * 60 + int(digits[2:])) * (1 if zone[0] == "+" else -1)
  return Stamp(wall, offset, hour is not None)


def resolve_zone(world: World, spec: str) -> tuple[str, int]:
  """(zone name, UTC offset in minutes) of a zone name, UTC offset or city name."""
  zones = world.timezones()
  key = norm(spec)
  by_norm = {norm(z): z for z in zones}
  if key in by_norm:
    return by_norm[key], zones[by_norm[key]]
  if key in ("utc", "gmt", "z"):
    return "UTC", 0
  m = _OFFSET.match(spec.strip().lower())
  if m:
    sign, hours, minutes = m.groups()
    offset = (int(hours) * 60 + int(minutes or 0)) * (1 if sign == "+" else -1)
    if abs(offset) > 14 * 60:
      raise ValueError(f"invalid UTC offset '{spec}'")
    return f"UTC{offset_text(offset)}", offset
  try:
    city = world.city(spec)
  except ValueError:
    raise ValueError(f"unknown time zone '{spec}': use UTC, an offset like UTC+05:30, "
                     f"a zone such as {sorted(zones)[0]} or a city name") from None
  return city.timezone, city.utc_offset_min


def to_utc(stamp: Stamp, default_offset_min: int) -> dt.datetime:
  """The naive UTC time of `stamp`; a stamp without offset is read at `default_offset_min`."""
  offset = stamp.offset_min if stamp.offset_min is not None else default_offset_min
  return stamp.wall - dt.timedelta(minutes=offset)


def iso_minutes(wall: dt.datetime) -> str:
  """YYYY-MM-DDTHH:MM, with seconds only when they are not zero."""
  return wall.isoformat(timespec="seconds" if wall.second else "minutes")


def human(wall: dt.datetime) -> str:
  """"Saturday, 14 June 2025, 09:30"."""
  # Month names from a table, not strftime("%B"), which follows the process locale.
  return (f"{WEEKDAYS[wall.weekday()]}, {wall.day} {MONTHS[wall.month - 1]} {wall.year}, "
          f"{wall:%H:%M}")
