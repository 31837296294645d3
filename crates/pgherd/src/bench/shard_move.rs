//! `pgherd bench shard-move` and `shard-split`: `pgherd shard move` or `shard split` under
//! pgbench load. Two one-node clusters are the shards of a sharded pgherd (pgbench's tables
//! loaded through it, `pgbench_accounts` spread by `aid`: by hash for a move, by ranges for a
//! split), and one or two empty clusters take shard 1 (a move) or its two halves (a split, at
//! the middle of its range: the upper half becomes shard 2). pgbench
//! runs a write script through pgherd (each transaction adds 1 to one account's balance and
//! reads it back) with a progress line a second; after a lead-in the move runs (copy, check,
//! cut-over under PAUSE). Reported: the clients' failed transactions and aborted clients, the
//! cut-over's pause as the command measured it, whether its consistency check of each copy
//! found no difference, throughput before, during and after, the slowest second, and whether
//! every committed transaction is in the balances read through pgherd afterwards (their sum
//! equals pgbench's count of committed transactions: no acknowledged write lost, none applied
//! twice, and a fan-out counts no row twice).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::consistency::parse_progress;
use super::pgbench::parse_report;
use super::shards::{hash_layout, range_layout, ProxySettings, ShardClusters};
use super::targets::BenchUser;
use super::work_dir;

#[derive(clap::Args, Debug)]
pub struct ShardMoveOptions {
    /// pgbench scale (10: a million rows in pgbench_accounts, half of them on the moved shard).
    #[arg(long, default_value_t = 10)]
    scale: u32,
    /// pgbench clients writing through pgherd.
    #[arg(long, default_value_t = 8)]
    clients: u32,
    /// Seconds of load before the move starts.
    #[arg(long, default_value_t = 10)]
    lead_s: u64,
    /// Seconds pgbench runs in all: the move must end well inside it.
    #[arg(long, default_value_t = 90)]
    duration_s: u64,
    /// Where the clusters live [default: a temporary directory].
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// One transaction: one account's balance up by exactly 1, then read. The balances' sum is
/// then the number of committed transactions.
const SCRIPT: &str = "\\set aid random(1, 100000 * :scale)\n\
BEGIN;\n\
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n\
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n\
END;\n";

/// What is done to shard 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reshape {
    /// `pgherd shard move 1` to a third cluster.
    Move,
    /// `pgherd shard split 1` at the middle of its range, into a third and a fourth cluster.
    Split,
}

impl Reshape {
    fn noun(self) -> &'static str {
        match self {
            Reshape::Move => "move",
            Reshape::Split => "split",
        }
    }
}

/// The move or split as it ran.
struct MoveRun {
    reshape: Reshape,
    said: String,
    succeeded: bool,
    started_s: f64,
    seconds: f64,
    held_ms: Option<u64>,
}

pub fn run(options: ShardMoveOptions, reshape: Reshape) -> Result<(), String> {
    let (dir, _tmp) = work_dir(options.dir.as_ref())?;
    let binaries = pgherd_cluster::PgBinaries::find().map_err(|e| e.to_string())?;
    let pgbench = binaries.tool("pgbench");
    let user = BenchUser::new("bench", 4096);
    let proxy = ProxySettings {
        user: &user,
        pool_size: 20,
        workers: 0,
    };
    let settings = vec![("wal_level".to_owned(), "logical".to_owned())];
    // Shards 0 and 1 loaded over two shards; the others are where shard 1 goes.
    let (clusters, layout) = match reshape {
        Reshape::Move => (3, hash_layout as fn(usize, u32) -> String),
        Reshape::Split => (4, range_layout as fn(usize, u32) -> String),
    };
    let shards = ShardClusters::create(
        &dir,
        (clusters, layout),
        &settings,
        &proxy,
        (&[2], options.scale),
        &pgbench,
    )?;
    // Every shard's cluster took the first one's superuser password (pgherd logs in with it).
    let password = &shards
        .cluster(0)
        .ok_or("no first cluster")?
        .superuser_password;
    let mut targets = Vec::new();
    for k in 2..clusters {
        let target = shards.cluster(k).ok_or("no target cluster")?;
        target.sql(
            "postgres",
            &format!("CREATE DATABASE shards2 OWNER {}", user.name),
        )?;
        let node = target.cluster.primary();
        targets.push(format!(
            "host={} port={} user=postgres password={password} dbname=shards2",
            node.host, node.port
        ));
    }
    let pgherd = shards.start_named_pgherd(2, &proxy, "pgherd-shard-move", true)?;
    let config = pgherd
        .config_path()
        .ok_or("the sharded pgherd has no config file")?
        .to_path_buf();
    let script = dir.join("add-one.sql");
    std::fs::write(&script, SCRIPT).map_err(|e| format!("{}: {e}", script.display()))?;
    let url = user.url(pgherd.port, "bench");

    eprintln!(
        "pgbench ({} clients, {} s) through the sharded pgherd; shard 1's {} starts after {} s ...",
        options.clients,
        options.duration_s,
        reshape.noun(),
        options.lead_s
    );
    let t0 = Instant::now();
    let load = Command::new(&pgbench)
        .args(["-n", "-P", "1", "-j", "2", "-M", "simple"])
        .args(["-c", &options.clients.to_string()])
        .args(["-T", &options.duration_s.to_string()])
        .args(["-D", &format!("scale={}", options.scale)])
        .arg("-f")
        .arg(&script)
        .arg(&url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run pgbench: {e}"))?;
    std::thread::sleep(Duration::from_secs(options.lead_s));
    let args: Vec<String> = match reshape {
        Reshape::Move => ["move", "1", "--to", &targets[0], "--name", "shard1-new"]
            .map(str::to_owned)
            .to_vec(),
        Reshape::Split => {
            // The middle of shard 1's range (the upper half of pgbench's keys).
            let cut = 1 + 75_000 * u64::from(options.scale);
            let at = cut.to_string();
            [
                "split",
                "1",
                "--at",
                &at,
                "--lower",
                &targets[0],
                "--lower-name",
                "shard1-lo",
                "--upper",
                &targets[1],
                "--upper-name",
                "shard2",
            ]
            .map(str::to_owned)
            .to_vec()
        }
    };
    let moved = reshape_shard(&config, reshape, &args, t0)?;
    eprintln!("{}", moved.said.trim());
    let out = load.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary = parse_report(&stdout);
    let aborted = stderr
        .lines()
        .filter(|l| l.contains("aborted in command"))
        .count();
    let sum = balance_sum(&pgbench, &url)?;
    print!(
        "{}",
        report(
            &options,
            &moved,
            Load {
                committed: summary.as_ref().map(|s| s.transactions),
                failed: summary.as_ref().map(|s| s.failed),
                aborted,
                progress: parse_progress(&stderr),
                balance_sum: sum,
                exit_ok: out.status.success(),
            }
        )
    );
    if !out.status.success() {
        eprintln!("pgbench's complaints:\n{}", first_errors(&stderr));
    }
    match moved.succeeded {
        true => Ok(()),
        false => Err(format!(
            "the {} failed: {}",
            reshape.noun(),
            moved.said.trim()
        )),
    }
}

fn reshape_shard(
    config: &Path,
    reshape: Reshape,
    args: &[String],
    t0: Instant,
) -> Result<MoveRun, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let out = Command::new(exe)
        .arg("shard")
        .args(args)
        .args(["--database", "shards2", "--config"])
        .arg(config)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run pgherd shard {}: {e}", reshape.noun()))?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(MoveRun {
        reshape,
        held_ms: held_ms(&said),
        succeeded: out.status.success(),
        said,
        started_s: started.duration_since(t0).as_secs_f64(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// How the consistency checks the command ran before its cut-over ended: one per copy, each
/// "N tables checked on ...: no difference" when the copy is equal to the rows it holds.
fn compared(said: &str, reshape: Reshape) -> String {
    let copies = match reshape {
        Reshape::Move => 1,
        Reshape::Split => 2,
    };
    let same = said
        .lines()
        .filter(|l| l.contains(" tables checked on ") && l.ends_with(": no difference"))
        .count();
    match same {
        n if n == copies => format!("{n} of {copies}: no difference"),
        n => format!("{n} of {copies} found equal (see the command's output)"),
    }
}

/// "new transactions were held N ms" in the move's report.
fn held_ms(said: &str) -> Option<u64> {
    let (_, after) = said.split_once("new transactions were held ")?;
    after.split_once(" ms")?.0.parse().ok()
}

/// The balances' sum read through pgherd (pgbench's `-i` starts them at 0).
fn balance_sum(pgbench: &Path, url: &str) -> Result<Option<i64>, String> {
    let psql = pgbench.with_file_name("psql");
    let out = Command::new(psql)
        .args(["-X", "-A", "-t", "-d", url, "-c"])
        .arg("SELECT sum(abalance) FROM pgbench_accounts")
        .output()
        .map_err(|e| format!("cannot run psql: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the balances could not be read through pgherd: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse().ok())
}

fn first_errors(stderr: &str) -> String {
    stderr
        .lines()
        .filter(|l| !l.starts_with("progress: "))
        .take(10)
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the load saw.
struct Load {
    committed: Option<u64>,
    failed: Option<u64>,
    aborted: usize,
    progress: Vec<(f64, f64)>,
    balance_sum: Option<i64>,
    exit_ok: bool,
}

fn report(options: &ShardMoveOptions, moved: &MoveRun, load: Load) -> String {
    let end_s = moved.started_s + moved.seconds;
    // A progress line covers the second before it.
    let mean_tps = |keep: &dyn Fn(f64) -> bool| {
        let tps: Vec<f64> = load
            .progress
            .iter()
            .filter(|(at_s, _)| keep(*at_s))
            .map(|(_, tps)| *tps)
            .collect();
        match tps.len() {
            0 => "n/a".to_owned(),
            n => format!("{:.0}", tps.iter().sum::<f64>() / n as f64),
        }
    };
    let before = mean_tps(&|at| at <= moved.started_s);
    let during = mean_tps(&|at| at - 1.0 >= moved.started_s && at <= end_s);
    let after = mean_tps(&|at| at - 1.0 >= end_s);
    let slowest = load
        .progress
        .iter()
        .filter(|(at, _)| *at - 1.0 >= moved.started_s && *at <= end_s + 1.0)
        .map(|(_, tps)| *tps)
        .fold(f64::INFINITY, f64::min);
    let show = |v: Option<u64>| v.map_or("unknown".to_owned(), |v| v.to_string());
    let writes_kept = match (load.committed, load.balance_sum) {
        (Some(c), Some(s)) if c as i64 == s => format!("yes: {s} = {c} committed"),
        (Some(c), Some(s)) => format!("NO: balances add up to {s}, pgbench committed {c}"),
        _ => "unknown (no pgbench summary or no sum)".to_owned(),
    };
    let noun = moved.reshape.noun();
    let what = match moved.reshape {
        Reshape::Move => "shard 1 to a third cluster",
        Reshape::Split => {
            "pgbench_accounts by aid ranges, shard 1 split at the middle of its range into a third and a fourth cluster"
        }
    };
    let mut out = format!(
        "\n## pgherd shard {noun} under pgbench load (scale {}, {} clients, one-node shards, {what})\n\n",
        options.scale, options.clients
    );
    out.push_str("| figure | value |\n|---|---|\n");
    let mut row = |k: &str, v: String| out.push_str(&format!("| {k} | {v} |\n"));
    row(
        noun,
        match moved.succeeded {
            true => format!(
                "succeeded, {:.1} s (from {:.1} s into the load)",
                moved.seconds, moved.started_s
            ),
            false => format!("FAILED after {:.1} s", moved.seconds),
        },
    );
    row(
        "new transactions held at the cut-over",
        moved
            .held_ms
            .map_or("not reported".to_owned(), |ms| format!("{ms} ms")),
    );
    row(
        "copies compared before the cut-over",
        compared(&moved.said, moved.reshape),
    );
    row("client transactions committed", show(load.committed));
    row("client transactions failed", show(load.failed));
    row("clients aborted by an error", load.aborted.to_string());
    row(
        "pgbench ended cleanly",
        if load.exit_ok { "yes" } else { "no" }.to_owned(),
    );
    row("every committed transaction in the balances", writes_kept);
    row(
        &format!("TPS before / during / after the {noun}"),
        format!("{before} / {during} / {after}"),
    );
    row(
        &format!("slowest second during the {noun}"),
        if slowest.is_finite() {
            format!("{slowest:.0} TPS")
        } else {
            "none measured".to_owned()
        },
    );
    if end_s > options.duration_s as f64 {
        row(
            "note",
            format!("the {noun} ended after the load: its cut-over was not under load (raise --duration-s)"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_is_read_from_the_move() {
        assert_eq!(
            held_ms("shard 1 moved to s (h:1/db): new transactions were held 123 ms; x"),
            Some(123)
        );
        assert_eq!(held_ms("pgherd: no"), None);
        let said = "2 tables checked on shard1, h:1/db: no difference\n\
                    2 tables checked on shard1, h:2/db: no difference\n";
        assert_eq!(compared(said, Reshape::Split), "2 of 2: no difference");
        assert!(compared(said, Reshape::Move).starts_with("2 of 1"));
    }
}
