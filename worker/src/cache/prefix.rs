//! Prefix caching keys and index.
//!
//! The chain hash over full token blocks (DESIGN §2): with `h[-1] = 0`,
//! `h[i] = xxh3_64(h[i-1] as u64 LE ‖ len(model_id) as u64 LE ‖ model_id UTF-8 ‖ len(namespace) as u64 LE ‖
//! namespace UTF-8 ‖ tokens[i*B..(i+1)*B] as u32 LE)`. The lengths are ours (DESIGN writes the plain
//! concatenation): without them model `llama-3` with tenant `.1acme` and model `llama-3.1` with tenant `acme` hash
//! the same bytes.
//! Only full blocks are hashed. Because `h[i]` covers every earlier block, equal hashes mean equal prefixes
//! (up to xxh3 collisions), so a hash names a whole cached prefix. The namespace salts the chain: two tenants
//! never produce the same hash for the same tokens, so they never share blocks.
//!
//! [`PrefixIndex`] maps a hash to its block group (the `n_layers × n_kv_heads` block ids holding that token
//! block, index `layer * n_kv_heads + head`). The [`BlockPool`](super::BlockPool) owns the index and keeps it
//! consistent with ref counts and eviction.

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3Default;

use super::BlockId;

/// One link of the chain: the hash of a full token block given the previous block's hash.
pub fn chain_hash(prev: u64, model_id: &str, namespace: &str, tokens: &[u32]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(&prev.to_le_bytes());
    h.update(&(model_id.len() as u64).to_le_bytes());
    h.update(model_id.as_bytes());
    h.update(&(namespace.len() as u64).to_le_bytes());
    h.update(namespace.as_bytes());
    let mut chunk = [0u8; 64];
    for group in tokens.chunks(16) {
        for (dst, t) in chunk.chunks_exact_mut(4).zip(group) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&chunk[..group.len() * 4]);
    }
    h.digest()
}

/// `namespace` salted by `kind` and `id` (a LoRA adapter's cache id, a request's `cache_salt` digest): blocks
/// hashed under it never match blocks of `namespace` alone or of another salt. The separator (a NUL) appears in no
/// tenant name ([`check_namespace`] keeps it so), so the tenant is the namespace up to the first one
/// ([`crate::scheduler::tenant_of`]); a salted namespace can be salted again.
pub fn salted_namespace(namespace: &str, kind: &str, id: &str) -> String {
    format!("{namespace}\u{0}{kind}\u{0}{id}")
}

/// The one salt kind a request's namespace may carry already: the router's `cache_salt`
/// (`tenant\0salt\0<digest>`). Every other kind, a LoRA adapter's above all, only the worker adds.
pub const CLIENT_SALT_KIND: &str = "salt";

/// Checks the namespace a request arrives with: a tenant name without control characters, salted at most once and
/// only as [`CLIENT_SALT_KIND`] with an id free of them too. Anything else could spell a salt the worker adds: a
/// base-model request in `acme\0lora\0sql@<id>` (the cache id is public in `Health`) would hash exactly as adapter
/// `sql`'s requests for `acme` do, and poison that adapter's cache with the base model's KV.
pub fn check_namespace(namespace: &str) -> Result<(), String> {
    let clean = |s: &str| !s.chars().any(char::is_control);
    let mut parts = namespace.split('\u{0}');
    let tenant = parts.next().unwrap_or_default();
    if !clean(tenant) {
        return Err("namespace: a tenant name may not hold control characters".into());
    }
    match (parts.next(), parts.next(), parts.next()) {
        (None, _, _) => Ok(()),
        (Some(CLIENT_SALT_KIND), Some(id), None) if !id.is_empty() && clean(id) => Ok(()),
        _ => Err(format!(
            "namespace: a NUL may only start a client salt, once (tenant\\0{CLIENT_SALT_KIND}\\0<id>, the id \
             without control characters)"
        )),
    }
}

/// Chain hashes of every full block of `tokens`.
pub fn block_hashes(model_id: &str, namespace: &str, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_hashes(model_id, namespace, tokens, block_size, &mut out);
    out
}

/// Extends `hashes` (the chain for the first `hashes.len()` blocks of `tokens`) to every full block of `tokens`.
pub fn extend_block_hashes(model_id: &str, namespace: &str, tokens: &[u32], block_size: usize, hashes: &mut Vec<u64>) {
    if block_size == 0 {
        return;
    }
    let full = tokens.len() / block_size;
    let mut prev = hashes.last().copied().unwrap_or(0);
    for i in hashes.len()..full {
        prev = chain_hash(prev, model_id, namespace, &tokens[i * block_size..(i + 1) * block_size]);
        hashes.push(prev);
    }
}

/// A cached block group and its idle state.
#[derive(Debug, Clone)]
pub struct CachedGroup {
    pub(crate) blocks: Box<[BlockId]>,
    /// Blocks of this group whose ref count is 0.
    pub(crate) idle: usize,
    /// Position in the pool's LRU queue while the whole group is idle.
    pub(crate) lru_tick: Option<u64>,
    /// False when the blocks hold a lossy copy (decoded from a compressed tier copy), not the KV the model
    /// computed: a reuse gets the prefix faster but not exactly.
    pub(crate) exact: bool,
}

impl CachedGroup {
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// True when no sequence holds this group (it sits on the LRU free queue).
    pub fn is_idle(&self) -> bool {
        self.lru_tick.is_some()
    }

    /// True unless the group was registered as a lossy copy ([`BlockPool::mark_inexact`](super::BlockPool::mark_inexact)).
    pub fn is_exact(&self) -> bool {
        self.exact
    }
}

/// hash → block group.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    map: HashMap<u64, CachedGroup>,
}

impl PrefixIndex {
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    pub fn get(&self, hash: u64) -> Option<&CachedGroup> {
        self.map.get(&hash)
    }

    /// Whether `hash` is cached as a lossy copy ([`CachedGroup::is_exact`]).
    pub fn holds_inexact(&self, hash: u64) -> bool {
        self.map.get(&hash).is_some_and(|g| !g.exact)
    }

    /// Number of leading hashes of `hashes` that are cached.
    pub fn match_len(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.map.contains_key(h)).count()
    }

    pub(crate) fn get_mut(&mut self, hash: u64) -> Option<&mut CachedGroup> {
        self.map.get_mut(&hash)
    }

    pub(crate) fn insert(&mut self, hash: u64, group: CachedGroup) {
        self.map.insert(hash, group);
    }

    pub(crate) fn remove(&mut self, hash: u64) -> Option<CachedGroup> {
        self.map.remove(&hash)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &CachedGroup)> {
        self.map.iter().map(|(h, g)| (*h, g))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    #[test]
    fn chain_hash_is_xxh3_of_the_concatenation() {
        let tokens: Vec<u32> = (100..116).collect();
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&7u64.to_le_bytes());
        bytes.extend_from_slice(&6u64.to_le_bytes());
        bytes.extend_from_slice(b"smollm");
        bytes.extend_from_slice(&8u64.to_le_bytes());
        bytes.extend_from_slice(b"tenant-a");
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(chain_hash(7, "smollm", "tenant-a", &tokens), xxh3_64(&bytes));
        // Also for a block size that is not a multiple of the internal chunk.
        let odd: Vec<u32> = (0..37).collect();
        let mut bytes = 0u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(b"m");
        bytes.extend_from_slice(&0u64.to_le_bytes());
        for t in &odd {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(chain_hash(0, "m", "", &odd), xxh3_64(&bytes));
    }

    #[test]
    fn model_and_namespace_do_not_run_into_each_other() {
        let tokens: Vec<u32> = (0..16).collect();
        assert_ne!(chain_hash(0, "llama-3", ".1acme", &tokens), chain_hash(0, "llama-3.1", "acme", &tokens));
        assert_ne!(chain_hash(0, "m", "", &tokens), chain_hash(0, "", "m", &tokens));
    }

    #[test]
    fn full_blocks_only_and_chained() {
        let tokens: Vec<u32> = (0..50).collect();
        let h = block_hashes("m", "ns", &tokens, 16);
        assert_eq!(h.len(), 3);
        assert_eq!(h[0], chain_hash(0, "m", "ns", &tokens[0..16]));
        assert_eq!(h[1], chain_hash(h[0], "m", "ns", &tokens[16..32]));
        // Same block contents after a different prefix hash differently.
        let mut other = tokens.clone();
        other[0] = 999;
        let h2 = block_hashes("m", "ns", &other, 16);
        assert_ne!(h[1], h2[1]);
        // Incremental extension equals the one-shot chain.
        let mut inc = block_hashes("m", "ns", &tokens[..20], 16);
        extend_block_hashes("m", "ns", &tokens, 16, &mut inc);
        assert_eq!(inc, h);
    }

    #[test]
    fn namespace_and_model_salt_the_chain() {
        let tokens: Vec<u32> = (0..32).collect();
        let a = block_hashes("m", "a", &tokens, 16);
        let b = block_hashes("m", "b", &tokens, 16);
        let c = block_hashes("m2", "a", &tokens, 16);
        assert!(a.iter().all(|h| !b.contains(h) && !c.contains(h)));
    }

    #[test]
    fn a_namespace_cannot_spell_a_salt_the_worker_adds() {
        for ok in ["", "acme", "ünïcode tenant", "acme\0salt\0ab12", "\0salt\0x"] {
            assert_eq!(check_namespace(ok), Ok(()), "{ok:?}");
        }
        // The router's cache_salt form is the one salt a request may bring.
        assert_eq!(check_namespace(&salted_namespace("acme", CLIENT_SALT_KIND, "0f")), Ok(()));
        for bad in [
            salted_namespace("acme", "lora", "sql@00ff"),
            salted_namespace(&salted_namespace("acme", CLIENT_SALT_KIND, "0f"), "lora", "sql@00ff"),
            salted_namespace(&salted_namespace("acme", CLIENT_SALT_KIND, "0f"), CLIENT_SALT_KIND, "1e"),
            salted_namespace("acme", CLIENT_SALT_KIND, ""),
            salted_namespace("acme", CLIENT_SALT_KIND, "a\tb"),
            "acme\0".into(),
            "acme\n".into(),
            "ac\u{7f}me".into(),
            "ac\u{85}me".into(),
        ] {
            assert!(check_namespace(&bad).is_err(), "{bad:?} accepted");
        }
    }
}
