//! Pagoda's etcd registry (DESIGN §6): who is in the cluster right now.
//!
//! Workers, routers and kvstore nodes each keep one key under `<prefix>/<role>/<id>` (JSON [`Member`]) attached to
//! a lease of [`RegistryConfig::ttl`] (10 s). [`register`] starts the task that owns that lease: it grants it, puts
//! the key, keeps it alive every third of the TTL, and when the lease is lost (expired while the process was frozen
//! or cut off, or revoked) grants a new one and puts the key again. [`watch`] starts the task that owns a view of
//! one role's members: it lists them (get), then watches from the next revision, and lists again after a
//! compaction, a cancelled watch or a broken connection; the consumer gets every list as a full
//! [`MembershipEvent::Listed`] and every change as `Joined`/`Left`. Everything is bounded: ids, values, the number
//! of members listed and every etcd call's time. [`documents`] keeps small shared documents (the routers' stored
//! responses) on leases of their own.

pub mod documents;
pub mod local;

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::sync::{mpsc, watch as tokio_watch};
use tokio::task::JoinHandle;

/// Longest member id (it is part of an etcd key).
pub const MAX_ID_LEN: usize = 256;
/// Largest member value accepted from etcd.
pub const MAX_VALUE_BYTES: usize = 4096;
/// Most members of one role a list accepts; more is a misconfiguration, not a cluster.
pub const MAX_MEMBERS: usize = 4096;
/// Events buffered for a watch consumer before the watcher waits for it.
const WATCH_BUFFER: usize = 1024;

/// Registry errors.
#[derive(Debug, Error)]
pub enum RegistryError {
    #[error("registry configuration: {0}")]
    Config(String),
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    #[error("registry value under {key}: {why}")]
    Decode { key: String, why: String },
    #[error("etcd lease {0} is gone")]
    LeaseLost(i64),
}

/// Which kind of member a key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Worker,
    Router,
    Kvstore,
}

impl Role {
    pub fn dir(self) -> &'static str {
        match self {
            Role::Worker => "workers",
            Role::Router => "routers",
            Role::Kvstore => "kvstore",
        }
    }
}

/// Where the registry lives and how long a member outlives its last keep-alive.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// etcd client URLs (`http://host:port` or `host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix of this cluster, e.g. `/pagoda/default`.
    pub prefix: String,
    pub ttl: Duration,
    /// Longest wait for one etcd call.
    pub call_timeout: Duration,
}

impl RegistryConfig {
    /// `endpoints` comma-separated or repeated; an empty `prefix` means `/pagoda/default`.
    pub fn new(endpoints: Vec<String>, prefix: &str) -> Result<RegistryConfig, RegistryError> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .flat_map(|e| e.split(','))
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Err(RegistryError::Config("no etcd endpoint".into()));
        }
        if endpoints.len() > 16 {
            return Err(RegistryError::Config(format!("{} etcd endpoints (at most 16)", endpoints.len())));
        }
        let prefix = if prefix.is_empty() { "/pagoda/default" } else { prefix.trim_end_matches('/') };
        if !prefix.starts_with('/') || prefix.len() > 256 {
            return Err(RegistryError::Config(format!("prefix {prefix:?} must start with '/' (<= 256 bytes)")));
        }
        Ok(RegistryConfig {
            endpoints,
            prefix: prefix.to_string(),
            ttl: Duration::from_secs(10),
            call_timeout: Duration::from_secs(3),
        })
    }

    /// The directory of `role`'s keys, with its trailing slash.
    pub fn role_prefix(&self, role: Role) -> String {
        format!("{}/{}/", self.prefix, role.dir())
    }

    pub fn key(&self, role: Role, id: &str) -> String {
        format!("{}{id}", self.role_prefix(role))
    }
}

/// What a member publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Unique within its role (a worker's directory id, a kvstore node's raft id, a router's address).
    pub id: String,
    /// Where the others reach it (gRPC for workers and kvstore nodes, HTTP for routers).
    pub address: String,
    /// Changes on every process start (microseconds since the epoch at start).
    pub epoch: u64,
    /// A kvstore node's raft id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<u64>,
}

impl Member {
    fn check(&self) -> Result<(), RegistryError> {
        if self.id.is_empty() || self.id.len() > MAX_ID_LEN || self.id.contains('/') {
            return Err(RegistryError::Config(format!(
                "member id {:?} must be 1 to {MAX_ID_LEN} bytes, no '/'",
                self.id
            )));
        }
        if self.address.is_empty() || self.address.len() > 512 {
            return Err(RegistryError::Config(format!("member address {:?} must be 1 to 512 bytes", self.address)));
        }
        Ok(())
    }
}

async fn bounded<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RegistryError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(RegistryError::from),
        Err(_) => Err(RegistryError::Timeout(limit)),
    }
}

/// Connects to etcd (lazily: the first call reaches it).
pub async fn connect(cfg: &RegistryConfig) -> Result<Client, RegistryError> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(cfg.call_timeout)
        .with_timeout(cfg.call_timeout)
        .with_keep_alive(Duration::from_secs(2), cfg.call_timeout);
    bounded(cfg.call_timeout, Client::connect(cfg.endpoints.clone(), Some(opts))).await
}

fn decode(key: &[u8], value: &[u8]) -> Result<Member, RegistryError> {
    let key = String::from_utf8_lossy(key).into_owned();
    if value.len() > MAX_VALUE_BYTES {
        return Err(RegistryError::Decode { key, why: format!("{} bytes (at most {MAX_VALUE_BYTES})", value.len()) });
    }
    let m: Member =
        serde_json::from_slice(value).map_err(|e| RegistryError::Decode { key: key.clone(), why: e.to_string() })?;
    m.check().map_err(|e| RegistryError::Decode { key, why: e.to_string() })?;
    Ok(m)
}

/// The members of `role` and the etcd revision they were read at.
pub async fn list(client: &mut Client, cfg: &RegistryConfig, role: Role) -> Result<(Vec<Member>, i64), RegistryError> {
    let opts = GetOptions::new().with_prefix().with_limit(MAX_MEMBERS as i64 + 1);
    let resp = bounded(cfg.call_timeout, client.get(cfg.role_prefix(role), Some(opts))).await?;
    if resp.kvs().len() > MAX_MEMBERS {
        return Err(RegistryError::Config(format!("more than {MAX_MEMBERS} {} registered", role.dir())));
    }
    let revision = resp.header().map_or(0, |h| h.revision());
    let mut members = Vec::with_capacity(resp.kvs().len());
    for kv in resp.kvs() {
        match decode(kv.key(), kv.value()) {
            Ok(m) => members.push(m),
            Err(e) => tracing::warn!(error = %e, "ignoring a malformed registry entry"),
        }
    }
    Ok((members, revision))
}

/// Waits (bounded by `timeout`) until at least `min` members of `role` are registered, and returns them.
pub async fn wait_for_members(
    cfg: &RegistryConfig,
    role: Role,
    min: usize,
    timeout: Duration,
) -> Result<Vec<Member>, RegistryError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_err = None;
    loop {
        let attempt = async {
            let mut client = connect(cfg).await?;
            list(&mut client, cfg, role).await
        };
        match attempt.await {
            Ok((members, _)) if members.len() >= min => return Ok(members),
            Ok(_) => {}
            Err(e) => last_err = Some(e),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(last_err.unwrap_or(RegistryError::Timeout(timeout)));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The state of one registration, as its task last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistrationStatus {
    /// The key is in etcd under a live lease.
    pub registered: bool,
    pub lease: i64,
    /// Leases granted so far (1 + how often a lost lease was replaced).
    pub grants: u64,
    pub last_error: Option<String>,
}

/// A running registration; [`Registration::stop`] revokes the lease (the key goes at once), dropping it only stops
/// the keep-alives (the key goes when the lease expires).
pub struct Registration {
    task: JoinHandle<()>,
    status: tokio_watch::Receiver<RegistrationStatus>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Registration {
    pub fn status(&self) -> RegistrationStatus {
        self.status.borrow().clone()
    }

    /// Waits until the member is registered (or `timeout`).
    pub async fn wait_registered(&mut self, timeout: Duration) -> Result<(), RegistryError> {
        let wait = self.status.wait_for(|s| s.registered);
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(RegistryError::Config("the registration task ended".into())),
            Err(_) => Err(RegistryError::Timeout(timeout)),
        }
    }

    /// Revokes the lease (bounded) and ends the task.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(Duration::from_secs(3), &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Registers `member` as a `role` and keeps it registered until stopped.
pub fn register(cfg: RegistryConfig, role: Role, member: Member) -> Result<Registration, RegistryError> {
    member.check()?;
    let value = serde_json::to_vec(&member).map_err(|e| RegistryError::Config(e.to_string()))?;
    let (tx, status) = tokio_watch::channel(RegistrationStatus::default());
    let (stop, stop_rx) = tokio::sync::oneshot::channel();
    let key = cfg.key(role, &member.id);
    let task = tokio::spawn(keep_registered(cfg, key, value, tx, stop_rx));
    Ok(Registration { task, status, stop: Some(stop) })
}

async fn keep_registered(
    cfg: RegistryConfig,
    key: String,
    value: Vec<u8>,
    status: tokio_watch::Sender<RegistrationStatus>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut grants = 0u64;
    let mut lease = 0i64;
    let mut client: Option<Client> = None;
    let mut failures = 0u32;
    loop {
        let round = hold_once(&cfg, &key, &value, &mut client, &status, &mut grants, &mut lease);
        let err = tokio::select! {
            e = round => e,
            _ = &mut stop => {
                if let Some(c) = client.as_mut() && lease != 0 {
                    let _ = bounded(cfg.call_timeout, c.lease_revoke(lease)).await;
                }
                status.send_modify(|s| s.registered = false);
                return;
            }
        };
        failures += 1;
        if failures == 1 || failures.is_multiple_of(20) {
            tracing::warn!(key, error = %err, "etcd registration lost; registering again");
        }
        if !matches!(err, RegistryError::LeaseLost(_)) {
            // A broken connection: reconnect from scratch next round.
            client = None;
        }
        status.send_modify(|s| {
            s.registered = false;
            s.last_error = Some(err.to_string());
        });
        let pause = if failures < 5 { Duration::from_millis(200) } else { Duration::from_secs(1) };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = &mut stop => return,
        }
    }
}

/// Grants a lease, puts the key and keeps the lease alive until something fails; returns what failed.
async fn hold_once(
    cfg: &RegistryConfig,
    key: &str,
    value: &[u8],
    client: &mut Option<Client>,
    status: &tokio_watch::Sender<RegistrationStatus>,
    grants: &mut u64,
    lease_out: &mut i64,
) -> RegistryError {
    let c = match client {
        Some(c) => c,
        None => match connect(cfg).await {
            Ok(c) => client.insert(c),
            Err(e) => return e,
        },
    };
    let ttl = i64::try_from(cfg.ttl.as_secs().max(1)).unwrap_or(10);
    let lease = match bounded(cfg.call_timeout, c.lease_grant(ttl, None)).await {
        Ok(l) => l.id(),
        Err(e) => return e,
    };
    *grants += 1;
    *lease_out = lease;
    let put = c.put(key, value.to_vec(), Some(PutOptions::new().with_lease(lease)));
    if let Err(e) = bounded(cfg.call_timeout, put).await {
        return e;
    }
    let (mut keeper, mut replies) = match bounded(cfg.call_timeout, c.lease_keep_alive(lease)).await {
        Ok(k) => k,
        Err(e) => return e,
    };
    status.send_replace(RegistrationStatus { registered: true, lease, grants: *grants, last_error: None });
    tracing::info!(key, lease, "registered in etcd");
    let every = (cfg.ttl / 3).max(Duration::from_millis(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = bounded(cfg.call_timeout, keeper.keep_alive()).await {
            return e;
        }
        match bounded(cfg.call_timeout, replies.message()).await {
            Ok(Some(r)) if r.ttl() > 0 => {}
            Ok(_) => return RegistryError::LeaseLost(lease),
            Err(e) => return e,
        }
    }
}

/// One change of a role's membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// The full membership (after the first list, and after every re-list).
    Listed(Vec<Member>),
    /// A member registered or re-registered (a new epoch or address).
    Joined(Member),
    /// The member with this id left (its lease expired or was revoked).
    Left(String),
}

/// Watches `role`'s members; the task ends when the receiver is dropped.
pub fn watch(cfg: RegistryConfig, role: Role) -> (mpsc::Receiver<MembershipEvent>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(WATCH_BUFFER);
    let task = tokio::spawn(async move {
        let mut failures = 0u32;
        loop {
            let err = follow(&cfg, role, &tx).await;
            if tx.is_closed() {
                return;
            }
            failures += 1;
            if failures == 1 || failures.is_multiple_of(20) {
                tracing::warn!(role = role.dir(), error = %err, "etcd registry watch ended; listing again");
            }
            tokio::time::sleep(if failures < 5 { Duration::from_millis(200) } else { Duration::from_secs(1) }).await;
        }
    });
    (rx, task)
}

fn id_of(key: &[u8], prefix: &str) -> Option<String> {
    std::str::from_utf8(key).ok()?.strip_prefix(prefix).filter(|id| !id.is_empty()).map(str::to_string)
}

/// Lists, then follows the watch; returns why it stopped.
async fn follow(cfg: &RegistryConfig, role: Role, tx: &mpsc::Sender<MembershipEvent>) -> RegistryError {
    let mut client = match connect(cfg).await {
        Ok(c) => c,
        Err(e) => return e,
    };
    let (members, revision) = match list(&mut client, cfg, role).await {
        Ok(l) => l,
        Err(e) => return e,
    };
    // Keys by id, for turning a delete event (a bare key) into an id.
    let mut known: BTreeMap<String, Member> = members.iter().map(|m| (m.id.clone(), m.clone())).collect();
    if tx.send(MembershipEvent::Listed(members)).await.is_err() {
        return RegistryError::Config("watch consumer gone".into());
    }
    let prefix = cfg.role_prefix(role);
    let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
    let mut stream = match bounded(cfg.call_timeout, client.watch(prefix.clone(), Some(opts))).await {
        Ok(s) => s,
        Err(e) => return e,
    };
    loop {
        let resp = match stream.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return RegistryError::Config("etcd closed the watch".into()),
            Err(e) => return e.into(),
        };
        if resp.compact_revision() > 0 {
            return RegistryError::Config(format!("watch compacted at revision {}", resp.compact_revision()));
        }
        if resp.canceled() {
            return RegistryError::Config(format!("watch cancelled: {}", resp.cancel_reason()));
        }
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            let Some(id) = id_of(kv.key(), &prefix) else { continue };
            let out = match ev.event_type() {
                EventType::Put => match decode(kv.key(), kv.value()) {
                    Ok(m) if known.len() < MAX_MEMBERS || known.contains_key(&m.id) => {
                        known.insert(m.id.clone(), m.clone());
                        MembershipEvent::Joined(m)
                    }
                    Ok(_) => {
                        tracing::warn!(role = role.dir(), "registry full; ignoring a new member");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "ignoring a malformed registry entry");
                        continue;
                    }
                },
                EventType::Delete => {
                    if known.remove(&id).is_none() {
                        continue;
                    }
                    MembershipEvent::Left(id)
                }
            };
            if tx.send(out).await.is_err() {
                return RegistryError::Config("watch consumer gone".into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_and_keys() {
        let cfg = RegistryConfig::new(vec!["127.0.0.1:1, 127.0.0.1:2".into()], "/pagoda/x/").unwrap();
        assert_eq!(cfg.endpoints, ["127.0.0.1:1", "127.0.0.1:2"]);
        assert_eq!(cfg.key(Role::Worker, "w1"), "/pagoda/x/workers/w1");
        assert_eq!(cfg.role_prefix(Role::Kvstore), "/pagoda/x/kvstore/");
        assert_eq!(RegistryConfig::new(vec!["e".into()], "").unwrap().prefix, "/pagoda/default");
        assert!(RegistryConfig::new(vec![" ".into()], "").is_err());
        assert!(RegistryConfig::new(vec!["e".into()], "relative").is_err());
    }

    #[test]
    fn members_are_checked() {
        let m = Member { id: "w/1".into(), address: "a:1".into(), epoch: 1, node_id: None };
        assert!(m.check().is_err());
        assert!(decode(b"k", b"{not json").is_err());
        assert!(decode(b"k", &vec![b' '; MAX_VALUE_BYTES + 1]).is_err());
        let ok = decode(b"k", br#"{"id":"w1","address":"127.0.0.1:5","epoch":3}"#).unwrap();
        assert_eq!(ok, Member { id: "w1".into(), address: "127.0.0.1:5".into(), epoch: 3, node_id: None });
        assert_eq!(id_of(b"/p/workers/w1", "/p/workers/"), Some("w1".into()));
        assert_eq!(id_of(b"/p/workers/", "/p/workers/"), None);
    }
}
