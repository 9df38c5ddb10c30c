"""The tool world's rule-based answer verifier, case by case."""

from __future__ import annotations

import pytest

from tree_rl.envs.toolworld import verify
from tree_rl.envs.toolworld.oracle import all_of, date_answer, number, string, time_answer, yes_no


@pytest.mark.parametrize("truth, text, ok", [
    (number(541.3), "The drive is 541.3 km.", True),
    (number(541.3), "roughly 541 km", True),  # the answer's own precision
    (number(14.5, rel_tol=0.01), "28.5 Celsius, 14 days ahead", False),  # a tie rounds up
    (number(14.5, rel_tol=0.01), "about 15 degrees", False),  # 15 is 3.4% off, and a tie
    (number(14.46, rel_tol=0.01), "about 14 degrees", True),
    (number(541.3), "about 536 km", True),  # within 1%
    (number(541.3), "about 530 km", False),
    (number(1234567), "about 1.23 million people", True),
    (number(1234567), "1,234,567 inhabitants", True),
    (number(-3.2), "The high will be -3.2 °C", True),
    (number(-3.2), "The high will be 3.2 °C", False),
    (number(-12.5, absolute=True), "revenue fell by 12.5%", True),
    (number(48, rel_tol=0.0), "In 48 days (on 2025-08-01).", True),
    (number(48, rel_tol=0.0), "In 47 days.", False),
    (number(14, rel_tol=0.0), "On 2025-06-14 at 14:00 there are 3 days left.", False),
    # Hedging over many values is not an answer.
    (number(541.3), "It is " + ", ".join(str(k) for k in range(530, 560)) + " km.", False),
])
def test_numbers(truth, text, ok):
  assert verify.matches(truth, text) == ok


@pytest.mark.parametrize("truth, text, ok", [
    (string("Mara Quint"), "It was founded by mara quint.", True),
    (string("Mara Quint"), "It was founded by Mara Quinton.", False),
    (string("Lunhaven Lions", ["Lunhaven Lions", "Frostvik Rovers"]),
     "Lunhaven Lions beat Frostvik Rovers 3-1.", True),
    (string("Lunhaven Lions", ["Lunhaven Lions", "Frostvik Rovers"]),
     "Frostvik Rovers won against the Lunhaven Lions.", False),
    (yes_no(True), "Yes, it opened at 162.3 EUR.", True),
    (yes_no(True), "No: it opened lower. Yes, really.", False),
    (yes_no(False), "It did not; no.", True),
    (yes_no(True), "It opened at 162.3 EUR.", False),
    (date_answer("2025-05-12"), "It falls on May 12th, 2025.", True),
    (date_answer("2025-05-12"), "12 May 2025", True),
    (date_answer("2025-05-12"), "2025-05-12", True),
    (date_answer("2025-05-12"), "May 13, 2025", False),
    (time_answer("14:30"), "It is 2:30 pm there.", True),
    (time_answer("14:30"), "It is 14:30.", True),
    (time_answer("14:30"), "It is 2:30 am there.", False),
    (time_answer("00:15"), "12:15 a.m.", True),
    (time_answer("14:30"), " or ".join(f"{h}:30" for h in range(24)), False),
    ({"type": "list", "value": ["A B", "C"], "ordered": True}, "First a b, then c.", True),
    ({"type": "list", "value": ["A B", "C"], "ordered": True}, "First c, then a b.", False),
    (all_of(string("Bellarosa"), number(50.36)), "Bellarosa, with a high of 50.4 °F.", True),
    (all_of(string("Bellarosa"), number(50.36)), "Verano, with a high of 50.4 °F.", False),
])
def test_typed_answers(truth, text, ok):
  assert verify.matches(truth, text) == ok


@pytest.mark.parametrize("text, unable", [
    ("I am unable to answer this question.", True),
    ("I couldn't find the weather for that city.", True),
    ("Sorry, I do not have enough information.", True),
    ("No data is available for that date.", True),
    ("The drive is 541.3 km.", False),
    ("No, it will stay dry.", False),
])
def test_unable_to_answer(text, unable):
  assert verify.is_unable(text) == unable
