//! `pgherd execute-script FILE --set NAME --to CONNINFO...`: a DDL script run on a replication
//! set's origin and every subscriber, statement by statement in the order that keeps logical
//! replication applying (`pgherd_replication::script`): what adds reaches the subscribers
//! first; what takes away reaches the origin first, and the subscribers once they have applied
//! everything before it (the set's marker, raised on the origin, arrives). It says what each
//! statement locks, and stops at the first failure with what ran where. Then the set's scan:
//! tables now matching its patterns join its publication and the subscriptions copy them.

use std::path::PathBuf;
use std::time::Duration;

use pgherd_proxy::server::ServerConn;
use pgherd_replication::consistency::table_selected;
use pgherd_replication::script::{plan_script, Order, Step};
use pgherd_replication::sets as set;

use crate::set_nodes::{
    given_subscribers, open_set, raise_mark, set_patterns, wait_applied, OpenSet, SetPatterns,
    Subscriber,
};
use crate::sets::{set_tables, tables_of, Origin};
use crate::sql_session::pg_error;

#[derive(clap::Args, Debug)]
pub struct ScriptOptions {
    /// The SQL file: schema changes only, each statement run in its own transaction.
    file: PathBuf,
    /// The replication set whose origin and subscribers run it.
    #[arg(long)]
    set: String,
    /// Each subscriber of the set, as a libpq connection string (every one the set has).
    #[arg(long = "to")]
    to: Vec<String>,
    /// How long a subscriber may take to apply the origin's changes before a statement that
    /// takes something away runs on it.
    #[arg(long, default_value_t = 60)]
    catch_up_s: u64,
    #[command(flatten)]
    on: Origin,
}

pub fn run(options: ScriptOptions) -> Result<(), String> {
    let script = std::fs::read_to_string(&options.file)
        .map_err(|e| format!("{}: {e}", options.file.display()))?;
    let steps = plan_script(&script).map_err(|e| format!("{}: {e}", options.file.display()))?;
    crate::runtime(1)?.block_on(execute(&options, &steps))
}

async fn execute(options: &ScriptOptions, steps: &[Step]) -> Result<(), String> {
    let name = options.set.as_str();
    let OpenSet {
        config,
        origin,
        mut conn,
        ..
    } = open_set(name, &options.on).await?;
    let mut subscribers = given_subscribers(&mut conn, name, (&options.to, &config.server_tls))
        .await
        .map_err(|e| format!("{e}; nothing was run"))?;
    for (i, step) in steps.iter().enumerate() {
        let order = match step.order {
            Order::SubscribersFirst => "on the subscribers first",
            Order::OriginFirst => "on the origin first",
        };
        let locks = match step.locks.as_slice() {
            [] => "locks no existing table".to_owned(),
            locks => format!("locks {}", locks.join(", ")),
        };
        eprintln!("statement {} (line {}): {order}; {locks}", i + 1, step.line);
    }
    let catch_up = Duration::from_secs(options.catch_up_s);
    for (i, step) in steps.iter().enumerate() {
        let mut ran: Vec<String> = Vec::new();
        let outcome = run_step(
            step,
            name,
            (&origin.name, &mut conn),
            &mut subscribers,
            catch_up,
            &mut ran,
        )
        .await;
        if let Err((node, error)) = outcome {
            let others: Vec<String> = std::iter::once(origin.name.clone())
                .chain(subscribers.iter().map(|s| s.shown.clone()))
                .filter(|n| *n != node && !ran.contains(n))
                .collect();
            return Err(format!(
                "statement {} (line {}) failed on {node}: {error}; it ran on {}; not on {}; the {} statement(s) after it were not run",
                i + 1,
                step.line,
                if ran.is_empty() { "no node".to_owned() } else { ran.join(", ") },
                if others.is_empty() { "any other node".to_owned() } else { others.join(", ") },
                steps.len() - i - 1
            ));
        }
        println!(
            "statement {} (line {}) ran on {}",
            i + 1,
            step.line,
            ran.join(", ")
        );
    }
    scan(name, &mut conn, &origin.name, &subscribers)
        .await
        .map(|_| ())
}

/// One statement on every node in its order; the node and error of a failure.
async fn run_step(
    step: &Step,
    set_name: &str,
    (origin_name, origin): (&str, &mut ServerConn),
    subscribers: &mut [Subscriber],
    catch_up: Duration,
    ran: &mut Vec<String>,
) -> Result<(), (String, String)> {
    if step.order == Order::SubscribersFirst {
        for s in subscribers.iter() {
            s.client
                .batch_execute(&step.sql)
                .await
                .map_err(|e| (s.shown.clone(), pg_error(&e)))?;
            ran.push(s.shown.clone());
        }
    }
    origin
        .simple_query(&step.sql)
        .await
        .map_err(|e| (origin_name.to_owned(), e.to_string()))?;
    ran.push(origin_name.to_owned());
    if step.order == Order::OriginFirst && !subscribers.is_empty() {
        let mark = raise_mark(origin, set_name)
            .await
            .map_err(|e| (origin_name.to_owned(), e.to_string()))?;
        for s in subscribers.iter() {
            wait_applied(&mut &s.client, set_name, mark, catch_up)
                .await
                .map_err(|e| (s.shown.clone(), e.to_string()))?;
            s.client
                .batch_execute(&step.sql)
                .await
                .map_err(|e| (s.shown.clone(), pg_error(&e)))?;
            ran.push(s.shown.clone());
        }
    }
    Ok(())
}

/// `set scan` and `set add-tables`: the set's scan on its own, after `added` patterns (if any)
/// joined the set's (a table taken out by `set drop-tables` stays out, said).
pub(crate) async fn scan_set(
    name: &str,
    added: Option<&[String]>,
    to: &[String],
    on: &Origin,
) -> Result<(), String> {
    let OpenSet {
        config,
        origin,
        mut conn,
        ..
    } = open_set(name, on).await?;
    let on_origin = |e: String| format!("origin {}: {e}", origin.name);
    let subscribers = given_subscribers(&mut conn, name, (to, &config.server_tls))
        .await
        .map_err(|e| format!("{e}; nothing was changed"))?;
    if let Some(added) = added {
        let now = set_patterns(&mut conn, name).await.map_err(on_origin)?;
        let (patterns, staying_out) = set::with_patterns(&now.tables, &now.excluded, added);
        conn.simple_query(&set::set_array_sql(
            name,
            set::SetArray::Patterns,
            &patterns,
        ))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
        if !staying_out.is_empty() {
            eprintln!(
                "set {name}: {} taken out of it (set drop-tables) and stay(s) out: the subscribers' copies are their own tables now",
                staying_out.join(", ")
            );
        }
        println!("set {name}: its table patterns are {}", patterns.join(", "));
    }
    let joined = scan(name, &mut conn, &origin.name, &subscribers).await?;
    if joined == 0 {
        println!("set {name}: no table joined it");
    }
    Ok(())
}

/// Tables that now match the set's patterns join its publication (one that logical
/// replication cannot carry, without a primary key or `REPLICA IDENTITY FULL`, is named and
/// left out), and each subscription refreshes, copying their rows. Returns how many joined.
async fn scan(
    set_name: &str,
    origin: &mut ServerConn,
    origin_name: &str,
    subscribers: &[Subscriber],
) -> Result<usize, String> {
    let on_origin = |e: String| format!("origin {origin_name}: {e}");
    // A table taken out of the set (`set drop-tables`) stays out while it matches.
    let SetPatterns {
        tables: patterns,
        excluded,
        ..
    } = set_patterns(origin, set_name).await.map_err(on_origin)?;
    let in_set = set_tables(origin, set_name)
        .await
        .map_err(on_origin)?
        .unwrap_or_default();
    let tables = tables_of(origin).await.map_err(on_origin)?;
    let new: Vec<_> = tables
        .iter()
        .filter(|t| {
            !t.name.starts_with("pgherd.")
                && !in_set.contains(&t.name)
                && !excluded.contains(&t.name)
        })
        .filter(|t| table_selected(&t.name, &patterns))
        .collect();
    let (keyed, keyless): (Vec<_>, Vec<_>) = new.into_iter().partition(|t| t.replicable());
    for t in &keyless {
        eprintln!(
            "warning: {} matches set {set_name}'s patterns but has no primary key: it was not added",
            t.name
        );
    }
    if keyed.is_empty() {
        return Ok(0);
    }
    let names: Vec<&str> = keyed.iter().map(|t| t.sql_name.as_str()).collect();
    origin
        .simple_query(&format!(
            "ALTER PUBLICATION {} ADD TABLE {}",
            set::publication(set_name),
            names.join(", ")
        ))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    for s in subscribers {
        s.client
            .batch_execute(&set::refresh_sql(&s.subscription))
            .await
            .map_err(|e| format!("subscriber {}: {}", s.shown, pg_error(&e)))?;
    }
    let shown: Vec<&str> = keyed.iter().map(|t| t.name.as_str()).collect();
    println!(
        "set {set_name}: {} joined it (matching its patterns); its subscribers copy {}",
        shown.join(", "),
        if shown.len() == 1 { "it" } else { "them" }
    );
    Ok(shown.len())
}
