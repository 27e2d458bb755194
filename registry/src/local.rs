//! A throwaway etcd server on loopback (the real `/usr/bin/etcd`, Debian's `etcd-server`), for tests and local
//! clusters: client and peer URLs on free 127.0.0.1 ports, its data in a fresh directory removed on drop, the
//! process killed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::RegistryError;

/// Where the etcd binary is looked for unless `PAGODA_ETCD_BIN` says otherwise.
pub const DEFAULT_ETCD_BIN: &str = "/usr/bin/etcd";

/// A running local etcd.
pub struct LocalEtcd {
    child: Child,
    dir: PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub client_url: String,
    /// The stderr log of the server.
    pub log: PathBuf,
}

fn free_port() -> Result<u16, RegistryError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| RegistryError::Config(format!("no free port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| RegistryError::Config(e.to_string()))
}

impl LocalEtcd {
    /// Starts etcd named `name` and waits (up to 20 s) until it answers.
    pub async fn start(name: &str) -> Result<LocalEtcd, RegistryError> {
        let bin = std::env::var("PAGODA_ETCD_BIN").unwrap_or_else(|_| DEFAULT_ETCD_BIN.into());
        let dir = std::env::temp_dir().join(format!("pagoda-etcd-{name}-{}-{}", std::process::id(), free_port()?));
        std::fs::create_dir_all(&dir).map_err(|e| RegistryError::Config(format!("{}: {e}", dir.display())))?;
        let client_url = format!("http://127.0.0.1:{}", free_port()?);
        let peer_url = format!("http://127.0.0.1:{}", free_port()?);
        let log = dir.with_extension("log");
        let err = std::fs::File::create(&log).map_err(|e| RegistryError::Config(format!("{}: {e}", log.display())))?;
        let child = Command::new(&bin)
            .args(["--name", name, "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .arg("--initial-cluster")
            .arg(format!("{name}={peer_url}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|e| RegistryError::Config(format!("cannot start {bin} (install etcd-server): {e}")))?;
        let etcd = LocalEtcd { child, dir, client_url, log };
        let cfg = crate::RegistryConfig::new(vec![etcd.client_url.clone()], "/pagoda-probe")?;
        let t0 = Instant::now();
        loop {
            let probe = async {
                let mut c = crate::connect(&cfg).await?;
                crate::list(&mut c, &cfg, crate::Role::Worker).await
            };
            if probe.await.is_ok() {
                return Ok(etcd);
            }
            if t0.elapsed() > Duration::from_secs(20) {
                let tail = std::fs::read_to_string(&etcd.log).unwrap_or_default();
                let tail = &tail[tail.len().saturating_sub(2000)..];
                return Err(RegistryError::Config(format!("etcd did not answer within 20 s:\n{tail}")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.log);
    }
}
