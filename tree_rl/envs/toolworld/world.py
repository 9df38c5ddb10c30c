"""The static part of the offline tool world: places, people, companies, teams.

`World.build(seed)` draws every static fact (city coordinates, founders,
landmark heights, league fixtures, holiday rules) from `random.Random(seed)`
in well under 0.2 s. Per-date values (weather, prices, FX rates, flights,
news) are not stored: `series.py` derives them on demand from a hash of
(seed, key), so a two-year date range costs nothing to build and every value
is the same no matter in which order tools ask for it.

Lookups are case- and punctuation-insensitive and raise `ValueError` with close
matches, which the executor shows the model as a tool error.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import hashlib
import math
import random
import re
from collections.abc import Mapping
from typing import Any

from tree_rl.envs.toolworld import names

FIRST_DAY = dt.date(2025, 1, 1)
LAST_DAY = dt.date(2026, 12, 31)
YEARS = (2025, 2026)


def unit(*key: Any) -> float:
  """A uniform number in [0, 1) that depends only on `key` (stable across runs)."""
  digest = hashlib.blake2b("|".join(map(str, key)).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") / 2.0**64


def norm(text: str) -> str:
  """Lower case, punctuation dropped, whitespace collapsed: the lookup key of a name."""
  return " ".join(re.sub(r"[^\w\s]", " ", text.lower().replace("'", "")).split())


def offset_text(minutes: int) -> str:
  """+05:30 style rendering of a UTC offset in minutes."""
  sign = "+" if minutes >= 0 else "-"
  return f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


@dataclasses.dataclass(frozen=True)
class Country:
  """A country: its currency, region and single time zone."""

  name: str
  currency: str
  region: str
  timezone: str
  utc_offset_min: int
  cities: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class City:
  """A city with coordinates, airport and its country's time zone."""

  name: str
  country: str
  lat: float
  lon: float
  population: int
  founded: int
  elevation_m: int
  airport: str
  timezone: str
  utc_offset_min: int


@dataclasses.dataclass(frozen=True)
class Person:
  """A person of the knowledge graph (founders, architects)."""

  name: str
  born: int
  nationality: str
  occupation: str


@dataclasses.dataclass(frozen=True)
class Company:
  """A listed company; `base_price` is in its exchange currency."""

  name: str
  ticker: str
  sector: str
  founded: int
  founder: str
  headquarters: str
  currency: str
  base_price: float


@dataclasses.dataclass(frozen=True)
class Landmark:
  """A landmark of the knowledge graph, in one city."""

  name: str
  kind: str
  city: str
  height_m: int
  opened: int
  architect: str


@dataclasses.dataclass(frozen=True)
class Team:
  """A sports team of one league."""

  name: str
  city: str
  league: str
  sport: str
  founded: int


@dataclasses.dataclass(frozen=True)
class HolidayRule:
  """A fixed date (month, day) or, when `weekday` is set, the nth such weekday of the month."""
  name: str
  month: int
  day: int = 1
  weekday: int | None = None
  nth: int = 1

  def date_in(self, year: int) -> dt.date:
    if self.weekday is None:
      return dt.date(year, self.month, self.day)
    first = dt.date(year, self.month, 1)
    return first + dt.timedelta(days=(self.weekday - first.weekday()) % 7 + 7 * (self.nth - 1))


@dataclasses.dataclass(frozen=True)
class Match:
  """One league match with its final score (shown only once played)."""

  league: str
  season: int
  round: int
  date: dt.date
  home: str
  away: str
  home_score: int
  away_score: int


def lookup(table: Mapping[str, Any], name: str, kind: str,
           index: Mapping[str, Any] | None = None) -> Any:
  """The entry of `table` whose normalised key equals `name`'s, else a helpful ValueError.

  `index` is `table` keyed by normalised names, when the caller has it cached.
  """
  by_key = index if index is not None else {norm(k): v for k, v in table.items()}
  key = norm(name)
  if key in by_key:
    return by_key[key]
  close = difflib.get_close_matches(name, list(table), n=3, cutoff=0.6)
  hint = f"; did you mean {', '.join(close)}?" if close else ""
  raise ValueError(f"unknown {kind} '{name}'{hint}")


def _poisson(u: float, lam: float) -> int:
  """Inverse-CDF Poisson draw (capped at 7 goals) from one uniform number."""
  k, p = 0, math.exp(-lam)
  total = p
  while u > total and k < 7:
    k += 1
    p *= lam / k
    total += p
  return k


@dataclasses.dataclass(frozen=True)
class World:
  """Every static fact of one seeded world; see `series.py` for per-date values."""

  seed: int
  countries: Mapping[str, Country]
  cities: Mapping[str, City]
  people: Mapping[str, Person]
  companies: Mapping[str, Company]
  landmarks: Mapping[str, Landmark]
  teams: Mapping[str, Team]
  leagues: Mapping[str, tuple[str, ...]]  # league -> its team names
  holidays: Mapping[str, tuple[HolidayRule, ...]]  # country -> its holidays
  fx_base: Mapping[str, float]  # currency -> units per USD before daily moves
  matches: tuple[Match, ...]
  # Derived lookup tables, filled on first use (a frozen dataclass may still fill a dict).
  cache: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def build(cls, seed: int) -> World:
    """Draws a world from `seed` (deterministic, no global random state)."""
    rng = random.Random(f"toolworld-{seed}")
    countries, cities = {}, {}
    for cname, currency, region, lat, lon, offset, city_specs in names.COUNTRIES:
      timezone = f"{region}/{city_specs[0][0].replace(' ', '_')}"
      countries[cname] = Country(cname, currency, region, timezone, offset,
                                 tuple(c for c, _ in city_specs))
      for i, (city, code) in enumerate(city_specs):
        population = rng.randint(1_500_000, 6_000_000) if i == 0 else rng.randint(120_000, 1_400_000)
        cities[city] = City(city, cname, round(lat + rng.uniform(-3.0, 3.0), 3),
                            round(lon + rng.uniform(-4.0, 4.0), 3), population,
                            rng.randint(800, 1890), rng.randint(0, 1400), code, timezone, offset)

    full_names = [f"{f} {l}" for f in names.FIRST_NAMES for l in names.LAST_NAMES]
    person_names = iter(rng.sample(full_names, len(names.COMPANIES) + len(names.LANDMARKS)))
    city_names = sorted(cities)
    people, companies, landmarks = {}, {}, {}
    for cname, ticker, sector in names.COMPANIES:
      founder = Person(next(person_names), rng.randint(1930, 1985),
                       rng.choice(sorted(countries)), "entrepreneur")
      people[founder.name] = founder
      hq = rng.choice(city_names)
      currency = countries[cities[hq].country].currency
      founded = min(2020, founder.born + rng.randint(24, 50))
      price = round(rng.uniform(15.0, 450.0) * names.BASE_FX_PER_USD[currency], 2)
      companies[cname] = Company(cname, ticker, sector, founded, founder.name, hq, currency, price)
    for lname, kind, (low, high) in names.LANDMARKS:
      architect = Person(next(person_names), rng.randint(1850, 1965),
                         rng.choice(sorted(countries)), "architect")
      people[architect.name] = architect
      landmarks[lname] = Landmark(lname, kind, rng.choice(city_names), rng.randint(low, high),
                                  min(2022, architect.born + rng.randint(30, 60)), architect.name)

    team_cities = rng.sample(city_names, 2 * 6)
    mascots = rng.sample(names.MASCOTS, len(names.MASCOTS))
    teams, leagues = {}, {}
    for li, (league, sport, _) in enumerate(names.LEAGUES):
      members = []
      for j in range(6):
        city = team_cities[6 * li + j]
        team = Team(f"{city} {mascots[6 * li + j]}", city, league, sport, rng.randint(1880, 1990))
        teams[team.name] = team
        members.append(team.name)
      leagues[league] = tuple(members)

    holidays = {}
    for cname in sorted(countries):
      months = rng.sample(range(2, 13), 5)
      rules = [HolidayRule("New Year's Day", 1, 1)]
      for k, (hname, month) in enumerate(zip(rng.sample(names.HOLIDAY_NAMES, 5), months)):
        if k == 0:  # one holiday per country moves: the nth Monday of its month
          rules.append(HolidayRule(hname, month, weekday=0, nth=rng.randint(1, 4)))
        else:
          rules.append(HolidayRule(hname, month, rng.randint(1, 28)))
      holidays[cname] = tuple(sorted(rules, key=lambda r: r.date_in(2025)))

    fx_base = {c: r * rng.uniform(0.95, 1.05) if c != "USD" else 1.0
               for c, r in names.BASE_FX_PER_USD.items()}
    world = cls(seed, countries, cities, people, companies, landmarks, teams, leagues,
                holidays, fx_base, (), {})
    return dataclasses.replace(world, matches=world._fixtures(), cache={})

  def _fixtures(self) -> tuple[Match, ...]:
    """Both seasons of every league: a double round robin played twice, every 14 days."""
    matches = []
    for league, _, weekday in names.LEAGUES:
      sport = self.teams[self.leagues[league][0]].sport
      for year in YEARS:
        order = list(self.leagues[league])
        random.Random(f"{self.seed}|{league}|{year}").shuffle(order)
        strength = {t: unit(self.seed, "strength", t, year) for t in order}
        pairings = []
        for r in range(len(order) - 1):  # circle method: fix the first team, rotate the rest
          rotated = [order[0]] + order[1:][-r:] + order[1:][:-r] if r else list(order)
          pairings.append([(rotated[i], rotated[-1 - i]) for i in range(len(order) // 2)])
        pairings += [[(b, a) for a, b in rnd] for rnd in pairings]
        pairings += pairings
        feb1 = dt.date(year, 2, 1)
        first = feb1 + dt.timedelta(days=(weekday - feb1.weekday()) % 7)
        for r, rnd in enumerate(pairings):
          day = first + dt.timedelta(days=14 * r)
          for home, away in rnd:
            u_home = unit(self.seed, "score", league, year, r, home)
            u_away = unit(self.seed, "score", league, year, r, away)
            if sport == "football":
              hs = _poisson(u_home, 1.0 + 1.2 * strength[home] - 0.4 * strength[away])
              as_ = _poisson(u_away, 0.7 + 1.2 * strength[away] - 0.4 * strength[home])
            else:
              hs = 88 + int(30 * u_home + 12 * strength[home])
              as_ = 85 + int(30 * u_away + 12 * strength[away])
              hs += 3 if hs == as_ else 0  # overtime: basketball has no draws
            matches.append(Match(league, year, r + 1, day, home, away, hs, as_))
    return tuple(sorted(matches, key=lambda m: (m.date, m.league, m.home)))

  # -- Lookups ---------------------------------------------------------------

  def cached(self, key: str, make: Any) -> Any:
    """`make()` computed once per world (lookup indexes, the knowledge graph)."""
    if key not in self.cache:
      self.cache[key] = make()
    return self.cache[key]

  def _find(self, table_name: str, name: str, kind: str,
            codes: Mapping[str, Any] | None = None) -> Any:
    """An entry of one of the world's tables by name (or by code, e.g. ticker)."""
    if codes and name.strip().upper() in codes:
      return codes[name.strip().upper()]
    table = getattr(self, table_name)
    index = self.cached(f"index/{table_name}", lambda: {norm(k): v for k, v in table.items()})
    return lookup(table, name, kind, index)

  def city(self, name: str) -> City:
    """The city called `name`, or its airport code."""
    codes = self.cached("airports", lambda: {c.airport: c for c in self.cities.values()})
    return self._find("cities", name, "city", codes)

  def country(self, name: str) -> Country:
    return self._find("countries", name, "country")

  def company(self, name: str) -> Company:
    """The company called `name`, or with ticker `name`."""
    codes = self.cached("tickers", lambda: {c.ticker: c for c in self.companies.values()})
    return self._find("companies", name, "company or ticker", codes)

  def team(self, name: str) -> Team:
    return self._find("teams", name, "team")

  def timezones(self) -> dict[str, int]:
    """Time zone name -> UTC offset in minutes, "UTC" included."""
    return self.cached("zones", lambda: {"UTC": 0, **{c.timezone: c.utc_offset_min
                                                      for c in self.countries.values()}})

  def check_day(self, day: dt.date) -> dt.date:
    """`day` itself, or a ValueError when it is outside the world's data range."""
    if not FIRST_DAY <= day <= LAST_DAY:
      raise ValueError(f"no data for {day.isoformat()}: records cover "
                       f"{FIRST_DAY.isoformat()} to {LAST_DAY.isoformat()}")
    return day
