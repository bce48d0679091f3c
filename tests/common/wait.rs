//! Waiting for an event instead of sleeping: a poll with a deadline, and what the kernel says about this
//! machine's TCP sockets (`/proc/net/tcp`), which shows what a peer process did with our bytes or connections
//! (read them, accepted them, left them waiting) without a fixed sleep that assumes it.
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

/// Poll `done` every 50 ms until it holds; fails the test naming `what` after `within`.
pub fn poll_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// As [`poll_until`], yielding to the test's runtime between polls (for in-process servers on that runtime).
pub async fn poll_until_async(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One IPv4 TCP socket as `/proc/net/tcp` lists it.
#[derive(Debug, Clone, Copy)]
pub struct TcpSocket {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The kernel's state number: 0x0A is LISTEN, 0x01 ESTABLISHED.
    pub state: u8,
    /// Bytes sent and not yet acknowledged by the peer's kernel; for a listener, 0.
    pub tx_queue: u64,
    /// Bytes received and not yet read by the process; for a listener, connections not yet accepted.
    pub rx_queue: u64,
}

const LISTEN: u8 = 0x0A;

/// Every IPv4 TCP socket of this network namespace.
pub fn tcp_sockets() -> Vec<TcpSocket> {
    let text = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp (Linux)");
    text.lines().skip(1).filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<TcpSocket> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (tx, rx) = fields.get(4)?.split_once(':')?;
    Some(TcpSocket {
        local: parse_addr(fields.get(1)?)?,
        remote: parse_addr(fields.get(2)?)?,
        state: u8::from_str_radix(fields.get(3)?, 16).ok()?,
        tx_queue: u64::from_str_radix(tx, 16).ok()?,
        rx_queue: u64::from_str_radix(rx, 16).ok()?,
    })
}

/// `0100007F:1F90`: the address as the kernel stores it (network order) printed as a native (little-endian
/// here) number, then the port in hex.
fn parse_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let ip = Ipv4Addr::from(u32::from_str_radix(ip, 16).ok()?.to_le_bytes());
    Some(SocketAddr::V4(SocketAddrV4::new(
        ip,
        u16::from_str_radix(port, 16).ok()?,
    )))
}

/// Connections that completed their handshake with `listener` and wait in its accept queue for the process to
/// accept them.
pub fn accept_backlog(listener: SocketAddr) -> u64 {
    tcp_sockets()
        .iter()
        .find(|s| s.state == LISTEN && s.local == listener)
        .map(|s| s.rx_queue)
        .unwrap_or_else(|| panic!("no listener on {listener} in /proc/net/tcp"))
}

/// Whether the process at the other end of `stream` has read everything written to it: the peer's kernel
/// acknowledged every byte (our send queue is empty) and nothing waits in the peer's receive queue.
pub fn peer_read_all(stream: &TcpStream) -> bool {
    let (ours, theirs) = (stream.local_addr().unwrap(), stream.peer_addr().unwrap());
    let sockets = tcp_sockets();
    let find = |local, remote| sockets.iter().find(|s| s.local == local && s.remote == remote).copied();
    match (find(ours, theirs), find(theirs, ours)) {
        (Some(me), Some(peer)) => me.tx_queue == 0 && peer.rx_queue == 0,
        _ => false,
    }
}
