"""BFCL function-calling items: the bundled BFCL v4 eval categories and a synthetic train set.

The eval split reads the single-turn Python categories shipped inside the `bfcl-eval`
package (its data files only; `bfcl.py` loads the package's AST checker, docs/bfcl.md).
The train split must never leak those questions, so it comes from a seeded generator of
requests over ~25 invented functions in several domains (geometry, unit conversion,
finance, weather, calendars, text utilities, math, travel, accounts). Both
produce `BfclItem`s in BFCL's own format: function docs with BFCL type names
("dict", "float", "tuple", ...) and possible answers `{name: {param: [acceptable, ...]}}`,
where "" among the acceptable values means the parameter may be omitted.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import pathlib
import random
from collections.abc import Callable, Sequence
from typing import Any

CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
_EVAL_FILES = {"simple": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json",
               "parallel": "BFCL_v4_parallel.json",
               "parallel_multiple": "BFCL_v4_parallel_multiple.json",
               "irrelevance": "BFCL_v4_irrelevance.json"}
_INSTALL_HINT = "install its data with `pip install --no-deps bfcl-eval`"


@dataclasses.dataclass(frozen=True)
class BfclItem:
  """One BFCL-format test case.

  Attributes:
    item_id: BFCL's id ("parallel_12") or a synthetic one ("synthetic_simple_3").
    category: one of CATEGORIES.
    messages: the user turn, OpenAI-style dicts.
    functions: the function docs offered (BFCL schema dialect).
    ground_truth: one {name: {param: [acceptable values]}} per expected call; empty
      when the right behaviour is to call nothing (irrelevance).
  """

  item_id: str
  category: str
  messages: tuple[dict[str, Any], ...]
  functions: tuple[dict[str, Any], ...]
  ground_truth: tuple[dict[str, dict[str, list[Any]]], ...]

  @property
  def question(self) -> str:
    return "\n".join(m["content"] for m in self.messages if m["role"] == "user")


# ----------------------------------------------------------------------------- eval split


def bfcl_data_dir() -> pathlib.Path:
  """The `data/` folder of the installed bfcl-eval package (without importing it)."""
  spec = importlib.util.find_spec("bfcl_eval")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(f"the BFCL eval split needs the bfcl-eval package; {_INSTALL_HINT}")
  return pathlib.Path(list(spec.submodule_search_locations)[0]) / "data"


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  if not path.is_file():
    raise FileNotFoundError(f"BFCL data file {path} is missing; {_INSTALL_HINT}")
  with path.open(encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=None)
def load_eval_items(category: str) -> tuple[BfclItem, ...]:
  """Every BFCL v4 item of `category`, in file order, with its possible answer."""
  if category not in _EVAL_FILES:
    raise ValueError(f"unknown BFCL category {category!r}; choose from {CATEGORIES}")
  data = bfcl_data_dir()
  rows = _read_jsonl(data / _EVAL_FILES[category])
  answers: dict[str, list] = {}
  if category != "irrelevance":  # irrelevance has no answer file: the answer is no call
    answers = {r["id"]: r["ground_truth"]
               for r in _read_jsonl(data / "possible_answer" / _EVAL_FILES[category])}
  items = []
  for row in rows:
    turns = row["question"]
    if len(turns) != 1:
      raise ValueError(f"{row['id']}: expected a single-turn question, got {len(turns)} turns")
    items.append(BfclItem(item_id=row["id"], category=category, messages=tuple(turns[0]),
                          functions=tuple(row["function"]),
                          ground_truth=tuple(answers.get(row["id"], ()))))
  return tuple(items)


@functools.lru_cache(maxsize=1)
def eval_questions() -> frozenset[str]:
  """The question texts of every eval category, or nothing when bfcl-eval is absent."""
  try:
    return frozenset(it.question for c in CATEGORIES for it in load_eval_items(c))
  except (ModuleNotFoundError, FileNotFoundError):
    return frozenset()


# ----------------------------------------------------------------------------- train split
# A spec is a BFCL function doc plus a sampler returning (imperative request, possible
# answer). Optional parameters the request does not mention accept "" or their default,
# as BFCL's own answers do.

Sampler = Callable[[random.Random], tuple[str, dict[str, list[Any]]]]


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class _Spec:
  domain: str
  doc: dict[str, Any]
  sample: Sampler


def _doc(name: str, description: str, required: Sequence[str], **params: dict) -> dict:
  return {"name": name, "description": description,
          "parameters": {"type": "dict", "properties": params, "required": list(required)}}


def _p(type_: str, description: str, **extra: Any) -> dict[str, Any]:
  return {"type": type_, "description": description, **extra}


def _dec(rng: random.Random, lo: int, hi: int) -> float:
  """A value with a non-zero first decimal, so "4.5" in the text is unambiguously a float."""
  return rng.randint(lo, hi) + rng.randint(1, 9) / 10


def _fmt(x: float) -> str:
  return f"{x:g}"


def _date(rng: random.Random) -> tuple[str, str]:
  """(ISO date, the way the request writes it): half the requests use month names."""
  y, m, d = rng.randint(2025, 2027), rng.randint(1, 12), rng.randint(1, 28)
  iso = f"{y}-{m:02d}-{d:02d}"
  months = ("January February March April May June July August September October November "
            "December").split()
  return iso, (iso if rng.random() < 0.5 else f"{months[m - 1]} {d}, {y}")


def _optional(rng: random.Random, choices: Sequence[Any]) -> Any | None:
  """None (not mentioned) half the time, else a value from `choices`.

  `choices` never holds the parameter's default, so a mentioned value must be passed.
  """
  return None if rng.random() < 0.5 else rng.choice(list(choices))


CITIES = ("Lisbon", "Osaka", "Nairobi", "Denver", "Krakow", "Montevideo", "Hanoi", "Perth",
          "Reykjavik", "Calgary", "Seville", "Tallinn", "Accra", "Busan", "Porto", "Quito",
          "Bergen", "Adelaide", "Valencia", "Cusco")
PHRASES = ("the quick brown fox", "open source software wins", "data never sleeps",
           "rain falls softly in the valley", "keep calm and carry on", "every cloud has a lining",
           "small steps make long journeys", "the market opens at nine")
TITLES = ("Team standup", "Dentist appointment", "Project review", "Yoga class",
          "Budget meeting", "Lunch with Priya", "Code freeze", "Quarterly planning")
LENGTH_UNITS = ("meters", "kilometers", "miles", "feet", "inches", "yards")
TEMP_SCALES = ("celsius", "fahrenheit", "kelvin")
CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF", "CAD", "AUD", "SEK")
TICKERS = ("NVDA", "AMD", "INTC", "ORCL", "SHOP", "UBER", "CRM", "ADBE")


def _two(rng: random.Random, pool: Sequence[Any]) -> tuple[Any, Any]:
  a, b = rng.sample(list(pool), 2)
  return a, b


def _circle_area(rng):
  r, unit = _dec(rng, 1, 30), _optional(rng, ("cm", "m", "inches", "feet"))
  text = f"calculate the area of a circle with a radius of {_fmt(r)}"
  if unit is None:
    return text, {"radius": [r], "unit": ["", "units"]}
  return f"{text} {unit}", {"radius": [r], "unit": [unit]}


def _rect_perimeter(rng):
  length, width = _dec(rng, 2, 40), _dec(rng, 1, 20)
  return (f"find the perimeter of a rectangle {_fmt(length)} long and {_fmt(width)} wide",
          {"length": [length], "width": [width]})


def _distance(rng):
  a = [_dec(rng, -9, 9), _dec(rng, -9, 9)]
  b = [_dec(rng, -9, 9), _dec(rng, -9, 9)]
  return (f"compute the distance between the points ({_fmt(a[0])}, {_fmt(a[1])}) and "
          f"({_fmt(b[0])}, {_fmt(b[1])})", {"point_a": [a], "point_b": [b]})


def _sphere_volume(rng):
  r, k = _dec(rng, 1, 15), _optional(rng, (0, 1, 3, 4))
  text = f"find the volume of a sphere with radius {_fmt(r)}"
  if k is None:
    return text, {"radius": [r], "decimal_places": ["", 2]}
  return text + f", rounded to {k} decimal places", {"radius": [r], "decimal_places": [k]}


def _convert_length(rng):
  v, (a, b) = _dec(rng, 1, 500), _two(rng, LENGTH_UNITS)
  return (f"convert {_fmt(v)} {a} to {b}", {"value": [v], "from_unit": [a], "to_unit": [b]})


def _convert_temperature(rng):
  t, (a, b) = _dec(rng, -40, 120), _two(rng, TEMP_SCALES)
  return (f"convert {_fmt(t)} degrees {a.capitalize()} to {b.capitalize()}",
          {"temperature": [t], "from_scale": [a], "to_scale": [b]})


def _convert_currency(rng):
  amount, (a, b) = _dec(rng, 5, 5000), _two(rng, CURRENCIES)
  return (f"convert {_fmt(amount)} {a} to {b}",
          {"amount": [amount], "from_currency": [a], "to_currency": [b]})


def _rate(rng) -> tuple[str, float]:
  tenths = rng.randint(11, 99)  # 1.1% .. 9.9%, given as a decimal fraction
  return f"{tenths / 10:g}%", round(tenths / 1000, 4)


def _compound_interest(rng):
  p, (pct, rate), years = _dec(rng, 1000, 50000), _rate(rng), rng.randint(2, 30)
  freq = _optional(rng, (("monthly", 12), ("quarterly", 4), ("daily", 365)))
  text = f"compute the compound interest on ${_fmt(p)} at an annual rate of {pct} for {years} years"
  args = {"principal": [p], "annual_rate": [rate], "years": [years]}
  if freq is None:
    return text, {**args, "compounds_per_year": ["", 1]}
  return text + f", compounded {freq[0]}", {**args, "compounds_per_year": [freq[1]]}


def _loan_payment(rng):
  p, (pct, rate), years = _dec(rng, 20000, 900000), _rate(rng), rng.randint(1, 30)
  return (f"work out the monthly payment on a ${_fmt(p)} loan at {pct} annual interest over "
          f"{years} years", {"principal": [p], "annual_rate": [rate], "term_months": [12 * years]})


def _stock_price(rng):
  ticker, exchange = rng.choice(TICKERS), _optional(rng, ("NYSE", "LSE"))
  text = f"get the latest stock price of {ticker}"
  if exchange is None:
    return text, {"ticker": [ticker], "exchange": ["", "NASDAQ"]}
  return text + f" on the {exchange}", {"ticker": [ticker], "exchange": [exchange]}


def _roi(rng):
  cost, gain = _dec(rng, 100, 9000), _dec(rng, 10, 4000)
  return (f"calculate the return on investment for a ${_fmt(cost)} investment that gained "
          f"${_fmt(gain)}", {"gain": [gain], "cost": [cost]})


def _forecast(rng):
  city, days = rng.choice(CITIES), rng.randint(2, 10)
  unit = _optional(rng, ("fahrenheit", "kelvin"))
  text = f"get the {days}-day weather forecast for {city}"
  args = {"city": [city], "days": [days]}
  if unit is None:
    return text, {**args, "unit": ["", "celsius"]}
  return text + f" in {unit}", {**args, "unit": [unit]}


def _air_quality(rng):
  city, pollutant = rng.choice(CITIES), _optional(rng, ("pm10", "ozone", "no2"))
  if pollutant is None:
    return f"check the air quality index in {city}", {"city": [city], "pollutant": ["", "pm2.5"]}
  said = {"pm10": "PM10", "ozone": "ozone", "no2": "NO2"}[pollutant]
  return (f"check the {said} air quality index in {city}",
          {"city": [city], "pollutant": [pollutant]})


def _historical_temperature(rng):
  city, (iso, said) = rng.choice(CITIES), _date(rng)
  return (f"look up the average temperature in {city} on {said}", {"city": [city], "date": [iso]})


def _create_event(rng):
  title, (iso, said) = rng.choice(TITLES), _date(rng)
  start = f"{rng.randint(7, 19):02d}:{rng.choice((0, 15, 30, 45)):02d}"
  minutes = _optional(rng, (15, 30, 45, 90, 120))
  text = f"schedule '{title}' on {said} at {start}"
  args = {"title": [title], "date": [iso], "start_time": [start]}
  if minutes is None:
    return text, {**args, "duration_minutes": ["", 60]}
  return text + f" for {minutes} minutes", {**args, "duration_minutes": [minutes]}


def _days_between(rng):
  (a, a_said), (b, b_said) = sorted([_date(rng), _date(rng)])
  include = _optional(rng, (True,))
  text = f"count the days between {a_said} and {b_said}"
  if include is None:
    return text, {"start_date": [a], "end_date": [b], "include_end_date": ["", False]}
  return (text + ", counting the end date too",
          {"start_date": [a], "end_date": [b], "include_end_date": [True]})


def _day_of_week(rng):
  iso, said = _date(rng)
  return f"tell me which day of the week {said} falls on", {"date": [iso]}


def _count_words(rng):
  s = rng.choice(PHRASES)
  return f"count the words in the sentence '{s}'", {"text": [s]}


def _replace_substring(rng):
  s = rng.choice(PHRASES)
  old = rng.choice(s.split())
  new = rng.choice(("sun", "moon", "river", "tiger", "engine", "garden"))
  return (f"replace '{old}' with '{new}' in the text '{s}'",
          {"text": [s], "old": [old], "new": [new]})


def _change_case(rng):
  s, case = rng.choice(PHRASES), rng.choice(("upper", "lower", "title"))
  return f"convert the text '{s}' to {case} case", {"text": [s], "case": [case]}


def _gcd(rng):
  k = rng.randint(2, 12)
  a, b = k * rng.randint(2, 40), k * rng.randint(2, 40)
  return f"find the greatest common divisor of {a} and {b}", {"a": [a], "b": [b]}


def _mean(rng):
  xs = [_dec(rng, 0, 99) for _ in range(rng.randint(3, 6))]
  return f"compute the mean of {', '.join(map(_fmt, xs))}", {"numbers": [xs]}


def _flights(rng):
  (a, b), (iso, said) = _two(rng, CITIES), _date(rng)
  n = _optional(rng, (2, 3, 4, 5))
  text = f"search for flights from {a} to {b} on {said}"
  args = {"origin": [a], "destination": [b], "date": [iso]}
  if n is None:
    return text, {**args, "passengers": ["", 1]}
  return text + f" for {n} passengers", {**args, "passengers": [n]}


def _hotel(rng):
  city, (iso, said), nights = rng.choice(CITIES), _date(rng), rng.randint(1, 14)
  breakfast = _optional(rng, (True,))
  text = f"book a hotel in {city} checking in on {said} for {nights} nights"
  args = {"city": [city], "check_in": [iso], "nights": [nights]}
  if breakfast is None:
    return text, {**args, "breakfast": ["", False]}
  return text + " with breakfast included", {**args, "breakfast": [True]}


def _update_contact(rng):
  uid = rng.randint(1000, 99999)
  email = f"{rng.choice(('ana', 'li', 'omar', 'sven', 'mei'))}{rng.randint(1, 99)}@example.org"
  phone = f"+1-555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
  if rng.random() < 0.5:
    return (f"update the contact details of user {uid} to the email {email}",
            {"user_id": [uid], "contact": [{"email": [email], "phone": [""]}]})
  return (f"update the contact details of user {uid} to the email {email} and the phone {phone}",
          {"user_id": [uid], "contact": [{"email": [email], "phone": [phone]}]})


def _check_stock(rng):
  ids = [f"SKU-{rng.randint(100, 999)}" for _ in range(rng.randint(1, 4))]
  warehouse = _optional(rng, ("north", "south", "east"))
  text = f"check the stock of products {', '.join(ids)}"
  if warehouse is None:
    return text, {"product_ids": [ids], "warehouse": ["", "main"]}
  return text + f" in the {warehouse} warehouse", {"product_ids": [ids], "warehouse": [warehouse]}


def _spec(domain: str, sample: Sampler, name: str, description: str, required: Sequence[str],
          **params: dict) -> _Spec:
  return _Spec(domain, _doc(name, description, required, **params), sample)


_DATE = "Date in YYYY-MM-DD format."
_RATE = "Annual interest rate as a decimal, e.g. 0.05 for 5%."
SPECS: tuple[_Spec, ...] = (
    _spec("geometry", _circle_area, "geometry.circle_area", "Calculate the area of a circle.",
          ["radius"], radius=_p("float", "Radius of the circle."),
          unit=_p("string", "Unit of the radius. Default 'units'.")),
    _spec("geometry", _rect_perimeter, "geometry.rectangle_perimeter",
          "Perimeter of a rectangle.", ["length", "width"],
          length=_p("float", "Length of the rectangle."),
          width=_p("float", "Width of the rectangle.")),
    _spec("geometry", _distance, "geometry.distance_2d",
          "Euclidean distance between two points in the plane.", ["point_a", "point_b"],
          point_a=_p("tuple", "First point (x, y).", items={"type": "float"}),
          point_b=_p("tuple", "Second point (x, y).", items={"type": "float"})),
    _spec("geometry", _sphere_volume, "geometry.sphere_volume", "Volume of a sphere.",
          ["radius"], radius=_p("float", "Radius of the sphere."),
          decimal_places=_p("integer", "Digits to round the result to. Default 2.")),
    _spec("units", _convert_length, "units.convert_length", "Convert a length between units.",
          ["value", "from_unit", "to_unit"], value=_p("float", "The length to convert."),
          from_unit=_p("string", "Unit of the value.", enum=list(LENGTH_UNITS)),
          to_unit=_p("string", "Unit to convert to.", enum=list(LENGTH_UNITS))),
    _spec("units", _convert_temperature, "units.convert_temperature",
          "Convert a temperature between scales.", ["temperature", "from_scale", "to_scale"],
          temperature=_p("float", "The temperature."),
          from_scale=_p("string", "Scale of the input.", enum=list(TEMP_SCALES)),
          to_scale=_p("string", "Scale to convert to.", enum=list(TEMP_SCALES))),
    _spec("units", _convert_currency, "convert_currency",
          "Convert an amount of money at today's exchange rate.",
          ["amount", "from_currency", "to_currency"], amount=_p("float", "Amount of money."),
          from_currency=_p("string", "ISO code of the source currency, e.g. 'USD'."),
          to_currency=_p("string", "ISO code of the target currency.")),
    _spec("finance", _compound_interest, "finance.compound_interest",
          "Interest earned with compounding.", ["principal", "annual_rate", "years"],
          principal=_p("float", "Initial amount."), annual_rate=_p("float", _RATE),
          years=_p("integer", "Number of years."),
          compounds_per_year=_p("integer", "Compounding periods per year. Default 1.")),
    _spec("finance", _loan_payment, "finance.loan_payment",
          "Monthly payment of an amortised loan.", ["principal", "annual_rate", "term_months"],
          principal=_p("float", "Loan amount."), annual_rate=_p("float", _RATE),
          term_months=_p("integer", "Length of the loan in months.")),
    _spec("finance", _stock_price, "stock.get_price", "Latest trading price of a stock.",
          ["ticker"], ticker=_p("string", "Ticker symbol."),
          exchange=_p("string", "Exchange to query. Default 'NASDAQ'.")),
    _spec("finance", _roi, "finance.return_on_investment",
          "Return on investment as a percentage.", ["gain", "cost"],
          gain=_p("float", "Net gain of the investment."),
          cost=_p("float", "Cost of the investment.")),
    _spec("weather", _forecast, "weather.get_forecast", "Daily weather forecast for a city.",
          ["city", "days"], city=_p("string", "Name of the city."),
          days=_p("integer", "Number of days to forecast."),
          unit=_p("string", "Temperature unit. Default 'celsius'.",
                  enum=["celsius", "fahrenheit", "kelvin"])),
    _spec("weather", _air_quality, "weather.air_quality", "Current air quality index of a city.",
          ["city"], city=_p("string", "Name of the city."),
          pollutant=_p("string", "Pollutant to report. Default 'pm2.5'.",
                       enum=["pm2.5", "pm10", "ozone", "no2"])),
    _spec("weather", _historical_temperature, "weather.historical_temperature",
          "Average temperature of a past or planned day.", ["city", "date"],
          city=_p("string", "Name of the city."), date=_p("string", _DATE)),
    _spec("calendar", _create_event, "calendar.create_event",
          "Add an event to the user's calendar.", ["title", "date", "start_time"],
          title=_p("string", "Title of the event."), date=_p("string", _DATE),
          start_time=_p("string", "Start time, 24-hour HH:MM."),
          duration_minutes=_p("integer", "Length in minutes. Default 60.")),
    _spec("calendar", _days_between, "calendar.days_between",
          "Number of days between two dates.", ["start_date", "end_date"],
          start_date=_p("string", _DATE), end_date=_p("string", _DATE),
          include_end_date=_p("boolean", "Count the end date as well. Default false.")),
    _spec("calendar", _day_of_week, "calendar.day_of_week", "Weekday of a date.", ["date"],
          date=_p("string", _DATE)),
    _spec("text", _count_words, "text.count_words", "Count the words of a text.", ["text"],
          text=_p("string", "The text.")),
    _spec("text", _replace_substring, "text.replace_substring",
          "Replace every occurrence of a substring.", ["text", "old", "new"],
          text=_p("string", "The text."), old=_p("string", "Substring to replace."),
          new=_p("string", "Replacement.")),
    _spec("text", _change_case, "text.change_case", "Change the letter case of a text.",
          ["text", "case"], text=_p("string", "The text."),
          case=_p("string", "Target case.", enum=["upper", "lower", "title"])),
    _spec("math", _gcd, "math.gcd", "Greatest common divisor of two integers.", ["a", "b"],
          a=_p("integer", "First integer."), b=_p("integer", "Second integer.")),
    _spec("math", _mean, "stats.mean", "Arithmetic mean of a list of numbers.", ["numbers"],
          numbers=_p("array", "The numbers.", items={"type": "float"})),
    _spec("travel", _flights, "travel.search_flights", "Search one-way flights.",
          ["origin", "destination", "date"], origin=_p("string", "Departure city."),
          destination=_p("string", "Arrival city."), date=_p("string", _DATE),
          passengers=_p("integer", "Number of passengers. Default 1.")),
    _spec("travel", _hotel, "travel.book_hotel", "Book a hotel room.",
          ["city", "check_in", "nights"], city=_p("string", "City of the hotel."),
          check_in=_p("string", _DATE), nights=_p("integer", "Number of nights."),
          breakfast=_p("boolean", "Include breakfast. Default false.")),
    _spec("account", _update_contact, "account.update_contact",
          "Update a user's contact details.", ["user_id", "contact"],
          user_id=_p("integer", "Id of the user."),
          contact=_p("dict", "New contact details.", required=["email"], properties={
              "email": _p("string", "Email address."), "phone": _p("string", "Phone number.")})),
    _spec("account", _check_stock, "inventory.check_stock", "Units in stock for some products.",
          ["product_ids"], product_ids=_p("array", "Product SKUs.", items={"type": "string"}),
          warehouse=_p("string", "Warehouse name. Default 'main'.")),
)

_OPENERS = (("", "."), ("Please ", "."), ("Could you ", "?"), ("I need you to ", "."),
            ("Help me ", "."), ("Can you ", "?"))


def _sentence(rng: random.Random, requests: Sequence[str]) -> str:
  opener, end = rng.choice(_OPENERS)
  body = requests[0] if len(requests) == 1 else (
      ", ".join(requests[:-1]) + ", and " + requests[-1])
  text = opener + body
  return text[0].upper() + text[1:] + end


def _distinct_samples(rng: random.Random, spec: _Spec, k: int) -> list[tuple[str, dict]]:
  out: list[tuple[str, dict]] = []
  while len(out) < k:
    s = spec.sample(rng)
    if all(s[0] != t[0] for t in out):
      out.append(s)
  return out


def _synthetic_item(rng: random.Random, category: str, item_id: str) -> BfclItem:
  """One synthetic item of `category`: functions offered, request and possible answer."""
  if category == "irrelevance":  # ask for something no offered function can do
    target = rng.choice(SPECS)
    others = [s for s in SPECS if s.domain != target.domain]
    offered = rng.sample(others, rng.randint(1, 2))
    calls: list[tuple[_Spec, dict]] = []
    requests = [target.sample(rng)[0]]
  else:
    if category in ("simple", "multiple"):
      chosen = [rng.choice(SPECS)]
    elif category == "parallel":
      chosen = [rng.choice(SPECS)] * rng.randint(2, 4)
    else:  # parallel_multiple: 2-3 distinct functions, some called twice
      distinct = rng.sample(SPECS, rng.randint(2, 3))
      chosen = distinct + rng.sample(distinct, rng.randint(0, 4 - len(distinct)))
    samples = []
    for spec in dict.fromkeys(chosen):  # distinct specs, first-seen order
      samples += [(spec, s) for s in _distinct_samples(rng, spec, chosen.count(spec))]
    calls = [(spec, answer) for spec, (_, answer) in samples]
    requests = [request for _, (request, _) in samples]
    offered = list(dict.fromkeys(chosen))
    if category == "multiple" or (category == "parallel_multiple" and rng.random() < 0.5):
      extra = [s for s in SPECS if s not in offered]
      offered += rng.sample(extra, 1 if category == "parallel_multiple" else rng.randint(1, 3))
  rng.shuffle(offered)
  return BfclItem(item_id=item_id, category=category,
                  messages=({"role": "user", "content": _sentence(rng, requests)},),
                  functions=tuple(s.doc for s in offered),
                  ground_truth=tuple({spec.doc["name"]: answer} for spec, answer in calls))


def synthetic_items(categories: Sequence[str], num_items: int, seed: int) -> list[BfclItem]:
  """`num_items` distinct synthetic items, cycling through `categories` in a seeded order.

  A question equal to a BFCL eval question (checked when bfcl-eval is installed) or to an
  earlier item is redrawn, so the train split never holds an eval question or a duplicate.
  """
  for c in categories:
    if c not in CATEGORIES:
      raise ValueError(f"unknown BFCL category {c!r}; choose from {CATEGORIES}")
  rng = random.Random(f"bfcl-train:{seed}")
  order = list(categories)
  rng.shuffle(order)
  banned, seen, items = eval_questions(), set(), []
  while len(items) < num_items:
    category = order[len(items) % len(order)]
    item = _synthetic_item(rng, category, f"synthetic_{category}_{len(items)}")
    if item.question in banned or item.question in seen:
      continue
    seen.add(item.question)
    items.append(item)
  return items
