#!/bin/bash
# Instructions a pooler executes per transaction, counted by valgrind's callgrind: repeatable
# for the same binary and load whatever else the machine does (wall-clock user time on this
# shared 2-core machine is not). Used for docs/benchmarks.md, "Instructions per transaction".
#
# usage: count-instructions.sh BINARY LABEL PORT TRANSACTIONS tpcb|select CLIENTS
#   BINARY is a pgherd build or /usr/sbin/pgbouncer (LABEL "pgbouncer"). Expects, in $D
#   (default /tmp/prof): pgherd.toml (one node, listen 127.0.0.1:6500, workers = 1,
#   route = "primary", pool 20, trust) or pgbouncer.ini (listen_port 6501, trust, pool 20),
#   in front of a PostgreSQL 15 server with `pgbench -i` tables, all owned by postgres.
# Warms up (the router's catalog load and first parses must fall outside the count), zeroes
# the counters, runs pgbench -t, dumps, and divides.
set -euo pipefail
BIN=$1; label=$2; port=$3; n=${4:-2000}; mode=${5:-tpcb}; clients=${6:-1}
D=${D:-/tmp/prof}
opt=""; [ "$mode" = select ] && opt="-S"
out=$D/cg-$label.out
rm -f "$out"*
if [ "$label" = pgbouncer ]; then
    sed "s/6501/$port/; s#pgbouncer.pid#pgbouncer-cg.pid#" "$D/pgbouncer.ini" >"$D/pgbouncer-cg.ini"
    chown postgres "$D/pgbouncer-cg.ini"
    runuser -u postgres -- valgrind --tool=callgrind --callgrind-out-file="$out" "$BIN" "$D/pgbouncer-cg.ini" >"$D/cg-$label.log" 2>&1 &
else
    # Health checks once a minute: they run by the clock, and valgrind slows the data path.
    sed "s/6500/$port/; s/\[cluster\]/[cluster]\nhealth_check_period_ms = 60000/" "$D/pgherd.toml" >"$D/pgherd-cg.toml"
    chown postgres "$D/pgherd-cg.toml"
    runuser -u postgres -- valgrind --tool=callgrind --callgrind-out-file="$out" "$BIN" run --config "$D/pgherd-cg.toml" >"$D/cg-$label.log" 2>&1 &
fi
for _ in $(seq 60); do ss -Hltn "sport = :$port" | grep -q . && break; sleep 1; done
pb() { runuser -u postgres -- /usr/lib/postgresql/15/bin/pgbench -n $opt -c "$clients" -j 1 -t "$1" -h 127.0.0.1 -p "$port" postgres >/dev/null 2>&1; }
pb 600; sleep 3; pb 100
pid=$(pgrep -f "callgrind-out-file=$out" | tail -1)
runuser -u postgres -- callgrind_control -z "$pid" >/dev/null
pb $((n / clients))
runuser -u postgres -- callgrind_control -d "$pid" >/dev/null
sleep 1; kill "$pid"; sleep 2
total=$(callgrind_annotate "$out.1" 2>/dev/null | grep -m1 "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
echo "$label $mode c=$clients: $total Ir over $n txns = $((total / n)) Ir/txn"
