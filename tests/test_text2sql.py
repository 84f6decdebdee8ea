"""Text-to-SQL: the SQLite sandbox, the execution-match reward, the BIRD and Spider loaders."""

import hashlib
import json
import os
import sqlite3
import time

import pytest

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_recipes.rewards import RewardPool
from arctic_rl_recipes.text2sql.execution import SQLExecutionError, execute, results_match
from arctic_rl_recipes.text2sql.synthetic import SyntheticSQLConfig, generate_text2sql
from arctic_rl_recipes.text2sql.task import Text2SQLConfig, Text2SQLTask, execution_reward, extract_sql

RUNAWAY_CTE = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
HOSTILE = [
    "ATTACH DATABASE '{dir}/evil.db' AS evil",
    "INSERT INTO customers (name) VALUES ('mallory')",
    "UPDATE customers SET age = 0",
    "DELETE FROM customers",
    "DROP TABLE customers",
    "CREATE TABLE evil (x)",
    "CREATE TEMP TABLE evil (x)",
    "PRAGMA journal_mode = WAL",
    "PRAGMA writable_schema = 1",
    "SELECT load_extension('{dir}/evil.so')",
    "VACUUM INTO '{dir}/copy.db'",
    "SELECT 1; DROP TABLE customers",
    "BEGIN IMMEDIATE",
]


@pytest.fixture(scope="module")
def bird(tmp_path_factory):
    root = tmp_path_factory.mktemp("bird")
    paths = generate_text2sql(str(root), SyntheticSQLConfig(seed=1, databases=2, train_questions=60, eval_questions=20))
    return root, paths


def digest(folder) -> dict:
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[path] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


def test_hostile_sql_changes_no_file_and_runaway_queries_stop_in_time(bird):
    root, paths = bird
    db = os.path.join(paths["db_root"], "shop", "shop.sqlite")
    before = digest(root)
    for template in HOSTILE:
        query = template.format(dir=root)
        with pytest.raises(SQLExecutionError):
            execute(db, query, timeout_s=1.0)
        assert execution_reward(query, db_path=db, gold_sql="SELECT COUNT(*) FROM customers", timeout_s=1.0,
                                max_rows=100).reward == 0.0
    t0 = time.perf_counter()
    with pytest.raises(SQLExecutionError, match="time limit"):  # its own limit ended it
        execute(db, RUNAWAY_CTE, timeout_s=0.3)
    assert time.perf_counter() - t0 < 20  # only guards against a limit that fires far too late
    with pytest.raises(SQLExecutionError, match="too big"):
        execute(db, "SELECT randomblob(100000000)", timeout_s=1.0)
    assert digest(root) == before  # not one byte or timestamp changed, no file added
    # The connection still reads.
    assert execute(db, "SELECT COUNT(*) FROM customers", timeout_s=1.0) == [(24,)]


def slow_reward(response: str, *, seconds: float):
    from arctic_rl_recipes.task import Score

    time.sleep(seconds)
    return Score(1.0, True)


def broken_reward(response: str):
    raise KeyError("a bug in a reward function")


def test_reward_pool_scores_in_worker_processes_with_a_hard_time_limit(bird):
    _, paths = bird
    db = os.path.join(paths["db_root"], "shop", "shop.sqlite")
    # The runaway query gets a short limit of the reward's own; the others a generous one, and the pool's limit
    # (per task, from its start in a worker) only bounds a hang. (The gold query, a few SQLite steps, runs under
    # each task's limit too: the limit is checked every 1000 steps, so it cannot fire on it.)
    args = {"db_path": db, "gold_sql": "SELECT COUNT(*) FROM customers", "timeout_s": 30.0, "max_rows": 100}
    pool = RewardPool(execution_reward, workers=2, timeout_s=60.0)
    try:
        batch = pool.score(["SELECT COUNT(*) FROM customers;", RUNAWAY_CTE, "SELECT nonsense", "ATTACH 'x' AS y"],
                           [args, {**args, "timeout_s": 0.5}, args, args])
        assert [s.reward for s in batch.scores] == [1.0, 0.0, 0.0, 0.0]
        # The runaway query ended at the reward's own 0.5 s limit, not the pool's (no wall clock: a busy
        # machine starts the workers late, and that is not what is tested).
        assert batch.timeouts == 0 and batch.errors == 0
    finally:
        pool.close()
    # A reward function that hangs is killed at the pool's limit; one that raises is counted; neither ends the run.
    # The limit is long enough for the quick one to return in time on a busy machine (it is timed from its start in
    # a fresh worker, after the killed one's); the hanging one would return, and score 1, only long after it.
    pool = RewardPool(slow_reward, workers=1, timeout_s=10.0)
    try:
        batch = pool.score(["a", "b"], [{"seconds": 60.0}, {"seconds": 0.0}])
        assert [s.reward for s in batch.scores] == [0.0, 1.0] and batch.timeouts == 1
    finally:
        pool.close()
    pool = RewardPool(broken_reward, workers=1, timeout_s=60.0)
    try:
        batch = pool.score(["a"], [{}])
        assert batch.errors == 1 and "KeyError" in batch.first_error and batch.scores[0].reward == 0.0
    finally:
        pool.close()


def test_result_comparison_is_a_multiset_unless_the_gold_query_orders():
    assert results_match([(2,), (1,)], [(1,), (2,)], "SELECT x FROM t")
    assert not results_match([(1,)], [(1,), (1,)], "SELECT x FROM t")
    assert not results_match([(2,), (1,)], [(1,), (2,)], "SELECT x FROM t ORDER BY x")
    assert results_match([(1,), (2,)], [(1,), (2,)], "select x from t order  by x")


def test_sql_extraction_takes_the_first_statement_or_the_fenced_block():
    assert extract_sql("SELECT 1; DROP TABLE t") == "SELECT 1"
    assert extract_sql("Here it is:\n```sql\nSELECT name FROM t\n```") == "SELECT name FROM t"


def test_bird_loader_builds_schema_prompts_and_gold_scores_one(bird, tmp_path):
    _, paths = bird
    task = Text2SQLTask(Text2SQLConfig(name="text2sql", format="bird", schema_rows=2, **paths), str(tmp_path))
    train, held_out = task.load("train"), task.load("eval")
    assert len(train) == 60 and len(held_out) == 20
    seen = {(e.reward_args["db_path"], e.prompt) for e in train}
    assert not any((e.reward_args["db_path"], e.prompt) in seen for e in held_out)
    example = train[0]
    assert "CREATE TABLE" in example.prompt and example.prompt.endswith("SQL:\n") and "/* (1," in example.prompt
    assert execution_reward(example.reference, **example.reward_args).correct
    assert not execution_reward("SELECT 12345", **example.reward_args).correct


def write_spider(root) -> dict:
    """A Spider-format fixture: train_spider.json, tables.json and database/<db_id>/<db_id>.sqlite."""
    db_dir = root / "database" / "concert_singer"
    db_dir.mkdir(parents=True)
    conn = sqlite3.connect(db_dir / "concert_singer.sqlite")
    conn.execute("CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)")
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)",
                     [(1, "Joe", "Netherlands", 52), (2, "Timbaland", "United States", 32), (3, "Justin", "France", 29)])
    conn.commit()
    conn.close()
    questions = [
        {"db_id": "concert_singer", "query": "SELECT count(*) FROM singer", "query_toks": ["SELECT", "count", "(", "*", ")", "FROM", "singer"],
         "query_toks_no_value": ["select", "count", "(", "*", ")", "from", "singer"], "question": "How many singers do we have?",
         "question_toks": ["How", "many", "singers", "do", "we", "have", "?"], "sql": {"select": [False, [[3, [0, [0, 0, False], None]]]]}},
        {"db_id": "concert_singer", "query": "SELECT name FROM singer ORDER BY age DESC", "query_toks": [], "query_toks_no_value": [],
         "question": "Names of singers from oldest to youngest?", "question_toks": [], "sql": {}},
    ]
    (root / "train_spider.json").write_text(json.dumps(questions))
    (root / "tables.json").write_text(json.dumps([{"db_id": "concert_singer", "table_names": ["singer"],
                                                    "column_names": [[-1, "*"], [0, "singer id"], [0, "name"], [0, "country"], [0, "age"]]}]))
    return {"train": str(root / "train_spider.json"), "eval": str(root / "train_spider.json"), "db_root": str(root / "database")}


def test_spider_loader_and_ordered_execution_match(tmp_path):
    paths = write_spider(tmp_path)
    task = Text2SQLTask(Text2SQLConfig(name="text2sql", format="spider", **paths), str(tmp_path / "run"))
    count, ordered = task.load("train")
    assert "CREATE TABLE singer" in count.prompt and "How many singers" in count.prompt
    assert execution_reward("SELECT COUNT(singer_id) FROM singer", **count.reward_args).correct
    assert execution_reward("SELECT name FROM singer ORDER BY age DESC;", **ordered.reward_args).correct
    assert not execution_reward("SELECT name FROM singer ORDER BY age", **ordered.reward_args).correct


@pytest.mark.parametrize("case,field", [
    ("missing_file", "task.train"),
    ("not_json", "task.train"),
    ("empty", "task.train"),
    ("spider_as_bird", "task.train[0].SQL"),
    ("missing_database", "task.train[0].db_id"),
])
def test_bad_data_names_the_file_or_record(tmp_path, case, field):
    paths = write_spider(tmp_path)
    fmt = "spider"
    if case == "missing_file":
        paths["train"] = str(tmp_path / "nope.json")
    elif case == "not_json":
        (tmp_path / "bad.json").write_text("{not json")
        paths["train"] = str(tmp_path / "bad.json")
    elif case == "empty":
        (tmp_path / "empty.json").write_text("[]")
        paths["train"] = str(tmp_path / "empty.json")
    elif case == "spider_as_bird":
        fmt = "bird"
    elif case == "missing_database":
        os.rename(tmp_path / "database" / "concert_singer", tmp_path / "database" / "renamed")
    task = Text2SQLTask(Text2SQLConfig(name="text2sql", format=fmt, **paths), str(tmp_path / "run"))
    with pytest.raises(InvalidRequest) as err:
        task.load("train")
    assert err.value.field == field
