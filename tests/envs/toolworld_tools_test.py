"""The 17 tool-world tools: schemas, rejected calls, and values against the world's ground truth."""

from __future__ import annotations

import datetime as dt
import math
import time

import pytest

from tree_rl.envs.base import ToolCall, ToolError
from tree_rl.envs.executor import ToolExecutor
from tree_rl.envs.toolworld import TOOL_NAMES, Context, World, make_tools
from tree_rl.envs.toolworld import series

NOW = dt.datetime(2025, 6, 12, 9, 30)  # a Thursday
HOME = "Lunhaven"  # Aldoria: UTC+01:00, EUR


@pytest.fixture(scope="module")
def world():
  return World.build(0)


@pytest.fixture(scope="module")
def tools(world):
  return {t.name: t for t in make_tools(world, Context(NOW, HOME))}


def run(tools, name, **arguments):
  """One call through the real executor (schema validation included)."""
  result, = ToolExecutor(list(tools.values())).execute(
      [ToolCall(name=name, arguments=arguments, raw="")])
  return result


# -- Schemas and rejected calls ---------------------------------------------------

# A call that violates each tool's schema (missing required argument, or a wrong type).
BAD_CALLS = {
    "news_search": {"date": "2025-06-01"}, "weather_search": {"date": "2025-06-01"},
    "flights_search": {"origin": "Lunhaven"}, "stocks_search": {"symbol": 7},
    "sports_search": {}, "maps_search": {"origin": "Lunhaven", "destination": 3},
    "conversion_calculation": {"value": "ten", "from_unit": "km", "to_unit": "mi"},
    "math_calculation": {"expression": 12}, "get_current_context": {"city": "Lunhaven"},
    "timestamp_comparator": {"timestamp_a": "2025-01-01"}, "sort_list": {"items": "1,2"},
    "holiday_search": {"country": "Aldoria", "year": "2025"}, "knowledge_search": {},
    "filter_list": {"items": [1], "operator": "~", "value": 1},
    "timestamp_converter": {"timestamp": "2025-01-01", "format": "rfc"},
    "timestamp_interval_calculator": {"end": "2025-01-01"}, "response_gen": {"answer": 42},
}


# A minimal valid call of each tool.
GOOD_CALLS = {
    "news_search": {"query": "Orrery"}, "weather_search": {"city": "Hollmar"},
    "flights_search": {"origin": "Lunhaven", "destination": "Kitazono"},
    "stocks_search": {"symbol": "TIDE"}, "sports_search": {"team": "<a team>"},
    "maps_search": {"origin": "Lunhaven", "destination": "Verano"},
    "conversion_calculation": {"value": 3, "from_unit": "km", "to_unit": "mi"},
    "math_calculation": {"expression": "1 + 1"}, "get_current_context": {},
    "timestamp_comparator": {"timestamp_a": "2025-01-01", "timestamp_b": "2025-01-02"},
    "sort_list": {"items": [2, 1]}, "holiday_search": {"country": "Aldoria"},
    "knowledge_search": {"query": "Aldoria"},
    "filter_list": {"items": [1, 2], "operator": ">", "value": 1},
    "timestamp_converter": {"timestamp": "2025-01-01T10:00"},
    "timestamp_interval_calculator": {"start": "2025-01-01", "days": 3},
    "response_gen": {"answer": "done"},
}


def test_all_seventeen_tools_in_order(tools):
  assert list(tools) == list(TOOL_NAMES) and len(TOOL_NAMES) == 17
  assert [n for n, t in tools.items() if t.terminal] == ["response_gen"]


@pytest.mark.parametrize("name", TOOL_NAMES)
def test_schema_is_a_valid_object_schema(tools, name):
  tool = tools[name]
  params = tool.parameters
  assert params["type"] == "object" and isinstance(params["properties"], dict)
  assert set(params["required"]) <= set(params["properties"])
  for prop in params["properties"].values():
    assert "type" in prop
  assert tool.schema()["function"]["name"] == name and len(tool.description) > 20


@pytest.mark.parametrize("name", TOOL_NAMES)
def test_bad_calls_are_rejected_by_the_executor(world, tools, name):
  good = dict(GOOD_CALLS[name])
  if name == "sports_search":  # team names depend on the world's seed
    good["team"] = sorted(world.teams)[0]
  assert run(tools, name, **good).ok
  bad = run(tools, name, **BAD_CALLS[name])
  assert not bad.ok and bad.error == ToolError.INVALID_ARGUMENTS
  extra = run(tools, name, **good, bogus=1)  # unexpected arguments are rejected
  assert not extra.ok and extra.error == ToolError.INVALID_ARGUMENTS
  assert "bogus" in extra.content


@pytest.mark.parametrize("name, arguments, fragment", [
    ("weather_search", {"city": "Atlantis"}, "unknown city"),
    ("weather_search", {"city": "Frostvik", "date": "2025-07-01"}, "14 days"),
    ("weather_search", {"city": "Frostvik", "date": "2024-12-31"}, "no data"),
    ("stocks_search", {"symbol": "ORRY", "date": "2025-06-07"}, "closed"),  # a Saturday
    ("stocks_search", {"symbol": "ORRY", "date": "2025-06-13"}, "future"),
    ("stocks_search", {"symbol": "ZZZZ"}, "unknown company"),
    ("maps_search", {"origin": "Lunhaven", "destination": "Varanam"}, "different continents"),
    ("holiday_search", {"country": "Narnia"}, "known countries"),
    ("knowledge_search", {"query": "Embr Spire"}, "did you mean Ember Spire"),
    ("news_search", {"query": "Orrery", "date": "2025-07-01"}, "future"),
    ("conversion_calculation", {"value": 1, "from_unit": "EUR", "to_unit": "kg"}, "currency"),
    ("timestamp_converter", {"timestamp": "June 1st"}, "invalid timestamp"),
    ("sports_search", {"team": "Nowhere United"}, "unknown team"),
])
def test_domain_errors_become_tool_errors(tools, name, arguments, fragment):
  result = run(tools, name, **arguments)
  assert not result.ok and result.error == ToolError.EXCEPTION
  assert fragment in result.content


# -- Behaviour against the world ------------------------------------------------

def test_world_builds_fast_and_deterministically():
  times = []
  for _ in range(3):  # the fastest of three: the build's own time, not a loaded machine's
    start = time.perf_counter()
    a = World.build(3)
    times.append(time.perf_counter() - start)
  assert min(times) < 0.2, times
  assert a == World.build(3)
  assert a.companies != World.build(4).companies


def test_get_current_context(tools):
  ctx = tools["get_current_context"].fn()
  assert ctx == {"date": "2025-06-12", "time": "09:30", "weekday": "Thursday",
                 "timezone": "Europe/Lunhaven", "utc_offset": "+01:00", "city": "Lunhaven",
                 "country": "Aldoria", "currency": "EUR"}


def test_weather_search_is_the_worlds_weather(world, tools):
  city = world.cities["Frostvik"]
  day = dt.date(2025, 5, 2)
  assert tools["weather_search"].fn(city="frostvik", date="2025-05-02") == \
      series.weather(world, city, day)
  today = tools["weather_search"].fn(city="Frostvik")
  assert today["date"] == "2025-06-12" and today["low_c"] < today["high_c"]
  # Precipitation and condition agree, and the climate follows the seasons.
  assert (today["precipitation_mm"] > 0) == (today["condition"] in ("rain", "snow",
                                                                    "thunderstorms"))
  january = [series.weather(world, city, dt.date(2025, 1, d))["high_c"] for d in range(1, 29)]
  july = [series.weather(world, city, dt.date(2025, 7, d))["high_c"] for d in range(1, 29)]
  assert sum(july) > sum(january) + 28 * 8


def test_conversion_at_the_days_fx_rate(world, tools):
  out = tools["conversion_calculation"].fn(value=250, from_unit="usd", to_unit="JPY",
                                           date="2025-03-03")
  rate = series.fx_per_usd(world, "JPY", dt.date(2025, 3, 3))
  assert out["rate"] == pytest.approx(rate, rel=1e-5)
  assert out["result"] == pytest.approx(250 * rate, rel=1e-5)
  back = tools["conversion_calculation"].fn(value=out["result"], from_unit="JPY",
                                            to_unit="USD", date="2025-03-03")
  assert back["result"] == pytest.approx(250, abs=0.02)
  assert tools["conversion_calculation"].fn(value=1, from_unit="EUR", to_unit="GBP")["date"] \
      == "2025-06-12"  # defaults to today


@pytest.mark.parametrize("value, source, target, expected", [
    (100, "km", "mi", 62.1371), (100, "C", "F", 212.0), (-40, "celsius", "fahrenheit", -40.0),
    (0, "K", "C", -273.15), (10, "lb", "kg", 4.5359), (1, "gallon", "litres", 3.7854),
])
def test_unit_conversion(tools, value, source, target, expected):
  out = tools["conversion_calculation"].fn(value=value, from_unit=source, to_unit=target)
  assert out["result"] == pytest.approx(expected, abs=1e-4)


def test_stocks_search_quotes(world, tools):
  company = world.companies["Orrery Systems"]
  by_ticker = tools["stocks_search"].fn(symbol="ORRY", date="2025-06-11")
  assert by_ticker == tools["stocks_search"].fn(symbol="orrery systems", date="2025-06-11")
  assert by_ticker == series.quote(world, company, dt.date(2025, 6, 11))
  assert by_ticker["currency"] == company.currency
  assert tools["stocks_search"].fn(symbol="ORRY")["date"] == "2025-06-12"


def test_flights_search_times_and_fares(world, tools):
  out = tools["flights_search"].fn(origin="LUN", destination="Harumi Bay", date="2025-06-20")
  flights = out["flights"]
  assert 2 <= len(flights) <= 4 and len({f["price"] for f in flights}) == len(flights)
  offset = world.cities["Harumi Bay"].utc_offset_min - world.cities["Lunhaven"].utc_offset_min
  for f in flights:
    dep, arr = (dt.datetime.fromisoformat(f[k]) for k in ("departure_local", "arrival_local"))
    assert arr - dep == dt.timedelta(minutes=f["duration_minutes"] + offset)
    assert f["currency"] == "EUR" and f["origin"] == "LUN" and f["destination"] == "HRB"


def test_maps_search_is_the_haversine_road_distance(world, tools):
  a, b = world.cities["Lunhaven"], world.cities["Frostvik"]
  p1, p2 = math.radians(a.lat), math.radians(b.lat)
  h = (math.sin((p2 - p1) / 2) ** 2
       + math.cos(p1) * math.cos(p2) * math.sin(math.radians(b.lon - a.lon) / 2) ** 2)
  km = 2 * 6371.0 * math.asin(math.sqrt(h)) * 1.25
  out = tools["maps_search"].fn(origin="Lunhaven", destination="Frostvik")
  assert out["distance_km"] == pytest.approx(km, abs=0.2)
  assert out["duration_minutes"] == round(out["distance_km"] / 75 * 60)
  walk = tools["maps_search"].fn(origin="Lunhaven", destination="Frostvik", mode="walking")
  assert walk["duration_minutes"] > 10 * out["duration_minutes"]


def test_sports_search_matches_the_fixtures(world, tools):
  played = [m for m in world.matches if m.date < NOW.date()][-1]
  out = tools["sports_search"].fn(team=played.away, date=played.date.isoformat())
  assert out["status"] == "final"
  assert (out["home_score"], out["away_score"]) == (played.home_score, played.away_score)
  future = [m for m in world.matches if m.date > NOW.date()][0]
  assert tools["sports_search"].fn(team=future.home, date=future.date.isoformat())["status"] \
      == "scheduled"
  summary = tools["sports_search"].fn(team=played.home)
  record = summary["record"]
  season = [m for m in world.matches if played.home in (m.home, m.away)
            and m.date.year == 2025 and m.date < NOW.date()]
  assert record["played"] == len(season)
  assert record["wins"] + record["draws"] + record["losses"] == len(season)
  assert summary["next_match"]["status"] == "scheduled"


def test_holiday_search(world, tools):
  out = tools["holiday_search"].fn(country="Aldoria")
  assert out["year"] == 2025 and out["holidays"][0] == {"name": "New Year's Day",
                                                        "date": "2025-01-01"}
  moving = [r for r in world.holidays["Aldoria"] if r.weekday is not None]
  assert len(moving) == 1
  for year in (2025, 2026):
    days = {h["name"]: h["date"] for h in
            tools["holiday_search"].fn(country="Lunhaven", year=year)["holidays"]}
    assert dt.date.fromisoformat(days[moving[0].name]).weekday() == 0


def test_knowledge_search(world, tools):
  company = world.companies["Tidewater Foods"]
  info = tools["knowledge_search"].fn(query="tidewater foods")
  assert (info["founder"], info["founded"], info["headquarters"]) == \
      (company.founder, company.founded, company.headquarters)
  person = tools["knowledge_search"].fn(query=company.founder)
  assert person["born"] < company.founded and "founder of Tidewater Foods" in person["known_for"]
  landmark = tools["knowledge_search"].fn(query="Skyreach Tower")
  assert landmark["height_m"] == world.landmarks["Skyreach Tower"].height_m


def test_news_search_finds_the_days_articles(world, tools):
  day = dt.date(2025, 6, 1)
  article = series.news(world, day)[0]
  out = tools["news_search"].fn(query=article["entities"][0], date="2025-06-01")
  assert out["articles"][0] == article
  assert tools["news_search"].fn(query="zzz unrelated words", date="2025-06-01")["articles"] == []


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14), ("(2025 - 1987) / 2", 19), ("2 ** 10", 1024), ("sqrt(144)", 12),
    ("round(10 / 3, 2)", 3.33), ("-7 // 2", -4), ("17 % 5", 2), ("max(3, 9, 4)", 9),
    ("1 / 3", 0.3333333333), ("pi * 2", 6.283185307),
])
def test_math_calculation_values(tools, expression, value):
  assert tools["math_calculation"].fn(expression=expression)["result"] == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('ls')", "(1).real", "open('x')", "x + 1", "2 ^ 3", "1 / 0",
    "sqrt(-1)", "9 ** 9 ** 9", "1,000 + 1", "lambda: 1", "[1, 2]", "(-8) ** 0.5", "2 +",
])
def test_math_calculation_rejects(tools, expression):
  with pytest.raises(ValueError):
    tools["math_calculation"].fn(expression=expression)


def test_timestamp_interval_calculator(tools):
  fn = tools["timestamp_interval_calculator"].fn
  out = fn(start="2025-06-12", end="2025-08-01")
  assert (out["days"], out["total_minutes"]) == (50, 50 * 1440)
  out = fn(start="2025-06-14T10:00+05:30", end="2025-06-14T10:00Z")
  assert out["total_minutes"] == 330 and (out["hours"], out["minutes"]) == (5, 30)
  back = fn(start="2025-06-14T10:00", end="2025-06-13T08:30")
  assert back["end_is_before_start"] and back["total_minutes"] == -(25 * 60 + 30)
  assert fn(start="2025-12-31", days=1)["result"] == "2026-01-01"
  assert fn(start="2025-03-01T22:00", hours=3, minutes=-30)["result"] == "2025-03-02T00:30"
  with pytest.raises(ValueError):
    fn(start="2025-01-01", end="2025-01-02", days=1)


def test_timestamp_converter_and_comparator(tools):
  convert = tools["timestamp_converter"].fn
  out = convert(timestamp="2025-06-12T10:00", to_timezone="Varanam")  # from the user's UTC+1
  assert (out["time"], out["utc_offset"], out["timezone"]) == ("14:30", "+05:30", "Asia/Varanam")
  assert convert(timestamp="2025-06-12T23:30Z", to_timezone="UTC+09:00")["date"] == "2025-06-13"
  assert convert(timestamp="1970-01-01T01:00", format="unix")["timestamp"] == "0"
  assert convert(timestamp="2025-06-12T09:30", format="human")["timestamp"] == \
      "Thursday, 12 June 2025, 09:30"
  compare = tools["timestamp_comparator"].fn
  out = compare(timestamp_a="2025-06-12T10:00", timestamp_b="2025-06-12T10:00+05:30")
  assert out["comparison"] == "timestamp_a is after timestamp_b"
  assert out["difference_minutes"] == 270
  assert compare(timestamp_a="2025-06-12", timestamp_b="2025-06-12T00:00")["comparison"] == \
      "timestamp_a equals timestamp_b"


def test_sort_list(tools):
  sort = tools["sort_list"].fn
  assert sort(items=[3, 1.5, 2]) == [1.5, 2, 3]
  assert sort(items=["b", "a"], descending=True) == ["b", "a"]
  teams = [{"t": "x", "record": {"points": 5}}, {"t": "y", "record": {"points": 9}}]
  assert [t["t"] for t in sort(items=teams, key="record.points", descending=True)] == ["y", "x"]
  with pytest.raises(ValueError):
    sort(items=[1, "a"])
  with pytest.raises(ValueError):
    sort(items=teams, key="record.wins")


def test_filter_list(tools):
  filt = tools["filter_list"].fn
  items = [{"c": "Rain", "mm": 3.2, "tags": ["wet"]}, {"c": "sunny", "mm": 0.0, "tags": []}]
  assert filt(items=items, key="mm", operator="==", value=0) == [items[1]]
  assert filt(items=items, key="mm", operator=">", value=1) == [items[0]]
  assert filt(items=items, key="c", operator="==", value="rain") == [items[0]]
  assert filt(items=items, key="c", operator="contains", value="SUN") == [items[1]]
  assert filt(items=items, key="tags", operator="contains", value="wet") == [items[0]]
  assert filt(items=[5, 1, 7], operator="<=", value=5) == [5, 1]
  with pytest.raises(ValueError):
    filt(items=items, key="c", operator=">", value=1)


def test_response_gen_is_terminal(tools):
  result = run(tools, "response_gen", answer="42")
  assert result.ok and "recorded" in result.content and tools["response_gen"].terminal
