//! The drill's verdict and its printout: signs of two primaries in the acknowledgements, and
//! the table of rounds with RTO medians per fault.

use std::time::Instant;

use super::{Ack, Fault, Front, Log, Round, HUNG_AFTER};

/// A fault injected: in which round (from 1) and when. A round injects one, or two when its
/// fault hits a second node after the first (`cascade`).
#[derive(Debug, Clone, Copy)]
pub struct Injection {
    pub round: usize,
    pub at: Instant,
}

impl Injection {
    /// The first injection of the round after the last one in `injections`.
    pub fn next_round(injections: &[Injection], at: Instant) -> Injection {
        Injection {
            round: injections.last().map_or(1, |i| i.round + 1),
            at,
        }
    }

    /// A second injection within the last round of `injections`.
    pub fn same_round(injections: &[Injection], at: Instant) -> Injection {
        Injection {
            round: injections.last().map_or(1, |i| i.round),
            at,
        }
    }
}

/// The last injection at or before `at`, by its index.
fn injection_before(injections: &[Injection], at: Instant) -> Option<usize> {
    injections.iter().rposition(|i| i.at <= at)
}

/// Signs that two nodes took writes at once: the node acknowledging writes changes more than
/// once after an injected fault (back and forth), or before the first fault.
pub fn split_brain(acks: &[Ack], injections: &[Injection]) -> Vec<String> {
    let mut acks = acks.to_vec();
    acks.sort_by_key(|a| a.at);
    let round_of = |at: Instant| injection_before(injections, at);
    let mut violations = Vec::new();
    let mut changes = vec![0usize; injections.len()];
    for pair in acks.windows(2) {
        if pair[0].port == pair[1].port {
            continue;
        }
        match round_of(pair[1].at) {
            None => violations.push(format!(
                "writes moved from port {} to {} before any fault",
                pair[0].port, pair[1].port
            )),
            Some(r) => {
                changes[r] += 1;
                if changes[r] > 1 {
                    violations.push(format!(
                        "round {}: writes moved again, from port {} to {}",
                        injections[r].round, pair[0].port, pair[1].port
                    ));
                }
            }
        }
    }
    violations
}

pub fn report(
    rounds: &[Round],
    log: &Log,
    lost: &[i64],
    violations: &[String],
    primary_port: u16,
    front: &Front,
) {
    let several = front.ports.len() > 1;
    println!(
        "round  fault                  hit                       primary after  {}RTO ms  client errors",
        if several { "leader after  " } else { "" }
    );
    for (i, r) in rounds.iter().enumerate() {
        let leader = match several {
            true => format!("{:<12}  ", r.leader_after.as_deref().unwrap_or("-")),
            false => String::new(),
        };
        println!(
            "{:>5}  {:<21}  {:<24}  {:<13}  {leader}{:>6}  {:>13}",
            i + 1,
            r.fault.name(),
            r.hit,
            r.new_primary,
            r.rto.map_or("?".to_owned(), |d| d.as_millis().to_string()),
            r.errors
        );
    }
    let summary = |what: &str, of: &dyn Fn(&Round) -> bool| {
        let mut rtos: Vec<u128> = rounds
            .iter()
            .filter(|r| of(r))
            .filter_map(|r| r.rto.map(|d| d.as_millis()))
            .collect();
        rtos.sort_unstable();
        let pick = |q: f64| {
            rtos.get(((rtos.len() as f64 - 1.0) * q).round() as usize)
                .map_or("-".to_owned(), |v| v.to_string())
        };
        println!(
            "RTO {what}: median {} ms, p95 {} ms over {} round(s)",
            pick(0.5),
            pick(0.95),
            rtos.len()
        );
    };
    summary("all", &|_| true);
    let mut faults: Vec<Fault> = rounds.iter().map(|r| r.fault).collect();
    faults.dedup();
    faults.sort_by_key(|f| f.name());
    faults.dedup();
    for fault in faults {
        summary(fault.name(), &|r| r.fault == fault);
    }
    println!(
        "acknowledged writes: {}, lost: {}, client errors: {}, split-brain signs: {}, never answered: {}, final primary port {primary_port}",
        log.acks.len(),
        lost.len(),
        log.errors,
        violations.len(),
        log.hung.len()
    );
    if several {
        let through: Vec<String> = (0..front.ports.len())
            .map(|i| {
                let count = log.acks.iter().filter(|a| a.instance == i).count();
                format!("{} {count}", front.names[i])
            })
            .collect();
        println!("acknowledged through: {}", through.join(", "));
    }
    for v in violations {
        println!("  {v}");
    }
}

/// The first lost writes and the writes pgherd never answered, each with when it happened
/// relative to the fault of its round.
pub fn unanswered(log: &Log, lost: &[i64], injections: &[Injection], front: &Front) {
    let when = |at: Instant| match injection_before(injections, at) {
        Some(r) => format!(
            "in round {} ({} ms after its fault)",
            injections[r].round,
            at.duration_since(injections[r].at).as_millis()
        ),
        None => "before the first fault".to_owned(),
    };
    for id in lost.iter().take(10) {
        if let Some(ack) = log.acks.iter().find(|a| a.id == *id) {
            println!(
                "  lost id {id}: acknowledged by port {} through {} {}",
                ack.port,
                front.names[ack.instance],
                when(ack.at)
            );
        }
    }
    for hung in log.hung.iter().take(10) {
        println!(
            "  never answered: writer {}'s insert of id {}, sent {}, no answer within {} s",
            hung.writer,
            hung.id,
            when(hung.sent_at),
            HUNG_AFTER.as_secs()
        );
    }
}
