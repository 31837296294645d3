"""psycopg 3 and asyncpg through pgherd's transaction pooling, with prepared statements."""
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
CLIENTS = int(os.environ.get("CLIENTS", "40"))
ITERATIONS = int(os.environ.get("ITERATIONS", "50"))


async def psycopg_client(n: int) -> None:
    # prepare_threshold=0: every statement is prepared server-side as _pg3_0, _pg3_1, ...,
    # names every client reuses for different texts.
    async with await psycopg.AsyncConnection.connect(
        host=HOST, port=PORT, user=USER, password=PASSWORD, dbname=DB,
        prepare_threshold=0, autocommit=True,
    ) as conn:
        for i in range(ITERATIONS):
            k = (n * ITERATIONS + i) % 1000 + 1
            cur = await conn.execute("SELECT v FROM kv WHERE k = %s", (k,))
            assert (await cur.fetchone())[0] == f"v{k}"
            cur = await conn.execute(f"SELECT %s::int * 1000 + {n}", (i,))
            assert (await cur.fetchone())[0] == i * 1000 + n, "wrong statement ran"
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO driver_log VALUES (%s, %s, %s)", ("psycopg", n, i)
                )


async def asyncpg_client(n: int) -> None:
    # The default statement cache names statements __asyncpg_stmt_N__ per connection.
    conn = await asyncpg.connect(host=HOST, port=PORT, user=USER, password=PASSWORD, database=DB)
    try:
        calc = await conn.prepare(f"SELECT $1::int * 1000 + {n}")
        for i in range(ITERATIONS):
            k = (n * ITERATIONS + i) % 1000 + 1
            assert await conn.fetchval("SELECT v FROM kv WHERE k = $1", k) == f"v{k}"
            assert await calc.fetchval(i) == i * 1000 + n, "wrong statement ran"
            async with conn.transaction():
                await conn.execute("INSERT INTO driver_log VALUES ($1, $2, $3)", "asyncpg", n, i)
    finally:
        await conn.close()


async def count(driver: str) -> int:
    conn = await asyncpg.connect(host=HOST, port=PORT, user=USER, password=PASSWORD, database=DB)
    try:
        return await conn.fetchval("SELECT count(*) FROM driver_log WHERE driver = $1", driver)
    finally:
        await conn.close()


async def main() -> int:
    which = sys.argv[1]
    client = {"psycopg": psycopg_client, "asyncpg": asyncpg_client}[which]
    await asyncio.gather(*(client(n) for n in range(CLIENTS)))
    got = await count(which)
    if got != CLIENTS * ITERATIONS:
        print(f"{which}: expected {CLIENTS * ITERATIONS} rows, found {got}", file=sys.stderr)
        return 1
    print(f"{which}: {CLIENTS} clients x {ITERATIONS} iterations ok")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
