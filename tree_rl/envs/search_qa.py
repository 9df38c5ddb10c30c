"""Multi-hop question answering over a generated encyclopedia, with a BM25 search tool.

A seeded world holds fictional countries, cities, rivers, universities, companies and
people whose names are built from random syllables, so no pretrained knowledge can answer
for the model. Each entity has a short encyclopedic document stating its attributes and
its forward relations (a person's birthplace, a company's founder, a city's country, ...).
A question follows 2-4 relations from an anchor entity ("In which country is the city
where the founder of Zorvex Labs was born?"): every hop needs one search of the entity
named by the previous hop. Only the `search` tool is offered (BM25 via bm25s, built once
per world and cached); documents are short enough that search results show them whole.

Splits share the world but not their anchors: an entity anchors questions of one split
only (a stable hash decides), so train and eval never share a question or an answer chain
start. The reward is SQuAD-style exact match or token F1 of the final <answer> against
the answer and its aliases.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
import re
import string
from collections.abc import Sequence
from typing import Any

import bm25s
import numpy as np

from tree_rl.envs.base import Message, Outcome, Task, Tool, render_tool_output, render_tool_prompt
from tree_rl.envs.parsing import format_tool_call, parse_step

REWARDS = ("em", "f1")
PREAMBLE = (
    "Answer the question with the search tool over an encyclopedia of fictional people, "
    "places and organisations. The facts exist only in this encyclopedia, so search instead "
    "of guessing. Questions take several searches: use each name you find in the results to "
    "search for the next fact.")
FINISH = ("When you know the answer, reply without a tool call and give only the answer (a "
          "name, a year or a number) inside <answer></answer>.")
SEARCH_SCHEMA = {"type": "object", "required": ["query"], "properties": {
    "query": {"type": "string", "description": "Keywords, e.g. a name and the fact you need."},
    "top_k": {"type": "integer", "minimum": 1, "maximum": 10, "default": 3,
              "description": "Number of documents to return (1-10, default 3)."}}}

# Edges: (source type, key) -> (target type or None for an attribute, noun phrase used
# inside a longer question, question when it is the last hop, search keyword).
EDGES: dict[tuple[str, str], tuple[str | None, str, str, str]] = {
    ("person", "born_in"): ("city", "the city where {x} was born",
                            "In which city was {x} born?", "born"),
    ("person", "studied_at"): ("university", "the university where {x} studied",
                               "At which university did {x} study?", "studied"),
    ("person", "birth_year"): (None, "", "In what year was {x} born?", "born"),
    ("person", "occupation"): (None, "", "What is the occupation of {x}?", "occupation"),
    ("company", "founded_by"): ("person", "the founder of {x}", "Who founded {x}?", "founded"),
    ("company", "headquartered_in"): ("city", "the city where {x} is headquartered",
                                      "In which city is {x} headquartered?", "headquartered"),
    ("company", "founded_year"): (None, "", "In what year was {x} founded?", "founded"),
    ("company", "industry"): (None, "", "In which industry does {x} operate?", "industry"),
    ("university", "located_in"): ("city", "the city where {x} is located",
                                   "In which city is {x} located?", "located"),
    ("university", "founded_year"): (None, "", "In what year was {x} founded?", "founded"),
    ("city", "country"): ("country", "the country of {x}", "In which country is {x}?", "country"),
    ("city", "river"): ("river", "the river that flows through {x}",
                        "Which river flows through {x}?", "river"),
    ("city", "founded_year"): (None, "", "In what year was {x} founded?", "founded"),
    ("country", "capital"): ("city", "the capital of {x}", "What is the capital of {x}?",
                             "capital"),
    ("country", "currency"): (None, "", "What is the currency of {x}?", "currency"),
    ("river", "source_country"): ("country", "the country where {x} rises",
                                  "In which country does {x} rise?", "rises"),
    ("river", "length_km"): (None, "", "How long is {x}, in kilometres?", "long"),
}
_LABELS = {"born_in": "birthplace", "studied_at": "university", "birth_year": "birth year",
           "occupation": "occupation", "founded_by": "founder", "headquartered_in": "headquarters",
           "founded_year": "founding year", "industry": "industry", "located_in": "location",
           "country": "country", "river": "river", "capital": "capital", "currency": "currency",
           "source_country": "source", "length_km": "length"}
OCCUPATIONS = ("architect", "chemist", "novelist", "sculptor", "astronomer", "surgeon",
               "economist", "composer", "engineer", "botanist")
INDUSTRIES = ("shipping", "robotics", "textiles", "banking", "mining", "publishing",
              "aviation", "pharmaceuticals", "agriculture", "software")


@dataclasses.dataclass
class Entity:
  """One encyclopedia entry: relations hold entity names, attributes plain values."""

  name: str
  kind: str
  facts: dict[str, Any] = dataclasses.field(default_factory=dict)
  aliases: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- world


def _words(rng: random.Random):
  """An endless stream of distinct invented words (2-3 syllables, no English stopword)."""
  onsets = ("b d f g k l m n p r s t v z br dr kr tr st gl pl th sh").split()
  vowels = ("a e i o u ai ei ou").split()
  codas = ("", "", "n", "r", "l", "s", "x", "th", "m")
  seen = set(bm25s.stopwords.STOPWORDS_EN)
  while True:
    syllables = [rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 3))]
    word = ("".join(syllables) + rng.choice(codas)).capitalize()
    if len(word) >= 4 and word.lower() not in seen:
      seen.add(word.lower())
      yield word


def _a(word: str) -> str:
  return ("an " if word[0] in "aeiou" else "a ") + word


def _describe(e: Entity) -> str:
  """The entity's document: its attributes and forward relations, its name repeated so
  that a search for the name ranks this document above those that merely mention it."""
  f, n = e.facts, e.name
  if e.kind == "person":
    last = n.split()[-1]
    return (f"{n} is {_a(f['occupation'])} born in {f['birth_year']} in {f['born_in']}. "
            f"{last} studied at {f['studied_at']}.")
  if e.kind == "company":
    return (f"{n} is {_a(f['industry'])} company founded in {f['founded_year']} by "
            f"{f['founded_by']}. {n} is headquartered in {f['headquartered_in']}.")
  if e.kind == "university":
    return (f"{n} is a university located in {f['located_in']}. {n} was founded in "
            f"{f['founded_year']}.")
  if e.kind == "city":
    river = f" The {f['river']} flows through {n}." if "river" in f else ""
    return f"{n} is a city in {f['country']}. {n} was founded in {f['founded_year']}.{river}"
  if e.kind == "country":
    return (f"{n} is a country whose capital is {f['capital']}. The currency of {n} is the "
            f"{f['currency']}.")
  return (f"The {n} is a river that rises in {f['source_country']}. The {n} is "
          f"{f['length_km']} kilometres long.")


def make_entities(seed: int, num_entities: int) -> list[Entity]:
  """The world's entities, deterministic in (seed, num_entities)."""
  if num_entities < 40:
    raise ValueError(f"num_entities must be >= 40, got {num_entities}")
  rng = random.Random(f"search_qa-world:{seed}:{num_entities}")
  words = _words(rng)
  counts = {"country": max(3, num_entities // 15), "city": max(6, num_entities // 5),
            "university": max(3, num_entities // 10), "river": max(3, num_entities // 12),
            "company": max(4, num_entities // 7)}
  counts["person"] = num_entities - sum(counts.values())
  countries = [Entity(next(words), "country", {"currency": next(words).lower()})
               for _ in range(counts["country"])]
  rivers = [Entity(f"{next(words)} River", "river",
                   {"source_country": rng.choice(countries).name,
                    "length_km": rng.randint(40, 3000)}) for _ in range(counts["river"])]
  cities = []
  for i in range(counts["city"]):
    country = countries[i % len(countries)]  # every country gets a city (its capital)
    facts = {"country": country.name, "founded_year": rng.randint(800, 1800)}
    if rng.random() < 0.5:
      facts["river"] = rng.choice(rivers).name
    cities.append(Entity(next(words), "city", facts))
  for country in countries:
    country.facts["capital"] = rng.choice([c.name for c in cities
                                           if c.facts["country"] == country.name])
  universities = [Entity(f"{next(words)} {rng.choice(('University', 'Institute', 'College'))}",
                         "university", {"located_in": rng.choice(cities).name,
                                        "founded_year": rng.randint(1500, 1950)})
                  for _ in range(counts["university"])]
  people = [Entity(f"{next(words)} {next(words)}", "person",
                   {"born_in": rng.choice(cities).name, "studied_at": rng.choice(universities).name,
                    "birth_year": rng.randint(1900, 1990), "occupation": rng.choice(OCCUPATIONS)})
            for _ in range(counts["person"])]
  companies = []
  for _ in range(counts["company"]):
    founder = rng.choice(people)
    companies.append(Entity(
        f"{next(words)} {rng.choice(('Labs', 'Holdings', 'Industries', 'Systems', 'Works'))}",
        "company", {"founded_by": founder.name, "headquartered_in": rng.choice(cities).name,
                    "founded_year": founder.facts["birth_year"] + rng.randint(20, 45),
                    "industry": rng.choice(INDUSTRIES)}))
  for e in universities + companies + rivers:  # the distinctive first word alone
    e.aliases = (e.name.split()[0],)
  return countries + rivers + cities + universities + people + companies


class World:
  """The entities, their documents and a BM25 index over them."""

  def __init__(self, seed: int, num_entities: int):
    self.seed, self.num_entities = seed, num_entities
    self.entities = {e.name: e for e in make_entities(seed, num_entities)}
    self.names = list(self.entities)
    self.docs = [{"title": n, "text": _describe(self.entities[n])} for n in self.names]
    corpus = [f"{d['title']}. {d['text']}" for d in self.docs]
    self._retriever = bm25s.BM25()
    self._retriever.index(_tokenize(corpus), show_progress=False)

  def search(self, query: str, top_k: int = 3) -> list[dict[str, str]]:
    """The `top_k` best documents for `query` with a positive score, ties by corpus order."""
    if not isinstance(query, str) or not query.strip():
      raise ValueError("query must be a non-empty string")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 10:
      raise ValueError(f"top_k must be an integer from 1 to 10, got {top_k!r}")
    vocab = self._retriever.vocab_dict
    tokens = [t for t in _tokenize([query])[0] if t in vocab]
    if not tokens:
      return []
    scores = np.asarray(self._retriever.get_scores(tokens), dtype=np.float64)
    order = np.lexsort((np.arange(len(scores)), -scores))[:top_k]  # stable: lowest index first
    return [dict(self.docs[i]) for i in order if scores[i] > 0]


def _tokenize(texts: list[str]) -> list[list[str]]:
  return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


@functools.lru_cache(maxsize=8)
def load_world(seed: int, num_entities: int) -> World:
  """The cached world of (seed, num_entities); building it indexes the corpus once."""
  return World(seed, num_entities)


# ----------------------------------------------------------------------------- answers

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
  """SQuAD normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
  text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
  return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
  """1.0 when the normalised prediction equals a normalised gold answer."""
  pred = normalize_answer(prediction)
  return float(any(pred == normalize_answer(g) for g in golds))


def token_f1(prediction: str, golds: Sequence[str]) -> float:
  """The best SQuAD token F1 of the prediction against the gold answers."""
  pred = normalize_answer(prediction).split()
  best = 0.0
  for gold in golds:
    ref = normalize_answer(gold).split()
    common = sum(min(pred.count(t), ref.count(t)) for t in set(pred))
    if common:
      precision, recall = common / len(pred), common / len(ref)
      best = max(best, 2 * precision * recall / (precision + recall))
  return best


# ----------------------------------------------------------------------------- questions


def _chains(world: World, anchors: Sequence[str], hops: int) -> list[tuple[str, tuple[str, ...]]]:
  """Every (anchor, edge keys) path of `hops` edges visiting distinct entities."""
  out = []

  def walk(anchor: str, name: str, keys: tuple[str, ...], visited: frozenset[str]):
    entity = world.entities[name]
    for (kind, key), (target, *_) in EDGES.items():
      if kind != entity.kind or key not in entity.facts:
        continue
      if target is not None and entity.facts[key] in visited:
        continue  # a loop back would name the answer in the question
      if len(keys) + 1 == hops:
        out.append((anchor, keys + (key,)))
      elif target is not None:
        nxt = entity.facts[key]
        walk(anchor, nxt, keys + (key,), visited | {nxt})

  for anchor in anchors:
    walk(anchor, anchor, (), frozenset([anchor]))
  return out


def _in_split(seed: int, name: str) -> str:
  """A stable 80/20 train/eval assignment of anchor entities."""
  digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
  return "eval" if digest[0] % 5 == 0 else "train"


class SearchQAFamily:
  """Multi-hop QA over a fictional encyclopedia, answered with BM25 `search` calls."""

  name = "search_qa"
  max_turns = 6

  def __init__(self, num_entities: int = 200, hops: Sequence[int] = (2, 3),
               reward: str = "em", world_seed: int = 0):
    """Args:
      num_entities: size of the world (>= 40).
      hops: the numbers of relations a question may follow (each in 1..4); a question of
        h hops takes h searches, so 4 hops still fit max_turns with the answer step.
      reward: "em" (exact match) or "f1" (token F1); `correct` is exact match either way.
      world_seed: the seed of the world; both splits share it.
    """
    if reward not in REWARDS:
      raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    if not hops or any(h not in (1, 2, 3, 4) for h in hops):
      raise ValueError(f"hops must be a non-empty subset of 1..4, got {hops}")
    self.num_entities, self.hops = num_entities, tuple(sorted(set(hops)))
    self.reward, self.world_seed = reward, world_seed
    self.world = load_world(world_seed, num_entities)

  def _search_tool(self, world: World) -> Tool:
    return Tool(name="search", parameters=SEARCH_SCHEMA, fn=world.search,
                description="Search the encyclopedia; returns the title and text of the best "
                            "matching documents.")

  def _world(self, task: Task) -> World:
    return load_world(task.metadata["world_seed"], task.metadata["num_entities"])

  def tools(self, task: Task) -> list[Tool]:
    """The search tool over the task's world."""
    return [self._search_tool(self._world(task))]

  def generate(self, split: str, num_tasks: int, seed: int) -> list[Task]:
    """`num_tasks` distinct questions of `split`, hop counts drawn uniformly from `hops`."""
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    world = self.world
    anchors = [n for n in world.names if _in_split(self.world_seed, n) == split]
    rng = random.Random(f"search_qa:{split}:{seed}")
    pools = {}
    for h in self.hops:
      pools[h] = _chains(world, anchors, h)
      rng.shuffle(pools[h])
    tasks: list[Task] = []
    while len(tasks) < num_tasks:
      open_hops = [h for h in self.hops if pools[h]]
      if not open_hops:
        raise ValueError(f"the {split} split of this world has only {len(tasks)} questions "
                         f"with hops {self.hops}; asked for {num_tasks}")
      anchor, keys = pools[rng.choice(open_hops)].pop()
      task = self._task(world, split, f"search_qa/{split}/{seed}/{len(tasks)}", anchor, keys)
      if task is not None:
        tasks.append(task)
    return tasks

  def _task(self, world: World, split: str, task_id: str, anchor: str,
            keys: tuple[str, ...]) -> Task | None:
    """The task of one chain, or None when search cannot reach one of its documents."""
    names, phrase = [anchor], anchor
    for key in keys[:-1]:
      entity = world.entities[names[-1]]
      phrase = EDGES[(entity.kind, key)][1].format(x=phrase)
      names.append(entity.facts[key])
    last = world.entities[names[-1]]
    _, _, question, _ = EDGES[(last.kind, keys[-1])]
    question = question.format(x=phrase)
    value = last.facts[keys[-1]]
    target = world.entities.get(value) if isinstance(value, str) else None
    answer = str(value)
    aliases = (answer,) + (target.aliases if target else ())
    if keys[-1] == "length_km":
      aliases += (f"{value} km", f"{value} kilometres", f"{value} kilometers")
    oracle = self._oracle(world, names, keys, answer)
    if oracle is None:
      return None
    tool = self._search_tool(world)
    system = render_tool_prompt([tool], PREAMBLE, FINISH)
    return Task(task_id=task_id, family=self.name, split=split,
                messages=({"role": "system", "content": system},
                          {"role": "user", "content": question}),
                tool_names=("search",), answer={"answer": answer, "aliases": list(aliases)},
                oracle=oracle, difficulty=len(keys),
                metadata={"world_seed": self.world_seed, "num_entities": self.num_entities,
                          "chain": names, "relations": list(keys)})

  def _oracle(self, world: World, names: Sequence[str], keys: Sequence[str],
              answer: str) -> tuple[Message, ...] | None:
    """One verified search per hop, then the answer; None if a document is unreachable."""
    messages: list[Message] = []
    for name, key in zip(names, keys):
      kind = world.entities[name].kind
      keyword = EDGES[(kind, key)][3]
      found = None
      for query in (f"{name} {keyword}", name):  # the plain name is the fallback
        for top_k in (3, 5, 10):
          hits = world.search(query, top_k)
          if any(h["title"] == name for h in hits):
            found = (query, top_k, hits)
            break
        if found:
          break
      if found is None:
        return None
      query, top_k, hits = found
      args = {"query": query} if top_k == 3 else {"query": query, "top_k": top_k}
      think = f"<think>I need the {_LABELS[key]} of {name}, so I search for it.</think>\n"
      messages.append({"role": "assistant", "content": think + format_tool_call("search", args)})
      messages.append({"role": "tool", "name": "search", "content": render_tool_output(hits)})
    think = f"<think>The documents give the answer: {answer}.</think>\n"
    messages.append({"role": "assistant", "content": f"{think}<answer>{answer}</answer>"})
    return tuple(messages)

  def score(self, task: Task, episode: Sequence[Message], truncated: bool) -> Outcome:
    """EM / F1 of the last step's answer; a truncated episode or no answer scores 0."""
    steps = [m for m in episode[len(task.messages):] if m.get("role") == "assistant"]
    parsed = parse_step(steps[-1].get("content") or "") if steps else None
    if truncated or parsed is None or parsed.num_tool_call_blocks or not parsed.answer:
      return Outcome(reward=0.0, correct=False, answered=False,
                     details={"em": 0.0, "f1": 0.0, "prediction": None})
    golds = [task.answer["answer"], *task.answer["aliases"]]
    em, f1 = exact_match(parsed.answer, golds), token_f1(parsed.answer, golds)
    return Outcome(reward=em if self.reward == "em" else f1, correct=em == 1.0, answered=True,
                   details={"em": em, "f1": f1, "prediction": parsed.answer})
