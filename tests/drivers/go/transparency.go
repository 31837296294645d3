// What pgx sees through pgherd must be what it sees from PostgreSQL (run as `go run .
// transparency`): unlogged tables and a standby's settings with replicas behind pgherd, the
// server's ParameterStatus values, statements cached across a type made again, DeallocateAll,
// and in session mode the backend's process id and the process id on its own notifications.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
)

func urlFor(db string, extra string) string {
	return fmt.Sprintf("postgres://%s:%s@%s:%s/%s%s", os.Getenv("PGHERD_USER"), os.Getenv("PGHERD_PASSWORD"),
		os.Getenv("PGHERD_HOST"), os.Getenv("PGHERD_PORT"), db, extra)
}

func transparency() error {
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	db := os.Getenv("PGHERD_DB")
	url := urlFor(db, "")
	steps := []struct {
		name string
		run  func() error
	}{
		{"unlogged table read in a new session", func() error { return unloggedTable(ctx, url) }},
		{"transaction_read_only", func() error { return standbySetting(ctx, url) }},
		{"ParameterStatus", func() error { return parameterStatus(ctx, db) }},
		{"type made again", func() error { return typeMadeAgain(ctx, url) }},
		{"DeallocateAll", func() error { return deallocateAll(ctx, url) }},
		{"own notifications (transaction mode)", func() error { return ownNotification(ctx, url, false) }},
		{"backend identity (session mode)", func() error {
			return ownNotification(ctx, urlFor(os.Getenv("PGHERD_SESSION_DB"), ""), true)
		}},
	}
	// Every step runs, so one run shows every difference.
	failed := 0
	for _, s := range steps {
		if err := s.run(); err != nil {
			fmt.Fprintf(os.Stderr, "pgx: %s: %v\n", s.name, err)
			failed++
			continue
		}
		fmt.Println("pgx:", s.name, "ok")
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d checks failed", failed, len(steps))
	}
	return nil
}

func scalar[T any](ctx context.Context, conn *pgx.Conn, sql string, args ...any) (T, error) {
	var v T
	err := conn.QueryRow(ctx, sql, args...).Scan(&v)
	return v, err
}

func unloggedTable(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "CREATE UNLOGGED TABLE ul_pgx (x int); INSERT INTO ul_pgx SELECT generate_series(1, 3)"); err != nil {
		return err
	}
	conn.Close(ctx)
	fresh, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer fresh.Close(ctx)
	n, err := scalar[int64](ctx, fresh, "SELECT count(*) FROM ul_pgx WHERE x > $1", 0)
	if err != nil {
		return err
	}
	if n != 3 {
		return fmt.Errorf("%d rows", n)
	}
	return nil
}

func standbySetting(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	v, err := scalar[string](ctx, conn, "SELECT current_setting('transaction_read_only')")
	if err != nil {
		return err
	}
	if v != "off" {
		return fmt.Errorf("transaction_read_only = %s outside a read-only transaction", v)
	}
	return nil
}

func parameterStatus(ctx context.Context, db string) error {
	conn, err := pgx.Connect(ctx, urlFor(db, "?client_encoding=utf8&DateStyle=german"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if v := conn.PgConn().ParameterStatus("client_encoding"); v != "UTF8" {
		return fmt.Errorf("client_encoding reported as %q", v)
	}
	if v := conn.PgConn().ParameterStatus("DateStyle"); v != "German, DMY" {
		return fmt.Errorf("DateStyle reported as %q", v)
	}
	return nil
}

// The statement cache keeps `SELECT $1::text::mood_pgx::text` prepared while the type is
// dropped and made again by another session, and inside a savepoint that rolls back.
func typeMadeAgain(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	other, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer other.Close(ctx)
	if _, err := other.Exec(ctx, "CREATE TYPE mood_pgx AS ENUM ('sad', 'ok')"); err != nil {
		return err
	}
	const sql = "SELECT $1::text::mood_pgx::text"
	expect := func(value string) error {
		got, err := scalar[string](ctx, conn, sql, value)
		if err != nil {
			return err
		}
		if got != value {
			return fmt.Errorf("%q for %q", got, value)
		}
		return nil
	}
	if err := expect("ok"); err != nil {
		return err
	}
	if _, err := other.Exec(ctx, "DROP TYPE mood_pgx"); err != nil {
		return err
	}
	if _, err := other.Exec(ctx, "CREATE TYPE mood_pgx AS ENUM ('sad', 'ok', 'happy')"); err != nil {
		return err
	}
	if err := expect("happy"); err != nil {
		return fmt.Errorf("after the type was made again: %w", err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	for _, sql := range []string{"SAVEPOINT s", "DROP TYPE mood_pgx", "CREATE TYPE mood_pgx AS ENUM ('only')"} {
		if _, err := tx.Exec(ctx, sql); err != nil {
			return err
		}
	}
	if err := expect("only"); err != nil {
		return fmt.Errorf("inside the savepoint: %w", err)
	}
	if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
		return err
	}
	if err := expect("happy"); err != nil {
		return fmt.Errorf("after the savepoint rolled back: %w", err)
	}
	return tx.Commit(ctx)
}

// pgx names cached statements by their text, so after DeallocateAll it prepares the same
// names again: pgherd must have forgotten them too.
func deallocateAll(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	for round := 0; round < 3; round++ {
		if _, err := conn.Prepare(ctx, "calc", "SELECT $1::int + 1"); err != nil {
			return fmt.Errorf("round %d: %w", round, err)
		}
		for i := 0; i < 3; i++ {
			v, err := scalar[int](ctx, conn, "SELECT $1::int * 2", i)
			if err != nil {
				return fmt.Errorf("round %d: %w", round, err)
			}
			if v != i*2 {
				return fmt.Errorf("round %d: %d", round, v)
			}
			if v, err = scalar[int](ctx, conn, "calc", i); err != nil || v != i+1 {
				return fmt.Errorf("round %d: calc %d %v", round, v, err)
			}
		}
		if err := conn.DeallocateAll(ctx); err != nil {
			return err
		}
	}
	return nil
}

// The process id pgx was given is the one on the notifications it sends itself; in session
// mode it is also the server's own.
func ownNotification(ctx context.Context, url string, session bool) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	pid := conn.PgConn().PID()
	if session {
		backend, err := scalar[int32](ctx, conn, "SELECT pg_backend_pid()")
		if err != nil {
			return err
		}
		if uint32(backend) != pid {
			return fmt.Errorf("pg_backend_pid() %d, driver knows %d", backend, pid)
		}
	}
	if _, err := conn.Exec(ctx, "LISTEN ch_pgx"); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "NOTIFY ch_pgx, 'hi'"); err != nil {
		return err
	}
	n, err := conn.WaitForNotification(ctx)
	if err != nil {
		return err
	}
	if n.PID != pid {
		return fmt.Errorf("notification from %d, driver knows %d", n.PID, pid)
	}
	return nil
}
