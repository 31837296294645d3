//! Starting, reloading and stopping: listeners, node monitors, pool upkeep, signals
//! (SIGHUP reloads, SIGTERM and SIGINT drain, SIGUSR2 upgrades), and the drain deadline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pgherd_config::Config;
use tokio::net::{TcpListener, TcpSocket};
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;
use tracing::Instrument;

use crate::app::App;
use crate::client;
use crate::nodes::NodeState;

/// Listen backlog: generous, so bursts of new connections (benchmarks with a connection per
/// transaction, thousands of clients reconnecting after a failover) are not refused.
const LISTEN_BACKLOG: u32 = 4096;

/// Runs pgherd until it is told to stop and has drained. `on_ready` gets the bound addresses
/// once clients can connect.
pub async fn serve(config: Config, on_ready: impl FnOnce(&[SocketAddr])) -> Result<(), String> {
    serve_with(config, None, on_ready).await
}

/// [`serve`], taking over from the old process of an upgrade (`crate::handover`) given the
/// line to it: its listeners, its view, its clients.
pub async fn serve_taking_over(
    config: Config,
    takeover_fd: i32,
    on_ready: impl FnOnce(&[SocketAddr]),
) -> Result<(), String> {
    let takeover = crate::handover::take_over(takeover_fd).await?;
    serve_with(config, Some(takeover), on_ready).await
}

async fn serve_with(
    config: Config,
    mut takeover: Option<crate::handover::Takeover>,
    on_ready: impl FnOnce(&[SocketAddr]),
) -> Result<(), String> {
    // Handled from the first moment, not only once ready: a SIGTERM that comes as soon as the
    // port accepts or READY is sent (`systemctl stop` right after start) must drain, not kill
    // the process with the signal's default action. One that comes while starting is acted on
    // once ready.
    let installed = (|| {
        Ok::<_, std::io::Error>((
            signal(SignalKind::hangup())?,
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
            signal(SignalKind::user_defined2())?,
        ))
    })();
    let (mut hangup, mut terminate, mut interrupt, mut upgrade) = match installed {
        Ok(handlers) => handlers,
        Err(e) => {
            let reason = format!("cannot handle signals: {e}");
            return Err(fail_takeover(takeover, reason).await);
        }
    };
    let app = match App::new(config) {
        Ok(app) => app,
        Err(e) => return Err(fail_takeover(takeover, e).await),
    };
    let config = app.config();
    let restored = match crate::kept::restore(&app) {
        Ok(restored) => restored,
        Err(e) => return Err(fail_takeover(takeover, e).await),
    };
    if !restored.is_empty() {
        tracing::warn!(file = %config.proxy.state_file.display(), kept = %restored.join("; "), "operator levers restored");
    }
    // The old process's view is the newest: it decided until a moment ago.
    if let Some(Err(e)) = takeover.as_ref().map(|t| t.adopt(&app)) {
        return Err(fail_takeover(takeover, e).await);
    }

    // Learn the roles before the first client arrives, so its first query is routed right.
    let first_check = Duration::from_millis(config.cluster.health_check_timeout_ms * 2);
    let clusters = app.clusters();
    for cluster in &clusters {
        let _ = tokio::time::timeout(
            first_check,
            crate::monitor::check_all_once(cluster, &config.cluster, &app.connect_context()),
        )
        .await;
    }
    tracing::info!(nodes = %app.nodes.describe_all(), "initial node check done");

    let mut listeners = Vec::new();
    for addr in &config.proxy.listen {
        let taken = takeover.as_mut().and_then(|t| t.listener(*addr));
        match taken.map_or_else(|| bind(*addr), Ok) {
            Ok(listener) => listeners.push(listener),
            Err(e) => {
                return Err(fail_takeover(takeover, format!("cannot listen on {addr}: {e}")).await)
            }
        }
    }
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .filter_map(|l| l.local_addr().ok())
        .collect();
    let mut api_listeners = Vec::new();
    let mut api_to_bind = Vec::new();
    for addr in &config.api.listen {
        match takeover.as_mut().and_then(|t| t.api_listener(*addr)) {
            Some(listener) => api_listeners.push(listener),
            None => api_to_bind.push(*addr),
        }
    }
    match crate::http::bind(&api_to_bind).await {
        Ok(bound) => api_listeners.extend(bound),
        Err(e) => return Err(fail_takeover(takeover, e).await),
    }
    if let Err(e) = app.handover.keep_listeners(&listeners, &api_listeners) {
        tracing::warn!(error = %e, "cannot keep the listening sockets for an upgrade");
    }

    for cluster in &clusters {
        for node in cluster.all().iter() {
            spawn_monitor(&app, cluster, node.clone());
        }
    }
    if let Some(shards) = &app.shards {
        crate::two_phase_recovery::spawn(app.clone(), shards.clone());
    }
    tokio::spawn(upkeep(app.clone()));
    tokio::spawn(crate::client::run_parking_lot(app.clone()));
    tokio::spawn(crate::sets_watch::watch(app.clone()));
    // A new process decides and accepts only once the old one said go (it accepts nobody
    // and decides nothing any more); it speaks to etcd only then too, where the old one's
    // lease makes it the leader the old one was.
    let taking_over = takeover.is_some();
    if let Some(takeover) = takeover {
        takeover.take_duties(app.clone()).await?;
    }
    if let Some(dcs) = &app.dcs {
        tokio::spawn(crate::dcs::run(app.clone(), dcs.clone()));
    }
    for (shard, cluster) in clusters.into_iter().enumerate() {
        let duty = crate::failover::run(app.clone(), cluster);
        match app.shards {
            // Its log lines say which shard they are about.
            Some(_) => tokio::spawn(duty.instrument(tracing::info_span!("shard", shard))),
            None => tokio::spawn(duty),
        };
    }
    for listener in listeners {
        tokio::spawn(accept_loop(app.clone(), listener));
    }
    crate::http::spawn(&app, api_listeners);
    tracing::info!(listen = ?addrs, pid = std::process::id(), "pgherd is ready");
    crate::systemd::spawn_watchdog(taking_over);
    crate::systemd::ready(&serving_status(&addrs));
    on_ready(&addrs);

    let mut stopping = app.shutdown_signal();
    loop {
        tokio::select! {
            _ = hangup.recv() => {
                match reload(&app) {
                    Ok(notes) => tracing::info!(?notes, "config reloaded (SIGHUP)"),
                    Err(e) => tracing::error!(error = %e, "reload failed; keeping the running config"),
                }
            }
            _ = upgrade.recv() => {
                tracing::info!("SIGUSR2: upgrading");
                let app = app.clone();
                // The signal loop stays free meanwhile (a SIGTERM still drains).
                tokio::spawn(async move {
                    if let Err(e) = crate::handover::upgrade(&app).await {
                        tracing::error!(error = %e, "upgrade (SIGUSR2) failed");
                    }
                });
            }
            _ = terminate.recv() => { tracing::info!("SIGTERM: draining"); app.begin_shutdown(); }
            _ = interrupt.recv() => { tracing::info!("SIGINT: draining"); app.begin_shutdown(); }
            _ = stopping.changed() => break,
        }
    }
    // After an upgrade the unit's main process is the new one: telling systemd this one
    // stops would stop the unit.
    if !app.handover.given() {
        crate::systemd::stopping();
    }
    drain(&app).await;
    Ok(())
}

/// A taker that cannot start tells the old process why (it serves on); returns the reason.
async fn fail_takeover(takeover: Option<crate::handover::Takeover>, reason: String) -> String {
    if let Some(takeover) = takeover {
        takeover.fail(&reason).await;
    }
    reason
}

/// Waits for clients to finish their transactions and leave, up to the shutdown deadline.
async fn drain(app: &Arc<App>) {
    let timeout = Duration::from_millis(app.config().proxy.shutdown_timeout_ms);
    let deadline = Instant::now() + timeout;
    while app.clients.connected() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = app.clients.connected();
    if left > 0 {
        tracing::warn!(
            clients = left,
            timeout_ms = timeout.as_millis() as u64,
            "shutdown deadline reached; closing the remaining connections"
        );
    } else {
        tracing::info!("all clients are gone; stopping");
    }
}

/// Reloads the config file and starts monitors for nodes it added. Used by SIGHUP and RELOAD.
pub fn reload(app: &Arc<App>) -> Result<Vec<String>, String> {
    crate::systemd::reloading();
    let reloaded = app.reload();
    crate::systemd::ready(match &reloaded {
        Ok(_) => "serving; config reloaded",
        Err(_) => "serving; the last reload failed and the running config is kept",
    });
    let reloaded = reloaded?;
    for (cluster, node) in reloaded.new_nodes {
        spawn_monitor(app, &cluster, node);
    }
    // A shard the layout gained: its nodes watched and its failover run, as at start.
    for (shard, cluster) in reloaded.new_shards {
        for node in cluster.all().iter() {
            spawn_monitor(app, &cluster, node.clone());
        }
        let duty = crate::failover::run(app.clone(), cluster);
        tokio::spawn(duty.instrument(tracing::info_span!("shard", shard)));
    }
    Ok(reloaded.notes)
}

fn serving_status(addrs: &[SocketAddr]) -> String {
    let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    format!("serving on {}", addrs.join(", "))
}

fn spawn_monitor(app: &Arc<App>, cluster: &Arc<crate::nodes::Nodes>, node: Arc<NodeState>) {
    let settings_app = app.clone();
    tokio::spawn(crate::monitor::monitor(
        cluster.clone(),
        node,
        move || settings_app.config().cluster.clone(),
        app.connect_context(),
        app.shutdown_signal(),
    ));
}

fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Accepts again on the kept copies of the listening sockets (an upgrade undone: the new
/// process that accepted on them is gone).
pub(crate) fn accept_again(app: &Arc<App>) {
    let copies = match app.handover.listener_copies() {
        Ok(copies) => copies,
        Err(e) => {
            tracing::error!(error = %e, "cannot accept again: the listening sockets cannot be copied");
            return;
        }
    };
    let listener = |fd: std::os::fd::OwnedFd| {
        let listener = std::net::TcpListener::from(fd);
        listener.set_nonblocking(true)?;
        TcpListener::from_std(listener)
    };
    let (clients, api) = copies;
    for fd in clients {
        match listener(fd) {
            Ok(l) => {
                tokio::spawn(accept_loop(app.clone(), l));
            }
            Err(e) => tracing::error!(error = %e, "cannot accept again on a listening socket"),
        }
    }
    let api: Vec<TcpListener> = api.into_iter().filter_map(|fd| listener(fd).ok()).collect();
    crate::http::spawn(app, api);
}

async fn accept_loop(app: Arc<App>, listener: TcpListener) {
    let mut stopping = app.shutdown_signal();
    let mut handed_over = app.handover.stop_accepting();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, addr)) => {
                    let _ = tcp.set_nodelay(true);
                    tokio::spawn(client::handle(app.clone(), tcp, addr));
                }
                Err(e) => {
                    // Out of descriptors or similar: back off instead of spinning.
                    tracing::error!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = stopping.changed() => return,
            // The new process of an upgrade accepts on the same socket from now on.
            _ = handed_over.changed() => return,
        }
    }
}

/// Pool upkeep once a second: idle timeouts, lifetimes, and `min_size`.
async fn upkeep(app: Arc<App>) {
    let mut stopping = app.shutdown_signal();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stopping.changed() => return,
        }
        for pool in app.pools() {
            // Idle connections to a node that stopped answering are dead or soon will be; a
            // node that comes back gets fresh ones.
            if app.nodes.get(&pool.node.name).is_some_and(|n| !n.is_up()) {
                pool.drop_idle();
                continue;
            }
            let missing = pool.maintain();
            if missing > 0 {
                let app = app.clone();
                tokio::spawn(async move {
                    for _ in 0..missing {
                        if let Err(e) = pool.warm_up_one(&app.connect_context()).await {
                            tracing::warn!(db = %pool.database, user = %pool.user, node = %pool.node.name, error = ?e, "cannot open a connection towards min_size");
                            return;
                        }
                    }
                });
            }
        }
    }
}
