//! pgherd under systemd, as the Debian package's `Type=notify` unit runs it: readiness,
//! reload and stop notifications and the watchdog on `NOTIFY_SOCKET`, and logs to the journal
//! when standard error is connected to it. systemd itself is not needed: the test plays the
//! service manager's side of each protocol.

mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A config for a pgherd whose one node does not answer: it still starts and serves the
/// admin console, which is all these tests need.
fn config(dir: &std::path::Path) -> (std::path::PathBuf, u16) {
    let port = pgherd_cluster::free_port().unwrap();
    let node_port = pgherd_cluster::free_port().unwrap();
    let path = dir.join("pgherd.toml");
    std::fs::write(
        &path,
        format!(
            "[pgherd]\nlisten = [\"127.0.0.1:{port}\"]\nshutdown_timeout_ms = 2000\n\n\
             [cluster]\nhealth_check_timeout_ms = 200\n\n\
             [[nodes]]\nname = \"pg1\"\nport = {node_port}\n"
        ),
    )
    .unwrap();
    (path, port)
}

/// Starts pgherd through `sh`, which `exec`s it, so `WATCHDOG_PID` can name pgherd's own
/// process as systemd would.
fn spawn(config: &std::path::Path, envs: &[(&str, String)], stderr: Stdio) -> Child {
    Command::new("sh")
        .arg("-c")
        .arg(r#"WATCHDOG_PID=$$ exec "$0" run --config "$1""#)
        .arg(BIN)
        .arg(config)
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start pgherd")
}

/// The next notification, skipping watchdog pings unless `watchdog` asks for them.
fn next_message(socket: &UnixDatagram, watchdog: bool) -> String {
    let mut buf = [0u8; 4096];
    loop {
        let n = socket
            .recv(&mut buf)
            .expect("a notification before the timeout");
        let message = String::from_utf8_lossy(&buf[..n]).into_owned();
        if watchdog || message != "WATCHDOG=1\n" {
            return message;
        }
    }
}

/// The service manager's end of `NOTIFY_SOCKET`, in `dir`: its path and the socket.
fn notify_socket(dir: &std::path::Path) -> (std::path::PathBuf, UnixDatagram) {
    let path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    (path, socket)
}

fn signal(child: &Child, signal: libc::c_int) {
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

#[test]
fn notifies_systemd_of_ready_reload_stop_and_feeds_the_watchdog() {
    let dir = tempfile::tempdir().unwrap();
    let (config, port) = config(dir.path());
    let (socket_path, socket) = notify_socket(dir.path());
    let mut child = spawn(
        &config,
        &[
            ("NOTIFY_SOCKET", socket_path.display().to_string()),
            ("WATCHDOG_USEC", "200000".to_owned()),
        ],
        Stdio::null(),
    );

    let ready = next_message(&socket, false);
    assert_eq!(
        ready,
        format!("READY=1\nSTATUS=serving on 127.0.0.1:{port}\n")
    );
    // Ready means ready: a client connects at once.
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("pgherd accepts once ready");

    // The watchdog is fed at half its 200 ms period.
    let started = Instant::now();
    let mut pings = 0;
    while pings < 3 {
        if next_message(&socket, true) == "WATCHDOG=1\n" {
            pings += 1;
        }
    }
    assert!(started.elapsed() < Duration::from_secs(15));

    signal(&child, libc::SIGHUP);
    let reloading = next_message(&socket, false);
    let mut lines = reloading.lines();
    assert_eq!(lines.next(), Some("RELOADING=1"), "{reloading}");
    let usec = lines
        .next()
        .and_then(|l| l.strip_prefix("MONOTONIC_USEC="))
        .unwrap_or_else(|| panic!("no MONOTONIC_USEC in {reloading:?}"));
    assert!(usec.parse::<u64>().unwrap() > 0);
    assert_eq!(
        next_message(&socket, false),
        "READY=1\nSTATUS=serving; config reloaded\n"
    );

    // A config that no longer validates is refused; pgherd says so and keeps serving.
    std::fs::write(&config, "[pgherd\n").unwrap();
    signal(&child, libc::SIGHUP);
    assert!(next_message(&socket, false).starts_with("RELOADING=1\n"));
    assert_eq!(
        next_message(&socket, false),
        "READY=1\nSTATUS=serving; the last reload failed and the running config is kept\n"
    );
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("still serving");

    signal(&child, libc::SIGTERM);
    assert_eq!(
        next_message(&socket, false),
        "STOPPING=1\nSTATUS=draining: waiting for clients to finish\n"
    );
    let status = child.wait().unwrap();
    assert!(status.success(), "pgherd exited with {status}");
}

/// `systemctl stop` right after `systemctl start`: the SIGTERM follows READY at once and must
/// drain (STOPPING, exit 0), not kill pgherd with the signal's default action. Repeated, as
/// the gap it once fell into was short.
#[test]
fn a_stop_right_after_ready_drains() {
    let dir = tempfile::tempdir().unwrap();
    let (config, _) = config(dir.path());
    let (socket_path, socket) = notify_socket(dir.path());
    for _ in 0..5 {
        let notify = [("NOTIFY_SOCKET", socket_path.display().to_string())];
        let mut child = spawn(&config, &notify, Stdio::null());
        assert!(next_message(&socket, false).starts_with("READY=1\n"));
        signal(&child, libc::SIGTERM);
        assert!(next_message(&socket, false).starts_with("STOPPING=1\n"));
        let status = child.wait().unwrap();
        assert!(status.success(), "pgherd exited with {status}");
    }
}

#[test]
fn runs_without_a_service_manager() {
    let dir = tempfile::tempdir().unwrap();
    let (config, port) = config(dir.path());
    let mut child = spawn(&config, &[], Stdio::null());
    serve_then_stop(&mut child, port);
}

/// Stops pgherd with SIGTERM as soon as its port accepts (which may be before it is ready)
/// and expects a clean exit.
fn serve_then_stop(child: &mut Child, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "pgherd never listened");
        std::thread::sleep(Duration::from_millis(1));
    }
    signal(child, libc::SIGTERM);
    assert!(child.wait().unwrap().success());
}

/// With `JOURNAL_STREAM` naming its standard error, pgherd writes native journal entries; when
/// there is no journal to write to (this machine has no systemd-journald) it says so once and
/// logs to standard error as usual. A `JOURNAL_STREAM` inherited from elsewhere is ignored.
#[test]
fn logs_to_the_journal_when_standard_error_is_connected_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let (config, port) = config(dir.path());
    let journal_available = std::path::Path::new("/run/systemd/journal/socket").exists();

    for (stream_is_ours, name) in [(true, "ours"), (false, "inherited")] {
        let log_path = dir.path().join(format!("stderr-{name}"));
        let log = std::fs::File::create(&log_path).unwrap();
        let meta = log.metadata().unwrap();
        let stream = if stream_is_ours {
            format!("{}:{}", meta.dev(), meta.ino())
        } else {
            format!("{}:{}", meta.dev(), meta.ino() + 1)
        };
        let mut child = spawn(&config, &[("JOURNAL_STREAM", stream)], Stdio::from(log));
        serve_then_stop(&mut child, port);
        let logged = std::fs::read_to_string(&log_path).unwrap();
        let fell_back = logged.contains("cannot log to the journal");
        let on_stderr = logged.contains("pgherd is ready");
        match (stream_is_ours, journal_available) {
            (true, false) => assert!(fell_back && on_stderr, "{logged}"),
            (true, true) => assert!(!fell_back && !on_stderr, "{logged}"),
            (false, _) => assert!(!fell_back && on_stderr, "{logged}"),
        }
    }
}
