"""Running model-written SQL against a real SQLite database, safely.

The predicted query is untrusted model output. Defence in depth:
- the database is opened read-only (`mode=ro` URI), so no write can reach the file;
- an authorizer allows only reading (SELECT, column reads, functions, recursive CTEs) and
  denies ATTACH, PRAGMA, writes, schema changes, transactions and file-touching functions;
- the number of attachable databases is limited to 0 and extension loading stays off;
- a progress handler aborts the query at its deadline (runaway recursive CTEs);
- at most `max_rows` rows are fetched, and no value may exceed 16 MiB.
The reward worker process adds a hard timeout and a heap cap on top (see `reward.py`).
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections import Counter
from urllib.parse import quote

_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
# Functions that reach outside the database or change the connection.
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "zipfile", "sqlar_compress",
                     "sqlar_uncompress", "unistr_quote"}
MAX_VALUE_BYTES = 16 * 2**20
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


class SQLExecutionError(Exception):
    """The query failed, was refused, ran past its time limit or returned too many rows."""


def _authorizer(action, arg1, arg2, db_name, trigger):
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def open_readonly(db_path: str) -> sqlite3.Connection:
    """A read-only connection to an existing database file, with the sandbox's limits installed."""
    if not os.path.isfile(db_path):
        raise SQLExecutionError(f"database file not found: {db_path}")
    uri = f"file:{quote(os.path.abspath(db_path))}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)  # e.g. randomblob(1e9)
    conn.set_authorizer(_authorizer)
    return conn


def execute(db_path: str, sql: str, *, timeout_s: float, max_rows: int = 10_000) -> list[tuple]:
    """Rows of one SELECT statement; raises `SQLExecutionError` for anything else."""
    if not sql.strip():
        raise SQLExecutionError("empty query")
    conn = open_readonly(db_path)
    deadline = time.monotonic() + timeout_s
    timed_out = False

    def past_deadline() -> int:
        nonlocal timed_out
        timed_out = time.monotonic() > deadline
        return int(timed_out)

    conn.set_progress_handler(past_deadline, 1000)
    try:
        cursor = conn.execute(sql)
        rows = cursor.fetchmany(max_rows + 1)
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as err:
        # sqlite3.Warning: more than one statement; ValueError: NUL characters in the text.
        if timed_out:
            raise SQLExecutionError(f"time limit of {timeout_s}s exceeded") from None
        raise SQLExecutionError(f"{type(err).__name__}: {err}") from None
    finally:
        conn.close()
    if len(rows) > max_rows:
        raise SQLExecutionError(f"more than {max_rows} rows")
    return rows


def results_match(predicted: list[tuple], gold: list[tuple], gold_sql: str) -> bool:
    """Result multisets are equal; row order matters only when the gold query orders."""
    if _ORDER_BY.search(gold_sql):
        return predicted == gold
    return Counter(predicted) == Counter(gold)


def schema_ddl(db_path: str, sample_rows: int = 0) -> str:
    """The database's CREATE statements as stored in it, each optionally followed by example rows."""
    conn = open_readonly(db_path)
    try:
        tables = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
        ).fetchall()
        parts = []
        for name, ddl in tables:
            parts.append(ddl.strip() + ";")
            if sample_rows:
                rows = conn.execute(f'SELECT * FROM "{name}" LIMIT {int(sample_rows)}').fetchall()
                if rows:
                    parts.append("/* " + " ".join(repr(tuple(r)) for r in rows) + " */")
        return "\n".join(parts)
    finally:
        conn.close()
