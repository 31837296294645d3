//! The `pgherd` command: runs the proxy, manages the embedded local cluster, and benchmarks.

mod bench;
mod clone;
mod config_file;
mod consistency;
mod drill;
mod local;
mod logging;
mod operate;
mod remove;
mod script;
mod set_drop;
mod set_move;
mod set_nodes;
mod set_sequences;
mod sets;
mod shard_copy;
mod shard_move;
mod sql_session;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pgherd_config::Config;

/// mimalloc: size classes that fit pgherd's many small per-client allocations with less waste
/// and fragmentation than glibc's allocator under connection churn.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "pgherd",
    version,
    about = "PostgreSQL pooler, router and high-availability manager in one program"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run pgherd with a config file.
    Run {
        #[arg(long, short, default_value = "pgherd.toml")]
        config: PathBuf,
        /// Take over from a running pgherd (an upgrade starts the new binary so).
        #[arg(long = "takeover-fd", hide = true)]
        takeover_fd: Option<i32>,
    },
    /// Create (first time) and start a local cluster (a primary and streaming replicas) with
    /// pgherd in front of it.
    Up(local::UpOptions),
    /// Stop what `pgherd up` started.
    Down {
        /// The cluster directory made by `pgherd up` [default: as `pgherd up`'s].
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Show pgherd and its nodes.
    Status {
        #[command(flatten)]
        at: local::Where,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Move the primary role to another node with no lost transaction and no client error
    /// (asks the running pgherd, on its admin console, as the [cluster] user).
    Switchover {
        #[command(flatten)]
        at: local::Where,
        /// The node to promote; by default the most advanced streaming replica.
        #[arg(long)]
        to: Option<String>,
    },
    /// Replace the running pgherd with the binary now at its path, dropping no client: idle
    /// clients move to the new process with their sessions, others when their transaction
    /// ends; the old process exits once it holds none (asks the running pgherd).
    Upgrade {
        #[command(flatten)]
        at: local::Where,
    },
    /// Make a node a standby of the primary again (a replaced primary after a failover):
    /// pg_rewind, or pg_basebackup when rewinding fails (asks the running pgherd).
    Rejoin {
        /// The node to rejoin.
        node: String,
        #[command(flatten)]
        at: local::Where,
    },
    /// Promote a replica by hand when the primary is dead and automatic failover is off or
    /// will not act (asks the running pgherd). The safeguards of automatic failover apply;
    /// each refusal names the one `--force` skips.
    Promote {
        node: String,
        /// A safeguard to skip: primary-answers, split-brain-guard, confirmed, settled,
        /// eligible, most-advanced, sync-quorum (repeatable).
        #[arg(long, value_name = "SAFEGUARD")]
        force: Vec<String>,
        #[command(flatten)]
        at: local::Where,
    },
    /// Take a node out of traffic (transactions running there finish; never promoted while
    /// detached); asks the running pgherd.
    Detach {
        node: String,
        #[command(flatten)]
        at: local::Where,
    },
    /// Let a detached node take traffic again.
    Attach {
        node: String,
        #[command(flatten)]
        at: local::Where,
    },
    /// The running pgherd's cluster events (failovers, switchovers, rejoins, ...), oldest
    /// first (from its HTTP API).
    Events {
        #[command(flatten)]
        at: local::Where,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Fault drills on a local cluster: faults on the primary under write load; checks that no
    /// acknowledged write is lost and no two nodes took writes, and reports the RTO clients saw.
    Drill(drill::DrillOptions),
    /// Make a new streaming replica on this machine, copied from any node: the primary, or a
    /// replica it then streams from (cascading); added to the config, and the running pgherd
    /// reloads.
    Clone(clone::CloneOptions),
    /// Take a replica out of the cluster while pgherd runs: stopped (when pgherd manages it),
    /// its replication slots dropped, its entry removed from the config, and the running
    /// pgherd reloads. The primary and a replica others stream from are refused.
    Remove(remove::RemoveOptions),
    /// Replication sets (Slony-I style, on logical replication): chosen tables of a database,
    /// published from their origin; other clusters or databases subscribe to them.
    Set {
        #[command(subcommand)]
        command: sets::SetCommand,
    },
    /// Shards of a sharded endpoint: `move` puts a shard on another cluster while clients
    /// write (copied, compared, cut over with new transactions held for a moment).
    Shard {
        #[command(subcommand)]
        command: shard_move::ShardCommand,
    },
    /// Run a DDL script on a replication set's origin and subscribers, each statement in the
    /// order that keeps replication applying, saying what it locks; stops at the first failure
    /// with what ran where; then tables that now match the set's patterns join it.
    ExecuteScript(script::ScriptOptions),
    /// Compare the rows of the primary and its replicas, table by table and key range by key
    /// range, at the same point on every node while writes go on; exits non-zero when a table
    /// differs, listing where.
    CheckConsistency(consistency::CheckOptions),
    /// Validate a config file and exit.
    CheckConfig {
        #[arg(default_value = "pgherd.toml")]
        config: PathBuf,
    },
    /// Benchmarks that measure pgherd beside its peers in one run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Print a SCRAM-SHA-256 verifier for a password read from standard input, for [users].
    Passwd {
        /// The user the verifier is for (printed in the TOML snippet).
        user: String,
    },
}

/// Gives the memory freed since the last call back to the system where whole pages are free
/// (mimalloc otherwise keeps them while the thread that freed them allocates nothing more).
fn release_memory() {
    // SAFETY: mi_collect takes no pointers; any thread may call it at any time.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

fn main() -> ExitCode {
    pgherd_proxy::handover::record_launch();
    pgherd_proxy::memory::set_release(release_memory);
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run {
            config,
            takeover_fd,
        } => run(&config, takeover_fd),
        Command::Up(options) => local::up(options),
        Command::Down { dir } => local::down(dir.as_deref()),
        Command::Status { at, json } => operate::status(&at, json),
        Command::Switchover { at, to } => {
            let command = match &to {
                Some(node) => format!("SWITCHOVER TO {node}"),
                None => "SWITCHOVER".to_owned(),
            };
            operate::admin_command(&at, &command)
        }
        Command::Upgrade { at } => operate::admin_command(&at, "UPGRADE"),
        Command::Rejoin { node, at } => operate::admin_command(&at, &format!("REJOIN \"{node}\"")),
        Command::Promote { node, force, at } => {
            let mut command = format!("PROMOTE \"{node}\"");
            if !force.is_empty() {
                command.push_str(&format!(" FORCE {}", force.join(",")));
            }
            // The console checks the names; this keeps anything else out of its command line.
            match force
                .iter()
                .find(|f| f.is_empty() || !f.chars().all(|c| c.is_ascii_alphabetic() || c == '-'))
            {
                Some(bad) => Err(format!("--force {bad:?} is not a safeguard name")),
                None => operate::admin_command(&at, &command),
            }
        }
        Command::Detach { node, at } => operate::admin_command(&at, &format!("DETACH \"{node}\"")),
        Command::Attach { node, at } => operate::admin_command(&at, &format!("ATTACH \"{node}\"")),
        Command::Events { at, json } => operate::events(&at, json),
        Command::Drill(options) => drill::run(options),
        Command::CheckConsistency(options) => consistency::run(options),
        Command::Clone(options) => clone::run(options),
        Command::Remove(options) => remove::run(options),
        Command::Set { command } => sets::run(command),
        Command::Shard { command } => shard_move::run(command),
        Command::ExecuteScript(options) => script::run(options),
        Command::CheckConfig { config } => check_config(&config),
        Command::Passwd { user } => passwd(&user),
        Command::Bench(command) => bench::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pgherd: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Worker threads when the config says 0: a quarter of the CPUs, at least one. A pooler
/// needs a fraction of the database's CPU, and on small machines it shares them with the
/// database: measured on 2 cores, one thread gives more throughput than two.
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).max(1))
}

/// Builds the runtime pgherd serves on. One worker runs everything on one thread, with no
/// work stealing or cross-thread wakeups.
pub fn runtime(workers: usize) -> Result<tokio::runtime::Runtime, String> {
    let workers = if workers == 0 {
        default_workers()
    } else {
        workers
    };
    let mut builder = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    if workers > 1 {
        builder.worker_threads(workers);
    }
    builder
        .enable_all()
        .on_thread_park(pgherd_proxy::memory::on_thread_idle)
        .thread_name("pgherd-worker")
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

fn run(path: &std::path::Path, takeover_fd: Option<i32>) -> Result<(), String> {
    let config = Config::load(path).map_err(|e| e.to_string())?;
    logging::init(&config.proxy);
    if let Some(warning) = config.group_readable_secret() {
        tracing::warn!("{warning}");
    }
    let rt = runtime(config.proxy.workers)?;
    match takeover_fd {
        Some(fd) => rt.block_on(pgherd_proxy::serve_taking_over(config, fd, |_| {})),
        None => rt.block_on(pgherd_proxy::serve(config, |_| {})),
    }
}

fn check_config(path: &std::path::Path) -> Result<(), String> {
    let config = Config::load(path).map_err(|e| e.to_string())?;
    println!(
        "{}: ok ({} node(s), {} database entr{}, {} user(s), {} hba rule(s))",
        path.display(),
        config.nodes.len(),
        config.databases.len(),
        if config.databases.len() == 1 {
            "y"
        } else {
            "ies"
        },
        config.users.len(),
        config.hba.len()
    );
    Ok(())
}

fn passwd(user: &str) -> Result<(), String> {
    let mut password = String::new();
    std::io::stdin()
        .read_line(&mut password)
        .map_err(|e| format!("cannot read the password from standard input: {e}"))?;
    let password = password.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err("the password read from standard input is empty".into());
    }
    let verifier = pgherd_wire::scram::ScramVerifier::from_password(
        password,
        &rand::random::<[u8; 16]>(),
        pgherd_wire::scram::DEFAULT_ITERATIONS,
    );
    println!("[users.{user}]\nscram = \"{verifier}\"");
    Ok(())
}
