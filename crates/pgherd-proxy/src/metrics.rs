//! Prometheus text exposition (format 0.0.4) of the counters pgherd keeps anyway: nothing
//! here adds work to the data path; a scrape reads atomics and snapshots.
//! Every metric is listed in docs/metrics.md; a test checks the two agree.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use crate::app::App;
use crate::counters::Histogram;
use crate::views;

/// One metric family being written: its samples follow its HELP and TYPE lines.
struct Family<'a> {
    out: &'a mut String,
}

impl Family<'_> {
    /// A histogram's `_bucket` (cumulative, with `le`), `_sum` and `_count` samples.
    fn histogram(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) {
        let (buckets, sum) = h.snapshot();
        let bucket_name = format!("{name}_bucket");
        for (bound, count) in &buckets {
            let le = if bound.is_infinite() {
                "+Inf".to_owned()
            } else {
                bound.to_string()
            };
            let mut with_le = labels.to_vec();
            with_le.push(("le", &le));
            self.sample(&bucket_name, &with_le, *count as f64);
        }
        self.sample(&format!("{name}_sum"), labels, sum);
        let count = buckets.last().map_or(0, |(_, n)| *n);
        self.sample(&format!("{name}_count"), labels, count as f64);
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family<'a>(out: &'a mut String, name: &str, kind: &str, help: &str) -> Family<'a> {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    Family { out }
}

/// The whole exposition.
pub fn render(app: &App) -> String {
    let mut out = String::with_capacity(8 << 10);

    family(
        &mut out,
        "pgherd_info",
        "gauge",
        "Always 1; the version as a label.",
    )
    .sample("pgherd_info", &[("version", crate::admin::VERSION)], 1.0);
    let uptime = app.started_at.elapsed().map_or(0.0, |d| d.as_secs_f64());
    family(
        &mut out,
        "pgherd_uptime_seconds",
        "gauge",
        "Seconds since pgherd started.",
    )
    .sample("pgherd_uptime_seconds", &[], uptime);
    family(
        &mut out,
        "pgherd_config_reloads_total",
        "counter",
        "Successful config reloads.",
    )
    .sample(
        "pgherd_config_reloads_total",
        &[],
        app.reloads.load(Ordering::Relaxed) as f64,
    );
    let view = app.nodes.view();
    family(
        &mut out,
        "pgherd_cluster_view_version",
        "gauge",
        "Changes applied to the cluster view since pgherd started.",
    )
    .sample("pgherd_cluster_view_version", &[], view.version as f64);
    family(
        &mut out,
        "pgherd_cluster_epoch",
        "gauge",
        "Primaries elected since pgherd started.",
    )
    .sample("pgherd_cluster_epoch", &[], view.epoch as f64);
    let gate = view.gate();
    let reason = gate.reason().map_or("", |why| why.kind());
    family(
        &mut out,
        "pgherd_write_gate",
        "gauge",
        "1 for the write gate's state now (open, held or refused) and its reason.",
    )
    .sample(
        "pgherd_write_gate",
        &[("state", gate.state()), ("reason", reason)],
        1.0,
    );
    let mut per_pair: std::collections::BTreeMap<(String, String), u64> = Default::default();
    for c in app.clients.all() {
        *per_pair
            .entry((c.database().to_string(), c.user().to_string()))
            .or_default() += 1;
    }
    let mut f = family(
        &mut out,
        "pgherd_clients",
        "gauge",
        "Client connections logged in, per database and user.",
    );
    for ((database, user), n) in &per_pair {
        f.sample(
            "pgherd_clients",
            &[("database", database), ("user", user)],
            *n as f64,
        );
    }

    let parked = app.parking.get().map_or(0, |lot| lot.parked_count());
    family(
        &mut out,
        "pgherd_clients_parked",
        "gauge",
        "Idle clients parked without a task of their own (client_park_after_ms).",
    )
    .sample("pgherd_clients_parked", &[], parked as f64);

    let pools = app.pools();
    let pool_gauges: [(&str, &str); 3] = [
        (
            "pgherd_pool_clients_waiting",
            "Requests waiting for a server connection of the pool.",
        ),
        (
            "pgherd_pool_max_size",
            "Largest number of server connections the pool may open.",
        ),
        (
            "pgherd_pool_server_connections",
            "Server connections of the pool by state (active: lent to a client; idle; connecting).",
        ),
    ];
    let snapshots: Vec<_> = pools.iter().map(|p| (p, p.snapshot())).collect();
    for (name, help) in pool_gauges {
        let mut f = family(&mut out, name, "gauge", help);
        for (p, s) in &snapshots {
            let labels = [
                ("database", p.database.as_str()),
                ("user", p.user.as_str()),
                ("node", p.node.name.as_str()),
            ];
            match name {
                "pgherd_pool_clients_waiting" => f.sample(name, &labels, s.waiting as f64),
                "pgherd_pool_max_size" => f.sample(name, &labels, f64::from(s.max_size)),
                _ => {
                    for (state, n) in [
                        ("active", f64::from(s.lent)),
                        ("idle", s.idle as f64),
                        ("connecting", f64::from(s.connecting)),
                    ] {
                        let mut with_state = labels.to_vec();
                        with_state.push(("state", state));
                        f.sample(name, &with_state, n);
                    }
                }
            }
        }
    }
    type Counter = fn(&crate::pool::PoolStats) -> f64;
    let pool_counters: [(&str, &str, Counter); 8] = [
        (
            "pgherd_transactions_total",
            "Transactions (or statements outside one) served by the pool.",
            |s| s.transactions.sum() as f64,
        ),
        ("pgherd_queries_total", "Queries served by the pool.", |s| {
            s.queries.sum() as f64
        }),
        (
            "pgherd_pool_wait_seconds_total",
            "Time requests spent waiting for a server connection.",
            |s| s.wait_time.sum_us() as f64 / 1e6,
        ),
        (
            "pgherd_pool_wait_timeouts_total",
            "Requests that found no server connection within pool.wait_timeout_ms.",
            |s| s.wait_timeouts.load(Ordering::Relaxed) as f64,
        ),
        (
            "pgherd_server_connects_total",
            "Server connections opened.",
            |s| s.connects.load(Ordering::Relaxed) as f64,
        ),
        (
            "pgherd_server_connect_failures_total",
            "Server connections that could not be opened.",
            |s| s.connect_failures.load(Ordering::Relaxed) as f64,
        ),
        (
            "pgherd_pool_bytes_to_servers_total",
            "Bytes written to the pool's server connections (client messages and pgherd's own statements).",
            |s| s.bytes_to_servers.sum() as f64,
        ),
        (
            "pgherd_pool_bytes_to_clients_total",
            "Bytes written to clients from the pool's server connections.",
            |s| s.bytes_to_clients.sum() as f64,
        ),
    ];
    for (name, help, read) in pool_counters {
        let mut f = family(&mut out, name, "counter", help);
        for p in &pools {
            f.sample(
                name,
                &[
                    ("database", p.database.as_str()),
                    ("user", p.user.as_str()),
                    ("node", p.node.name.as_str()),
                ],
                read(&p.stats),
            );
        }
    }

    for (name, help, pick) in [
        (
            "pgherd_transaction_duration_seconds",
            "Transactions (or statements outside one) from their first request reaching pgherd, wait for a server included, to the ReadyForQuery that ends them.",
            (|s| &s.transaction_time) as fn(&crate::pool::PoolStats) -> &Histogram,
        ),
        (
            "pgherd_pool_wait_duration_seconds",
            "Waits for a server connection by requests that found none idle (requests served at once are not counted).",
            |s| &s.wait_time,
        ),
    ] {
        let mut f = family(&mut out, name, "histogram", help);
        for p in &pools {
            let labels = [
                ("database", p.database.as_str()),
                ("user", p.user.as_str()),
                ("node", p.node.name.as_str()),
            ];
            f.histogram(name, &labels, pick(&p.stats));
        }
    }
    let mut f = family(
        &mut out,
        "pgherd_transaction_duration_quantile_seconds",
        "gauge",
        "Transaction latency quantiles since pgherd started, estimated from the histogram's buckets (as histogram_quantile does).",
    );
    for p in &pools {
        for (quantile, q) in [("0.5", 0.5), ("0.95", 0.95), ("0.99", 0.99)] {
            if let Some(us) = p.stats.transaction_time.quantile_us(q) {
                f.sample(
                    "pgherd_transaction_duration_quantile_seconds",
                    &[
                        ("database", p.database.as_str()),
                        ("user", p.user.as_str()),
                        ("node", p.node.name.as_str()),
                        ("quantile", quantile),
                    ],
                    us as f64 / 1e6,
                );
            }
        }
    }
    let mut f = family(
        &mut out,
        "pgherd_server_errors_total",
        "counter",
        "Errors servers sent to clients, by SQLSTATE class (the code's first two characters).",
    );
    for p in &pools {
        for (class, n) in p.stats.server_errors.snapshot() {
            f.sample(
                "pgherd_server_errors_total",
                &[
                    ("database", p.database.as_str()),
                    ("user", p.user.as_str()),
                    ("node", p.node.name.as_str()),
                    ("class", class.as_str()),
                ],
                n as f64,
            );
        }
    }
    let mut f = family(
        &mut out,
        "pgherd_errors_total",
        "counter",
        "Errors pgherd itself answered requests with (no node to send them to, a cancelled wait, a full pool), by SQLSTATE class.",
    );
    for (class, n) in app.own_errors.snapshot() {
        f.sample(
            "pgherd_errors_total",
            &[("class", class.as_str())],
            n as f64,
        );
    }
    let routers = app.routers();
    for (name, help, read) in [
        (
            "pgherd_route_cache_hits_total",
            "Read/write routing decisions found in the cache (by statement shape).",
            (|r| r.cache_counts().0) as fn(&crate::routing::Router) -> u64,
        ),
        (
            "pgherd_route_cache_misses_total",
            "Statements classified with the PostgreSQL parser (not in the cache).",
            |r| r.cache_counts().1,
        ),
        (
            "pgherd_catalog_readings_total",
            "Readings of the database's catalog for routing (at start, after schema changes and unknown names, and every minute).",
            |r| r.catalog_counts().0,
        ),
        (
            "pgherd_catalog_changes_total",
            "Catalog readings that found what routing decisions depend on changed; they made every statement shape be classified again.",
            |r| r.catalog_counts().1,
        ),
    ] {
        let mut f = family(&mut out, name, "counter", help);
        for (database, router) in &routers {
            f.sample(
                name,
                &[("database", database.as_str())],
                read(router) as f64,
            );
        }
    }
    cache_metrics(app, &mut out);
    sets_metrics(app, &mut out);

    let nodes = app.nodes.all();
    type NodeValue = fn(&App, &crate::nodes::NodeState) -> f64;
    let node_gauges: [(&str, &str, NodeValue); 6] = [
        (
            "pgherd_node_up",
            "1 if the node's health checks pass (down only after failures_before_down in a row).",
            |_, n| f64::from(u8::from(n.is_up())),
        ),
        (
            "pgherd_node_fenced",
            "1 if failover fenced the node: no traffic through pgherd.",
            |app, n| f64::from(u8::from(app.nodes.is_fenced(n))),
        ),
        (
            "pgherd_node_takes_writes",
            "1 for the node writes are routed to now.",
            |app, n| f64::from(u8::from(views::takes_writes(app, n))),
        ),
        (
            "pgherd_node_in_read_set",
            "1 if reads may be balanced to the node.",
            |_, n| f64::from(u8::from(n.in_read_set())),
        ),
        (
            "pgherd_node_replication_lag_bytes",
            "WAL bytes the replica's replay is behind the primary (0 on the primary).",
            |_, n| n.lag_bytes() as f64,
        ),
        (
            "pgherd_node_replication_lag_seconds",
            "How far the replica's replay is behind the primary, in time.",
            |_, n| n.lag_ms() as f64 / 1e3,
        ),
    ];
    for (name, help, read) in node_gauges {
        let mut f = family(&mut out, name, "gauge", help);
        for n in nodes.iter() {
            f.sample(
                name,
                &[("node", n.name()), ("role", n.role().as_str())],
                read(app, n),
            );
        }
    }
    let health_checks = "pgherd_node_health_checks_total";
    let mut f = family(
        &mut out,
        health_checks,
        "counter",
        "Health checks of the node by result.",
    );
    for n in nodes.iter() {
        let h = n.health();
        f.sample(
            health_checks,
            &[("node", n.name()), ("result", "ok")],
            h.checks_ok as f64,
        );
        f.sample(
            health_checks,
            &[("node", n.name()), ("result", "failed")],
            h.checks_failed as f64,
        );
    }
    let mut f = family(
        &mut out,
        "pgherd_node_down_total",
        "counter",
        "Times the node went from up to down.",
    );
    for n in nodes.iter() {
        f.sample(
            "pgherd_node_down_total",
            &[("node", n.name())],
            n.health().times_down as f64,
        );
    }
    let mut f = family(
        &mut out,
        "pgherd_events_total",
        "counter",
        "Cluster events by kind (promoted: failovers; switched_over: switchovers; see SHOW EVENTS).",
    );
    for (kind, n) in app.events.counts() {
        f.sample("pgherd_events_total", &[("kind", kind)], n as f64);
    }
    out
}

/// Per replication set and subscriber (`[sets]`): how far behind, and whether it streams.
fn sets_metrics(app: &App, out: &mut String) {
    let figures = crate::sets_watch::subscriber_figures(app);
    let name = "pgherd_set_subscriber_lag_bytes";
    let mut f = family(
        out,
        name,
        "gauge",
        "WAL a replication set's origin wrote that the subscriber has not confirmed (its slot's confirmed position).",
    );
    for figure in &figures {
        if let Some(lag) = figure.lag_bytes {
            f.sample(name, &figure.labels(), lag as f64);
        }
    }
    let name = "pgherd_set_subscriber_streaming";
    let mut f = family(
        out,
        name,
        "gauge",
        "1 while the subscription's slot on the origin is in use.",
    );
    for figure in &figures {
        f.sample(
            name,
            &figure.labels(),
            f64::from(u8::from(figure.streaming)),
        );
    }
}

/// The result cache's figures per database.
fn cache_metrics(app: &App, out: &mut String) {
    use crate::result_cache::CacheReport;
    let reports = crate::result_cache::reports(app);
    type CacheValue = fn(&CacheReport) -> u64;
    let families: [(&str, &str, &str, CacheValue); 12] = [
        ("pgherd_cache_hits_total", "counter", "Simple queries answered from the result cache.", |r| r.figures.hits),
        ("pgherd_cache_misses_total", "counter", "Statements asked to be cached that the cache did not answer.", |r| r.figures.misses),
        ("pgherd_cache_stores_total", "counter", "Answers kept in the result cache.", |r| r.figures.stores),
        ("pgherd_cache_not_stored_total", "counter", "Answers not kept: a table they read changed while they were on their way, or they were too large.", |r| r.figures.not_stored),
        ("pgherd_cache_evictions_total", "counter", "Entries dropped to stay within max_bytes (least recently used first).", |r| r.figures.evictions),
        ("pgherd_cache_invalidations_total", "counter", "Entries dropped because a table they read changed (or the cache was cleared).", |r| r.figures.invalidations),
        ("pgherd_cache_expirations_total", "counter", "Entries dropped for being older than ttl_ms.", |r| r.figures.expirations),
        ("pgherd_cache_entries", "gauge", "Entries in the result cache.", |r| r.figures.entries),
        ("pgherd_cache_bytes", "gauge", "Bytes the result cache's entries take (keys, answers, bookkeeping).", |r| r.figures.bytes),
        ("pgherd_cache_serving", "gauge", "1 while the cache may serve: its invalidation stream is live, heard from and caught up.", |r| u64::from(r.serving.is_ok())),
        ("pgherd_cache_decoding_lag_bytes", "gauge", "How far the invalidation stream's decoded position is behind the primary's WAL as last seen.", |r| r.lag_bytes),
        ("pgherd_cache_restarts_total", "counter", "Times the invalidation stream ended and was started again.", |r| r.status.restarts),
    ];
    for (name, kind, help, read) in families {
        let mut f = family(out, name, kind, help);
        for report in &reports {
            f.sample(
                name,
                &[("database", report.database.as_str())],
                read(report) as f64,
            );
        }
    }
    let name = "pgherd_cache_invalidation_delay_seconds";
    let mut f = family(
        out,
        name,
        "histogram",
        "From a commit on the primary (its commit time) to the answers of its tables dropped from the result cache.",
    );
    for db in app.caches.all() {
        f.histogram(
            name,
            &[("database", db.database.as_str())],
            &db.invalidation_delay,
        );
    }
}
