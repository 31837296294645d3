//! A TCP relay between one pgherd instance and etcd, so the drill can cut that one instance
//! off from etcd while it still reaches its clients and PostgreSQL (everything else runs on
//! one loopback, where a link cannot be taken down for one process alone).
//!
//! Cut, the relay behaves as a partition does, not as a closed port: bytes stop flowing both
//! ways and connections, old and new, stay open without an answer, so the instance sees
//! timeouts. Once the link is back those connections are closed and new ones go through.

use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Relay {
    pub port: u16,
    cut: watch::Sender<bool>,
}

impl Relay {
    /// Listens on a free loopback port and relays to `target_port` there.
    pub async fn start(target_port: u16) -> Result<Relay, String> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| format!("relay: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("relay: {e}"))?
            .port();
        let (cut, watching) = watch::channel(false);
        tokio::spawn(accept(listener, target_port, watching));
        Ok(Relay { port, cut })
    }

    pub fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

async fn accept(listener: TcpListener, target_port: u16, cut: watch::Receiver<bool>) {
    while let Ok((client, _)) = listener.accept().await {
        tokio::spawn(carry(client, target_port, cut.clone()));
    }
}

async fn carry(mut client: TcpStream, target_port: u16, mut cut: watch::Receiver<bool>) {
    if *cut.borrow_and_update() {
        wait_for(&mut cut, false).await;
        return;
    }
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", target_port)).await else {
        return;
    };
    tokio::select! {
        _ = copy_bidirectional(&mut client, &mut server) => {}
        _ = wait_for(&mut cut, true) => wait_for(&mut cut, false).await,
    }
}

/// Returns once the link's state is `cut` (at once if it is); never if the relay is gone.
async fn wait_for(watching: &mut watch::Receiver<bool>, cut: bool) {
    loop {
        if *watching.borrow_and_update() == cut {
            return;
        }
        if watching.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
