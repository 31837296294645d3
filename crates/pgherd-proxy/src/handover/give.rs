//! The running process's side of an upgrade: start the new binary, give it the listeners, the
//! view and the credentials, stop acting, and once it is ready send it every client that can
//! move; exit when none is left.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pgherd_wire::scram::ScramCredential;
use pgherd_wire::startup::CancelKey;

use super::channel::Channel;
use super::{
    decode, encode, ClientRecord, CredentialRecord, InitialState, Message, ScramKeysRecord,
    READY_TIMEOUT, TAKEOVER_FD_ARG,
};
use crate::app::App;
use crate::dcs::shared::SharedView;

/// The binary and the arguments this process was started with: an upgrade starts the file now
/// at that path (the new version) the same way.
static LAUNCH: OnceLock<(PathBuf, Vec<OsString>)> = OnceLock::new();

/// Remembers how this process was started; call it first thing in `main`, before the binary
/// can have been replaced (afterwards `/proc/self/exe` names the old, deleted file). The path
/// is the one it was started by, links not followed: an upgrade that moves a link to a new
/// version starts that version.
pub fn record_launch() {
    let mut args = std::env::args_os();
    let named = args.next().and_then(|argv0| launch_path(Path::new(&argv0)));
    if let Some(exe) = named.or_else(|| std::env::current_exe().ok()) {
        let _ = LAUNCH.set((exe, without_takeover_fd(args.collect())));
    }
}

/// `argv0` as a path that names the same file later: absolute against the working directory
/// if it has a slash, else found on `PATH` as a shell would.
fn launch_path(argv0: &Path) -> Option<PathBuf> {
    if argv0.components().count() > 1 {
        return std::env::current_dir().ok().map(|cwd| cwd.join(argv0));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(argv0))
        .find(|candidate| candidate.is_file())
        .and_then(|found| match found.is_absolute() {
            true => Some(found),
            false => std::env::current_dir().ok().map(|cwd| cwd.join(found)),
        })
}

/// The arguments without a `--takeover-fd N` a taker was started with.
fn without_takeover_fd(args: Vec<OsString>) -> Vec<OsString> {
    let mut kept = Vec::with_capacity(args.len());
    let mut skip_next = false;
    for arg in args {
        if std::mem::take(&mut skip_next) {
            continue;
        }
        if arg == TAKEOVER_FD_ARG {
            skip_next = true;
            continue;
        }
        if arg
            .to_str()
            .is_some_and(|a| a.starts_with(&format!("{TAKEOVER_FD_ARG}=")))
        {
            continue;
        }
        kept.push(arg);
    }
    kept
}

/// Upgrades: returns what happened once the new process serves (clients move from then on),
/// or why nothing changed (the old process serves and acts on).
pub async fn upgrade(app: &Arc<App>) -> Result<String, String> {
    if app.is_shutting_down() {
        return Err("pgherd is shutting down".into());
    }
    if app.handover.upgrading.swap(true, Ordering::AcqRel) {
        return Err("an upgrade is already under way".into());
    }
    let given = give(app).await;
    if given.is_err() {
        app.handover.upgrading.store(false, Ordering::Release);
    }
    given
}

async fn give(app: &Arc<App>) -> Result<String, String> {
    let (exe, args) = LAUNCH
        .get()
        .ok_or("this process does not know which binary started it")?;
    for cluster in app.clusters() {
        if cluster.is_switching() {
            return Err("a switchover is under way; upgrade when it is over".into());
        }
        if let Some(node) = cluster.all().iter().find(|n| n.is_rejoining()) {
            return Err(format!(
                "node {} is rejoining; upgrade when it is done",
                node.name()
            ));
        }
    }
    let (line, theirs) =
        Channel::pair().map_err(|e| format!("cannot make the line to the new process: {e}"))?;
    let their_fd = theirs.as_raw_fd();
    let mut command = tokio::process::Command::new(exe);
    command
        .args(args)
        .arg(TAKEOVER_FD_ARG)
        .arg(their_fd.to_string())
        .stdin(std::process::Stdio::null());
    // SAFETY: between fork and exec only fcntl, which is async-signal-safe, on a descriptor
    // this process owns. The end stays close-on-exec here, so no other program this process
    // starts meanwhile inherits it (its death would then not close the line).
    unsafe {
        command.pre_exec(move || {
            if libc::fcntl(their_fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    drop(theirs);
    let child_pid = child.id().unwrap_or(0);
    tracing::info!(pid = child_pid, binary = %exe.display(), "upgrade: the new process is starting");

    stop_acting(app).await;
    let ready = hand_state(app, &line)
        .await
        .map_err(|e| format!("cannot give the new process what it takes over: {e}"));
    let ready = match ready {
        Ok(()) => wait_ready(&line, &mut child).await,
        Err(e) => Err(e),
    };
    let pid = match ready {
        Ok(pid) => pid,
        Err(why) => {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            app.handover.handed_over.store(false, Ordering::Release);
            tracing::error!(reason = %why, "upgrade failed; this process serves on");
            return Err(format!("the upgrade failed, nothing changed: {why}"));
        }
    };
    // This process accepts no one and moves everyone it can; then the taker takes over.
    let line = Arc::new(line);
    app.handover.to_new.store(Some(line.clone()));
    app.handover.stop_accepting.send_replace(true);
    if let Err(e) = line.send(&encode(&Message::Go)?, &[]).await {
        let why = format!("the new process could not be told to take over: {e}");
        let _ = child.start_kill();
        undo(app, &why);
        return Err(format!("the upgrade failed, nothing changed: {why}"));
    }
    app.clients.signal_all(crate::clients::SIGNAL_HANDOVER);
    crate::systemd::main_pid(pid);
    tokio::spawn(answer_taker(app.clone(), line, child));
    tokio::spawn(leave_when_empty(app.clone()));
    tracing::info!(
        pid,
        "upgrade: the new process serves; clients move to it at their next idle point"
    );
    Ok(format!(
        "the new process (pid {pid}) serves; clients move to it at their next idle point and this one (pid {}) exits when none is left",
        std::process::id()
    ))
}

/// Stops this process's failover decisions: taken under every cluster's role-change lock, so
/// no turn, PROMOTE or switchover is half done when the view is sent.
async fn stop_acting(app: &Arc<App>) {
    let clusters = app.clusters();
    let mut turns = Vec::with_capacity(clusters.len());
    for cluster in &clusters {
        turns.push(cluster.role_change.lock().await);
    }
    app.handover.handed_over.store(true, Ordering::Release);
}

async fn hand_state(app: &Arc<App>, line: &Channel) -> Result<(), String> {
    // Copies held until sent: the kept ones may be closed meanwhile (a SIGTERM).
    let (listen, api, copies) = {
        let listeners = app.handover.listeners.lock();
        let addrs = |l: &[(std::net::SocketAddr, OwnedFd)]| l.iter().map(|(a, _)| *a).collect();
        let copies = listeners
            .clients
            .iter()
            .chain(&listeners.api)
            .map(|(_, fd)| fd.try_clone())
            .collect::<std::io::Result<Vec<OwnedFd>>>()
            .map_err(|e| format!("cannot copy a listening socket: {e}"))?;
        (addrs(&listeners.clients), addrs(&listeners.api), copies)
    };
    let fds: Vec<i32> = copies.iter().map(AsRawFd::as_raw_fd).collect();
    let view_of = |cluster: &crate::nodes::Nodes| {
        SharedView::of(&cluster.view(), "", 0, |id| cluster.name_of(id))
    };
    let view = view_of(&app.nodes);
    let shard_views = app
        .clusters()
        .iter()
        .skip(1)
        .map(|cluster| view_of(cluster))
        .collect();
    let state = InitialState {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        pid: std::process::id(),
        listen,
        api,
        view,
        credentials: credentials(app),
        dcs_lease: app.dcs.as_ref().and_then(|dcs| dcs.status().lease),
        shard_views,
        cancel_keys: app
            .clients
            .all()
            .iter()
            .map(|c| (c.key.process_id, c.key.secret_key))
            .collect(),
    };
    line.send(&encode(&Message::State(Box::new(state)))?, &fds)
        .await
        .map_err(|e| e.to_string())
}

fn credentials(app: &App) -> Vec<CredentialRecord> {
    app.learnt_credentials()
        .into_iter()
        .map(|(user, scram, md5_hash)| CredentialRecord {
            user,
            scram: match scram {
                Some(ScramCredential::Keys {
                    client_key,
                    server_key,
                    salt,
                    iterations,
                }) => Some(ScramKeysRecord {
                    client_key: client_key.to_vec(),
                    server_key: server_key.to_vec(),
                    salt,
                    iterations,
                }),
                _ => None,
            },
            md5_hash,
        })
        .collect()
}

/// The taker's pid once it says it is ready; why not otherwise (it failed, exited or took
/// too long).
async fn wait_ready(line: &Channel, child: &mut tokio::process::Child) -> Result<u32, String> {
    let answer = tokio::select! {
        answer = tokio::time::timeout(READY_TIMEOUT, line.recv()) => answer,
        status = child.wait() => {
            return Err(match status {
                Ok(status) => format!("the new process exited before it was ready ({status})"),
                Err(e) => format!("the new process could not be waited for: {e}"),
            })
        }
    };
    let received = match answer {
        Err(_) => {
            return Err(format!(
                "the new process was not ready within {} s",
                READY_TIMEOUT.as_secs()
            ))
        }
        Ok(Ok(Some(received))) => received,
        // The line closes as the process exits: its status says more.
        Ok(lost) => {
            let exited = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            return Err(match (exited, lost) {
                (Ok(Ok(status)), _) => format!(
                    "the new process exited before it was ready ({status}; its log says why)"
                ),
                (_, Err(e)) => format!("the line to the new process failed: {e}"),
                (_, Ok(_)) => "the new process closed the line before it was ready".into(),
            });
        }
    };
    match decode(&received.json)? {
        Message::Ready { pid } => Ok(pid),
        Message::Failed { reason } => Err(format!("the new process cannot start: {reason}")),
        other => Err(format!(
            "the new process said {other:?} where it should have said it was ready"
        )),
    }
}

/// Sends a session that left at its idle point to the taker, its connection with it (and the
/// server connection it keeps, if any).
pub async fn send_client(
    app: &App,
    connection: OwnedFd,
    server: Option<OwnedFd>,
    record: ClientRecord,
) -> Result<(), String> {
    let line = app
        .handover
        .to_new
        .load_full()
        .ok_or("no new process is taking clients")?;
    let json = encode(&Message::Client(Box::new(record)))?;
    let mut fds = vec![connection.as_raw_fd()];
    fds.extend(server.as_ref().map(|s| s.as_raw_fd()));
    line.send(&json, &fds)
        .await
        .map_err(|e| format!("cannot send the client to the new process: {e}"))
}

/// What the taker asks of this process while clients remain here: their cancel requests.
/// Its end of the line closes only when it exits: then this process takes its duties back.
async fn answer_taker(app: Arc<App>, line: Arc<Channel>, mut child: tokio::process::Child) {
    loop {
        let received = match line.recv().await {
            Ok(Some(received)) => received,
            ended => {
                let why = match ended {
                    Err(e) => format!("the line to it failed: {e}"),
                    _ => "it closed the line".to_owned(),
                };
                // Reaped if it exited; killed if it lives on without its line.
                let _ = child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                if !app.is_shutting_down() {
                    undo(&app, &format!("the new process is gone ({why})"));
                }
                return;
            }
        };
        match decode(&received.json) {
            Ok(Message::Cancel {
                process_id,
                secret_key,
            }) => {
                let key = CancelKey {
                    process_id,
                    secret_key,
                };
                app.clients.cancel(key, Duration::from_secs(5));
            }
            Ok(other) => {
                tracing::warn!(message = ?other, "upgrade: unexpected message from the new process")
            }
            Err(e) => {
                tracing::warn!(error = %e, "upgrade: unreadable message from the new process")
            }
        }
    }
}

/// Waits until every client left or moved (or the shutdown deadline passed), then stops
/// this process; not if the handover was undone meanwhile.
async fn leave_when_empty(app: Arc<App>) {
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(app.config().proxy.shutdown_timeout_ms);
    while app.clients.connected() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if !app.handover.given() {
            return;
        }
    }
    if !app.handover.given() {
        return;
    }
    tracing::info!(
        clients_left = app.clients.connected(),
        "upgrade: this process holds no more clients it can keep; stopping"
    );
    app.begin_shutdown();
}

/// The new process died after it took over: this one accepts, decides and keeps its clients
/// again (those that moved went with it).
fn undo(app: &Arc<App>, why: &str) {
    tracing::error!(reason = %why, "upgrade undone: this process serves and decides again");
    app.handover.to_new.store(None);
    app.clients.clear_for_all(crate::clients::SIGNAL_HANDOVER);
    app.handover.handed_over.store(false, Ordering::Release);
    app.handover.stop_accepting.send_replace(false);
    app.handover.upgrading.store(false, Ordering::Release);
    crate::lifecycle::accept_again(app);
    crate::systemd::main_pid(std::process::id());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_takers_own_descriptor_is_not_passed_on() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            without_takeover_fd(args(&["run", "--config", "a.toml", "--takeover-fd", "5"])),
            args(&["run", "--config", "a.toml"])
        );
        assert_eq!(
            without_takeover_fd(args(&["run", "--takeover-fd=7", "-c", "b.toml"])),
            args(&["run", "-c", "b.toml"])
        );
    }
}
