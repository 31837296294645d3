//! How the drill reaches pgherd: the application's and the superuser's URLs through each
//! instance, what an instance says of the agreement (`SHOW CLUSTER`), and when they agree.

use std::time::Duration;

use tokio_postgres::{Client, SimpleQueryMessage};

use super::{connect_within, poll, CONNECT_TIMEOUT, RECOVERY_TIMEOUT};
use crate::bench::targets::BenchUser;

/// One instance's SHOW CLUSTER, as far as the drill needs it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub leader: String,
    pub gate: String,
    pub dcs: String,
    pub version: String,
}

/// How the drill reaches pgherd: each instance's listen port (one without `--instances`).
pub struct Front {
    pub ports: Vec<u16>,
    pub names: Vec<String>,
    pub superuser_password: String,
    pub user: BenchUser,
}

impl Front {
    /// The application's URL through each instance.
    pub fn app_urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|&p| self.user.url(p, "drill"))
            .collect()
    }

    pub fn superuser_url(&self, instance: usize, database: &str) -> String {
        format!(
            "postgres://postgres:{}@127.0.0.1:{}/{database}",
            self.superuser_password, self.ports[instance]
        )
    }

    /// The superuser on `database` through the first instance that answers.
    pub async fn superuser(&self, database: &str) -> Result<Client, String> {
        let mut last = String::from("no pgherd instance");
        for i in 0..self.ports.len() {
            match connect_within(&self.superuser_url(i, database), CONNECT_TIMEOUT).await {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// What instance `i` says (SHOW CLUSTER).
    pub async fn seen_by(&self, i: usize) -> Option<Seen> {
        let c = connect_within(&self.superuser_url(i, "pgherd"), CONNECT_TIMEOUT)
            .await
            .ok()?;
        let rows = tokio::time::timeout(CONNECT_TIMEOUT, c.simple_query("SHOW CLUSTER"))
            .await
            .ok()?
            .ok()?;
        rows.iter().find_map(|m| match m {
            SimpleQueryMessage::Row(r) => {
                let column = |name: &str| r.get(name).unwrap_or_default().to_owned();
                Some(Seen {
                    leader: column("leader"),
                    gate: column("write_gate"),
                    dcs: column("dcs"),
                    version: column("version"),
                })
            }
            _ => None,
        })
    }

    /// The leading instance, once every instance reaches etcd, names the same leader, routes
    /// by the same view and lets writes through (one instance leads itself).
    pub async fn agreed_leader(&self) -> Result<usize, String> {
        if self.ports.len() == 1 {
            return Ok(0);
        }
        let mut seen = Vec::new();
        let agreed = poll(Duration::from_millis(100), async || {
            seen.clear();
            for i in 0..self.ports.len() {
                seen.push(self.seen_by(i).await);
            }
            let Some(first) = seen.first().cloned().flatten() else {
                return Ok(None);
            };
            // The same view everywhere: the leader's last change has reached the others.
            let all_agree = seen.iter().all(|s| {
                s.as_ref().is_some_and(|s| {
                    s.leader == first.leader
                        && s.version == first.version
                        && s.gate == "open"
                        && s.dcs == "reachable"
                })
            });
            let leader = self.names.iter().position(|n| *n == first.leader);
            Ok(leader.filter(|_| all_agree))
        })
        .await?;
        agreed.ok_or_else(|| {
            format!(
                "the instances do not agree on a leader with writes open after {} s: {seen:?}",
                RECOVERY_TIMEOUT.as_secs()
            )
        })
    }
}
