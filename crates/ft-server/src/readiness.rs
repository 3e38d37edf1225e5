//! When to tell the service manager that the server is ready or stopping (`notify`): READY once the API really
//! answers (`GET /health` gives 200 on the bound address, asked like any client would), STOPPING as soon as
//! SIGTERM or SIGINT starts the drain.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// Polls `GET /health` on `bound` until it answers 200, then sends READY=1 with `status`.
pub async fn notify_ready_when_answering(bound: SocketAddr, status: String) {
    let addr = reachable(bound);
    while !tokio::task::spawn_blocking(move || health_is_ok(addr)).await.unwrap_or(false) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    crate::notify::ready(&status);
}

/// Sends STOPPING=1 at the first SIGTERM or SIGINT (the HTTP server drains on the same signal).
pub async fn notify_stopping_on_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return;
    };
    let sig = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    crate::notify::stopping(&format!("{sig} received: draining in-flight requests"));
}

/// The address a client connects to for a listener bound to `bound` (an unspecified address is reached through
/// loopback).
fn reachable(bound: SocketAddr) -> SocketAddr {
    match bound.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bound.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), bound.port()),
        _ => bound,
    }
}

/// One `GET /health` over HTTP/1.1 (blocking, a second at most): true for a 200 answer.
fn health_is_ok(addr: SocketAddr) -> bool {
    let ask = || -> std::io::Result<bool> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
        stream.set_read_timeout(Some(Duration::from_secs(1)))?;
        stream.set_write_timeout(Some(Duration::from_secs(1)))?;
        stream.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head)?;
        Ok(head.starts_with(b"HTTP/1.1 200"))
    };
    ask().unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_probe_reads_the_status_line() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(!health_is_ok(SocketAddr::new(addr.ip(), 1)), "nothing listens on port 1");
        for (status, ok) in [("HTTP/1.1 200 OK\r\n\r\n", true), ("HTTP/1.1 503 Service Unavailable\r\n\r\n", false)] {
            let server = std::thread::scope(|scope| {
                let answer = scope.spawn(|| {
                    let (mut s, _) = listener.accept().unwrap();
                    let mut buf = [0u8; 256];
                    let n = s.read(&mut buf).unwrap();
                    s.write_all(status.as_bytes()).unwrap();
                    String::from_utf8_lossy(&buf[..n]).into_owned()
                });
                assert_eq!(health_is_ok(addr), ok, "{status}");
                answer.join().unwrap()
            });
            assert!(server.starts_with("GET /health HTTP/1.1\r\n"), "{server}");
        }
        assert_eq!(reachable("0.0.0.0:7".parse().unwrap()), "127.0.0.1:7".parse().unwrap());
        assert_eq!(reachable("[::]:7".parse().unwrap()), "[::1]:7".parse().unwrap());
    }
}
