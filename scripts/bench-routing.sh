#!/usr/bin/env bash
# Read-your-writes against eventual consistency (and primary-only reads) on a 90/10 read/write
# pgbench mix through pgherd, on the embedded default cluster: a primary and two streaming
# replicas on this machine. Rounds are interleaved; medians and ratios are printed.
#
#   cargo build --release && scripts/bench-routing.sh
#
# Environment: PGHERD_BIN (default ./target/release/pgherd), PORT (6543), CLIENTS (16),
# DURATION_S (10), ROUNDS (3), SCALE (10).
set -euo pipefail
BIN=${PGHERD_BIN:-./target/release/pgherd}
PORT=${PORT:-6543}
CLIENTS=${CLIENTS:-16}
DURATION_S=${DURATION_S:-10}
ROUNDS=${ROUNDS:-3}
SCALE=${SCALE:-10}
PGBIN=${PGHERD_PG_BIN:-/usr/lib/postgresql/15/bin}
DIR=$(mktemp -d /tmp/pgherd-bench-routing-XXXXXX)
chmod 755 "$DIR"
trap '"$BIN" down --dir "$DIR" >/dev/null 2>&1 || true; rm -rf "$DIR"' EXIT

"$BIN" up --dir "$DIR" --port "$PORT" --detach >/dev/null
"$BIN" down --dir "$DIR" >/dev/null
cat >> "$DIR/pgherd.toml" <<TOML

[databases.read_your_writes]
dbname = "app"
consistency = "read_your_writes"

[databases.eventual]
dbname = "app"
consistency = "eventual"

[databases.primary_only]
dbname = "app"
consistency = "primary"
TOML
"$BIN" up --dir "$DIR" --detach >/dev/null
PASSWORD=$(sed -n 's/^app=//p' "$DIR/passwords")
url() { echo "postgres://app:${PASSWORD}@127.0.0.1:${PORT}/$1"; }

"$PGBIN/pgbench" -i -q -s "$SCALE" "$(url app)" >/dev/null 2>&1
sleep 2

declare -A RESULTS
for round in $(seq 1 "$ROUNDS"); do
  for mode in read_your_writes eventual primary_only; do
    out=$("$PGBIN/pgbench" -n -b select-only@9 -b simple-update@1 -c "$CLIENTS" -j 2 \
      -T "$DURATION_S" "$(url "$mode")" 2>&1) || { echo "$out"; exit 1; }
    tps=$(echo "$out" | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    failed=$(echo "$out" | sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p')
    echo "round $round  $mode  $tps tps  failed $failed"
    RESULTS[$mode]="${RESULTS[$mode]:-} $tps"
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
ryw=$(echo "${RESULTS[read_your_writes]}" | median)
ev=$(echo "${RESULTS[eventual]}" | median)
pr=$(echo "${RESULTS[primary_only]}" | median)
echo
echo "| consistency | median TPS | vs eventual |"
echo "|---|---:|---:|"
for pair in "read_your_writes $ryw" "eventual $ev" "primary_only $pr"; do
  set -- $pair
  echo "| $1 | $2 | $(awk -v a="$2" -v b="$ev" 'BEGIN {printf "%.2f", a/b}') |"
done
echo
echo "$CLIENTS clients, 90 % select-only / 10 % simple-update (pgbench builtins), $ROUNDS rounds x ${DURATION_S} s, scale $SCALE, primary + 2 replicas"
