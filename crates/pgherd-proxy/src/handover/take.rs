//! The new process's side of an upgrade: read what it takes over from the line it was given
//! (`--takeover-fd`), start with it, say it is ready, then take each client the old process
//! sends and carry its session on.

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use pgherd_wire::scram::ScramCredential;
use pgherd_wire::startup::CancelKey;

use super::channel::Channel;
use super::{decode, encode, InitialState, Message};
use crate::app::App;

/// What a new process takes over, until it serves.
pub struct Takeover {
    line: Channel,
    state: InitialState,
    clients: Vec<(SocketAddr, std::net::TcpListener)>,
    api: Vec<(SocketAddr, std::net::TcpListener)>,
}

/// Reads what the old process gives over descriptor `fd`.
pub async fn take_over(fd: RawFd) -> Result<Takeover, String> {
    // SAFETY: F_GETFD only asks whether `fd` is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(format!("--takeover-fd {fd} is not an open descriptor"));
    }
    // SAFETY: the descriptor was inherited from the old process for this process alone, and
    // nothing else here owns it.
    let line = Channel::adopt(unsafe { OwnedFd::from_raw_fd(fd) })
        .map_err(|e| format!("cannot use the line to the old process: {e}"))?;
    let received = line
        .recv()
        .await
        .map_err(|e| format!("cannot read from the old process: {e}"))?
        .ok_or("the old process closed the line before giving anything")?;
    let state = match decode(&received.json)? {
        Message::State(state) => *state,
        other => return Err(format!("the old process sent {other:?} first")),
    };
    if received.fds.len() != state.listen.len() + state.api.len() {
        return Err(format!(
            "the old process gave {} listening sockets for {} addresses",
            received.fds.len(),
            state.listen.len() + state.api.len()
        ));
    }
    let mut fds = received.fds.into_iter();
    let mut listeners = |addrs: &[SocketAddr]| -> Result<Vec<_>, String> {
        addrs
            .iter()
            .zip(fds.by_ref())
            .map(|(addr, fd)| {
                let listener = std::net::TcpListener::from(fd);
                listener
                    .set_nonblocking(true)
                    .map_err(|e| format!("listener {addr}: {e}"))?;
                Ok((*addr, listener))
            })
            .collect()
    };
    let clients = listeners(&state.listen)?;
    let api = listeners(&state.api)?;
    tracing::info!(
        from_pid = state.pid,
        from_version = %state.version,
        listeners = clients.len(),
        "upgrade: taking over"
    );
    Ok(Takeover {
        line,
        state,
        clients,
        api,
    })
}

impl Takeover {
    /// The old process's listener for `addr` (the same address, or the same port of an
    /// unspecified one), if it had one.
    pub fn listener(&mut self, addr: SocketAddr) -> Option<tokio::net::TcpListener> {
        take_listener(&mut self.clients, addr)
    }

    pub fn api_listener(&mut self, addr: SocketAddr) -> Option<tokio::net::TcpListener> {
        take_listener(&mut self.api, addr)
    }

    /// Takes up the old process's cluster view and the server credentials it learnt; before
    /// any task of this process decides or connects.
    pub fn adopt(&self, app: &App) -> Result<(), String> {
        let state = self
            .state
            .view
            .state(|name| app.nodes.get(name).map(|n| n.id))
            .map_err(|e| format!("the old process's view does not fit this config: {e}"))?;
        app.nodes
            .change(pgherd_failover::Change::Adopt(Box::new(state)));
        let shards = app.clusters();
        if shards.len() != self.state.shard_views.len() + 1 {
            return Err(format!(
                "the old process serves {} shard(s), this config {}",
                self.state.shard_views.len() + 1,
                shards.len()
            ));
        }
        for (cluster, view) in shards.iter().skip(1).zip(&self.state.shard_views) {
            let state = view
                .state(|name| cluster.get(name).map(|n| n.id))
                .map_err(|e| {
                    format!("the old process's view of a shard does not fit this config: {e}")
                })?;
            cluster.change(pgherd_failover::Change::Adopt(Box::new(state)));
        }
        if let (Some(dcs), Some(lease)) = (&app.dcs, self.state.dcs_lease) {
            dcs.inherit_lease(lease);
        }
        for credential in &self.state.credentials {
            let keys = credential.scram.as_ref().and_then(|k| {
                Some(ScramCredential::Keys {
                    client_key: k.client_key.as_slice().try_into().ok()?,
                    server_key: k.server_key.as_slice().try_into().ok()?,
                    salt: k.salt.clone(),
                    iterations: k.iterations,
                })
            });
            let user = app.user_credentials(&credential.user);
            let mut user = user.lock();
            if user.scram_keys.is_none() {
                user.scram_keys = keys;
            }
            if user.md5_hash.is_none() {
                user.md5_hash = credential.md5_hash.clone();
            }
        }
        Ok(())
    }

    /// Tells the old process this one is ready and waits for its go (or its end: then nobody
    /// else serves); from then on takes the clients it sends.
    pub async fn take_duties(self, app: Arc<App>) -> Result<(), String> {
        let ready = encode(&Message::Ready {
            pid: std::process::id(),
        })?;
        self.line
            .send(&ready, &[])
            .await
            .map_err(|e| format!("cannot tell the old process this one is ready: {e}"))?;
        match self.line.recv().await {
            Ok(Some(received)) => match decode(&received.json)? {
                Message::Go => {}
                other => return Err(format!("the old process said {other:?} instead of go")),
            },
            Ok(None) | Err(_) => {
                tracing::warn!("upgrade: the old process is gone before it said go; taking over")
            }
        }
        *app.handover.old_keys.lock() = self.state.cancel_keys.iter().copied().collect();
        let line = Arc::new(self.line);
        app.handover.from_old.store(Some(line.clone()));
        take_pid_file(&app.config().source, self.state.pid);
        tokio::spawn(take_clients(app, line));
        Ok(())
    }

    /// Tells the old process this one cannot start (it serves on).
    pub async fn fail(self, reason: &str) {
        if let Ok(json) = encode(&Message::Failed {
            reason: reason.to_owned(),
        }) {
            let _ = self.line.send(&json, &[]).await;
        }
    }
}

/// A pid file beside the config (`pgherd.pid` for `pgherd.toml`, as `pgherd up` keeps one)
/// that names the old process names this one from now on, so `pgherd down` and `status`
/// find it.
fn take_pid_file(config: &std::path::Path, old_pid: u32) {
    let path = config.with_extension("pid");
    let names_old =
        std::fs::read_to_string(&path).is_ok_and(|pid| pid.trim() == old_pid.to_string());
    if names_old {
        if let Err(e) = std::fs::write(&path, std::process::id().to_string()) {
            tracing::warn!(file = %path.display(), error = %e, "upgrade: cannot update the pid file");
        }
    }
}

fn take_listener(
    listeners: &mut Vec<(SocketAddr, std::net::TcpListener)>,
    addr: SocketAddr,
) -> Option<tokio::net::TcpListener> {
    let at = listeners.iter().position(|(had, _)| {
        *had == addr
            || (addr.port() != 0 && had.port() == addr.port() && addr.ip().is_unspecified())
    })?;
    let (_, listener) = listeners.swap_remove(at);
    tokio::net::TcpListener::from_std(listener).ok()
}

async fn take_clients(app: Arc<App>, line: Arc<Channel>) {
    let mut taken = 0u64;
    loop {
        let received = match line.recv().await {
            Ok(Some(received)) => received,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(error = %e, "upgrade: the line from the old process failed");
                break;
            }
        };
        let record = match decode(&received.json) {
            Ok(Message::Client(record)) => record,
            Ok(other) => {
                tracing::warn!(message = ?other, "upgrade: unexpected message from the old process");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "upgrade: unreadable message from the old process");
                continue;
            }
        };
        let mut fds = received.fds.into_iter();
        let Some(connection) = fds.next() else {
            tracing::warn!(user = %record.user, "upgrade: a client came without its connection");
            continue;
        };
        taken += 1;
        crate::client::resume(app.clone(), connection, fds.next(), *record).await;
    }
    app.handover.from_old.store(None);
    app.handover.old_keys.lock().clear();
    tracing::info!(clients = taken, "upgrade: the old process is gone");
}

/// Passes a cancel request for a client the old process held when it gave its state (and may
/// still hold) to it; false for any other key, which is answered as a wrong one.
pub fn forward_cancel(app: &App, key: CancelKey) -> bool {
    if !app
        .handover
        .old_keys
        .lock()
        .contains(&(key.process_id, key.secret_key))
    {
        return false;
    }
    let Some(line) = app.handover.from_old.load_full() else {
        return false;
    };
    let Ok(json) = encode(&Message::Cancel {
        process_id: key.process_id,
        secret_key: key.secret_key,
    }) else {
        return false;
    };
    tokio::spawn(async move {
        let _ = line.send(&json, &[]).await;
    });
    true
}
