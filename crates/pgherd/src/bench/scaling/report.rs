//! The scaling run's report: TPS per point aggregated over the rounds (medians, or means by
//! the thesis's method), each setup's peak and its ratios (like the thesis's Table 2), the
//! parser's cost, and the CSV, Markdown and SVG files.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::super::pgbench::median;
use super::super::shards;
use super::super::svg::{LineChart, Series};
use super::super::{csv_text, fmt, output_prefix, write_failed_runs};
use super::{Sample, ScalingOptions, ScalingTarget, ScalingWorkload, PROXIES};

/// Median TPS per (workload, target, nodes, clients) (the mean, by the thesis's method).
pub(in crate::bench) type Medians = BTreeMap<(ScalingWorkload, ScalingTarget, usize, u32), f64>;

pub(super) fn medians(samples: &[Sample], options: &ScalingOptions) -> Medians {
    let mut groups: BTreeMap<_, Vec<f64>> = BTreeMap::new();
    for s in samples {
        let tps = match options.transactions_per_client {
            Some(_) => s.result.tps_including_connections(),
            None => s.result.tps,
        };
        groups
            .entry((s.workload, s.target, s.nodes, s.clients))
            .or_default()
            .push(tps);
    }
    let by_mean = options.transactions_per_client.is_some();
    groups
        .into_iter()
        .map(|(k, v)| {
            let tps = match by_mean {
                true => mean_of_finite(&v),
                false => median(&v),
            };
            (k, tps)
        })
        .collect()
}

/// The mean of the values that ran (failed runs are NaN); NaN if none did.
fn mean_of_finite(values: &[f64]) -> f64 {
    let ran: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    match ran.len() {
        0 => f64::NAN,
        n => ran.iter().sum::<f64>() / n as f64,
    }
}

/// The best median over client counts, and the client count it was reached at.
pub(in crate::bench) fn peak(
    m: &Medians,
    workload: ScalingWorkload,
    target: ScalingTarget,
    nodes: usize,
) -> (f64, u32) {
    m.iter()
        .filter(|((w, t, n, _), tps)| {
            *w == workload && *t == target && *n == nodes && tps.is_finite()
        })
        .map(|((_, _, _, c), tps)| (*tps, *c))
        .fold((f64::NAN, 0), |best, x| {
            if best.0.is_nan() || x.0 > best.0 {
                x
            } else {
                best
            }
        })
}

/// What classifying a statement with PostgreSQL's parser costs in pgherd, against computing
/// the literal-blind shape that the decision cache is keyed by (what a cache hit costs).
pub(super) struct ParserCost {
    statement: &'static str,
    classify_us: f64,
    shape_us: f64,
}

pub(super) fn parser_cost() -> Vec<ParserCost> {
    use pgherd_route::catalog::{FunctionInfo, RelationInfo};
    struct AllStable;
    impl pgherd_route::Catalog for AllStable {
        fn function(&self, _: &str) -> Option<FunctionInfo> {
            Some(FunctionInfo::default())
        }
        fn relation(&self, _: &str) -> Option<RelationInfo> {
            Some(RelationInfo::default())
        }
    }
    const STATEMENTS: &[&str] = &[
        "SELECT abalance FROM pgbench_accounts WHERE aid = 48213;",
        "SELECT count(*) FROM seq_scan WHERE k = 812;",
        "UPDATE pgbench_accounts SET abalance = abalance + -3121 WHERE aid = 48213;",
        "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (7, 1, 48213, -3121, CURRENT_TIMESTAMP);",
    ];
    const ITERATIONS: u32 = 20_000;
    STATEMENTS
        .iter()
        .map(|&statement| {
            let time = |f: &dyn Fn()| {
                f();
                let start = Instant::now();
                for _ in 0..ITERATIONS {
                    f();
                }
                start.elapsed().as_secs_f64() * 1e6 / f64::from(ITERATIONS)
            };
            ParserCost {
                statement,
                classify_us: time(&|| {
                    let mut key = Vec::new();
                    let lexed = pgherd_route::lex(statement.as_bytes(), true, &mut key);
                    std::hint::black_box(pgherd_route::classify(
                        std::hint::black_box(statement),
                        &lexed,
                        &AllStable,
                        pgherd_route::parse::DEFAULT_MAX_PARSE_BYTES,
                    ));
                }),
                shape_us: time(&|| {
                    let mut key = Vec::with_capacity(statement.len() + 16);
                    std::hint::black_box(pgherd_route::lex(
                        std::hint::black_box(statement.as_bytes()),
                        true,
                        &mut key,
                    ));
                }),
            }
        })
        .collect()
}

pub(super) fn render_report(
    options: &ScalingOptions,
    nodes: &[usize],
    samples: &[Sample],
    parser: &[ParserCost],
    took: Duration,
) -> String {
    let m = medians(samples, options);
    let get = |w, t, n, c| m.get(&(w, t, n, c)).copied().unwrap_or(f64::NAN);
    let base_nodes = nodes[0];
    let mut r = String::new();
    let _ = writeln!(
        r,
        "## pgherd bench scaling\n\n{} round(s) x {}, scale {}, every node limited to {}% of a core \
         (cgroup v1 cpu quota; 0 = none), pgherd balance {}, Pgpool-II {} load balancing; {} over rounds; \
         {} min in all. `direct` is one node with nothing in front.\n",
        options.rounds,
        match options.transactions_per_client {
            Some(t) => format!("{t} transactions per client (TPS counting the connections' opening)"),
            None => format!("{} s per run", options.duration_s),
        },
        options.scale(),
        options.cpu_quota_percent,
        options.balance,
        if options.pgpool_statement_level { "statement-level" } else { "session-level (its default)" },
        if options.transactions_per_client.is_some() { "means" } else { "medians" },
        took.as_secs() / 60
    );
    if options.node_memory_mb > 0 {
        let _ = writeln!(
            r,
            "Every node's memory, page cache included, is capped at {} MiB (cgroup v1 memory; \
             shared_buffers a quarter of it): the data larger than that is read from the disk.\n",
            options.node_memory_mb
        );
    }
    for &workload in &options.workloads {
        let _ = writeln!(r, "### {} (TPS)\n", workload.name());
        let mut header = String::from("| clients | direct |");
        let mut rule = String::from("|---:|---:|");
        for target in PROXIES {
            if !options.targets.contains(&target) {
                continue;
            }
            for &n in nodes {
                let _ = write!(header, " {} {n} |", target.name());
                rule.push_str("---:|");
            }
        }
        let _ = writeln!(r, "{header}\n{rule}");
        for &clients in &options.clients {
            let _ = write!(
                r,
                "| {clients} | {} |",
                fmt(get(workload, ScalingTarget::Direct, 1, clients), 0)
            );
            for target in PROXIES {
                if !options.targets.contains(&target) {
                    continue;
                }
                for &n in nodes {
                    let _ = write!(r, " {} |", fmt(get(workload, target, n, clients), 0));
                }
            }
            r.push('\n');
        }
        r.push('\n');
    }
    let _ = writeln!(
        r,
        "### Scaling (like the thesis's Table 2)\n\nPeak TPS over client counts (clients at the peak), \
         and its ratio to one node direct and to the same middleware on {base_nodes} node(s).\n"
    );
    let _ = writeln!(
        r,
        "| workload | nodes | pgherd peak | pgherd / direct | pgherd / pgherd {base_nodes} | Pgpool-II peak | Pgpool-II / direct | Pgpool-II / Pgpool-II {base_nodes} | pgherd / Pgpool-II |"
    );
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &workload in &options.workloads {
        let direct = peak(&m, workload, ScalingTarget::Direct, 1).0;
        let h1 = peak(&m, workload, ScalingTarget::Pgherd, base_nodes).0;
        let p1 = peak(&m, workload, ScalingTarget::Pgpool, base_nodes).0;
        for &n in nodes {
            let (h, hc) = peak(&m, workload, ScalingTarget::Pgherd, n);
            let (p, pc) = peak(&m, workload, ScalingTarget::Pgpool, n);
            let _ = writeln!(
                r,
                "| {} | {n} | {} ({hc}) | {} | {} | {} ({pc}) | {} | {} | {} |",
                workload.name(),
                fmt(h, 0),
                fmt(h / direct, 2),
                fmt(h / h1, 2),
                fmt(p, 0),
                fmt(p / direct, 2),
                fmt(p / p1, 2),
                fmt(h / p, 2)
            );
        }
    }
    if options.targets.contains(&ScalingTarget::PgherdShards) {
        shards::report(&mut r, &options.workloads, nodes, &m);
    }
    let throttled: Vec<String> = options
        .workloads
        .iter()
        .flat_map(|&w| nodes.iter().map(move |&n| (w, n)))
        .filter_map(|(w, n)| {
            let shares: Vec<f64> = samples
                .iter()
                .filter(|s| s.workload == w && s.nodes == n && s.target == ScalingTarget::Pgherd)
                .filter(|s| Some(s.clients) == options.clients.iter().copied().max())
                .filter_map(|s| s.throttled)
                .collect();
            (!shares.is_empty())
                .then(|| format!("{} {n} node(s): {:.0}%", w.name(), median(&shares) * 100.0))
        })
        .collect();
    if !throttled.is_empty() {
        let _ = writeln!(
            r,
            "\nShare of the nodes' CPU periods that ran out of quota through pgherd at the most clients \
             (near 100% means the nodes, not pgbench or pgherd, were the limit): {}.",
            throttled.join("; ")
        );
    }
    disk_reads(&mut r, options, samples);
    let _ = writeln!(
        r,
        "\n### Parser cost\n\nMicroseconds per statement in this process, one core: classifying with \
         PostgreSQL's parser (a decision-cache miss) against the literal-blind shape that keys the \
         cache (what every request pays; a hit adds one hash-map lookup).\n"
    );
    let _ = writeln!(r, "| statement | classify µs | shape µs |");
    let _ = writeln!(r, "|---|---:|---:|");
    for p in parser {
        let _ = writeln!(
            r,
            "| `{}` | {:.2} | {:.3} |",
            p.statement, p.classify_us, p.shape_us
        );
    }
    write_failed_runs(
        &mut r,
        samples.iter().filter_map(|s| {
            let e = s.error.as_ref()?;
            Some(format!(
                "- {} {} node(s) {} clients {}: {e}",
                s.workload.name(),
                s.nodes,
                s.clients,
                s.target.name()
            ))
        }),
    );
    r
}

/// KiB read from the disks per transaction (medians over rounds), per workload, target and
/// node count at each client count: whether the reads came from memory or from the disk.
fn disk_reads(r: &mut String, options: &ScalingOptions, samples: &[Sample]) {
    let mut groups: BTreeMap<_, Vec<(u32, f64)>> = BTreeMap::new();
    for s in samples {
        if let Some(kib) = s.disk_read_kib_per_txn {
            groups
                .entry((s.workload, s.target, s.nodes))
                .or_default()
                .push((s.clients, kib));
        }
    }
    if groups.is_empty() || options.node_memory_mb == 0 {
        return;
    }
    let _ = writeln!(
        r,
        "\n### Disk reads\n\nKiB read from the machine's disks per transaction (/proc/diskstats; \
         medians over rounds).\n"
    );
    let mut header = String::from("| workload | target | nodes |");
    let mut rule = String::from("|---|---|---:|");
    for c in &options.clients {
        let _ = write!(header, " {c} clients |");
        rule.push_str("---:|");
    }
    let _ = writeln!(r, "{header}\n{rule}");
    for ((workload, target, nodes), points) in groups {
        let _ = write!(r, "| {} | {} | {nodes} |", workload.name(), target.name());
        for &c in &options.clients {
            let at: Vec<f64> = points
                .iter()
                .filter(|(clients, _)| *clients == c)
                .map(|(_, kib)| *kib)
                .collect();
            let _ = write!(r, " {} |", fmt(median(&at), 1));
        }
        r.push('\n');
    }
}

pub(super) fn write_outputs(
    options: &ScalingOptions,
    nodes: &[usize],
    samples: &[Sample],
    report: &str,
) -> Result<(), String> {
    let prefix = output_prefix(&options.out, "scaling")?;
    let mut csv = String::from(
        "round,workload,nodes,clients,target,tps,tps_including_connections,latency_avg_ms,latency_p99_ms,transactions,failed,nodes_throttled_share,disk_read_kib_per_txn,error\n",
    );
    for s in samples {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{:.1},{:.1},{:.4},{:.4},{},{},{},{},{}",
            s.round + 1,
            s.workload.name(),
            s.nodes,
            s.clients,
            s.target.name(),
            s.result.tps,
            s.result.tps_including_connections(),
            s.result.latency_avg_ms,
            s.result.latency_p99_ms,
            s.result.transactions,
            s.result.failed,
            s.throttled.map(|t| format!("{t:.3}")).unwrap_or_default(),
            s.disk_read_kib_per_txn
                .map(|k| format!("{k:.2}"))
                .unwrap_or_default(),
            csv_text(s.error.as_deref())
        );
    }
    let mut written = vec![
        format!("{}.csv", prefix.display()),
        format!("{}.md", prefix.display()),
    ];
    std::fs::write(&written[0], csv).map_err(|e| e.to_string())?;
    std::fs::write(&written[1], report).map_err(|e| e.to_string())?;
    let m = medians(samples, options);
    for &workload in &options.workloads {
        for target in PROXIES {
            if !options.targets.contains(&target) {
                continue;
            }
            let line = |t: ScalingTarget, n: usize| -> Vec<(f64, f64)> {
                options
                    .clients
                    .iter()
                    .map(|&c| {
                        (
                            f64::from(c),
                            m.get(&(workload, t, n, c)).copied().unwrap_or(f64::NAN),
                        )
                    })
                    .collect()
            };
            let mut series = vec![Series {
                name: "1 node direct".into(),
                points: line(ScalingTarget::Direct, 1),
                dashed: true,
            }];
            series.extend(nodes.iter().map(|&n| Series {
                name: format!(
                    "{} {n} node{}",
                    target_label(target),
                    if n == 1 { "" } else { "s" }
                ),
                points: line(target, n),
                dashed: false,
            }));
            let chart = LineChart {
                title: format!(
                    "{}: {} over 1–{} nodes",
                    workload.name(),
                    target_label(target),
                    nodes[nodes.len() - 1]
                ),
                x_label: "clients".into(),
                y_label: "transactions per second".into(),
                series,
            };
            let path = format!(
                "{}-{}-{}.svg",
                prefix.display(),
                workload.name(),
                target.name()
            );
            std::fs::write(&path, chart.render()).map_err(|e| format!("{path}: {e}"))?;
            written.push(path);
        }
    }
    eprintln!("wrote {}", written.join(", "));
    Ok(())
}

fn target_label(target: ScalingTarget) -> &'static str {
    match target {
        ScalingTarget::Direct => "direct",
        ScalingTarget::Pgherd => "pgherd",
        ScalingTarget::Pgpool => "Pgpool-II",
        ScalingTarget::PgherdShards => "pgherd sharded",
    }
}
