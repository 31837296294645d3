//! The calm phase: heavy load and no fault, counting the health checks that fail, the nodes
//! marked down and the failover events anyway (false positives).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::{Client, SimpleQueryMessage};

use super::front::Front;
use super::{connect, simple_rows, within, DrillOptions, HUNG_AFTER};

/// Heavy load and no fault for `calm_s` seconds: every health check that fails, node marked
/// down or failover event in that time is a false positive.
pub(super) async fn calm(options: &DrillOptions, front: &Front) -> Result<(), String> {
    let admin = front.superuser("pgherd").await?;
    let before = check_counts(&admin).await?;
    let events_before = simple_rows(&admin, "SHOW EVENTS")
        .await?
        .iter()
        .filter(|m| matches!(m, SimpleQueryMessage::Row(_)))
        .count();
    let stop = Arc::new(AtomicBool::new(false));
    let urls = front.app_urls();
    let readers: Vec<_> = (0..options.calm_readers)
        .map(|r| {
            let (url, stop) = (urls[r % urls.len()].clone(), stop.clone());
            tokio::spawn(async move {
                let mut reads = 0u64;
                let Ok(c) = connect(&url).await else {
                    return reads;
                };
                let scan = "SELECT sum(id), count(*) FROM drill_writes";
                while !stop.load(Ordering::Relaxed) {
                    // A sequential scan of the growing table: CPU on whichever node serves it.
                    match within(HUNG_AFTER, scan, c.simple_query(scan)).await {
                        Ok(Ok(_)) => reads += 1,
                        Ok(Err(_)) => {}
                        Err(_) => break,
                    }
                }
                reads
            })
        })
        .collect();
    eprintln!(
        "calm phase: {} s of load ({} readers) without a fault",
        options.calm_s, options.calm_readers
    );
    tokio::time::sleep(Duration::from_secs(options.calm_s)).await;
    stop.store(true, Ordering::Relaxed);
    let mut reads = 0;
    for r in readers {
        reads += r.await.unwrap_or(0);
    }
    let after = check_counts(&admin).await?;
    let events: Vec<String> = simple_rows(&admin, "SHOW EVENTS")
        .await?
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(format!(
                "{} {}: {}",
                r.get(1).unwrap_or(""),
                r.get(2).unwrap_or(""),
                r.get(3).unwrap_or("")
            )),
            _ => None,
        })
        .skip(events_before)
        .collect();
    let (mut checks, mut failed, mut down) = (0, 0, 0);
    for (name, (ok_after, failed_after, down_after)) in &after {
        let (ok_before, failed_before, down_before) = before.get(name).copied().unwrap_or_default();
        checks += ok_after - ok_before + failed_after - failed_before;
        failed += failed_after - failed_before;
        down += down_after - down_before;
    }
    println!(
        "calm phase: {} s, {reads} scans; health checks {checks}, failed {failed}, nodes marked down {down}, events {}",
        options.calm_s,
        events.len()
    );
    for e in &events {
        println!("  event: {e}");
    }
    Ok(())
}

/// Per node: (checks ok, checks failed, times marked down), from SHOW NODES.
async fn check_counts(admin: &Client) -> Result<HashMap<String, (u64, u64, u64)>, String> {
    let messages = simple_rows(admin, "SHOW NODES").await?;
    let mut counts = HashMap::new();
    for m in &messages {
        if let SimpleQueryMessage::Row(r) = m {
            let number = |column: &str| -> Result<u64, String> {
                r.try_get(column)
                    .ok()
                    .flatten()
                    .and_then(|v: &str| v.parse().ok())
                    .ok_or_else(|| format!("SHOW NODES has no number in column {column}"))
            };
            counts.insert(
                r.get("name").unwrap_or_default().to_owned(),
                (
                    number("checks_ok")?,
                    number("checks_failed")?,
                    number("times_down")?,
                ),
            );
        }
    }
    Ok(counts)
}
