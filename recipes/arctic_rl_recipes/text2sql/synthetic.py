"""A synthetic text-to-SQL data set written in BIRD's format, for tiny models and tests.

Several small databases (DDL + rows in real SQLite files) and questions made from
templates with their gold SQL. The output is exactly what the BIRD loader reads:
`train.json` and `dev.json` (question records) and `databases/<db_id>/<db_id>.sqlite`.
The held-out split (`dev.json`) holds question/SQL pairs that never occur in training.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class SyntheticSQLConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    databases: int = Field(4, ge=1, le=len(("shop", "school", "library", "clinic")))
    rows_per_table: int = Field(24, ge=4)
    train_questions: int = Field(460, ge=1)
    eval_questions: int = Field(200, ge=1)


@dataclass(frozen=True)
class Table:
    name: str
    label: str  # the words a question uses for the table's rows
    key: str  # the column questions list
    text: dict[str, list[str]]  # text column -> values
    numbers: dict[str, tuple[int, int]]  # numeric column -> value range


_SCHEMAS: dict[str, list[Table]] = {
    "shop": [
        Table("customers", "customers", "name",
              {"name": ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"],
               "city": ["paris", "berlin", "rome", "madrid", "oslo"]},
              {"age": (18, 70), "points": (0, 500)}),
        Table("products", "products", "title",
              {"title": ["lamp", "chair", "desk", "sofa", "shelf", "clock", "rug", "mirror"],
               "category": ["home", "office", "garden"]},
              {"price": (5, 400), "stock": (0, 90)}),
    ],
    "school": [
        Table("students", "students", "name",
              {"name": ["ivan", "judy", "karl", "lena", "mike", "nina", "omar", "pia"],
               "city": ["paris", "berlin", "rome", "madrid", "oslo"]},
              {"age": (10, 19), "grade": (1, 12)}),
        Table("courses", "courses", "title",
              {"title": ["math", "art", "music", "biology", "history", "physics", "latin", "drama"],
               "teacher": ["smith", "jones", "brown", "lee"]},
              {"credits": (1, 8), "hours": (10, 60)}),
    ],
    "library": [
        Table("books", "books", "title",
              {"title": ["dune", "emma", "ulysses", "beloved", "hamlet", "ivanhoe", "walden", "rebecca"],
               "genre": ["novel", "drama", "poetry", "essay"]},
              {"year": (1800, 2020), "pages": (90, 900)}),
        Table("members", "members", "name",
              {"name": ["quinn", "rosa", "sam", "tara", "uma", "vic", "wes", "xena"],
               "city": ["paris", "berlin", "rome", "madrid", "oslo"]},
              {"age": (16, 80), "loans": (0, 40)}),
    ],
    "clinic": [
        Table("patients", "patients", "name",
              {"name": ["yara", "zack", "abel", "bea", "cody", "dina", "eli", "fay"],
               "ward": ["north", "south", "east", "west"]},
              {"age": (1, 95), "visits": (1, 30)}),
        Table("doctors", "doctors", "name",
              {"name": ["gill", "hart", "iris", "jack", "kim", "lou", "mae", "ned"],
               "specialty": ["heart", "skin", "bones", "eyes"]},
              {"salary": (50, 300), "years": (1, 40)}),
    ],
}

_AGGREGATES = {"average": "AVG", "maximum": "MAX", "minimum": "MIN", "total": "SUM"}


def _create_database(path: str, tables: list[Table], rows: int, rng: random.Random) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        os.remove(path)
    conn = sqlite3.connect(path)
    for table in tables:
        columns = ["id INTEGER PRIMARY KEY"] + [f"{c} TEXT" for c in table.text] + [f"{c} INTEGER" for c in table.numbers]
        conn.execute(f"CREATE TABLE {table.name} ({', '.join(columns)})")
        for i in range(rows):
            values = [i + 1] + [rng.choice(v) for v in table.text.values()] + [rng.randint(*r) for r in table.numbers.values()]
            conn.execute(f"INSERT INTO {table.name} VALUES ({', '.join('?' * len(values))})", values)
    conn.commit()
    conn.close()


def _thresholds(low: int, high: int) -> list[int]:
    """Eight round numbers inside a column's range: the constants questions compare against."""
    step = max(1, (high - low) // 9)
    return [low + step * i for i in range(1, 9)]


def _questions(table: Table, rng: random.Random) -> tuple[str, str]:
    """One templated question about `table` and its gold SQL."""
    text_col = rng.choice([c for c in table.text if c != table.key] or list(table.text))
    num_col = rng.choice(list(table.numbers))
    value = rng.choice(table.text[text_col])
    n = rng.choice(_thresholds(*table.numbers[num_col]))
    word, fn = rng.choice(list(_AGGREGATES.items()))
    kind = rng.randrange(7)
    t = table.name
    if kind == 0:
        return f"How many {table.label} have {text_col} {value}?", f"SELECT COUNT(*) FROM {t} WHERE {text_col} = '{value}'"
    if kind == 1:
        return (f"List the {table.key} of {table.label} with {num_col} greater than {n}.",
                f"SELECT {table.key} FROM {t} WHERE {num_col} > {n}")
    if kind == 2:
        return (f"How many {table.label} have {num_col} less than {n}?",
                f"SELECT COUNT(*) FROM {t} WHERE {num_col} < {n}")
    if kind == 3:
        return f"What is the {word} {num_col} of {table.label}?", f"SELECT {fn}({num_col}) FROM {t}"
    if kind == 4:
        return (f"What is the {word} {num_col} of {table.label} with {text_col} {value}?",
                f"SELECT {fn}({num_col}) FROM {t} WHERE {text_col} = '{value}'")
    if kind == 5:
        return (f"List the {table.key} of {table.label} with {text_col} {value}.",
                f"SELECT {table.key} FROM {t} WHERE {text_col} = '{value}'")
    return (f"List the {table.key} of {table.label} ordered by {num_col}.",
            f"SELECT {table.key} FROM {t} ORDER BY {num_col}")


def generate_text2sql(out_dir: str, config: SyntheticSQLConfig | None = None) -> dict[str, str]:
    """Write the data set under `out_dir`; return the paths the BIRD loader takes."""
    config = config or SyntheticSQLConfig()
    rng = random.Random(config.seed)
    db_ids = list(_SCHEMAS)[: config.databases]
    db_root = os.path.join(out_dir, "databases")
    for db_id in db_ids:
        _create_database(os.path.join(db_root, db_id, f"{db_id}.sqlite"), _SCHEMAS[db_id], config.rows_per_table, rng)

    wanted = config.train_questions + config.eval_questions
    pairs: dict[tuple[str, str], str] = {}  # (db_id, question) -> sql; distinct questions only
    attempts = 0
    while len(pairs) < wanted:
        attempts += 1
        if attempts > 50 * wanted:
            raise ValueError(f"the templates give fewer than {wanted} distinct questions; ask for fewer")
        db_id = rng.choice(db_ids)
        question, sql = _questions(rng.choice(_SCHEMAS[db_id]), rng)
        pairs.setdefault((db_id, question), sql)
    records = [
        {"question_id": i, "db_id": db_id, "question": question, "evidence": "", "SQL": sql, "difficulty": "simple"}
        for i, ((db_id, question), sql) in enumerate(pairs.items())
    ]
    rng.shuffle(records)
    paths = {"train": os.path.join(out_dir, "train.json"), "eval": os.path.join(out_dir, "dev.json"), "db_root": db_root}
    for split, chunk in (("train", records[config.eval_questions:]), ("eval", records[: config.eval_questions])):
        with open(paths[split], "w") as f:
            json.dump(chunk, f, indent=1)
    return paths
