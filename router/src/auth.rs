//! API keys, tenants and the admin key: parsing the keys file and the admin key file, and checking a request's
//! `Authorization: Bearer <key>` header (or Anthropic's `x-api-key: <key>`, [`presented_key`]) against them.
//!
//! Keys are never kept in memory as text: each is stored as its SHA-256 digest, and a presented key is hashed and
//! compared with every digest in constant time, so neither the comparison nor the table order leaks how much of a
//! key matched.
//!
//! ## Keys file (`--api-keys-file`, env `PAGODA_API_KEYS_FILE`)
//!
//! One key per line: `<key> <tenant> [rps=<f64>] [burst=<u32>] [concurrency=<u32>] [weight=<u32>]`, fields
//! separated by spaces or tabs. Blank lines and lines starting with `#` are ignored. `weight` (1 to
//! [`MAX_WEIGHT`], default 1) is the key's requests' weight under workers' fair and token-fair (`vtc`) scheduling.
//!
//! - `key`: 16 to 256 printable ASCII characters without spaces, or `sha256:<64 hex digits>`, the digest of the
//!   key, so the file need not hold the key itself.
//! - `tenant`: 1 to 64 characters of `[A-Za-z0-9._-]`. The tenant is the prefix-cache namespace: requests of
//!   different tenants never share KV blocks. Several keys may share a tenant (and so its cache).
//! - `rps` (requests per second, > 0) and `burst` (bucket size, >= 1): the key's token bucket; default: no rate
//!   limit. `burst` defaults to `max(1, ceil(rps))`.
//! - `concurrency` (>= 1): most requests of this key in flight at once; default: unlimited.
//!
//! ## Admin key file (`--admin-key-file`)
//!
//! The first non-blank, non-comment line is the admin key (same two forms as above). It opens `/debug/*` and the
//! dashboard.
//!
//! ## Dashboard sessions
//!
//! A browser cannot send a bearer header when it navigates, so the dashboard's login trades the admin key for a
//! session cookie: `<expiry unix seconds>.<HMAC-SHA256(session secret, expiry) in hex>`. It never holds the key
//! and expires after [`ADMIN_SESSION`].
//!
//! The session secret must not be computable from what the admin key file may show: the `sha256:` form puts the
//! key's digest there, and a secret derived from the digest would let anyone who reads the file forge sessions.
//! So with the key itself in the file, the secret is a domain-separated hash of the key: every router replica
//! with the same key accepts the cookie, and changing the key ends every session. With only the digest in the
//! file, no such secret exists, and each router process draws a random one: a session then opens that process
//! only, and ends when it restarts ([`AdminKey::sessions_per_process`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::HeaderValue;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Longest accepted key, in bytes (and the longest `Authorization` header value looked at, plus the scheme).
pub const MAX_KEY_BYTES: usize = 256;
/// Shortest accepted key: shorter ones are guessable.
pub const MIN_KEY_BYTES: usize = 16;
/// Longest tenant name, in bytes.
pub const MAX_TENANT_BYTES: usize = 64;
/// Most keys in one file: keeps the per-key limiter state and the constant-time scan bounded.
pub const MAX_KEYS: usize = 10_000;
/// Largest keys file read, in bytes.
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Largest accepted `rps`, `burst` and `concurrency`.
pub const MAX_LIMIT: f64 = 1e6;
/// How long a dashboard session lasts.
pub const ADMIN_SESSION: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
/// Label of the MAC input, so a session token is no MAC of anything else.
const SESSION_LABEL: &[u8] = b"pagoda-dashboard-session:";
/// Prefix of the hash that turns the admin key into the session secret, so that the secret is neither the key's
/// digest (which a `sha256:` key file shows) nor any other hash of the key used elsewhere.
const SESSION_SECRET_LABEL: &[u8] = b"pagoda-dashboard-session-secret\0";

/// Why a keys file or admin key file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum KeysFileError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is larger than {MAX_FILE_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("{path} line {line}: {message}")]
    Line { path: PathBuf, line: usize, message: String },
    #[error("{path} holds no key")]
    Empty { path: PathBuf },
}

/// A key's request limits; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits {
    /// Token bucket: refill rate (requests per second) and size.
    pub rate: Option<Rate>,
    /// Most requests in flight at once.
    pub concurrency: Option<u32>,
}

/// A token-bucket rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_second: f64,
    pub burst: u32,
}

/// One configured key: its digest, tenant and limits.
#[derive(Clone)]
pub struct KeyEntry {
    digest: [u8; 32],
    /// The tenant, also the prefix-cache namespace.
    pub tenant: Arc<str>,
    pub limits: Limits,
    /// The key's requests' weight under fair scheduling (`weight=`, 1 to [`MAX_WEIGHT`]; default 1).
    pub weight: u32,
    /// Index in the table, the limiter's slot for this key.
    pub index: usize,
}

impl KeyEntry {
    /// A short public id of the key: the first 8 hex digits of its SHA-256 (never the key).
    pub fn fingerprint(&self) -> String {
        self.digest[..4].iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyEntry")
            .field("fingerprint", &self.fingerprint())
            .field("tenant", &self.tenant)
            .field("limits", &self.limits)
            .finish()
    }
}

/// The keys of one keys file.
#[derive(Debug, Clone)]
pub struct KeyTable {
    entries: Vec<KeyEntry>,
}

/// The authenticated caller of a `/v1` request, put in the request's extensions by the auth middleware.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: Arc<str>,
    /// The key's index in the [`KeyTable`] (`None` when auth is off).
    pub key: Option<usize>,
    /// The key's weight under fair scheduling (1 when auth is off).
    pub weight: u32,
}

/// Largest `weight=` a key may have: what a worker accepts as `GenerateRequest.tenant_weight`.
pub const MAX_WEIGHT: u32 = pagoda_worker::service::MAX_TENANT_WEIGHT;

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// Constant-time equality of two digests: no early exit, and `black_box` keeps the optimiser from adding one.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= std::hint::black_box(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

/// Parses a key field: the key itself, or `sha256:<hex>`.
fn parse_key(field: &str) -> Result<[u8; 32], String> {
    if let Some(hex) = field.strip_prefix("sha256:") {
        return parse_hex32(hex).ok_or_else(|| "a `sha256:` key needs exactly 64 hex digits".into());
    }
    if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&field.len()) {
        return Err(format!(
            "the key is {} bytes long; keys must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes",
            field.len()
        ));
    }
    if !field.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("keys must be printable ASCII without spaces".into());
    }
    Ok(digest(field.as_bytes()))
}

pub(crate) fn valid_tenant(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= MAX_TENANT_BYTES
        && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

fn parse_limit(name: &str, value: &str) -> Result<f64, String> {
    let v: f64 = value.parse().map_err(|_| format!("`{name}` must be a number, got `{value}`"))?;
    if !v.is_finite() || v <= 0.0 || v > MAX_LIMIT {
        return Err(format!("`{name}` must be > 0 and <= {MAX_LIMIT}, got `{value}`"));
    }
    Ok(v)
}

fn parse_count(name: &str, value: &str) -> Result<u32, String> {
    let v: u32 = value.parse().map_err(|_| format!("`{name}` must be a whole number, got `{value}`"))?;
    if v == 0 || f64::from(v) > MAX_LIMIT {
        return Err(format!("`{name}` must be >= 1 and <= {MAX_LIMIT}, got `{value}`"));
    }
    Ok(v)
}

/// `weight=`: a whole number from 1 to [`MAX_WEIGHT`].
fn parse_weight(value: &str) -> Result<u32, String> {
    match value.parse::<u32>() {
        Ok(w) if (1..=MAX_WEIGHT).contains(&w) => Ok(w),
        _ => Err(format!("`weight` must be a whole number from 1 to {MAX_WEIGHT}, got `{value}`")),
    }
}

/// Parses one key line (without comment or blank handling).
fn parse_line(line: &str, index: usize) -> Result<KeyEntry, String> {
    let mut fields = line.split_ascii_whitespace();
    let key = fields.next().ok_or("empty line")?;
    let digest = parse_key(key)?;
    let tenant = fields.next().ok_or(
        "missing tenant after the key (format: `<key> <tenant> [rps=N] [burst=N] [concurrency=N] [weight=N]`)",
    )?;
    if !valid_tenant(tenant) {
        return Err(format!("tenant `{tenant}` must be 1 to {MAX_TENANT_BYTES} characters of [A-Za-z0-9._-]"));
    }
    let (mut rps, mut burst, mut concurrency, mut weight) = (None, None, None, None);
    for f in fields {
        let Some((name, value)) = f.split_once('=') else {
            return Err(format!("expected `name=value`, got `{f}`"));
        };
        let slot_taken = match name {
            "rps" => rps.replace(parse_limit(name, value)?).is_some(),
            "burst" => burst.replace(parse_count(name, value)?).is_some(),
            "concurrency" => concurrency.replace(parse_count(name, value)?).is_some(),
            "weight" => weight.replace(parse_weight(value)?).is_some(),
            _ => return Err(format!("unknown limit `{name}` (known: rps, burst, concurrency, weight)")),
        };
        if slot_taken {
            return Err(format!("`{name}` is given twice"));
        }
    }
    let rate = match (rps, burst) {
        (Some(per_second), burst) => {
            Some(Rate { per_second, burst: burst.unwrap_or_else(|| (per_second.ceil() as u32).max(1)) })
        }
        (None, Some(_)) => return Err("`burst` needs `rps`".into()),
        (None, None) => None,
    };
    let weight = weight.unwrap_or(1);
    Ok(KeyEntry { digest, tenant: Arc::from(tenant), limits: Limits { rate, concurrency }, weight, index })
}

fn is_skipped(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

fn read_bounded(path: &Path) -> Result<String, KeysFileError> {
    let read_err = |source| KeysFileError::Read { path: path.to_path_buf(), source };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(KeysFileError::TooLarge { path: path.to_path_buf() });
    }
    std::fs::read_to_string(path).map_err(read_err)
}

impl KeyTable {
    /// Reads and parses a keys file.
    pub fn load(path: &Path) -> Result<KeyTable, KeysFileError> {
        KeyTable::parse(&read_bounded(path)?, path)
    }

    /// Parses the text of a keys file; `path` only names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<KeyTable, KeysFileError> {
        let line_err = |line: usize, message: String| KeysFileError::Line { path: path.to_path_buf(), line, message };
        let mut entries: Vec<KeyEntry> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if is_skipped(line) {
                continue;
            }
            if entries.len() == MAX_KEYS {
                return Err(line_err(i + 1, format!("more than {MAX_KEYS} keys")));
            }
            let entry = parse_line(line, entries.len()).map_err(|m| line_err(i + 1, m))?;
            if entries.iter().any(|e| e.digest == entry.digest) {
                return Err(line_err(i + 1, "this key is already listed on an earlier line".into()));
            }
            entries.push(entry);
        }
        if entries.is_empty() {
            return Err(KeysFileError::Empty { path: path.to_path_buf() });
        }
        Ok(KeyTable { entries })
    }

    pub fn entries(&self) -> &[KeyEntry] {
        &self.entries
    }

    /// Distinct tenants.
    pub fn tenant_count(&self) -> usize {
        let mut t: Vec<&str> = self.entries.iter().map(|e| &*e.tenant).collect();
        t.sort_unstable();
        t.dedup();
        t.len()
    }

    /// The entry whose key `presented` is. Every entry is compared, whatever matches, so the time taken does
    /// not depend on which key (if any) matched.
    pub fn find(&self, presented: &[u8]) -> Option<&KeyEntry> {
        let d = digest(presented);
        let mut found = None;
        for e in &self.entries {
            if ct_eq(&e.digest, &d) {
                found = Some(e);
            }
        }
        found
    }
}

/// The admin key.
#[derive(Clone)]
pub struct AdminKey {
    digest: [u8; 32],
    /// What dashboard session tokens are MACed with (see the module docs).
    session_secret: [u8; 32],
    /// The file held only the key's digest, so `session_secret` is this process's own random one.
    sessions_per_process: bool,
}

impl fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminKey(..)")
    }
}

impl AdminKey {
    /// Reads the admin key file.
    pub fn load(path: &Path) -> Result<AdminKey, KeysFileError> {
        AdminKey::parse(&read_bounded(path)?, path)
    }

    /// Parses the text of an admin key file; `path` only names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<AdminKey, KeysFileError> {
        let (i, line) = text
            .lines()
            .enumerate()
            .find(|(_, l)| !is_skipped(l))
            .ok_or_else(|| KeysFileError::Empty { path: path.to_path_buf() })?;
        let field = line.trim();
        let digest = parse_key(field).map_err(|message| KeysFileError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        })?;
        let sessions_per_process = field.starts_with("sha256:");
        let session_secret: [u8; 32] = if sessions_per_process {
            rand::random()
        } else {
            Sha256::new().chain_update(SESSION_SECRET_LABEL).chain_update(field.as_bytes()).finalize().into()
        };
        Ok(AdminKey { digest, session_secret, sessions_per_process })
    }

    pub fn matches(&self, presented: &[u8]) -> bool {
        ct_eq(&self.digest, &digest(presented))
    }

    /// Whether dashboard sessions open only this router process (the admin key file held the key's digest, not
    /// the key): another replica, or this one after a restart, asks for the key again.
    pub fn sessions_per_process(&self) -> bool {
        self.sessions_per_process
    }

    fn session_mac(&self, expires_unix: u64) -> [u8; 32] {
        let mut msg = SESSION_LABEL.to_vec();
        msg.extend_from_slice(expires_unix.to_string().as_bytes());
        hmac_sha256(&self.session_secret, &msg)
    }

    /// A dashboard session token that expires at `expires_unix` (see the module docs).
    pub fn session_token(&self, expires_unix: u64) -> String {
        let mac: String = self.session_mac(expires_unix).iter().map(|b| format!("{b:02x}")).collect();
        format!("{expires_unix}.{mac}")
    }

    /// Whether `token` is a session token of this key that is still valid at `now_unix`. Tokens that expire
    /// further ahead than [`ADMIN_SESSION`] are refused too (they were not made by this router's clock).
    pub fn session_valid(&self, token: &str, now_unix: u64) -> bool {
        let Some((expires, mac_hex)) = token.split_once('.') else { return false };
        if expires.is_empty() || expires.len() > 20 || !expires.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        let Ok(expires_unix) = expires.parse::<u64>() else { return false };
        if expires_unix <= now_unix || expires_unix > now_unix.saturating_add(ADMIN_SESSION.as_secs() + 60) {
            return false;
        }
        let Some(mac) = parse_hex32(mac_hex) else { return false };
        ct_eq(&mac, &self.session_mac(expires_unix))
    }
}

fn parse_hex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// HMAC-SHA256 (RFC 2104) with a key of at most one block (64 bytes).
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    let n = key.len().min(64);
    block[..n].copy_from_slice(&key[..n]);
    let pad = |byte: u8| block.map(|k| k ^ byte);
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

/// The router's authentication settings. The default (no keys file, no admin key) is the embedded dev mode:
/// every request is served, as tenant `default`.
#[derive(Debug, Clone, Default)]
pub struct Security {
    pub keys: Option<Arc<KeyTable>>,
    pub admin: Option<AdminKey>,
}

impl Security {
    /// Loads whichever of the two files are given.
    pub fn load(keys_file: Option<&Path>, admin_key_file: Option<&Path>) -> Result<Security, KeysFileError> {
        Ok(Security {
            keys: keys_file.map(KeyTable::load).transpose()?.map(Arc::new),
            admin: admin_key_file.map(AdminKey::load).transpose()?,
        })
    }
}

/// The key a `/v1` request presents: its `Authorization: Bearer <key>` header, or, without one, its `x-api-key`
/// header (how Anthropic's clients send it, for `/v1/messages`). `Err` says what is wrong, for the 401 message.
pub fn presented_key(headers: &axum::http::HeaderMap) -> Result<&[u8], ApiError> {
    if let Some(authorization) = headers.get(axum::http::header::AUTHORIZATION) {
        return bearer(Some(authorization));
    }
    let Some(value) = headers.get("x-api-key") else {
        return bearer(None);
    };
    let key = value.as_bytes().trim_ascii();
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(ApiError::invalid_api_key(format!(
            "The x-api-key header must hold a key of 1 to {MAX_KEY_BYTES} bytes."
        )));
    }
    Ok(key)
}

/// The key in an `Authorization: Bearer <key>` header. `Err` says what is wrong, for the 401 message.
pub fn bearer(header: Option<&HeaderValue>) -> Result<&[u8], ApiError> {
    let Some(value) = header else {
        return Err(ApiError::invalid_api_key(
            "You didn't provide an API key. Send it in the Authorization header as `Bearer <key>` (or in x-api-key).",
        ));
    };
    let bytes = value.as_bytes();
    if bytes.len() > MAX_KEY_BYTES + 16 {
        return Err(ApiError::invalid_api_key("The Authorization header is too long."));
    }
    let scheme_ok = bytes.len() > 7 && bytes[..7].eq_ignore_ascii_case(b"bearer ");
    if !scheme_ok {
        return Err(ApiError::invalid_api_key("The Authorization header must be `Bearer <key>`."));
    }
    let key = bytes[7..].trim_ascii();
    if key.is_empty() {
        return Err(ApiError::invalid_api_key("The Authorization header holds no key."));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_A: &str = "sk-tenant-a-0123456789";
    const KEY_B: &str = "sk-tenant-b-0123456789";

    fn table(text: &str) -> Result<KeyTable, KeysFileError> {
        KeyTable::parse(text, Path::new("keys.txt"))
    }

    fn line_of(e: KeysFileError) -> (usize, String) {
        match e {
            KeysFileError::Line { line, message, .. } => (line, message),
            other => panic!("expected a line error, got {other}"),
        }
    }

    #[test]
    fn parses_keys_tenants_and_limits() {
        let hashed =
            format!("sha256:{}", digest(KEY_B.as_bytes()).iter().map(|b| format!("{b:02x}")).collect::<String>());
        let text = format!(
            "# comment\n\n{KEY_A} acme rps=2.5 burst=4 concurrency=3\n  \t\n{hashed}\tglobex concurrency=1 weight=3\nsk-other-key-0123456 acme rps=0.5\n"
        );
        let t = table(&text).unwrap();
        assert_eq!(t.entries().len(), 3);
        assert_eq!(t.tenant_count(), 2);
        let a = t.find(KEY_A.as_bytes()).unwrap();
        assert_eq!(&*a.tenant, "acme");
        assert_eq!(a.limits.rate, Some(Rate { per_second: 2.5, burst: 4 }));
        assert_eq!(a.limits.concurrency, Some(3));
        assert_eq!(a.weight, 1, "the default weight");
        let b = t.find(KEY_B.as_bytes()).unwrap();
        assert_eq!(&*b.tenant, "globex");
        assert_eq!(b.weight, 3);
        assert_eq!(b.limits.rate, None);
        assert_eq!(b.index, 1);
        let c = t.find(b"sk-other-key-0123456").unwrap();
        assert_eq!(c.limits.rate, Some(Rate { per_second: 0.5, burst: 1 }));
        assert!(t.find(b"sk-tenant-a-0123456780").is_none());
        assert!(t.find(b"").is_none());
        assert!(!format!("{t:?}").contains(KEY_A));
    }

    #[test]
    fn malformed_files_name_the_line() {
        let cases = [
            ("short acme\n", 1, "bytes"),
            (&format!("# c\n{KEY_A}\n") as &str, 2, "missing tenant"),
            (&format!("{KEY_A} acme\n{KEY_A} other\n"), 2, "already listed"),
            (&format!("{KEY_A} ac/me\n"), 1, "tenant"),
            (&format!("{KEY_A} acme rps=0\n"), 1, "rps"),
            (&format!("{KEY_A} acme rps=NaN\n"), 1, "rps"),
            (&format!("{KEY_A} acme rps=inf\n"), 1, "rps"),
            (&format!("{KEY_A} acme burst=3\n"), 1, "needs `rps`"),
            (&format!("{KEY_A} acme concurrency=-1\n"), 1, "concurrency"),
            (&format!("{KEY_A} acme concurrency=0\n"), 1, "concurrency"),
            (&format!("{KEY_A} acme weight=0\n"), 1, "weight"),
            (&format!("{KEY_A} acme weight=1001\n"), 1, "weight"),
            (&format!("{KEY_A} acme weight=1 weight=2\n"), 1, "twice"),
            (&format!("{KEY_A} acme rps=1 rps=2\n"), 1, "twice"),
            (&format!("{KEY_A} acme colour=blue\n"), 1, "unknown limit"),
            (&format!("{KEY_A} acme 5\n"), 1, "name=value"),
            ("sha256:abcd acme\n", 1, "64 hex"),
            (&format!("\n\n{KEY_A} {}\n", "t".repeat(65)), 3, "tenant"),
        ];
        for (text, want_line, want_msg) in cases {
            let (line, msg) = line_of(table(text).unwrap_err());
            assert_eq!(line, want_line, "{text:?}: {msg}");
            assert!(msg.contains(want_msg), "{text:?}: {msg}");
        }
        assert!(matches!(table("# only comments\n\n"), Err(KeysFileError::Empty { .. })));
        let e = table(&format!("{KEY_A} acme rps=0\n")).unwrap_err().to_string();
        assert!(e.starts_with("keys.txt line 1:"), "{e}");
    }

    #[test]
    fn admin_key_file() {
        let a = AdminKey::parse("# admin\n\n  sk-admin-0123456789abcdef  \n", Path::new("admin")).unwrap();
        assert!(a.matches(b"sk-admin-0123456789abcdef"));
        assert!(!a.matches(b"sk-admin-0123456789abcdeF"));
        assert!(matches!(AdminKey::parse("#\n", Path::new("admin")), Err(KeysFileError::Empty { .. })));
        assert!(matches!(AdminKey::parse("short\n", Path::new("admin")), Err(KeysFileError::Line { line: 1, .. })));
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        let hex = |b: [u8; 32]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        // Test case 2.
        assert_eq!(
            hex(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 1: key 0x0b * 20, "Hi There".
        assert_eq!(
            hex(hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }

    #[test]
    fn session_tokens_expire_and_belong_to_their_key() {
        let a = AdminKey::parse("sk-admin-0123456789abcdef\n", Path::new("a")).unwrap();
        let b = AdminKey::parse("sk-admin-0123456789abcdeF\n", Path::new("b")).unwrap();
        let now = 1_800_000_000;
        let t = a.session_token(now + 3600);
        assert!(a.session_valid(&t, now));
        assert!(!b.session_valid(&t, now), "another admin key");
        assert!(!a.session_valid(&t, now + 3600), "expired");
        let far = a.session_token(now + ADMIN_SESSION.as_secs() + 3600);
        assert!(!a.session_valid(&far, now), "expiry beyond the session length");
        let (exp, mac) = t.split_once('.').unwrap();
        let later = format!("{}.{mac}", now + 7200);
        assert!(!a.session_valid(&later, now), "expiry changed without the MAC");
        let flipped = format!("{exp}.{}{}", &mac[..63], if mac.ends_with('0') { '1' } else { '0' });
        assert!(!a.session_valid(&flipped, now));
        for bad in ["", ".", "abc", &format!("{exp}."), &format!(".{mac}"), &format!("+{exp}.{mac}"), &t[..t.len() - 1]]
        {
            assert!(!a.session_valid(bad, now), "{bad:?}");
        }
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The token an attacker who read a `sha256:` admin key file could make if sessions were keyed by the digest.
    fn forged_from_digest(key: &str, expires_unix: u64) -> String {
        let mut msg = SESSION_LABEL.to_vec();
        msg.extend_from_slice(expires_unix.to_string().as_bytes());
        format!("{expires_unix}.{}", hex(&hmac_sha256(&digest(key.as_bytes()), &msg)))
    }

    #[test]
    fn session_tokens_cannot_be_made_from_the_key_digest() {
        const KEY: &str = "sk-admin-0123456789abcdef";
        let now = 1_800_000_000;
        let plain = AdminKey::parse(KEY, Path::new("a")).unwrap();
        let hashed = AdminKey::parse(&format!("sha256:{}", hex(&digest(KEY.as_bytes()))), Path::new("a")).unwrap();
        assert!(hashed.matches(KEY.as_bytes()));
        for (form, a) in [("plain", &plain), ("sha256", &hashed)] {
            assert!(!a.session_valid(&forged_from_digest(KEY, now + 60), now), "{form}");
            assert!(a.session_valid(&a.session_token(now + 60), now), "{form}");
        }
        assert!(!plain.sessions_per_process());
        assert!(hashed.sessions_per_process());
        // The plain form's secret comes from the key alone, so another replica with the key accepts the token.
        let replica = AdminKey::parse(&format!("# replica\n{KEY}\n"), Path::new("b")).unwrap();
        assert!(replica.session_valid(&plain.session_token(now + 60), now));
        // The digest form's is random: another process with the same file refuses it.
        let other = AdminKey::parse(&format!("sha256:{}", hex(&digest(KEY.as_bytes()))), Path::new("b")).unwrap();
        assert!(!other.session_valid(&hashed.session_token(now + 60), now));
    }

    #[test]
    fn bearer_header_forms() {
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(bearer(Some(&h("Bearer abc"))).unwrap(), b"abc");
        assert_eq!(bearer(Some(&h("bearer   abc  "))).unwrap(), b"abc");
        for bad in ["Basic abc", "Bearer", "Bearer    ", "abc", "Bearerabc"] {
            let e = bearer(Some(&h(bad))).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::UNAUTHORIZED, "{bad}");
            assert_eq!(e.code, Some("invalid_api_key"));
        }
        assert!(bearer(None).is_err());
        assert!(bearer(Some(&h(&format!("Bearer {}", "k".repeat(400))))).is_err());
    }

    #[test]
    fn x_api_key_is_read_when_there_is_no_authorization_header() {
        let headers = |pairs: &[(&'static str, &str)]| {
            let mut m = axum::http::HeaderMap::new();
            for (k, v) in pairs {
                m.insert(*k, HeaderValue::from_str(v).unwrap());
            }
            m
        };
        assert_eq!(presented_key(&headers(&[("x-api-key", " abc ")])).unwrap(), b"abc");
        let both = headers(&[("authorization", "Bearer first"), ("x-api-key", "second")]);
        assert_eq!(presented_key(&both).unwrap(), b"first", "Authorization wins");
        let bad_bearer = headers(&[("authorization", "Basic x"), ("x-api-key", "second")]);
        assert!(presented_key(&bad_bearer).is_err(), "a bad Authorization header is not overridden");
        for bad in [headers(&[]), headers(&[("x-api-key", "  ")]), headers(&[("x-api-key", &"k".repeat(300))])] {
            assert_eq!(presented_key(&bad).unwrap_err().status, axum::http::StatusCode::UNAUTHORIZED);
        }
    }
}
