"""What drivers see through pgherd must be what they see from PostgreSQL.

Run with PSYCOPG_IMPL=python to use the system's libpq (older than 17 on Debian 12): psycopg
then evicts statements from its cache with SQL `DEALLOCATE name`, which pgherd must map onto
the statement the driver prepared through the protocol.
"""
import os
import sys

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


def main() -> int:
    print("psycopg", psycopg.__version__, "implementation", psycopg.pq.__impl__, "libpq", psycopg.pq.version())
    more_statements_than_the_cache_holds(autocommit=True)
    more_statements_than_the_cache_holds(autocommit=False)
    parameter_status_is_the_servers()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
