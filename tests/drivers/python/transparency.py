"""What drivers see through pgherd must be what they see from PostgreSQL.

`transparency.py psycopg`, with PSYCOPG_IMPL=python to use the system's libpq (older than 17
on Debian 12): psycopg then evicts statements from its cache with SQL `DEALLOCATE name`, which
pgherd must map onto the statement the driver prepared through the protocol.

`transparency.py asyncpg`: unlogged tables and a standby's settings with replicas behind
pgherd, the server's ParameterStatus values, the statement cache across a type made again, and
the backend's process id (session mode, PGHERD_SESSION_DB) and on the session's own
notifications.
"""
import asyncio
import os
import sys

import asyncpg
import psycopg

HOST = os.environ["PGHERD_HOST"]
PORT = int(os.environ["PGHERD_PORT"])
USER = os.environ["PGHERD_USER"]
PASSWORD = os.environ["PGHERD_PASSWORD"]
DB = os.environ["PGHERD_DB"]


def connect(**kwargs) -> psycopg.Connection:
    return psycopg.connect(
        host=HOST, port=PORT, user=USER, password=PASSWORD, dbname=DB, **kwargs
    )


def more_statements_than_the_cache_holds(autocommit: bool) -> None:
    """prepare_threshold=0 and prepared_max=2: six statements, each evicting an older one."""
    with connect(prepare_threshold=0, autocommit=autocommit) as conn:
        conn.prepared_max = 2
        for round in range(3):
            for i in range(6):
                row = conn.execute(f"SELECT %s::int + {i}", (round,)).fetchone()
                assert row[0] == round + i, row
            if not autocommit:
                conn.commit()


def parameter_status_is_the_servers() -> None:
    with connect(client_encoding="utf8") as conn:
        assert conn.info.parameter_status("client_encoding") == "UTF8", conn.info.parameter_status(
            "client_encoding"
        )
    with connect(options="-c DateStyle=german") as conn:
        assert conn.info.parameter_status("DateStyle") == "German, DMY"


def psycopg_checks() -> None:
    print("psycopg", psycopg.__version__, "implementation", psycopg.pq.__impl__, "libpq", psycopg.pq.version())
    more_statements_than_the_cache_holds(autocommit=True)
    more_statements_than_the_cache_holds(autocommit=False)
    parameter_status_is_the_servers()


async def aconnect(db: str = DB, **kwargs) -> asyncpg.Connection:
    return await asyncpg.connect(
        host=HOST, port=PORT, user=USER, password=PASSWORD, database=db, **kwargs
    )


async def unlogged_table() -> None:
    conn = await aconnect()
    await conn.execute("CREATE UNLOGGED TABLE ul_asyncpg (x int); INSERT INTO ul_asyncpg SELECT generate_series(1, 3)")
    await conn.close()
    conn = await aconnect()
    try:
        n = await conn.fetchval("SELECT count(*) FROM ul_asyncpg WHERE x > $1", 0)
        assert n == 3, f"{n} rows"
    finally:
        await conn.close()


async def standby_setting() -> None:
    conn = await aconnect()
    try:
        v = await conn.fetchval("SELECT current_setting('transaction_read_only')")
        assert v == "off", f"transaction_read_only = {v} outside a read-only transaction"
    finally:
        await conn.close()


async def parameter_status() -> None:
    # asyncpg asks for client_encoding 'utf-8' (quoted) in its startup packet.
    conn = await aconnect(server_settings={"DateStyle": "german"})
    try:
        settings = conn.get_settings()
        assert settings.client_encoding == "UTF8", settings.client_encoding
        assert settings.DateStyle == "German, DMY", settings.DateStyle
    finally:
        await conn.close()


async def type_made_again() -> None:
    """The statement cache keeps the statement while the type is made again by another
    session, and inside a savepoint that rolls back."""
    conn, other = await aconnect(), await aconnect()
    try:
        await other.execute("CREATE TYPE mood_asyncpg AS ENUM ('sad', 'ok')")
        sql = "SELECT $1::text::mood_asyncpg::text"
        assert await conn.fetchval(sql, "ok") == "ok"
        await other.execute("DROP TYPE mood_asyncpg")
        await other.execute("CREATE TYPE mood_asyncpg AS ENUM ('sad', 'ok', 'happy')")
        assert await conn.fetchval(sql, "happy") == "happy", "after the type was made again"
        async with conn.transaction():
            await conn.execute("SAVEPOINT s")
            await conn.execute("DROP TYPE mood_asyncpg")
            await conn.execute("CREATE TYPE mood_asyncpg AS ENUM ('only')")
            assert await conn.fetchval(sql, "only") == "only", "inside the savepoint"
            await conn.execute("ROLLBACK TO SAVEPOINT s")
            assert await conn.fetchval(sql, "happy") == "happy", "after the savepoint rolled back"
    finally:
        await conn.close()
        await other.close()


async def own_notification(db: str, session: bool) -> None:
    conn = await aconnect(db)
    try:
        pid = conn.get_server_pid()
        if session:
            backend = await conn.fetchval("SELECT pg_backend_pid()")
            assert backend == pid, f"pg_backend_pid() {backend}, driver knows {pid}"
        got: asyncio.Future = asyncio.get_running_loop().create_future()
        await conn.add_listener("ch_asyncpg", lambda _c, sender, _ch, _p: got.done() or got.set_result(sender))
        await conn.execute("NOTIFY ch_asyncpg, 'hi'")
        sender = await asyncio.wait_for(got, 10)
        assert sender == pid, f"notification from {sender}, driver knows {pid}"
    finally:
        await conn.close()


async def asyncpg_checks() -> None:
    steps = [
        ("unlogged table read in a new session", unlogged_table),
        ("transaction_read_only", standby_setting),
        ("ParameterStatus", parameter_status),
        ("type made again", type_made_again),
        ("own notifications (transaction mode)", lambda: own_notification(DB, False)),
        ("backend identity (session mode)", lambda: own_notification(os.environ["PGHERD_SESSION_DB"], True)),
    ]
    # Every step runs, so one run shows every difference.
    failed = 0
    for name, step in steps:
        try:
            await step()
            print("asyncpg:", name, "ok")
        except Exception as e:
            print(f"asyncpg: {name}: {e!r}", file=sys.stderr)
            failed += 1
    if failed:
        raise SystemExit(f"asyncpg: {failed} of {len(steps)} checks failed")


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "psycopg"
    if which == "psycopg":
        psycopg_checks()
    else:
        asyncio.run(asyncpg_checks())
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
