//! A fault-injecting TCP proxy on loopback, for network-partition tests: it forwards one listening port to one
//! target, and can be switched at any time between
//!
//! - [`Fault::None`]: bytes flow both ways;
//! - [`Fault::Blackhole`]: a partition. Every open connection stops forwarding in both directions and stays open
//!   (no FIN, no RST: packets are simply lost), and so does every connection accepted while it lasts. Such a
//!   connection stays dead after the partition heals, as a TCP connection whose peer vanished would: only new
//!   connections work again, so the client must notice the dead one (keepalive, timeouts) to recover;
//! - [`Fault::Reset`]: every open and new connection is closed at once with a TCP RST.
//!
//! The proxy owns its tasks; dropping it closes the listener and every connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to traffic now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None = 0,
    Blackhole = 1,
    Reset = 2,
}

impl Fault {
    fn from_u8(v: u8) -> Fault {
        match v {
            1 => Fault::Blackhole,
            2 => Fault::Reset,
            _ => Fault::None,
        }
    }
}

/// Counters of what the proxy did.
#[derive(Debug, Default)]
pub struct ProxyCounters {
    pub accepted: AtomicU64,
    pub forwarded_bytes: AtomicU64,
    /// Connections that went dead in a blackhole.
    pub blackholed: AtomicU64,
    pub reset: AtomicU64,
}

/// A running proxy; see the module doc.
pub struct FaultProxy {
    addr: SocketAddr,
    fault: Arc<AtomicU8>,
    counters: Arc<ProxyCounters>,
    /// Flipped on drop: every task of the proxy ends.
    shutdown: watch::Sender<bool>,
}

/// Bytes read per forwarding step.
const CHUNK: usize = 16 * 1024;
/// How often a connection parked by a fault checks whether the proxy is gone.
const PARK_POLL: Duration = Duration::from_millis(100);

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let fault = Arc::new(AtomicU8::new(Fault::None as u8));
        let counters = Arc::new(ProxyCounters::default());
        let (shutdown, stop) = watch::channel(false);
        let (f, c) = (fault.clone(), counters.clone());
        tokio::spawn(async move {
            let mut stop_accept = stop.clone();
            loop {
                let conn = tokio::select! {
                    _ = stop_accept.changed() => return,
                    c = listener.accept() => c,
                };
                let Ok((client, _)) = conn else { continue };
                c.accepted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve(client, target, f.clone(), c.clone(), stop.clone()));
            }
        });
        Ok(FaultProxy { addr, fault, counters, shutdown })
    }

    /// The address clients connect to instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn set(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::SeqCst);
    }

    pub fn counters(&self) -> &ProxyCounters {
        &self.counters
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

async fn serve(
    client: TcpStream,
    target: SocketAddr,
    fault: Arc<AtomicU8>,
    counters: Arc<ProxyCounters>,
    stop: watch::Receiver<bool>,
) {
    let current = || Fault::from_u8(fault.load(Ordering::SeqCst));
    match current() {
        Fault::Reset => return reset(client, &counters),
        Fault::Blackhole => {
            counters.blackholed.fetch_add(1, Ordering::Relaxed);
            return park(client, None, stop).await;
        }
        Fault::None => {}
    }
    let Ok(upstream) = TcpStream::connect(target).await else { return reset(client, &counters) };
    let _ = upstream.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let mut up = [0u8; CHUNK];
    let mut down = [0u8; CHUNK];
    let mut stop_rx = stop.clone();
    // One task pumps both directions, so a fault seen on either side stops both at once.
    let outcome = loop {
        let (n, to_upstream) = tokio::select! {
            _ = stop_rx.changed() => return,
            r = cr.read(&mut up) => (r, true),
            r = ur.read(&mut down) => (r, false),
        };
        match current() {
            Fault::None => {}
            other => break other,
        }
        let n = match n {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let written = if to_upstream { uw.write_all(&up[..n]).await } else { cw.write_all(&down[..n]).await };
        if written.is_err() {
            return;
        }
        counters.forwarded_bytes.fetch_add(n as u64, Ordering::Relaxed);
    };
    let (Ok(client), Ok(upstream)) = (cr.reunite(cw), ur.reunite(uw)) else { return };
    match outcome {
        Fault::Reset => {
            reset(client, &counters);
            drop(upstream);
        }
        _ => {
            counters.blackholed.fetch_add(1, Ordering::Relaxed);
            park(client, Some(upstream), stop).await;
        }
    }
}

/// Closes `client` with an RST (linger 0) rather than a FIN.
fn reset(client: TcpStream, counters: &ProxyCounters) {
    counters.reset.fetch_add(1, Ordering::Relaxed);
    let _ = client.set_zero_linger();
    drop(client);
}

/// Holds a dead connection open, reading nothing, until the proxy is dropped.
async fn park(client: TcpStream, upstream: Option<TcpStream>, mut stop: watch::Receiver<bool>) {
    loop {
        if *stop.borrow() {
            break;
        }
        let _ = tokio::time::timeout(PARK_POLL, stop.changed()).await;
    }
    drop((client, upstream));
}
