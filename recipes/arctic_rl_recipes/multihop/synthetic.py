"""A synthetic two-hop QA data set written in HotpotQA's (distractor) format, for tiny models and tests.

Each question needs two paragraphs (a person's birth city, then that city's
country); the other paragraphs are distractors about other people and cities.
Output: `train.json` and `dev.json`, lists of HotpotQA records.
"""

from __future__ import annotations

import json
import os
import random

from pydantic import BaseModel, ConfigDict, Field

_FIRST = ["ada", "boris", "clara", "dmitri", "elena", "felix", "greta", "hugo", "ines", "jonas", "kira", "luca",
          "maya", "nils", "olga", "pavel", "rosa", "sven", "tina", "umar", "vera", "wim", "xenia", "yuri", "zora"]
_LAST = ["berg", "costa", "dahl", "eriksen", "fontaine", "garcia", "holm", "ivanov", "jensen", "kowalski"]
_CITIES = {"lyon": "france", "nice": "france", "porto": "portugal", "braga": "portugal", "turin": "italy",
           "genoa": "italy", "bergen": "norway", "tromso": "norway", "graz": "austria", "linz": "austria",
           "ghent": "belgium", "bruges": "belgium", "malmo": "sweden", "uppsala": "sweden"}


class SyntheticQAConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    train_questions: int = Field(1000, ge=1)
    eval_questions: int = Field(128, ge=1)
    distractors: int = Field(6, ge=0)
    """Distractor paragraphs per question besides the two supporting ones."""


def _record(qid: str, person: str, city: str, people: dict[str, str], rng: random.Random, distractors: int) -> dict:
    country = _CITIES[city]
    supporting = [(person.title(), [f"{person.title()} was born in {city.title()}.", f"{person.title()} worked as a teacher."]),
                  (city.title(), [f"{city.title()} is a city in {country.title()}."])]
    others = [p for p in people if p != person]
    pool = [(p.title(), [f"{p.title()} was born in {people[p].title()}."]) for p in rng.sample(others, k=min(len(others), distractors))]
    pool += [(c.title(), [f"{c.title()} is a city in {_CITIES[c].title()}."]) for c in rng.sample([c for c in _CITIES if c != city], k=distractors // 2)]
    context = supporting + rng.sample(pool, k=min(len(pool), distractors))
    rng.shuffle(context)
    return {
        "_id": qid,
        "question": f"In which country was {person.title()} born?",
        "answer": country.title(),
        "supporting_facts": [[person.title(), 0], [city.title(), 0]],
        "context": [[title, sentences] for title, sentences in context],
        "type": "bridge",
        "level": "easy",
    }


def generate_multihop(out_dir: str, config: SyntheticQAConfig | None = None) -> dict[str, str]:
    """Write the data set under `out_dir`; return the paths the HotpotQA loader takes."""
    config = config or SyntheticQAConfig()
    rng = random.Random(config.seed)
    names = [f"{first} {last}" for first in _FIRST for last in _LAST]
    people = {name: rng.choice(list(_CITIES)) for name in names}
    wanted = config.train_questions + config.eval_questions
    # Held-out questions ask about people never asked about in training.
    asked = rng.sample(names, k=min(len(names), wanted))
    records = [_record(f"syn-{i}", person, people[person], people, rng, config.distractors)
               for i, person in enumerate(asked)]
    while len(records) < wanted:  # more questions than people: repeat training people with new distractors
        person = rng.choice(asked[config.eval_questions:])
        records.append(_record(f"syn-{len(records)}", person, people[person], people, rng, config.distractors))
    os.makedirs(out_dir, exist_ok=True)
    paths = {"train": os.path.join(out_dir, "train.json"), "eval": os.path.join(out_dir, "dev.json")}
    for split, chunk in (("train", records[config.eval_questions:]), ("eval", records[: config.eval_questions])):
        with open(paths[split], "w") as f:
            json.dump(chunk, f, indent=1)
    return paths
