//! A real one-member etcd (Debian's `etcd-server`) in a temporary directory on free ports, for
//! tests of several pgherd instances agreeing through it.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pgherd_cluster::free_port;

pub struct TestEtcd {
    child: Option<Child>,
    pub client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    /// Clients over TLS with a certificate the CA signed: (CA, server certificate, key).
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
}

/// What etcd logs once it serves clients (a member that leads, its membership written).
const READY: &str = "ready to serve client requests";

impl TestEtcd {
    /// Starts etcd; returns once it accepts clients.
    pub fn start() -> TestEtcd {
        Self::start_with(None)
    }

    /// Starts etcd taking clients over TLS only, each with a certificate `certs`' CA signed
    /// (`--client-cert-auth`).
    pub fn start_tls(certs: &crate::certs::TestCerts) -> TestEtcd {
        Self::start_with(Some((
            certs.ca_file.clone(),
            certs.server_cert.clone(),
            certs.server_key.clone(),
        )))
    }

    fn start_with(tls: Option<(PathBuf, PathBuf, PathBuf)>) -> TestEtcd {
        let mut etcd = TestEtcd {
            child: None,
            client_port: free_port().expect("no free port"),
            peer_port: free_port().expect("no free port"),
            dir: tempfile::Builder::new()
                .prefix("pgherd-etcd-")
                .tempdir()
                .expect("temp dir"),
            tls,
        };
        etcd.spawn();
        etcd
    }

    /// The client URL for `[dcs] endpoints`.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    fn spawn(&mut self) {
        let ready_before = self.log().matches(READY).count();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        if let Some((ca, cert, key)) = &self.tls {
            command
                .arg("--cert-file")
                .arg(cert)
                .arg("--key-file")
                .arg(key)
                .arg("--trusted-ca-file")
                .arg(ca)
                .arg("--client-cert-auth");
        }
        let child = command
            .args(["--name", "test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("cannot start etcd (Debian package etcd-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", self.client_port)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        // Listening is not ready: a new member killed before it has made itself leader and
        // written its membership comes back with no voters and never serves again (a test
        // that killed etcd at once hung so on a loaded machine).
        while self.log().matches(READY).count() <= ready_before {
            assert!(
                Instant::now() < deadline,
                "etcd did not serve within 30 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL: etcd is gone, as after a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for TestEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}
