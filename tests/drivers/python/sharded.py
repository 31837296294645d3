"""psycopg 3 through a sharded endpoint: rows copied in and inserted with parameters (a
pipelined executemany), read by key and fanned out, in server-side prepared statements and
unnamed ones, text and binary, in transactions; every answer checked against the rows it
wrote. Table accounts(aid int primary key, abalance int, note text), sharded by aid, exists
and is empty."""
import os
import sys
from decimal import Decimal

import psycopg

HOST = os.environ["PGHERD_HOST"]
PORT = int(os.environ["PGHERD_PORT"])
USER = os.environ["PGHERD_USER"]
PASSWORD = os.environ["PGHERD_PASSWORD"]
DB = os.environ["PGHERD_DB"]

failures = []


def check(what, got, expected):
    if got != expected:
        failures.append(f"{what}: got {got!r}, expected {expected!r}")


def connect(prepare_threshold):
    return psycopg.connect(
        host=HOST, port=PORT, user=USER, password=PASSWORD, dbname=DB,
        autocommit=True, prepare_threshold=prepare_threshold,
    )


def load(conn):
    with conn.cursor() as cur:
        with cur.copy("COPY accounts (aid, abalance, note) FROM STDIN") as copy:
            for aid in range(1, 201):
                copy.write_row((aid, aid * 10, f"n{aid}"))
        cur.executemany(
            "INSERT INTO accounts (aid, abalance, note) VALUES (%s, %s, %s)",
            [(aid, aid * 10, f"n{aid}") for aid in range(201, 301)],
        )


def copy_out(conn, label):
    """COPY TO STDOUT over every shard comes back as one COPY, the header once."""
    with conn.cursor() as cur:
        with cur.copy("COPY (SELECT aid FROM accounts WHERE aid <= 300) TO STDOUT WITH (FORMAT csv, HEADER)") as copy:
            lines = b"".join(bytes(chunk) for chunk in copy).decode().splitlines()
    check(f"{label}: copy header", lines[0], "aid")
    check(f"{label}: copied rows", sorted(int(l) for l in lines[1:]), list(range(1, 301)))


def reads(conn, label):
    for aid in (1, 150, 299):
        row = conn.execute("SELECT abalance, note FROM accounts WHERE aid = %s", (aid,)).fetchone()
        check(f"{label}: row {aid}", row, (aid * 10, f"n{aid}"))
    row = conn.execute(
        "SELECT abalance FROM accounts WHERE aid = %s", (7,), binary=True
    ).fetchone()
    check(f"{label}: binary row", row, (70,))
    row = conn.execute(
        "SELECT count(*), sum(abalance), max(aid) FROM accounts WHERE abalance >= %s", (100,)
    ).fetchone()
    check(f"{label}: aggregates", row, (291, sum(a * 10 for a in range(10, 301)), 300))
    rows = conn.execute(
        "SELECT aid FROM accounts WHERE abalance > %s ORDER BY aid DESC LIMIT 3", (0,)
    ).fetchall()
    check(f"{label}: ordered", rows, [(300,), (299,), (298,)])
    row = conn.execute("SELECT avg(abalance) FROM accounts WHERE aid <= %s", (10,)).fetchone()
    check(f"{label}: average", row, (Decimal("55.0000000000000000"),))
    rows = conn.execute(
        "SELECT aid FROM accounts WHERE aid IN (%s, %s, %s) ORDER BY aid", (3, 100, 250)
    ).fetchall()
    check(f"{label}: keys in a list", rows, [(3,), (100,), (250,)])


def transactions(conn):
    with conn.transaction():
        conn.execute("UPDATE accounts SET abalance = abalance + %s WHERE aid = %s", (1, 1))
        conn.execute("UPDATE accounts SET abalance = abalance + %s WHERE aid = %s", (1, 2))
    try:
        with conn.transaction():
            conn.execute("UPDATE accounts SET abalance = 0 WHERE aid = %s", (3,))
            conn.execute("UPDATE accounts SET abalance = 0 WHERE aid = %s", (4,))
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    rows = conn.execute(
        "SELECT aid, abalance FROM accounts WHERE aid <= %s ORDER BY aid", (4,)
    ).fetchall()
    check("transactions", rows, [(1, 11), (2, 21), (3, 30), (4, 40)])


def refusals(conn):
    try:
        conn.execute("SELECT aid, count(*) OVER () FROM accounts WHERE aid > %s", (0,))
        failures.append("a window function over the shards was not refused")
    except psycopg.errors.FeatureNotSupported:
        pass
    row = conn.execute("SELECT note FROM accounts WHERE aid = %s", (5,)).fetchone()
    check("after a refusal", row, ("n5",))


def main():
    with connect(prepare_threshold=0) as prepared, connect(prepare_threshold=None) as unnamed:
        load(prepared)
        reads(prepared, "prepared")
        reads(unnamed, "unnamed")
        copy_out(unnamed, "unnamed")
        transactions(prepared)
        refusals(unnamed)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        return 1
    print("psycopg through a sharded endpoint: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
