// pgx through pgherd's transaction pooling: the statement cache prepares every query under a
// name derived from its text, and each client also prepares "calc" with a text of its own.
package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"

	"github.com/jackc/pgx/v5"
)

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "transparency" {
		if err := transparency(); err != nil {
			fmt.Fprintln(os.Stderr, "pgx:", err)
			os.Exit(1)
		}
		return
	}
	clients, _ := strconv.Atoi(env("CLIENTS", "40"))
	iterations, _ := strconv.Atoi(env("ITERATIONS", "50"))
	url := fmt.Sprintf("postgres://%s:%s@%s:%s/%s", os.Getenv("PGHERD_USER"), os.Getenv("PGHERD_PASSWORD"),
		os.Getenv("PGHERD_HOST"), os.Getenv("PGHERD_PORT"), os.Getenv("PGHERD_DB"))
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for n := 0; n < clients; n++ {
		wg.Add(1)
		go func(n int) {
			defer wg.Done()
			if err := client(ctx, url, n, iterations); err != nil {
				errs <- fmt.Errorf("client %d: %w", n, err)
			}
		}(n)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close(ctx)
	var count int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM driver_log WHERE driver = 'pgx'").Scan(&count); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if count != clients*iterations {
		fmt.Fprintf(os.Stderr, "expected %d rows, found %d\n", clients*iterations, count)
		os.Exit(1)
	}
	fmt.Printf("pgx: %d clients x %d iterations ok\n", clients, iterations)
}

func client(ctx context.Context, url string, n, iterations int) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Prepare(ctx, "calc", fmt.Sprintf("SELECT $1::int * 1000 + %d", n)); err != nil {
		return err
	}
	for i := 0; i < iterations; i++ {
		k := (n*iterations+i)%1000 + 1
		var v string
		if err := conn.QueryRow(ctx, "SELECT v FROM kv WHERE k = $1", k).Scan(&v); err != nil {
			return err
		}
		if v != fmt.Sprintf("v%d", k) {
			return fmt.Errorf("kv %d: %s", k, v)
		}
		var x int
		if err := conn.QueryRow(ctx, "calc", i).Scan(&x); err != nil {
			return err
		}
		if x != i*1000+n {
			return fmt.Errorf("ran another client's statement: %d", x)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO driver_log VALUES ($1, $2, $3)", "pgx", n, i); err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
	}
	return nil
}
