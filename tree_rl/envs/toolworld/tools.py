"""The 17 PORTool tools, bound to one world and one task's present (`Context`).

PORTool (arXiv 2510.26020, App. C.1) names the tools but not their schemas; these are
ours (docs/methods/portool.md#tool-world). Each
tool is a `Tool` with an OpenAI-style object schema, and its function raises
`ValueError` with a message the model can act on (unknown entity, date out of
range, market closed), which the executor turns into a tool error. Tools that
depend on time default their date to the task's today, so "today" questions
need no `get_current_context` step while "tomorrow" questions do.

Every return value is JSON-serialisable and deterministic, so an oracle's tool
messages can be replayed and compared byte for byte.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from tree_rl.envs import calculator
from tree_rl.envs.base import Tool
from tree_rl.envs.toolworld import calc, series
from tree_rl.envs.toolworld.timetools import TIME_TOOL_SPECS, TimeTools
from tree_rl.envs.toolworld.timeutil import WEEKDAYS, Context, parse_date
from tree_rl.envs.toolworld.world import World, lookup, norm, offset_text

TOOL_NAMES = ("news_search", "weather_search", "flights_search", "stocks_search",
              "sports_search", "maps_search", "conversion_calculation", "math_calculation",
              "get_current_context", "timestamp_comparator", "sort_list", "holiday_search",
              "knowledge_search", "filter_list", "timestamp_converter",
              "timestamp_interval_calculator", "response_gen")
FORECAST_DAYS = 14  # weather_search sees at most this far past today
NEWS_TOPICS = ("business", "sports", "culture", "technology", "travel")
_SPEED_KMH = {"driving": 75.0, "cycling": 18.0, "walking": 5.0}
_ROAD_FACTOR = 1.25  # roads are longer than the great circle


def obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
  """An object schema with these properties; `required` must name some of them."""
  return {"type": "object", "properties": properties, "required": list(required)}


def _date_arg(what: str) -> dict[str, Any]:
  return {"type": "string", "description": f"{what} as YYYY-MM-DD; defaults to today"}


def knowledge_table(world: World) -> dict[str, dict[str, Any]]:
  """Entity name -> its knowledge-graph record (people, companies, landmarks, places, teams).

  Built once per world (`World.cached`); callers must not mutate the records.
  """
  known_for: dict[str, list[str]] = {}
  for c in world.companies.values():
    known_for.setdefault(c.founder, []).append(f"founder of {c.name}")
  for lm in world.landmarks.values():
    known_for.setdefault(lm.architect, []).append(f"architect of {lm.name}")
  table: dict[str, dict[str, Any]] = {}
  for p in world.people.values():
    table[p.name] = {"type": "person", "name": p.name, "born": p.born,
                     "nationality": p.nationality, "occupation": p.occupation,
                     "known_for": known_for.get(p.name, [])}
  for c in world.companies.values():
    table[c.name] = {"type": "company", "name": c.name, "ticker": c.ticker, "sector": c.sector,
                     "founded": c.founded, "founder": c.founder,
                     "headquarters": c.headquarters, "stock_currency": c.currency}
  for lm in world.landmarks.values():
    table[lm.name] = {"type": "landmark", "name": lm.name, "kind": lm.kind, "city": lm.city,
                      "country": world.cities[lm.city].country, "height_m": lm.height_m,
                      "opened": lm.opened, "architect": lm.architect}
  for c in world.cities.values():
    table[c.name] = {"type": "city", "name": c.name, "country": c.country,
                     "population": c.population, "founded": c.founded,
                     "elevation_m": c.elevation_m, "latitude": c.lat, "longitude": c.lon,
                     "timezone": c.timezone, "utc_offset": offset_text(c.utc_offset_min),
                     "airport": c.airport}
  for c in world.countries.values():
    table[c.name] = {"type": "country", "name": c.name, "currency": c.currency,
                     "region": c.region, "timezone": c.timezone,
                     "utc_offset": offset_text(c.utc_offset_min), "cities": list(c.cities)}
  for t in world.teams.values():
    table[t.name] = {"type": "team", "name": t.name, "sport": t.sport, "league": t.league,
                     "city": t.city, "founded": t.founded}
  return table


_DATE = {"date": _date_arg("the day")}

# name -> (description, parameters schema), in TOOL_NAMES order once merged.
TOOL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "news_search": (
        "Search the news articles of one day by keywords (entity names, topics).",
        obj({"query": {"type": "string", "description": "keywords, e.g. a company or city"},
             "date": _date_arg("publication day (not in the future)"),
             "topic": {"type": "string", "enum": list(NEWS_TOPICS)}}, ("query",))),
    "weather_search": (
        "Daily weather of a city: condition, high/low in Celsius, precipitation. Past days and "
        f"forecasts up to {FORECAST_DAYS} days ahead.",
        obj({"city": {"type": "string"}, **_DATE}, ("city",))),
    "flights_search": (
        "Direct flights between two cities (names or airport codes) on a day, with local "
        "departure/arrival times and fares in the origin's currency.",
        obj({"origin": {"type": "string"}, "destination": {"type": "string"}, **_DATE},
            ("origin", "destination"))),
    "stocks_search": (
        "Open and close price of a stock on a trading day (weekdays, not in the future), in "
        "its exchange currency. Accepts a ticker or company name.",
        obj({"symbol": {"type": "string"}, **_DATE}, ("symbol",))),
    "sports_search": (
        "A team's season record, last result and next match as of today; with a date, the "
        "team's match on that day.",
        obj({"team": {"type": "string"},
             "date": {"type": "string", "description": "YYYY-MM-DD of one match (optional)"}},
            ("team",))),
    "maps_search": (
        "Road distance (km) and travel time (minutes) between two cities.",
        obj({"origin": {"type": "string"}, "destination": {"type": "string"},
             "mode": {"type": "string", "enum": list(_SPEED_KMH)}}, ("origin", "destination"))),
    "conversion_calculation": (
        "Convert a value between units (length, mass, volume, speed, temperature) or currencies "
        "(ISO codes, at the day's exchange rate).",
        obj({"value": {"type": "number"}, "from_unit": {"type": "string"},
             "to_unit": {"type": "string"},
             "date": _date_arg("exchange-rate day (currencies only)")},
            ("value", "from_unit", "to_unit"))),
    "math_calculation": (
        "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, pi, e, sqrt, "
        "abs, round, min, max, floor, ceil, log, log10, exp, sin, cos, tan.",
        obj({"expression": {"type": "string"}}, ("expression",))),
    "get_current_context": (
        "The current local date, time, weekday and time zone, and the user's city, country and "
        "currency.", obj({})),
    "sort_list": (
        "Sort a list of numbers, strings, or objects by a key (dotted keys such as "
        "'record.points' reach nested fields).",
        obj({"items": {"type": "array"}, "key": {"type": "string"},
             "descending": {"type": "boolean"}}, ("items",))),
    "filter_list": (
        "Keep the items of a list whose value (at key, for objects) satisfies 'operator value'; "
        "strings compare case-insensitively.",
        obj({"items": {"type": "array"}, "key": {"type": "string"},
             "operator": {"type": "string", "enum": list(calc.FILTER_OPERATORS)},
             "value": {"type": ["number", "string", "boolean"]}},
            ("items", "operator", "value"))),
    "holiday_search": (
        "Public holidays of a country (or of a city's country) in a year.",
        obj({"country": {"type": "string"},
             "year": {"type": "integer", "description": "defaults to this year"}},
            ("country",))),
    "knowledge_search": (
        "Facts about a named person, company, landmark, city, country or sports team (founders, "
        "years, heights, populations, headquarters...).",
        obj({"query": {"type": "string", "description": "the entity's name"}}, ("query",))),
    "response_gen": (
        "Give the final answer to the user; this ends the conversation.",
        obj({"answer": {"type": "string"}}, ("answer",))),
    **TIME_TOOL_SPECS,
}


class ToolBox(TimeTools):
  """The tools' implementations, bound to one world and one task's present.

  Each public method is one tool; `make_tools` wraps the bound methods into
  `Tool`s. Methods raise ValueError for anything the model can fix.
  """

  def __init__(self, world: World, context: Context):
    self.world = world
    self.context = context
    self.today = context.now.date()
    self.home = world.city(context.city)

  def _day(self, date: str | None, *, future_ok: bool = True) -> dt.date:
    """The day a tool asks about: `date`, or today when omitted; inside the data range."""
    day = self.today if date is None else parse_date(date)
    self.world.check_day(day)
    if not future_ok and day > self.today:
      raise ValueError(f"{day.isoformat()} is in the future (today is {self.today.isoformat()})")
    return day

  def news_search(self, query: str, date: str | None = None, topic: str | None = None
                  ) -> dict[str, Any]:
    """The day's articles (default today) sharing a word with `query`, best match first."""
    day = self._day(date, future_ok=False)
    words = [w for w in norm(query).split() if len(w) >= 3]
    if not words:
      raise ValueError("query needs at least one word of three or more letters")
    hits = []
    for article in series.news(self.world, day):
      text = norm(" ".join([article["headline"], article["topic"], *article["entities"]])).split()
      score = sum(w in text for w in words)
      if score and (topic is None or article["topic"] == topic):
        hits.append((-score, len(hits), article))
    return {"date": day.isoformat(), "query": query,
            "articles": [a for _, _, a in sorted(hits, key=lambda h: h[:2])]}

  def weather_search(self, city: str, date: str | None = None) -> dict[str, Any]:
    """The city's weather on a past day or up to FORECAST_DAYS ahead (default today)."""
    day = self._day(date)
    if (day - self.today).days > FORECAST_DAYS:
      last = self.today + dt.timedelta(days=FORECAST_DAYS)
      raise ValueError(f"forecasts reach at most {FORECAST_DAYS} days ahead "
                       f"(until {last.isoformat()})")
    return series.weather(self.world, self.world.city(city), day)

  def flights_search(self, origin: str, destination: str, date: str | None = None
                     ) -> dict[str, Any]:
    """The direct flights of a day (default today) between two cities or airport codes."""
    day = self._day(date)
    a, b = self.world.city(origin), self.world.city(destination)
    return {"origin": f"{a.name} ({a.airport})", "destination": f"{b.name} ({b.airport})",
            "date": day.isoformat(), "flights": series.flights(self.world, a, b, day)}

  def stocks_search(self, symbol: str, date: str | None = None) -> dict[str, Any]:
    """Open/close of a ticker or company on a past trading day (default today)."""
    return series.quote(self.world, self.world.company(symbol), self._day(date, future_ok=False))

  def sports_search(self, team: str, date: str | None = None) -> dict[str, Any]:
    """The team's summary as of today, or its match on `date`."""
    found = self.world.team(team)
    if date is None:
      return series.team_summary(self.world, found, self.today)
    return series.match_on(self.world, found, self._day(date), self.today)

  def maps_search(self, origin: str, destination: str, mode: str = "driving") -> dict[str, Any]:
    """Road distance and travel time between two cities of one continent."""
    a, b = self.world.city(origin), self.world.city(destination)
    if a.name == b.name:
      raise ValueError("origin and destination are the same city")
    ra, rb = (self.world.countries[c.country].region for c in (a, b))
    if ra != rb:
      raise ValueError(f"no road route between {a.name} ({ra}) and {b.name} ({rb}); "
                       "they are on different continents")
    km = round(series.distance_km(a, b) * _ROAD_FACTOR, 1)
    return {"origin": a.name, "destination": b.name, "mode": mode, "distance_km": km,
            "duration_minutes": round(km / _SPEED_KMH[mode] * 60)}

  def conversion_calculation(self, value: float | int, from_unit: str, to_unit: str,
                             date: str | None = None) -> dict[str, Any]:
    """`value` in another unit, or another currency at the day's rate (default today)."""
    fx = self.world.fx_base
    source, target = from_unit.strip().upper(), to_unit.strip().upper()
    if source in fx and target in fx:
      day = self._day(date, future_ok=False)
      rate = series.fx_rate(self.world, source, target, day)
      return {"value": value, "from_unit": source, "to_unit": target, "date": day.isoformat(),
              "rate": rate, "result": round(value * rate, 2)}
    if (source in fx) != (target in fx):
      unknown = to_unit if source in fx else from_unit
      raise ValueError(f"cannot convert between a currency and '{unknown}'; "
                       f"known currencies: {', '.join(sorted(fx))}")
    result, a, b = calc.convert_units(value, from_unit, to_unit)
    return {"value": value, "from_unit": a, "to_unit": b, "result": result}

  def math_calculation(self, expression: str) -> dict[str, Any]:
    """The value of an arithmetic expression (see `calculator.evaluate_to_number`)."""
    return {"expression": expression, "result": calculator.evaluate_to_number(expression)}

  def get_current_context(self) -> dict[str, Any]:
    """The task's present: local date, time, zone, and the user's city and currency."""
    home = self.home
    return {"date": self.today.isoformat(), "time": self.context.now.strftime("%H:%M"),
            "weekday": WEEKDAYS[self.today.weekday()], "timezone": home.timezone,
            "utc_offset": offset_text(home.utc_offset_min), "city": home.name,
            "country": home.country, "currency": self.world.countries[home.country].currency}

  def sort_list(self, items: list[Any], key: str | None = None, descending: bool = False
                ) -> list[Any]:
    """`items` sorted (by a dotted key for objects); stable."""
    return calc.sort_items(items, key, descending)

  def filter_list(self, items: list[Any], operator: str, value: str | float | int | bool,
                  key: str | None = None) -> list[Any]:
    """The items whose value (at a dotted key) satisfies `operator value`."""
    return calc.filter_items(items, key, operator, value)

  def holiday_search(self, country: str, year: int | None = None) -> dict[str, Any]:
    """A country's (or a city's country's) public holidays in a year (default this year)."""
    try:
      found = self.world.country(country)
    except ValueError:
      try:  # a city stands for its country
        found = self.world.countries[self.world.city(country).country]
      except ValueError:
        raise ValueError(f"unknown country '{country}'; known countries: "
                         f"{', '.join(sorted(self.world.countries))}") from None
    year = self.today.year if year is None else year
    return {"country": found.name, "year": year,
            "holidays": series.holidays(self.world, found.name, year)}

  def knowledge_search(self, query: str) -> dict[str, Any]:
    """The knowledge-graph record of a named entity (company tickers work too)."""
    table = self.world.cached("knowledge", lambda: knowledge_table(self.world))
    try:
      return table[self.world.company(query).name]  # company names and tickers
    except ValueError:
      pass
    index = self.world.cached("index/knowledge", lambda: {norm(k): v for k, v in table.items()})
    return lookup(table, query, "entity", index)

  def response_gen(self, answer: str) -> str:
    """The terminal tool: acknowledges the final answer."""
    del answer  # the episode's last assistant step holds it; the verifier reads it there
    return "Your answer has been recorded."


def make_tools(world: World, context: Context) -> list[Tool]:
  """All 17 tools bound to `world` and `context`, in `TOOL_NAMES` order.

  Args:
    world: the world the tools read.
    context: the task's present: local date/time and the user's city.

  Returns:
    The tools; `response_gen` is the terminal one.
  """
  box = ToolBox(world, context)
  return [Tool(name, TOOL_SPECS[name][0], TOOL_SPECS[name][1], getattr(box, name),
               terminal=name == "response_gen") for name in TOOL_NAMES]
