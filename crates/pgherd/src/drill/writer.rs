//! The drill's clients: each inserts rows with unique ids and logs what was acknowledged.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use super::{connect_within, Ack, Hung, Log, CONNECT_TIMEOUT};
use crate::sql_session::{client_rows, first};

/// A client inserting rows with unique ids through pgherd until told to stop, logging each
/// acknowledgement with the node that committed it. It connects as a multi-host connection
/// string does, trying the instances in turn from its own preferred one, and reconnects after
/// errors.
pub struct Writer {
    pub number: usize,
    pub urls: Arc<Vec<String>>,
    pub patience: Patience,
}

/// How long a writer waits for an answer, and what not hearing back in that time means.
#[derive(Debug, Clone, Copy)]
pub enum Patience {
    /// Gives up and reconnects, as a client with a socket timeout does (to another instance
    /// if this one hangs): an ordinary error.
    GivesUpAfter(Duration),
    /// Waits this long for an answer pgherd owes it: a failed node's sessions are ended, so
    /// silence this long is a hang, which the drill reports (and then reconnects, so one hang
    /// cannot keep the drill from finishing).
    HungAfter(Duration),
}

impl Patience {
    fn limit(self) -> Duration {
        match self {
            Patience::GivesUpAfter(limit) | Patience::HungAfter(limit) => limit,
        }
    }
}

impl Writer {
    pub async fn run(self, stop: Arc<AtomicBool>, log: Arc<Mutex<Log>>) {
        let mut n: i64 = 0;
        let mut client: Option<(Client, usize)> = None;
        // The instance to try first: this writer's own, then, after a failure, the next one
        // (as a client with several hosts in random order moves on).
        let mut start_at = self.number;
        let failed = |log: &Mutex<Log>| {
            if let Ok(mut log) = log.lock() {
                log.errors += 1;
            }
        };
        while !stop.load(Ordering::Relaxed) {
            let (c, instance) = match &client {
                Some((c, instance)) => (c, *instance),
                None => match self.connect(start_at).await {
                    Some(connected) => {
                        let (c, instance) = client.insert(connected);
                        (&*c, *instance)
                    }
                    None => {
                        failed(&log);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            n += 1;
            let id = self.number as i64 * 1_000_000_000 + n;
            let sql = format!(
                "INSERT INTO drill_writes VALUES ({id}, {}) RETURNING current_setting('port')",
                self.number
            );
            // An error and no answer in time are the same to the writer: not acknowledged.
            let sent_at = Instant::now();
            let answer = tokio::time::timeout(self.patience.limit(), client_rows(c, &sql)).await;
            if answer.is_err() {
                if let (Patience::HungAfter(_), Ok(mut log)) = (self.patience, log.lock()) {
                    log.hung.push(Hung {
                        writer: self.number,
                        id,
                        sent_at,
                    });
                }
            }
            match answer.ok().and_then(Result::ok) {
                Some(rows) => {
                    let port = first(&rows).and_then(|p| p.parse().ok()).unwrap_or(0);
                    if let Ok(mut log) = log.lock() {
                        log.acks.push(Ack {
                            id,
                            at: Instant::now(),
                            port,
                            writer: self.number,
                            instance,
                        });
                    }
                }
                None => {
                    failed(&log);
                    client = None;
                    start_at = instance + 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// The first instance that takes the connection, from instance `first` on.
    async fn connect(&self, first: usize) -> Option<(Client, usize)> {
        let count = self.urls.len();
        for k in 0..count {
            let instance = (first + k) % count;
            if let Ok(c) = connect_within(&self.urls[instance], CONNECT_TIMEOUT).await {
                return Some((c, instance));
            }
        }
        None
    }
}
