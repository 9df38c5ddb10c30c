"""Query templates of difficulty 3 to 5: chains of lookups, sorting, filtering, conversion.

These are the multi-step questions PORTool's tree rollout is meant for: each
step depends on the previous one (which day is tomorrow, which city is the
headquarters, which flights are affordable), and independent lookups share a
step as parallel calls. Templates pre-check the world so that every step is
needed (e.g. the overall warmest city is rainy, so skipping filter_list gives a
wrong answer) and the answer is unique (no ties).
"""

from __future__ import annotations

from typing import Any

from tree_rl.envs.toolworld import series
from tree_rl.envs.toolworld.oracle import (Gen, Solver, all_of, number, require, string,
                                           template, time_answer)
from tree_rl.envs.toolworld.templates_basic import CONTEXT, cheapest, stock_threshold
from tree_rl.envs.toolworld.world import City

_TRIES = 30  # parameter draws a template makes before giving up on this context


@template("founder_age_at_founding", 3)
def founder_age_at_founding(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  company = g.pick(sorted(g.world.companies))
  question = f"How old was the founder of {company} when they founded it?"
  s = g.solver()
  info, = s.step(f"I need {company}'s founder and founding year.",
                 ("knowledge_search", {"query": company}))
  person, = s.step(f"Founded in {info['founded']} by {info['founder']}; now the birth year.",
                   ("knowledge_search", {"query": info["founder"]}))
  out, = s.step("I will subtract the birth year from the founding year.",
                ("math_calculation", {"expression": f"{info['founded']} - {person['born']}"}))
  s.finish(f"{info['founder']} was about {out['result']} years old when founding {company}.")
  return question, number(out["result"], rel_tol=0.0), s


@template("founder_age_this_year", 3)
def founder_age_this_year(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  company = g.pick(sorted(g.world.companies))
  question = f"How old does the founder of {company} turn this year?"
  s = g.solver()
  now, info = s.step("I need the current year and the company's founder.",
                     CONTEXT, ("knowledge_search", {"query": company}))
  person, = s.step(f"The founder is {info['founder']}; now the birth year.",
                   ("knowledge_search", {"query": info["founder"]}))
  year = now["date"][:4]
  out, = s.step("Age this year is the current year minus the birth year.",
                ("math_calculation", {"expression": f"{year} - {person['born']}"}))
  s.finish(f"{info['founder']} turns {out['result']} this year.")
  return question, number(out["result"], rel_tol=0.0), s


@template("days_until_next_holiday", 3)
def days_until_next_holiday(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  question = g.pick(["How many days are left until the next public holiday where I live?",
                     "How many days from today until the next public holiday in my country?"])
  s = g.solver()
  now, = s.step("I need today's date and the user's country.", CONTEXT)
  calendar, = s.step(f"I will get this year's holidays of {now['country']}.",
                     ("holiday_search", {"country": now["country"]}))
  upcoming = [h for h in calendar["holidays"] if h["date"] > now["date"]]
  require(bool(upcoming), "no holiday left this year")
  out, = s.step(f"The next one is {upcoming[0]['name']} on {upcoming[0]['date']}.",
                ("timestamp_interval_calculator", {"start": now["date"],
                                                   "end": upcoming[0]["date"]}))
  s.finish(f"The next public holiday is {upcoming[0]['name']}, in {out['days']} days.")
  return question, number(out["days"], rel_tol=0.0), s


@template("stock_threshold_yesterday", 3)
def stock_threshold_yesterday(g: Gen) -> tuple[str, dict[str, Any], Solver, Solver]:
  return stock_threshold(g, yesterday=True)


def _forecasts(g: Gen, cities: list[str]) -> list[dict[str, Any]]:
  """Tomorrow's weather of `cities`, read from the world to choose parameters."""
  return [series.weather(g.world, g.world.cities[c], g.day(1)) for c in cities]


def _unique_top(reports: list[dict[str, Any]], key: str) -> bool:
  values = sorted((r[key] for r in reports), reverse=True)
  return len(values) == 1 or values[0] > values[1]


@template("warmest_tomorrow", 3)
def warmest_tomorrow(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  cities = g.sample(g.cities(), 3)
  require(_unique_top(_forecasts(g, cities), "high_c"), "tie for the warmest")
  question = f"Which will be warmest tomorrow: {cities[0]}, {cities[1]} or {cities[2]}?"
  s = g.solver()
  s.step("I need today's date to know which day tomorrow is.", CONTEXT)
  tomorrow = g.day(1).isoformat()
  reports = s.step("The three forecasts are independent.",
                   *[("weather_search", {"city": c, "date": tomorrow}) for c in cities])
  ranked, = s.step("I will sort them by high temperature.",
                   ("sort_list", {"items": reports, "key": "high_c", "descending": True}))
  top = ranked[0]
  s.finish(f"{top['city']} will be the warmest, with a high of {top['high_c']} °C.")
  return question, string(top["city"], cities), s


@template("flight_tomorrow_in_currency", 3)
def flight_tomorrow_in_currency(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  a, b = g.sample(g.cities(), 2)
  origin_currency = g.world.countries[g.world.cities[a].country].currency
  target = g.pick([c for c in sorted(g.world.fx_base) if c != origin_currency])
  question = f"How much does the cheapest flight from {a} to {b} tomorrow cost in {target}?"
  s = g.solver()
  s.step("I need today's date to know which day tomorrow is.", CONTEXT)
  found, = s.step("Now tomorrow's flights.",
                  ("flights_search", {"origin": a, "destination": b,
                                      "date": g.day(1).isoformat()}))
  require(len(found["flights"]) >= 2, "no choice of flights on this route")
  best = cheapest(found["flights"])
  out, = s.step(f"The cheapest is {best['flight_number']} at {best['price']} {best['currency']}; "
                f"I will convert it to {target}.",
                ("conversion_calculation", {"value": best["price"],
                                            "from_unit": best["currency"], "to_unit": target}))
  s.finish(f"The cheapest flight, {best['flight_number']}, costs about {out['result']} {target}.")
  return question, number(out["result"]), s


@template("top_team_next_match", 3)
def top_team_next_match(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  league = g.pick(sorted(g.world.leagues))
  teams = g.sample(g.world.leagues[league], 3)
  summaries = [series.team_summary(g.world, g.world.teams[t], g.today) for t in teams]
  require(_unique_top([{"p": x["record"]["points"]} for x in summaries], "p"), "tie on points")
  require(all(x["next_match"] for x in summaries), "a season is over")
  question = (f"Of {teams[0]}, {teams[1]} and {teams[2]}, which team has the most points this "
              "season, and how many days is it until that team's next match?")
  s = g.solver()
  now, *found = s.step("I need today's date and the three teams' records.", CONTEXT,
                       *[("sports_search", {"team": t}) for t in teams])
  ranked, = s.step("I will sort the teams by points.",
                   ("sort_list", {"items": found, "key": "record.points", "descending": True}))
  top = ranked[0]
  out, = s.step(f"{top['team']} leads; its next match is on {top['next_match']['date']}.",
                ("timestamp_interval_calculator", {"start": now["date"],
                                                   "end": top["next_match"]["date"]}))
  s.finish(f"{top['team']} has the most points ({top['record']['points']} points); its next "
           f"match is in {out['days']} days.")
  return question, all_of(string(top["team"], teams), number(out["days"], rel_tol=0.0)), s


# -- Difficulty 4 ---------------------------------------------------------------

def _filter_matters(reports: list[dict[str, Any]]) -> bool:
  """At least two dry cities with a unique warmest, and the overall warmest is wet."""
  dry = [r for r in reports if r["precipitation_mm"] == 0]
  top = max(reports, key=lambda r: r["high_c"])
  return (len(dry) >= 2 and _unique_top(dry, "high_c") and _unique_top(reports, "high_c")
          and top["precipitation_mm"] > 0)


@template("dry_warmest_tomorrow", 4)
def dry_warmest_tomorrow(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  for _ in range(_TRIES):
    cities = g.sample(g.cities(), 4)
    if _filter_matters(_forecasts(g, cities)):
      break
  else:
    require(False, "no city set where the filter matters")
  names = f"{cities[0]}, {cities[1]}, {cities[2]} and {cities[3]}"
  question = f"Of {names}, which will be the warmest tomorrow among those that stay dry?"
  s = g.solver()
  s.step("I need today's date to know which day tomorrow is.", CONTEXT)
  reports = s.step("The four forecasts are independent.",
                   *[("weather_search", {"city": c, "date": g.day(1).isoformat()})
                     for c in cities])
  dry, = s.step("I keep the cities without precipitation.",
                ("filter_list", {"items": reports, "key": "precipitation_mm", "operator": "==",
                                 "value": 0}))
  ranked, = s.step("Now I sort the dry ones by high temperature.",
                   ("sort_list", {"items": dry, "key": "high_c", "descending": True}))
  top = ranked[0]
  s.finish(f"{top['city']} will be the warmest dry city, with a high of {top['high_c']} °C.")
  return question, string(top["city"], cities), s


@template("cheapest_flight_from_home", 4)
def cheapest_flight_from_home(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  dest = g.pick(g.cities(exclude=[g.home.name]))
  home_currency = g.world.countries[g.home.country].currency
  target = g.pick([c for c in sorted(g.world.fx_base) if c != home_currency])
  question = (f"I'm flying from here to {dest} tomorrow. How much does the cheapest flight "
              f"cost in {target}?")
  s = g.solver()
  now, = s.step("I need the user's city and tomorrow's date.", CONTEXT)
  found, = s.step(f"The user is in {now['city']}; I will search tomorrow's flights.",
                  ("flights_search", {"origin": now["city"], "destination": dest,
                                      "date": g.day(1).isoformat()}))
  require(len(found["flights"]) >= 2, "no choice of flights on this route")
  ranked, = s.step("I will sort the flights by price.",
                   ("sort_list", {"items": found["flights"], "key": "price"}))
  best = ranked[0]
  out, = s.step(f"The cheapest costs {best['price']} {best['currency']}; now in {target}.",
                ("conversion_calculation", {"value": best["price"],
                                            "from_unit": best["currency"], "to_unit": target}))
  s.finish(f"The cheapest flight, {best['flight_number']}, costs about {out['result']} {target}.")
  return question, number(out["result"]), s


@template("stock_change_converted", 4)
def stock_change_converted(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  require(1 <= g.today.weekday() <= 4, "today or yesterday is not a trading day")
  company = g.world.companies[g.pick(sorted(g.world.companies))]
  target = g.pick([c for c in sorted(g.world.fx_base) if c != company.currency])
  question = (f"How much higher or lower did {company.name} stock open today than it closed "
              f"yesterday, in {target}?")
  s = g.solver()
  s.step("I need today's date to know which day yesterday was.", CONTEXT)
  today, yesterday = s.step("Today's and yesterday's quotes are independent.",
                            ("stocks_search", {"symbol": company.ticker}),
                            ("stocks_search", {"symbol": company.ticker,
                                               "date": g.day(-1).isoformat()}))
  diff, = s.step("The change is today's open minus yesterday's close.",
                 ("math_calculation", {"expression": f"{today['open']} - {yesterday['close']}"}))
  out, = s.step(f"That is {diff['result']} {company.currency}; I will convert it to {target}.",
                ("conversion_calculation", {"value": diff["result"],
                                            "from_unit": company.currency, "to_unit": target}))
  direction = "higher" if diff["result"] >= 0 else "lower"
  s.finish(f"It opened {abs(out['result'])} {target} {direction} than yesterday's close.")
  return question, number(out["result"], absolute=True), s


# -- Difficulty 5 ---------------------------------------------------------------

@template("hq_dry_warmest_fahrenheit", 5)
def hq_dry_warmest_fahrenheit(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  for _ in range(_TRIES):
    companies = [g.world.companies[c] for c in g.sample(sorted(g.world.companies), 3)]
    hqs = [c.headquarters for c in companies]
    if len(set(hqs)) == 3 and _filter_matters(_forecasts(g, hqs)):
      break
  else:
    require(False, "no company set where the filter matters")
  names = f"{companies[0].name}, {companies[1].name} and {companies[2].name}"
  question = (f"Among the headquarters cities of {names}, which will be the warmest tomorrow "
              "without rain or snow, and what will its high be in Fahrenheit?")
  s = g.solver()
  _, *infos = s.step("I need tomorrow's date and the three headquarters.", CONTEXT,
                     *[("knowledge_search", {"query": c.name}) for c in companies])
  reports = s.step("Now tomorrow's forecasts for those cities.",
                   *[("weather_search", {"city": i["headquarters"],
                                         "date": g.day(1).isoformat()}) for i in infos])
  dry, = s.step("I keep the cities without precipitation.",
                ("filter_list", {"items": reports, "key": "precipitation_mm", "operator": "==",
                                 "value": 0}))
  ranked, = s.step("I sort the dry cities by high temperature.",
                   ("sort_list", {"items": dry, "key": "high_c", "descending": True}))
  top = ranked[0]
  out, = s.step(f"{top['city']} is the warmest dry one at {top['high_c']} °C; in Fahrenheit:",
                ("conversion_calculation", {"value": top["high_c"], "from_unit": "C",
                                            "to_unit": "F"}))
  s.finish(f"{top['city']} will be the warmest dry headquarters city tomorrow, with a high of "
           f"{out['result']} °F.")
  return question, all_of(string(top["city"], hqs), number(out["result"])), s


def _affordable_cutoff(flights: list[dict[str, Any]]) -> int | None:
  """A fare cap that keeps at least two flights and drops the earliest one, else None."""
  earliest = min(flights, key=lambda f: f["departure_local"])
  for cap in sorted(f["price"] for f in flights):
    kept = [f for f in flights if f["price"] <= cap]
    if len(kept) >= 2 and earliest["price"] > cap:
      return cap
  return None


@template("affordable_flight_landing_home_time", 5)
def affordable_flight_landing_home_time(g: Gen) -> tuple[str, dict[str, Any], Solver]:
  home: City = g.home
  for _ in range(_TRIES):
    landmark = g.world.landmarks[g.pick(sorted(g.world.landmarks))]
    dest = g.world.cities[landmark.city]
    if dest.name == home.name or dest.utc_offset_min == home.utc_offset_min:
      continue
    flights = series.flights(g.world, home, dest, g.day(1))
    cap = _affordable_cutoff(flights) if len(flights) >= 3 else None
    if cap is not None:
      break
  else:
    require(False, "no destination where the fare cap matters")
  currency = g.world.countries[home.country].currency
  question = (f"Tomorrow I want to fly from here to the city where {landmark.name} stands, on "
              f"the earliest flight that costs at most {cap} {currency}. What time will it be "
              "back home when I land?")
  s = g.solver()
  now, info = s.step("I need the user's city, tomorrow's date and the landmark's city.",
                     CONTEXT, ("knowledge_search", {"query": landmark.name}))
  found, = s.step(f"{landmark.name} is in {info['city']}; I will search tomorrow's flights.",
                  ("flights_search", {"origin": now["city"], "destination": info["city"],
                                      "date": g.day(1).isoformat()}))
  kept, = s.step(f"I keep the flights costing at most {cap} {currency}.",
                 ("filter_list", {"items": found["flights"], "key": "price", "operator": "<=",
                                  "value": cap}))
  ranked, = s.step("I sort them by departure time.",
                   ("sort_list", {"items": kept, "key": "departure_local"}))
  flight = ranked[0]
  out, = s.step(f"{flight['flight_number']} lands at {flight['arrival_local']} local time; "
                "I will convert that to the user's time zone.",
                ("timestamp_converter", {"timestamp": flight["arrival_local"],
                                         "from_timezone": info["city"],
                                         "to_timezone": now["timezone"]}))
  s.finish(f"Take {flight['flight_number']}; it will be {out['time']} at home when you land.")
  return question, time_answer(out["time"]), s
