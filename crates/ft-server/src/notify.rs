//! systemd's notify protocol (`sd_notify(3)`), spoken directly: one datagram of `KEY=VALUE` lines to the
//! `AF_UNIX` socket named by `NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without
//! `NOTIFY_SOCKET` every call does nothing, so `ft serve` and `ft-server` speak it only under a `Type=notify`
//! unit (`packaging/systemd/freetoken.service`):
//!
//! ```text
//!  start-up  STATUS=Listening on ... / Loading the model ... / ...   (Rust and the Python worker's phases)
//!  serving   READY=1 once GET /health answers 200 on the bound address, STATUS=Serving ...
//!            WATCHDOG=1 from the engine's step watchdog while no step has overrun --step-timeout
//!  stopping  STOPPING=1 when SIGTERM / SIGINT starts the drain (or the engine dies)
//! ```

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where notifications go: the socket and an unbound datagram socket to send from.
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
}

impl Notifier {
    /// A notifier for the socket `name` (`NOTIFY_SOCKET`'s syntax: a path, or `@` + an abstract name).
    pub fn new(name: &str) -> std::io::Result<Notifier> {
        let addr = match name.strip_prefix('@') {
            Some(abstract_name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(abstract_name.as_bytes())?
            }
            None => SocketAddr::from_pathname(name)?,
        };
        Ok(Notifier { socket: UnixDatagram::unbound()?, addr })
    }

    /// Sends `state` (newline-separated `KEY=VALUE` assignments) as one datagram.
    pub fn send(&self, state: &str) -> std::io::Result<()> {
        self.socket.send_to_addr(state.as_bytes(), &self.addr).map(|_| ())
    }
}

/// The process's notifier, from `NOTIFY_SOCKET` (read once); `None` when not run by systemd.
fn notifier() -> Option<&'static Notifier> {
    static NOTIFIER: OnceLock<Option<Notifier>> = OnceLock::new();
    NOTIFIER
        .get_or_init(|| {
            let name = std::env::var("NOTIFY_SOCKET").ok().filter(|n| !n.is_empty())?;
            Notifier::new(&name).map_err(|e| tracing::warn!("NOTIFY_SOCKET={name}: {e}")).ok()
        })
        .as_ref()
}

/// True when a service manager listens (`NOTIFY_SOCKET` is set).
pub fn enabled() -> bool {
    notifier().is_some()
}

/// Sends `state` when a service manager listens; a failed send is logged once per process, never fatal.
pub fn notify(state: &str) {
    if let Some(n) = notifier() {
        if let Err(e) = n.send(state) {
            static WARNED: OnceLock<()> = OnceLock::new();
            WARNED.get_or_init(|| tracing::warn!("cannot notify the service manager: {e}"));
        }
    }
}

/// `STATUS=` (one line: newlines would end the assignment).
pub fn status(text: &str) {
    notify(&format!("STATUS={}", text.replace('\n', " ")));
}

/// The API answers: `READY=1` with a status line.
pub fn ready(text: &str) {
    notify(&format!("READY=1\nSTATUS={}", text.replace('\n', " ")));
}

/// The drain (or the end) has begun.
pub fn stopping(text: &str) {
    notify(&format!("STOPPING=1\nSTATUS={}", text.replace('\n', " ")));
}

/// systemd's watchdog period (`WATCHDOG_USEC`, for this process when `WATCHDOG_PID` names one); `None` when no
/// watchdog is asked for or nothing listens.
pub fn watchdog_period() -> Option<Duration> {
    notifier()?;
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok().filter(|u| *u > 0)?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    Some(Duration::from_micros(usec))
}

/// Sends `WATCHDOG=1` at most every `period / 4` (systemd restarts the service after a whole period without
/// one). The engine's watchdog calls [`tick`](Self::tick) on every round in which no step has overrun.
pub struct WatchdogPinger {
    every: Option<Duration>,
    last: Option<Instant>,
}

impl WatchdogPinger {
    pub fn from_env() -> Self {
        WatchdogPinger { every: watchdog_period().map(|p| p / 4), last: None }
    }

    pub fn tick(&mut self) {
        let Some(every) = self.every else { return };
        if self.last.is_none_or(|t| t.elapsed() >= every) {
            notify("WATCHDOG=1");
            self.last = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receive(listener: &UnixDatagram) -> String {
        let mut buf = [0u8; 512];
        let n = listener.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn datagrams_reach_a_path_socket() {
        let dir = std::env::temp_dir().join(format!("ft-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::new(path.to_str().unwrap()).unwrap();
        n.send("READY=1\nSTATUS=Serving").unwrap();
        assert_eq!(receive(&listener), "READY=1\nSTATUS=Serving");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn datagrams_reach_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("ft-notify-test-{}", std::process::id());
        let listener = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        Notifier::new(&format!("@{name}")).unwrap().send("WATCHDOG=1").unwrap();
        assert_eq!(receive(&listener), "WATCHDOG=1");
    }
}
