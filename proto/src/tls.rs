//! Mutual TLS between Pagoda's components: router → worker, worker ↔ worker (`Transfer`), worker and router →
//! kvstore, kvstore ↔ kvstore (raft). Off by default (plaintext h2 on a trusted network, as in `pagoda up`).
//!
//! A process takes one identity at start-up ([`install`], from `--tls-cert`, `--tls-key`, `--tls-ca`): its
//! certificate and key, and the CA that signs every component's certificate. From then on every gRPC server it runs
//! ([`server`]) asks each client for a certificate signed by that CA, and every channel it opens ([`endpoint`])
//! presents its own and checks the server's against the CA and the address dialled (a DNS name or an IP address in
//! the certificate's subject alternative names). One CA for the whole cluster, as with cert-manager's CA issuer:
//! any component may call any other, which the NetworkPolicies then narrow. The identity is process-wide because
//! it is the process's; it is set once, before any channel or server exists, and never changes.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

/// Largest PEM file accepted (a certificate chain or a key is a few KiB).
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// The three PEM files of a component's identity.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// This component's certificate (chain), PEM.
    pub cert: PathBuf,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA that signs every component's certificate, PEM.
    pub ca: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {source}")]
    Read { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{what} {path} is over {MAX_PEM_BYTES} bytes")]
    TooLarge { what: &'static str, path: PathBuf },
    #[error("{what} {path} holds no PEM `{label}` block")]
    NotPem { what: &'static str, path: PathBuf, label: &'static str },
    #[error("the TLS identity is already installed")]
    AlreadyInstalled,
    #[error("bad address `{addr}`: {reason}")]
    Address { addr: String, reason: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

struct MutualTls {
    identity: Identity,
    ca: Certificate,
}

static TLS: OnceLock<MutualTls> = OnceLock::new();

fn read_pem(what: &'static str, path: &Path, label: &'static str) -> Result<Vec<u8>, TlsError> {
    let len = std::fs::metadata(path).map_err(|source| TlsError::Read { what, path: path.into(), source })?.len();
    if len > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge { what, path: path.into() });
    }
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.into(), source })?;
    let text = String::from_utf8_lossy(&bytes);
    // "PRIVATE KEY" also matches "RSA PRIVATE KEY" and "EC PRIVATE KEY".
    if !text.lines().any(|l| l.starts_with("-----BEGIN ") && l.contains(label)) {
        return Err(TlsError::NotPem { what, path: path.into(), label });
    }
    Ok(bytes)
}

/// Reads the identity and makes every later [`server`] and [`endpoint`] of this process mutual-TLS. Call once, at
/// start-up, before serving or connecting.
pub fn install(files: &TlsFiles) -> Result<(), TlsError> {
    let cert = read_pem("certificate", &files.cert, "CERTIFICATE")?;
    let key = read_pem("key", &files.key, "PRIVATE KEY")?;
    let ca = read_pem("CA certificate", &files.ca, "CERTIFICATE")?;
    let tls = MutualTls { identity: Identity::from_pem(cert, key), ca: Certificate::from_pem(ca) };
    // Build both sides once now, so that a certificate or key that does not parse fails the start, not a call.
    server_config(&tls)?;
    Endpoint::from_static("https://localhost").tls_config(client_config(&tls, "localhost")).map_err(config_err)?;
    TLS.set(tls).map_err(|_| TlsError::AlreadyInstalled)
}

/// Whether this process talks mutual TLS.
pub fn enabled() -> bool {
    TLS.get().is_some()
}

/// An endpoint for a component at `addr` (`host:port`, or a URL whose scheme is replaced): `https` with this
/// process's identity when TLS is installed, plain `http` otherwise.
pub fn endpoint(addr: &str) -> Result<Endpoint, TlsError> {
    let host_port = addr.strip_prefix("http://").or_else(|| addr.strip_prefix("https://")).unwrap_or(addr);
    let bad = |reason: String| TlsError::Address { addr: addr.to_owned(), reason };
    match TLS.get() {
        None => Endpoint::from_shared(format!("http://{host_port}")).map_err(|e| bad(e.to_string())),
        Some(tls) => {
            let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            Endpoint::from_shared(format!("https://{host_port}"))
                .map_err(|e| bad(e.to_string()))?
                .tls_config(client_config(tls, host))
                .map_err(config_err)
        }
    }
}

/// A gRPC server builder: it requires a client certificate signed by the CA when TLS is installed.
pub fn server() -> Result<Server, TlsError> {
    match TLS.get() {
        None => Ok(Server::builder()),
        Some(tls) => server_config(tls),
    }
}

/// How long a TLS handshake may take, either side.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn config_err(e: tonic::transport::Error) -> TlsError {
    TlsError::Config(format!("{e}: {}", std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default()))
}

fn server_config(tls: &MutualTls) -> Result<Server, TlsError> {
    let config = ServerTlsConfig::new()
        .identity(tls.identity.clone())
        .client_ca_root(tls.ca.clone())
        .client_auth_optional(false)
        .timeout(HANDSHAKE_TIMEOUT);
    Server::builder().tls_config(config).map_err(config_err)
}

fn client_config(tls: &MutualTls, host: &str) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(tls.ca.clone())
        .identity(tls.identity.clone())
        .domain_name(host.to_owned())
        .timeout(HANDSHAKE_TIMEOUT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_checked_before_anything_is_installed() {
        let dir = std::env::temp_dir().join(format!("pagoda-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = dir.join("cert.pem");
        std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
        let not_pem = dir.join("key.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        let files = |key: &Path, ca: &Path| TlsFiles { cert: cert.clone(), key: key.into(), ca: ca.into() };
        let e = install(&files(&not_pem, &cert)).unwrap_err();
        assert!(matches!(e, TlsError::NotPem { what: "key", .. }), "{e}");
        let e = install(&files(&dir.join("missing.pem"), &cert)).unwrap_err();
        assert!(matches!(e, TlsError::Read { what: "key", .. }), "{e}");
        assert!(!enabled());
        // Plaintext until installed: the scheme is replaced, not trusted from the address.
        assert_eq!(endpoint("https://10.0.0.1:7000").unwrap().uri().scheme_str(), Some("http"));
        assert!(endpoint("not a uri:::").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
