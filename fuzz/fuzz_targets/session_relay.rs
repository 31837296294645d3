#![no_main]
//! A client session driven through a running pgherd (`pgherd_proxy::serve`, in this process)
//! against a fake server, both sides from the fuzz input: the client's bytes after a good
//! login, and what the server answers each time pgherd sends it something. A panic anywhere
//! in pgherd aborts the process (libfuzzer-sys's panic hook), so this finds what one client
//! and one misbehaving server can do to the relay, the pool and the routing on the way.
//!
//! Input: `client_len: u16 LE`, the client's bytes, then server chunks (`len: u16 LE`,
//! bytes), each written when pgherd next sends the application's server connection a message
//! that asks for an answer; once they are used up, the server closes that connection at the
//! next such message.
//! pgherd's own connections (health checks, catalog) get a plausible primary's answers.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The management user pgherd checks the node as; anyone else is an application session.
const MANAGER: &str = "postgres";

/// Answers waiting for the application's server connections.
static SERVER_SCRIPT: Mutex<VecDeque<Vec<u8>>> = Mutex::new(VecDeque::new());

struct Harness {
    runtime: tokio::runtime::Runtime,
    pgherd: SocketAddr,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let pgherd = runtime.block_on(start());
        Harness { runtime, pgherd }
    })
}

/// Starts the fake server and pgherd in front of it; pgherd's address once it serves.
async fn start() -> SocketAddr {
    let server = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let server_port = server.local_addr().expect("an address").port();
    tokio::spawn(async move {
        while let Ok((conn, _)) = server.accept().await {
            tokio::spawn(fake_server(conn));
        }
    });
    let dir = std::env::temp_dir().join(format!("pgherd-fuzz-relay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let text = format!(
        "[pgherd]\nlisten = [\"127.0.0.1:0\"]\nshutdown_timeout_ms = 1000\n\
         client_login_timeout_ms = 2000\n\n\
         [cluster]\nuser = \"{MANAGER}\"\nhealth_check_period_ms = 1000\n\n\
         [[nodes]]\nname = \"pg1\"\nport = {server_port}\n\n\
         [pool]\nmode = \"transaction\"\nmax_size = 4\nwait_timeout_ms = 1000\n\n\
         [databases.\"*\"]\n\n[[hba]]\nmethod = \"trust\"\n"
    );
    let config = pgherd_config::Config::parse(&text, &dir.join("pgherd.toml"))
        .unwrap_or_else(|e| panic!("the harness's config: {e}"));
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let result = pgherd_proxy::serve(config, move |addrs| {
            let _ = ready_tx.send(addrs[0]);
        })
        .await;
        panic!("pgherd stopped: {result:?}");
    });
    ready_rx.await.expect("pgherd serves")
}

/// One message: its type byte and body, or None when the peer is gone.
async fn read_message(conn: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let tag = conn.read_u8().await.ok()?;
    let len = conn.read_u32().await.ok()?;
    let mut body = vec![0; (len as usize).checked_sub(4)?];
    conn.read_exact(&mut body).await.ok()?;
    Some((tag, body))
}

fn message(out: &mut Vec<u8>, tag: u8, body: &[u8]) {
    out.push(tag);
    out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
    out.extend_from_slice(body);
}

/// A server that logs anyone in; pgherd's own checks get a primary's answers, application
/// sessions the fuzz input's.
async fn fake_server(mut conn: TcpStream) {
    let Some(params) = startup(&mut conn).await else {
        return;
    };
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let mut out = Vec::new();
    if param("replication").is_some() {
        // The result cache's stream: not served here.
        message(
            &mut out,
            b'E',
            b"SFATAL\0C0A000\0Mreplication is not served by this server\0\0",
        );
        let _ = conn.write_all(&out).await;
        return;
    }
    message(&mut out, b'R', &0u32.to_be_bytes());
    for (name, value) in [
        ("server_version", "15.0"),
        ("server_encoding", "UTF8"),
        ("client_encoding", "UTF8"),
        ("DateStyle", "ISO, MDY"),
        ("TimeZone", "UTC"),
        ("integer_datetimes", "on"),
        ("standard_conforming_strings", "on"),
    ] {
        message(&mut out, b'S', format!("{name}\0{value}\0").as_bytes());
    }
    message(&mut out, b'K', &[0, 0, 0, 7, 0, 0, 0, 9]);
    message(&mut out, b'Z', b"I");
    if conn.write_all(&out).await.is_err() {
        return;
    }
    if param("user") == Some(MANAGER) {
        manage(conn).await
    } else {
        scripted(conn).await
    }
}

/// Reads the startup packet (refusing TLS and GSS requests); its parameters.
async fn startup(conn: &mut TcpStream) -> Option<Vec<(String, String)>> {
    loop {
        let len = conn.read_u32().await.ok()? as usize;
        let mut body = vec![0; len.checked_sub(4)?];
        conn.read_exact(&mut body).await.ok()?;
        let code = u32::from_be_bytes(body.get(..4)?.try_into().ok()?);
        if code == 80877103 || code == 80877104 {
            conn.write_all(b"N").await.ok()?;
            continue;
        }
        let text: Vec<String> = body[4..]
            .split(|b| *b == 0)
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        return Some(
            text.chunks(2)
                .filter(|kv| kv.len() == 2 && !kv[0].is_empty())
                .map(|kv| (kv[0].clone(), kv[1].clone()))
                .collect(),
        );
    }
}

/// pgherd's health checks: a primary at a fixed position; any other query an empty answer.
async fn manage(mut conn: TcpStream) {
    while let Some((tag, body)) = read_message(&mut conn).await {
        let mut out = Vec::new();
        match tag {
            b'Q' if body.starts_with(b"SELECT pg_is_in_recovery(),") => {
                let mut description = 6u16.to_be_bytes().to_vec();
                for i in 0..6 {
                    description.extend_from_slice(format!("c{i}\0").as_bytes());
                    description.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 25]);
                    // Size -1, modifier -1, text format.
                    description.extend_from_slice(&[255, 255, 255, 255, 255, 255, 0, 0]);
                }
                message(&mut out, b'T', &description);
                let mut row = 6u16.to_be_bytes().to_vec();
                for value in [
                    Some("f"),
                    Some("0/3000000"),
                    None,
                    Some("1"),
                    Some("f"),
                    None,
                ] {
                    match value {
                        Some(v) => {
                            row.extend_from_slice(&(v.len() as u32).to_be_bytes());
                            row.extend_from_slice(v.as_bytes());
                        }
                        None => row.extend_from_slice(&(-1i32).to_be_bytes()),
                    }
                }
                message(&mut out, b'D', &row);
                message(&mut out, b'C', b"SELECT 1\0");
                message(&mut out, b'Z', b"I");
            }
            b'Q' => {
                message(&mut out, b'C', b"SELECT 0\0");
                message(&mut out, b'Z', b"I");
            }
            b'S' => message(&mut out, b'Z', b"I"),
            b'X' => return,
            _ => {}
        }
        if conn.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// An application session's server: each message that asks for an answer (a query, a Sync,
/// a Flush, the end of COPY data) gets the next chunk of the script; none left, the
/// connection ends.
async fn scripted(mut conn: TcpStream) {
    while let Some((tag, _)) = read_message(&mut conn).await {
        match tag {
            b'Q' | b'S' | b'H' | b'c' | b'f' => {}
            b'X' => return,
            _ => continue,
        }
        let chunk = SERVER_SCRIPT.lock().expect("the script").pop_front();
        let Some(chunk) = chunk else {
            return;
        };
        if conn.write_all(&chunk).await.is_err() {
            return;
        }
    }
}

/// Splits the input into the client's bytes and the server's chunks.
fn split(data: &[u8]) -> (&[u8], VecDeque<Vec<u8>>) {
    let take = |data: &[u8]| -> (usize, usize) {
        match data {
            [a, b, ..] => (2, u16::from_le_bytes([*a, *b]) as usize),
            _ => (data.len(), 0),
        }
    };
    let (skip, len) = take(data);
    let rest = &data[skip..];
    let (client, mut rest) = rest.split_at(len.min(rest.len()));
    let mut chunks = VecDeque::new();
    while !rest.is_empty() {
        let (skip, len) = take(rest);
        let body = &rest[skip..];
        let (chunk, tail) = body.split_at(len.min(body.len()));
        chunks.push_back(chunk.to_vec());
        rest = tail;
    }
    (client, chunks)
}

/// Logs in as an application user: false if pgherd did not let it (a pool still held by
/// the previous input's sessions, say).
async fn log_in(conn: &mut TcpStream) -> bool {
    let mut body = 196608u32.to_be_bytes().to_vec();
    body.extend_from_slice(b"user\0app\0database\0app\0\0");
    let mut packet = (body.len() as u32 + 4).to_be_bytes().to_vec();
    packet.extend_from_slice(&body);
    if conn.write_all(&packet).await.is_err() {
        return false;
    }
    let login = async {
        while let Some((tag, body)) = read_message(conn).await {
            match tag {
                b'Z' => return true,
                b'E' => return false,
                b'R' if body.get(..4) != Some(&[0, 0, 0, 0]) => return false,
                _ => {}
            }
        }
        false
    };
    tokio::time::timeout(Duration::from_secs(5), login)
        .await
        .unwrap_or(false)
}

/// Sends the client's bytes and reads what comes back until the connection ends or pgherd
/// has been quiet for a moment.
async fn session(pgherd: SocketAddr, client: &[u8]) {
    let Ok(mut conn) = TcpStream::connect(pgherd).await else {
        return;
    };
    if !log_in(&mut conn).await || conn.write_all(client).await.is_err() {
        return;
    }
    let mut buf = vec![0; 64 << 10];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(15), conn.read(&mut buf)).await
    {
        if n == 0 {
            break;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let harness = harness();
    let (client, chunks) = split(data);
    *SERVER_SCRIPT.lock().expect("the script") = chunks;
    harness.runtime.block_on(session(harness.pgherd, client));
});
