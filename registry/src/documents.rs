//! Small documents every member of the cluster can read: values under `<prefix>/<dir>/<key>`, each on its own lease
//! so that etcd deletes it after a time to live. The routers keep the Responses API's stored responses here, so a
//! follow-up reaches its conversation through any router.
//!
//! [`DocumentStore`] owns one lazily connected etcd client (connected on first use, again after a failed connect).
//! Every value and key is bounded and every call is bounded in time; bounding how much a member writes is the
//! caller's part (etcd's space is the registry's too).

use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio::sync::OnceCell;

use crate::{RegistryConfig, RegistryError, bounded, connect};

/// Largest document: well inside etcd's default request limit (1.5 MiB).
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;
/// Longest key below the directory.
pub const MAX_DOCUMENT_KEY: usize = 512;

/// Documents under `<prefix>/<dir>/`.
pub struct DocumentStore {
    cfg: RegistryConfig,
    dir: String,
    ttl: Duration,
    client: OnceCell<Client>,
}

impl DocumentStore {
    /// Documents under `<cfg.prefix>/<dir>/`, each deleted by etcd `ttl` after it was written.
    pub fn new(cfg: RegistryConfig, dir: &str, ttl: Duration) -> DocumentStore {
        let dir = format!("{}/{}/", cfg.prefix, dir.trim_matches('/'));
        DocumentStore { cfg, dir, ttl, client: OnceCell::new() }
    }

    async fn client(&self) -> Result<Client, RegistryError> {
        self.client.get_or_try_init(|| connect(&self.cfg)).await.cloned()
    }

    fn full_key(&self, key: &str) -> Result<String, RegistryError> {
        if key.is_empty() || key.len() > MAX_DOCUMENT_KEY {
            return Err(RegistryError::Config(format!(
                "document key of {} bytes (1 to {MAX_DOCUMENT_KEY})",
                key.len()
            )));
        }
        Ok(format!("{}{key}", self.dir))
    }

    /// Writes `value` under `key` on a new lease of the store's time to live.
    pub async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), RegistryError> {
        let full = self.full_key(key)?;
        if value.len() > MAX_DOCUMENT_BYTES {
            return Err(RegistryError::Config(format!(
                "document {key} is {} bytes (at most {MAX_DOCUMENT_BYTES})",
                value.len()
            )));
        }
        let mut client = self.client().await?;
        let limit = self.cfg.call_timeout;
        let ttl = i64::try_from(self.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = bounded(limit, client.lease_grant(ttl, None)).await?;
        bounded(limit, client.put(full, value, Some(PutOptions::new().with_lease(lease.id())))).await?;
        Ok(())
    }

    /// The value under `key`, if there is one.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        let full = self.full_key(key)?;
        let mut client = self.client().await?;
        let resp = bounded(self.cfg.call_timeout, client.get(full.clone(), None)).await?;
        match resp.kvs().first() {
            None => Ok(None),
            Some(kv) if kv.value().len() > MAX_DOCUMENT_BYTES => Err(RegistryError::Decode {
                key: full,
                why: format!("{} bytes (at most {MAX_DOCUMENT_BYTES})", kv.value().len()),
            }),
            Some(kv) => Ok(Some(kv.value().to_vec())),
        }
    }

    /// Deletes `key`; whether it was there.
    pub async fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        let full = self.full_key(key)?;
        let mut client = self.client().await?;
        let resp = bounded(self.cfg.call_timeout, client.delete(full, None)).await?;
        Ok(resp.deleted() > 0)
    }
}
