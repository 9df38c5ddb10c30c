"""Query templates of difficulty 1 and 2 (one or two tool-call steps before the answer).

Difficulty-1 questions name everything they need (explicit dates, or "today",
which every time-sensitive tool defaults to); difficulty-2 questions add one
hop: resolving "tomorrow"/"yesterday"/"here" with get_current_context, a second
knowledge lookup, or a conversion. Each template solves itself with the real
tools (see `oracle.py`); the world is consulted directly only to choose
parameters that make a well-posed question.
"""

from __future__ import annotations

import re
from typing import Any

from tree_rl.envs.toolworld import series
from tree_rl.envs.toolworld.oracle import (Gen, Solver, date_answer, number, require, spoken,
                                           string, template, time_answer, yes_no)

CONTEXT = ("get_current_context", {})
REGIONS = ("Europe", "America", "Asia", "Oceania")


@template("founder", 1)
def founder(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  company = g.pick(sorted(g.world.companies))
  question = g.pick([f"Who founded {company}?", f"Who is the founder of {company}?"])
  s = g.solver()
  info, = s.step(f"I need the founder of {company}; the knowledge base has company facts.",
                 ("knowledge_search", {"query": company}))
  s.finish(f"{company} was founded by {info['founder']}.")
  return question, string(info["founder"]), s


@template("landmark_height", 1)
def landmark_height(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  landmark = g.pick(sorted(g.world.landmarks))
  question = g.pick([f"How tall is {landmark}?", f"What is the height of {landmark} in metres?"])
  s = g.solver()
  info, = s.step(f"I will look up {landmark} in the knowledge base.",
                 ("knowledge_search", {"query": landmark}))
  s.finish(f"{landmark} is {info['height_m']} m tall.")
  return question, number(info["height_m"]), s


@template("drive_distance", 1)
def drive_distance(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  a, b = g.sample(g.cities(region=g.pick(REGIONS)), 2)
  question = g.pick([f"How far is it to drive from {a} to {b}?",
                     f"What is the driving distance between {a} and {b} in kilometres?"])
  s = g.solver()
  route, = s.step("A maps search gives the road distance.",
                  ("maps_search", {"origin": a, "destination": b}))
  s.finish(f"The drive from {a} to {b} is {route['distance_km']} km "
           f"(about {route['duration_minutes']} minutes).")
  return question, number(route["distance_km"]), s


@template("past_weather_high", 1)
def past_weather_high(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  city, day = g.pick(g.cities()), g.day(-g.rng.randint(1, 60))
  question = f"What was the high temperature in {city} on {spoken(day)}?"
  s = g.solver()
  report, = s.step(f"I need the weather of {city} on {day.isoformat()}.",
                   ("weather_search", {"city": city, "date": day.isoformat()}))
  s.finish(f"The high in {city} that day was {report['high_c']} °C.")
  return question, number(report["high_c"]), s


@template("holiday_date", 1)
def holiday_date(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  country = g.pick(sorted(g.world.countries))
  name = g.pick([r.name for r in g.world.holidays[country] if r.name != "New Year's Day"])
  year = g.pick([2025, 2026])
  question = g.pick([f"On what date is {name} in {country} in {year}?",
                     f"When is {name} celebrated in {country} in {year}?"])
  s = g.solver()
  calendar, = s.step(f"I will get the {year} public holidays of {country}.",
                     ("holiday_search", {"country": country, "year": year}))
  day = next(h["date"] for h in calendar["holidays"] if h["name"] == name)
  s.finish(f"{name} in {country} falls on {day} in {year}.")
  return question, date_answer(day), s


@template("math_expression", 1)
def math_expression(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  r = g.rng
  a, b, c, p = r.randint(12, 999), r.randint(3, 99), r.randint(1, 500), r.randint(2, 5)
  question, expression = g.pick([
      (f"What is {a} multiplied by {b}, minus {c}?", f"{a} * {b} - {c}"),
      (f"What is {a} divided by {b}, rounded to two decimals?", f"round({a} / {b}, 2)"),
      (f"What is the square root of {a * b}?", f"sqrt({a * b})"),
      (f"What is {b} to the power of {p}?", f"{b} ** {p}"),
      (f"What is {b}% of {a * 10}?", f"{b} / 100 * {a * 10}"),
  ])
  s = g.solver()
  out, = s.step("I will evaluate this with the calculator.",
                ("math_calculation", {"expression": expression}))
  s.finish(f"The result is {out['result']}.")
  return question, number(out["result"]), s


_CONVERSIONS = (("km", "mi", "kilometres", "miles", 1, 900),
                ("mi", "km", "miles", "kilometres", 1, 600),
                ("kg", "lb", "kilograms", "pounds", 1, 300),
                ("lb", "kg", "pounds", "kilograms", 1, 600),
                ("C", "F", "degrees Celsius", "degrees Fahrenheit", -25, 45),
                ("F", "C", "degrees Fahrenheit", "degrees Celsius", -10, 110),
                ("l", "gal", "litres", "gallons", 1, 400),
                ("ft", "m", "feet", "metres", 1, 30000),
                ("km/h", "mph", "km/h", "mph", 5, 300))


@template("unit_conversion", 1)
def unit_conversion(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  source, target, source_words, target_words, low, high = g.pick(_CONVERSIONS)
  value = g.rng.randint(low, high)
  question = g.pick([f"How many {target_words} is {value} {source_words}?",
                     f"Convert {value} {source_words} to {target_words}."])
  s = g.solver()
  out, = s.step("The conversion tool handles units.",
                ("conversion_calculation", {"value": value, "from_unit": source,
                                            "to_unit": target}))
  s.finish(f"{value} {source_words} is {out['result']} {target_words}.")
  return question, number(out["result"]), s


@template("stock_open_today", 1)
def stock_open_today(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  require(g.today.weekday() < 5, "the exchange is closed today")
  company = g.world.companies[g.pick(sorted(g.world.companies))]
  question = g.pick([f"What did {company.name} stock open at today?",
                     f"What was today's opening price of {company.ticker}?"])
  s = g.solver()
  quote, = s.step("stocks_search defaults to today's prices.",
                  ("stocks_search", {"symbol": company.ticker}))
  s.finish(f"{company.name} ({company.ticker}) opened at {quote['open']} {quote['currency']} "
           "today.")
  return question, number(quote["open"]), s


@template("match_winner", 1)
def match_winner(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  played = [m for m in g.world.matches if 1 <= (g.today - m.date).days <= 120
            and m.home_score != m.away_score]
  require(bool(played), "no decided match in the last 120 days")
  m = g.pick(played)
  sport = g.world.teams[m.home].sport
  question = f"Who won the {sport} match between {m.home} and {m.away} on {spoken(m.date)}?"
  s = g.solver()
  result, = s.step(f"I will look up {m.home}'s match on {m.date.isoformat()}.",
                   ("sports_search", {"team": m.home, "date": m.date.isoformat()}))
  s.finish(f"{result['winner']} won, {result['score']} ({m.home} at home).")
  return question, string(result["winner"], [m.home, m.away]), s


@template("taller_landmark", 1)
def taller_landmark(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  a, b = g.sample(sorted(g.world.landmarks), 2)
  require(g.world.landmarks[a].height_m != g.world.landmarks[b].height_m, "equal heights")
  question = f"Which is taller, {a} or {b}?"
  s = g.solver()
  ia, ib = s.step("I need both heights; the lookups are independent.",
                  ("knowledge_search", {"query": a}), ("knowledge_search", {"query": b}))
  tall, short = (ia, ib) if ia["height_m"] > ib["height_m"] else (ib, ia)
  s.finish(f"{tall['name']} is taller: {tall['height_m']} m against {short['height_m']} m.")
  return question, string(tall["name"], [a, b]), s


def cheapest(flights: list[dict[str, Any]]) -> dict[str, Any]:
  return min(flights, key=lambda f: f["price"])


@template("cheapest_flight_on_date", 1)
def cheapest_flight_on_date(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  a, b = g.sample(g.cities(), 2)
  day = g.day(g.rng.randint(1, 60))
  question = f"Which is the cheapest flight from {a} to {b} on {spoken(day)}?"
  s = g.solver()
  found, = s.step("I will search the flights of that day.",
                  ("flights_search", {"origin": a, "destination": b, "date": day.isoformat()}))
  require(len(found["flights"]) >= 2, "no choice of flights on this route")
  best = cheapest(found["flights"])
  s.finish(f"The cheapest is {best['flight_number']} ({best['airline']}) at {best['price']} "
           f"{best['currency']}.")
  return question, string(best["flight_number"], [f["flight_number"] for f in found["flights"]]), s


@template("news_office", 1)
def news_office(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  start = g.rng.randint(1, 20)
  for back in range(start, start + 20):
    articles = series.news(g.world, g.day(-back))
    office = [a for a in articles if " to open new office in " in a["headline"]]
    if office:
      break
  require(bool(office), "no office news in the window")
  company, city = office[0]["entities"]
  day = g.day(-back)
  question = f"According to the news on {spoken(day)}, where will {company} open a new office?"
  s = g.solver()
  s.step(f"I will search that day's news for {company}.",
         ("news_search", {"query": company, "date": day.isoformat()}))
  s.finish(f"{company} will open a new office in {city}.")
  return question, string(city), s


# -- Difficulty 2 ---------------------------------------------------------------

@template("weather_tomorrow_high", 2)
def weather_tomorrow_high(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  city = g.pick(g.cities())
  question = g.pick([f"What will the high temperature be in {city} tomorrow?",
                     f"How warm will it get in {city} tomorrow?"])
  s = g.solver()
  now, = s.step("I need today's date to know which day tomorrow is.", CONTEXT)
  tomorrow = g.day(1).isoformat()
  assert now["date"] == g.today.isoformat()
  report, = s.step(f"Tomorrow is {tomorrow}; I will get the forecast for {city}.",
                   ("weather_search", {"city": city, "date": tomorrow}))
  s.finish(f"Tomorrow's high in {city} will be {report['high_c']} °C ({report['condition']}).")
  return question, number(report["high_c"]), s


def _precipitation_answer(report: dict[str, Any]) -> str:
  if report["precipitation_mm"] > 0:
    return f"Yes: {report['condition']} with {report['precipitation_mm']} mm expected."
  return f"No, it should stay dry ({report['condition']})."


@template("precip_tomorrow", 2)
def precip_tomorrow(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  city = g.pick(g.cities())
  question = f"Will it rain or snow in {city} tomorrow?"
  s = g.solver()
  s.step("I need today's date to know which day tomorrow is.", CONTEXT)
  report, = s.step(f"I will get {city}'s forecast for tomorrow.",
                   ("weather_search", {"city": city, "date": g.day(1).isoformat()}))
  s.finish(_precipitation_answer(report))
  return question, yes_no(report["precipitation_mm"] > 0), s


@template("precip_here_today", 2)
def precip_here_today(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  question = g.pick(["Will it rain or snow where I am today?",
                     "Is any rain or snow expected here today?"])
  s = g.solver()
  s.step("I need to know where the user is.", CONTEXT)
  report, = s.step(f"The user is in {g.home.name}; weather_search defaults to today.",
                   ("weather_search", {"city": g.home.name}))
  s.finish(_precipitation_answer(report))
  return question, yes_no(report["precipitation_mm"] > 0), s


@template("hq_population", 2)
def hq_population(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  company = g.pick(sorted(g.world.companies))
  question = f"What is the population of the city where {company} is headquartered?"
  s = g.solver()
  info, = s.step(f"First I need {company}'s headquarters.",
                 ("knowledge_search", {"query": company}))
  city, = s.step(f"It is headquartered in {info['headquarters']}; now its population.",
                 ("knowledge_search", {"query": info["headquarters"]}))
  s.finish(f"{info['headquarters']}, where {company} is headquartered, has a population of "
           f"{city['population']}.")
  return question, number(city["population"]), s


def _nice(x: float) -> float | int:
  """A threshold a person would write: an integer from 10 up, else two decimals."""
  return round(x) if x >= 10 else round(x, 2)


def stock_threshold(g: Gen, yesterday: bool) -> tuple[str, dict[str, Any], Solver, Solver]:
  """"Did X open (close) above T <currency> today (yesterday)?", with both valid routes.

  Route A converts the threshold into the stock's currency, route B converts the
  price into the threshold's currency (PORTool, arXiv 2510.26020, §3.1: several valid
  tool-call routes).
  The threshold is at least 6% away from the price, so rounding cannot make the
  routes disagree.
  """
  day = g.day(-1 if yesterday else 0)
  require(day.weekday() < 5, "the exchange was closed")
  company = g.world.companies[g.pick(sorted(g.world.companies))]
  target = g.pick([c for c in sorted(g.world.fx_base) if c != company.currency])
  field, when = ("close", "yesterday") if yesterday else ("open", "today")
  verb, past = ("close", "closed") if yesterday else ("open", "opened")
  price = series.quote(g.world, company, day)[field]
  above = g.rng.random() < 0.5
  factor = g.rng.uniform(1.06, 1.3)
  threshold = _nice(price * series.fx_rate(g.world, company.currency, target, day)
                    * (1 / factor if above else factor))
  question = f"Did {company.name} stock {verb} above {threshold} {target} {when}?"
  date_args = {"date": day.isoformat()} if yesterday else {}
  routes = []
  for convert_threshold in (True, False):
    s = g.solver()
    if yesterday:
      s.step("I need today's date to know which day yesterday was.", CONTEXT)
    quote, = s.step(f"I will get {company.ticker}'s price {when}.",
                    ("stocks_search", {"symbol": company.ticker, **date_args}))
    value = quote[field]
    if convert_threshold:
      out, = s.step(f"The price is in {company.currency}; I will convert the threshold.",
                    ("conversion_calculation", {"value": threshold, "from_unit": target,
                                                "to_unit": company.currency, **date_args}))
      yes = value > out["result"]
      detail = (f"it {past} at {value} {company.currency}, and {threshold} {target} is "
                f"{out['result']} {company.currency}.")
    else:
      out, = s.step(f"The price is in {company.currency}; I will convert it to {target}.",
                    ("conversion_calculation", {"value": value, "from_unit": company.currency,
                                                "to_unit": target, **date_args}))
      yes = out["result"] > threshold
      detail = f"it {past} at {value} {company.currency}, which is {out['result']} {target}."
    s.finish(f"{'Yes' if yes else 'No'}: {detail}")
    require(yes == above, "the routes disagree after rounding")
    routes.append(s)
  return question, yes_no(above), routes[0], routes[1]


@template("stock_threshold_today", 2)
def stock_threshold_today(g: Gen) -> tuple[str, dict[str, Any], Solver, Solver]:
  return stock_threshold(g, yesterday=False)


@template("time_in_city_now", 2)
def time_in_city_now(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  city = g.world.cities[g.pick(g.cities())]
  require(city.utc_offset_min != g.home.utc_offset_min, "same time zone as the user")
  question = g.pick([f"What time is it right now in {city.name}?",
                     f"What is the current local time in {city.name}?"])
  s = g.solver()
  now, = s.step("I need the current time and time zone.", CONTEXT)
  out, = s.step(f"It is {now['time']} in {now['timezone']}; I will convert it.",
                ("timestamp_converter", {"timestamp": f"{now['date']}T{now['time']}",
                                         "from_timezone": now["timezone"],
                                         "to_timezone": city.name}))
  s.finish(f"It is {out['time']} in {city.name} ({out['weekday']}).")
  return question, time_answer(out["time"]), s


@template("landmark_distance", 2)
def landmark_distance(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  landmark = g.world.landmarks[g.pick(sorted(g.world.landmarks))]
  region = g.world.countries[g.world.cities[landmark.city].country].region
  city = g.pick(g.cities(region=region, exclude=[landmark.city]))
  question = f"How far is it to drive from {landmark.name} to {city}?"
  s = g.solver()
  info, = s.step(f"First I need the city of {landmark.name}.",
                 ("knowledge_search", {"query": landmark.name}))
  route, = s.step(f"It is in {info['city']}; now the road distance to {city}.",
                  ("maps_search", {"origin": info["city"], "destination": city}))
  s.finish(f"{landmark.name} is in {info['city']}, {route['distance_km']} km by road from {city}.")
  return question, number(route["distance_km"]), s


@template("news_revenue_yesterday", 2)
def news_revenue_yesterday(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  articles = [a for a in series.news(g.world, g.day(-1)) if "quarterly revenue" in a["headline"]]
  require(bool(articles), "no revenue news yesterday")
  match = re.search(r"([\d.]+)% (rise|drop)", articles[0]["headline"])
  assert match is not None
  company = articles[0]["entities"][0]
  pct = float(match.group(1)) * (1 if match.group(2) == "rise" else -1)
  owner = f"{company}'" if company.endswith("s") else f"{company}'s"
  question = (f"According to yesterday's news, by what percentage did {owner} quarterly "
              "revenue change?")
  s = g.solver()
  s.step("I need today's date to know which day yesterday was.", CONTEXT)
  s.step(f"I will search yesterday's news for {company}.",
         ("news_search", {"query": company, "date": g.day(-1).isoformat()}))
  s.finish(f"{company} reported a {abs(pct)}% {match.group(2)} in quarterly revenue.")
  return question, number(pct, absolute=True), s


@template("cheapest_flight_tomorrow", 2)
def cheapest_flight_tomorrow(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  a, b = g.sample(g.cities(), 2)
  question = f"What is the cheapest flight from {a} to {b} tomorrow?"
  s = g.solver()
  s.step("I need today's date to know which day tomorrow is.", CONTEXT)
  found, = s.step("Now the flights of tomorrow.",
                  ("flights_search", {"origin": a, "destination": b,
                                      "date": g.day(1).isoformat()}))
  require(len(found["flights"]) >= 2, "no choice of flights on this route")
  best = cheapest(found["flights"])
  s.finish(f"The cheapest is {best['flight_number']} ({best['airline']}) at {best['price']} "
           f"{best['currency']}.")
  return question, string(best["flight_number"], [f["flight_number"] for f in found["flights"]]), s
