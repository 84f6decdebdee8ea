"""The text-to-SQL task: BIRD and Spider loaders, schema prompts, execution-match reward."""

from __future__ import annotations

import functools
import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_recipes.data_files import read_json_records
from arctic_rl_recipes.task import Example, Score, require_paths
from arctic_rl_recipes.text2sql.execution import SQLExecutionError, execute, results_match, schema_ddl
from arctic_rl_recipes.text2sql.synthetic import SyntheticSQLConfig, generate_text2sql

# Question-record keys per format: (question, gold SQL).
_FORMAT_KEYS = {"bird": ("question", "SQL"), "spider": ("question", "query")}
_FENCE = re.compile(r"```(?:sql)?\s*(.*?)(?:```|$)", re.IGNORECASE | re.DOTALL)


class Text2SQLConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["text2sql"]
    format: Literal["bird", "spider"] = "bird"
    train: str | None = None
    """Question JSON of the training split (BIRD `train.json`, Spider `train_spider.json`)."""
    eval: str | None = None
    """Question JSON of the held-out split (BIRD `dev.json`, Spider `dev.json`)."""
    db_root: str | None = None
    """Folder of `<db_id>/<db_id>.sqlite` (BIRD `train_databases`, Spider `database`)."""
    eval_db_root: str | None = None
    """The held-out split's databases when they live apart (BIRD `dev_databases`); default `db_root`."""
    schema_rows: int = Field(0, ge=0)
    """Example rows shown after each CREATE TABLE in the prompt."""
    sql_timeout_s: float = Field(2.0, gt=0)
    max_rows: int = Field(10_000, ge=1)
    synthetic: SyntheticSQLConfig | None = None
    """Generate a synthetic set in BIRD format under the run's output folder and train on it."""


def extract_sql(response: str) -> str:
    """The query in a model response: inside a ```sql fence if there is one, up to the first `;`."""
    fenced = _FENCE.search(response)
    text = fenced.group(1) if fenced else response
    return text.split(";", 1)[0].strip()


@functools.lru_cache(maxsize=4096)
def _gold_rows(db_path: str, gold_sql: str, timeout_s: float, max_rows: int) -> list[tuple]:
    return execute(db_path, gold_sql, timeout_s=timeout_s, max_rows=max_rows)


def execution_reward(response: str, *, db_path: str, gold_sql: str, timeout_s: float, max_rows: int) -> Score:
    """1 if the predicted query returns the gold query's rows on the database, else 0.

    A predicted query that fails, is refused by the sandbox or runs out of time scores 0.
    A gold query that fails raises: that is a data error, not the model's.
    """
    gold = _gold_rows(db_path, gold_sql, timeout_s, max_rows)
    try:
        predicted = execute(db_path, extract_sql(response), timeout_s=timeout_s, max_rows=max_rows)
    except SQLExecutionError:
        return Score(0.0, False)
    correct = results_match(predicted, gold, gold_sql)
    return Score(float(correct), correct)


def build_prompt(schema: str, question: str, evidence: str = "") -> str:
    hint = f"-- Hint: {evidence}\n" if evidence else ""
    return f"{schema}\n{hint}-- Question: {question}\nSQL:\n"


class Text2SQLTask:
    name = "text2sql"
    reward_fn = staticmethod(execution_reward)

    def __init__(self, config: Text2SQLConfig, output_dir: str):
        if config.synthetic is not None:
            paths = generate_text2sql(os.path.join(output_dir, "data"), config.synthetic)
            config = config.model_copy(update={"train": paths["train"], "eval": paths["eval"], "db_root": paths["db_root"]})
        require_paths(config, ("train", "eval", "db_root"))
        self.config = config

    def _db_root(self, split: str) -> tuple[str, str]:
        if split == "eval" and self.config.eval_db_root:
            return "task.eval_db_root", self.config.eval_db_root
        return "task.db_root", self.config.db_root

    def load(self, split: str) -> list[Example]:
        field = f"task.{split}"
        question_key, sql_key = _FORMAT_KEYS[self.config.format]
        records = read_json_records(getattr(self.config, split), field, ("db_id", question_key, sql_key), self.config.format)
        root_field, root = self._db_root(split)
        if not os.path.isdir(root):
            raise InvalidRequest(root_field, f"folder not found: {root}")
        schemas: dict[str, str] = {}
        examples = []
        for i, record in enumerate(records):
            db_id = record["db_id"]
            db_path = os.path.join(root, db_id, f"{db_id}.sqlite")
            if db_id not in schemas:
                if not os.path.isfile(db_path):
                    raise InvalidRequest(f"{field}[{i}].db_id", f"no database file {db_path} under {root_field}")
                schemas[db_id] = schema_ddl(db_path, self.config.schema_rows)
            gold = record[sql_key].strip().rstrip(";").strip()
            examples.append(Example(
                id=str(record.get("question_id", i)),
                prompt=build_prompt(schemas[db_id], record[question_key], record.get("evidence") or ""),
                reference=gold + ";",
                reward_args={"db_path": db_path, "gold_sql": gold, "timeout_s": self.config.sql_timeout_s,
                             "max_rows": self.config.max_rows},
            ))
        return examples
