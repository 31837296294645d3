//! Free TCP ports on loopback for nodes and proxies.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;

static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A port on 127.0.0.1 nothing listens on, below the kernel's ephemeral range so outgoing
/// connections never take it, and never the same twice in one process.
pub fn free_port() -> std::io::Result<u16> {
    free_ports(1)
}

/// The first of `count` consecutive ports, each as [`free_port`] gives one (for instances
/// that take consecutive ports).
pub fn free_ports(count: u16) -> std::io::Result<u16> {
    let mut guard = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
    let handed_out = guard.get_or_insert_with(HashSet::new);
    for _ in 0..1000 {
        let first = 20_000 + (random_u32() % (12_000 - u32::from(count))) as u16;
        let ports = first..first + count;
        let free = ports.clone().all(|port| {
            !handed_out.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok()
        });
        if free {
            handed_out.extend(ports);
            return Ok(first);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "no free port found in 20000..32000",
    ))
}

fn random_u32() -> u32 {
    let mut bytes = [0u8; 4];
    // getrandom(2) cannot fail for four bytes on Linux; fall back to the clock just in case.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n == 4 {
        u32::from_ne_bytes(bytes)
    } else {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    }
}
