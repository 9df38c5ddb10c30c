"""Per-date values of the tool world: weather, FX, stock quotes, flights, news, sports.

Nothing here is stored. Each value is a pure function of (world seed, key,
date) through `world.unit`, so the world is cheap to build, any date can be
asked in any order, and two processes agree without sharing state. The
functions take already-resolved entities (a `City`, not a city name); the tools
in `tools.py` do the name lookups and the "today" defaults.
"""

from __future__ import annotations

import datetime as dt
import math
import random
from typing import Any

from tree_rl.envs.toolworld import names
from tree_rl.envs.toolworld.timeutil import WEEKDAYS, iso_minutes
from tree_rl.envs.toolworld.world import YEARS, City, Company, Match, Team, World, unit

Record = dict[str, Any]


def _days(day: dt.date) -> int:
  return (day - dt.date(2025, 1, 1)).days


def distance_km(a: City, b: City) -> float:
  """Great-circle distance between two cities (haversine, Earth radius 6371 km)."""
  p1, p2 = math.radians(a.lat), math.radians(b.lat)
  dp, dl = p2 - p1, math.radians(b.lon - a.lon)
  h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
  return round(2 * 6371.0 * math.asin(math.sqrt(h)), 1)


def weather(world: World, city: City, day: dt.date) -> Record:
  """The day's weather: a latitude climate with a seasonal cycle plus hashed noise."""
  u = [unit(world.seed, "weather", city.name, day, k) for k in range(7)]
  season = math.cos(2 * math.pi * (day.timetuple().tm_yday - 200) / 365.25)
  season *= 1.0 if city.lat >= 0 else -1.0  # southern summer peaks in January
  mid = 29.0 - 0.35 * abs(city.lat) - city.elevation_m / 160 + 0.2 * abs(city.lat) * season
  mid += 7.0 * (u[0] - 0.5)
  spread = 5.0 + 7.0 * u[1]
  high, low = round(mid + spread / 2, 1), round(mid - spread / 2, 1)
  precipitation = round(0.2 + 25.0 * u[3] ** 2, 1) if u[2] < 0.38 else 0.0
  if precipitation > 0:
    condition = "snow" if high < 2.0 else "thunderstorms" if precipitation >= 12 else "rain"
    humidity = int(70 + 28 * u[5])
  else:
    condition = ("sunny" if u[4] < 0.45 else "partly cloudy" if u[4] < 0.75
                 else "overcast" if u[4] < 0.93 else "fog")
    humidity = int(35 + 45 * u[5])
  return {"city": city.name, "country": city.country, "date": day.isoformat(),
          "condition": condition, "high_c": high, "low_c": low,
          "precipitation_mm": precipitation, "humidity_pct": humidity,
          "wind_kph": int(4 + 36 * u[6])}


def fx_per_usd(world: World, currency: str, day: dt.date) -> float:
  """Units of `currency` per US dollar on `day` (slow cycles plus daily noise)."""
  if currency == "USD":
    return 1.0
  t = _days(day)
  phase1 = 2 * math.pi * unit(world.seed, "fx-phase", currency, 1)
  phase2 = 2 * math.pi * unit(world.seed, "fx-phase", currency, 2)
  move = (0.04 * math.sin(2 * math.pi * t / 365 + phase1)
          + 0.015 * math.sin(2 * math.pi * t / 41 + phase2)
          + 0.004 * (unit(world.seed, "fx", currency, day) - 0.5))
  return round(world.fx_base[currency] * (1 + move), 6)


def fx_rate(world: World, source: str, target: str, day: dt.date) -> float:
  """Units of `target` per unit of `source` on `day`, to 6 significant digits."""
  rate = fx_per_usd(world, target, day) / fx_per_usd(world, source, day)
  return float(f"{rate:.6g}")


def quote(world: World, company: Company, day: dt.date) -> Record:
  """Open and close of the day; exchanges are closed at weekends (ValueError)."""
  if day.weekday() >= 5:
    raise ValueError(f"the exchange is closed on {day.isoformat()} ({WEEKDAYS[day.weekday()]}); "
                     "there is no trading data for weekends")
  t = _days(day)
  phases = [2 * math.pi * unit(world.seed, "stock-phase", company.ticker, k) for k in range(3)]
  log_move = (0.12 * math.sin(2 * math.pi * t / 365 + phases[0])
              + 0.06 * math.sin(2 * math.pi * t / 53 + phases[1])
              + 0.025 * math.sin(2 * math.pi * t / 11 + phases[2])
              + 0.02 * (unit(world.seed, "stock", company.ticker, day) - 0.5))
  close = company.base_price * math.exp(log_move)
  open_ = close * (1 + 0.016 * (unit(world.seed, "stock-open", company.ticker, day) - 0.5))
  close, open_ = round(close, 2), round(open_, 2)
  return {"ticker": company.ticker, "company": company.name, "currency": company.currency,
          "date": day.isoformat(), "open": open_, "close": close,
          "change_pct": round((close - open_) / open_ * 100, 2)}


def flights(world: World, origin: City, dest: City, day: dt.date) -> list[Record]:
  """The day's direct flights, ordered by flight number; none for routes under 150 km.

  Schedules (numbers, times) repeat daily like a real timetable; fares change per
  day and are quoted in whole units of the origin country's currency.
  """
  if origin.name == dest.name:
    raise ValueError("origin and destination are the same city")
  dist = distance_km(origin, dest)
  if dist < 150:
    return []
  rng = random.Random(f"{world.seed}|flights|{origin.airport}|{dest.airport}")
  count = 2 + rng.randrange(3)
  slots = rng.sample(range(6 * 12, 22 * 12), count)  # distinct 5-minute departure slots
  duration = 5 * round((dist / 780 * 60 + 35) / 5)
  currency = world.countries[origin.country].currency
  per_usd = fx_per_usd(world, currency, day)
  records, numbers, fares = [], set(), set()
  for i, slot in enumerate(slots):
    code, airline = rng.choice(names.AIRLINES)
    number = f"{code}{rng.randint(100, 989)}"
    while number in numbers:
      number = f"{code}{int(number[2:]) + 1}"
    numbers.add(number)
    fare_usd = (60 + 0.11 * dist) * (0.75 + 0.7 * unit(world.seed, "fare", number, day))
    fare = round(fare_usd * per_usd)
    while fare in fares:  # distinct fares: "the cheapest flight" is always one flight
      fare += 1
    fares.add(fare)
    depart = dt.datetime.combine(day, dt.time(slot // 12, slot % 12 * 5))
    arrive = depart + dt.timedelta(minutes=duration + dest.utc_offset_min - origin.utc_offset_min)
    records.append({"flight_number": number, "airline": airline, "origin": origin.airport,
                    "destination": dest.airport, "departure_local": iso_minutes(depart),
                    "arrival_local": iso_minutes(arrive), "duration_minutes": duration,
                    "price": fare, "currency": currency})
  return sorted(records, key=lambda r: r["flight_number"])


_NEWS_KINDS = ("revenue", "office", "signing", "festival", "launch", "airport")


def news(world: World, day: dt.date) -> list[Record]:
  """The day's four articles: headline, topic and the entities they mention."""
  rng = random.Random(f"{world.seed}|news|{day.isoformat()}")
  companies, cities, teams = sorted(world.companies), sorted(world.cities), sorted(world.teams)
  articles = []
  for kind in rng.sample(_NEWS_KINDS, 4):
    if kind == "revenue":
      company, pct = rng.choice(companies), round(rng.uniform(1.0, 25.0), 1)
      direction = "rise" if rng.random() < 0.6 else "drop"
      item = ("business", f"{company} reports {pct}% {direction} in quarterly revenue", [company])
    elif kind == "office":
      company, city = rng.choice(companies), rng.choice(cities)
      item = ("business", f"{company} to open new office in {city}", [company, city])
    elif kind == "signing":
      team = rng.choice(teams)
      player = f"{rng.choice(names.FIRST_NAMES)} {rng.choice(names.LAST_NAMES)}"
      item = ("sports", f"{team} sign {player} on a {rng.randint(2, 5)}-year deal", [team, player])
    elif kind == "festival":
      city = rng.choice(cities)
      item = ("culture", f"{city} prepares for its annual {rng.choice(names.FESTIVALS)} festival",
              [city])
    elif kind == "launch":
      company = rng.choice(companies)
      item = ("technology", f"{company} unveils its new {rng.choice(names.PRODUCTS)} platform",
              [company])
    else:
      city = rng.choice(cities)
      item = ("travel", f"{city} airport expects {rng.randrange(20_000, 180_000, 500):,} "
              "travellers this weekend", [city])
    topic, headline, entities = item
    articles.append({"date": day.isoformat(), "topic": topic, "headline": headline,
                     "entities": entities})
  return articles


def holidays(world: World, country: str, year: int) -> list[Record]:
  """The public holidays of `country` in `year`, by date."""
  if year not in YEARS:
    raise ValueError(f"no holiday calendar for {year}; calendars cover {YEARS[0]}-{YEARS[-1]}")
  return sorted(({"name": r.name, "date": r.date_in(year).isoformat()}
                 for r in world.holidays[country]), key=lambda h: h["date"])


def _match_record(m: Match, today: dt.date) -> Record:
  """A played match with its score, or a scheduled one (date on or after today)."""
  record = {"date": m.date.isoformat(), "league": m.league, "home": m.home, "away": m.away}
  if m.date >= today:
    return {**record, "status": "scheduled"}
  winner = m.home if m.home_score > m.away_score else m.away if m.away_score > m.home_score else None
  return {**record, "status": "final", "home_score": m.home_score, "away_score": m.away_score,
          "score": f"{m.home_score}-{m.away_score}", "winner": winner or "draw"}


def team_summary(world: World, team: Team, today: dt.date) -> Record:
  """Season record (matches before today in today's year), last result and next fixture."""
  own = [m for m in world.matches if team.name in (m.home, m.away)]
  played = [m for m in own if m.date < today]
  season = [m for m in played if m.season == today.year]
  wins = sum((m.home_score > m.away_score) == (m.home == team.name)
             and m.home_score != m.away_score for m in season)
  draws = sum(m.home_score == m.away_score for m in season)
  losses = len(season) - wins - draws
  points = 3 * wins + draws if team.sport == "football" else 2 * wins
  upcoming = [m for m in own if m.date >= today]
  return {"team": team.name, "league": team.league, "sport": team.sport, "season": today.year,
          "record": {"played": len(season), "wins": wins, "draws": draws, "losses": losses,
                     "points": points},
          "last_match": _match_record(played[-1], today) if played else None,
          "next_match": _match_record(upcoming[0], today) if upcoming else None}


def match_on(world: World, team: Team, day: dt.date, today: dt.date) -> Record:
  """The team's match on `day`, or a ValueError naming its nearest match dates."""
  own = [m for m in world.matches if team.name in (m.home, m.away)]
  for m in own:
    if m.date == day:
      return _match_record(m, today)
  before = [m.date.isoformat() for m in own if m.date < day][-1:]
  after = [m.date.isoformat() for m in own if m.date > day][:1]
  near = " and ".join(before + after) or "none"
  raise ValueError(f"{team.name} has no match on {day.isoformat()}; nearest match dates: {near}")
