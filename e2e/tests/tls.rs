//! Mutual TLS between components, through real processes and certificates generated here (a throwaway CA and one
//! component certificate for `localhost` and `127.0.0.1`, as cert-manager's CA issuer would make them): a kvstore
//! node, two workers and a router, all started with `--tls-cert/--tls-key/--tls-ca`.
//!
//! Every link carries traffic: the router places and streams over TLS (router → worker), the second request pulls
//! the first one's prefix from the other worker (worker → worker `Transfer`), the workers report their blocks and
//! the router follows the directory (worker → kvstore, router → kvstore). Then the refusals: a plaintext client, a
//! TLS client without a certificate, and one whose certificate another CA signed all fail to reach a worker, while
//! a client holding the cluster's certificate gets through.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{BIN, chat, river_log_prompt};
use pagoda_e2e::cluster::die_with_parent;
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{Http, Proc, free_port, require_model, wait_until};
use pagoda_proto::worker::StatsRequest;
use pagoda_proto::worker::worker_client::WorkerClient;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A CA and one certificate it signed, all PEM.
struct Pki {
    ca: String,
    cert: String,
    key: String,
}

fn pki(name: &str) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, format!("{name} CA"));
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let mut params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, format!("{name} component"));
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    Pki { ca: ca.pem(), cert: cert.pem(), key: key.serialize_pem() }
}

fn write(dir: &Path, name: &str, pem: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, pem).unwrap();
    p.to_string_lossy().into_owned()
}

/// A gRPC channel to `addr` as the test chooses to present itself.
async fn channel(addr: &str, tls: Option<ClientTlsConfig>) -> Result<Channel, String> {
    let endpoint = match tls {
        None => Endpoint::from_shared(format!("http://{addr}")).unwrap(),
        Some(cfg) => Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(cfg).unwrap(),
    };
    let endpoint = endpoint.connect_timeout(Duration::from_secs(5)).timeout(Duration::from_secs(5));
    endpoint.connect().await.map_err(|e| format!("{e:?}"))
}

async fn stats_over(addr: &str, tls: Option<ClientTlsConfig>) -> Result<pagoda_e2e::StatsResponse, String> {
    let mut c = WorkerClient::new(channel(addr, tls).await?);
    c.stats(StatsRequest {}).await.map(|r| r.into_inner()).map_err(|e| format!("{e:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn components_talk_mutual_tls_and_refuse_anyone_else() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let dir = std::env::temp_dir().join(format!("pagoda-e2e-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cluster_pki = pki("pagoda");
    let (ca, cert, key) = (
        write(&dir, "ca.pem", &cluster_pki.ca),
        write(&dir, "cert.pem", &cluster_pki.cert),
        write(&dir, "key.pem", &cluster_pki.key),
    );
    let tls = ["--tls-cert", cert.as_str(), "--tls-key", key.as_str(), "--tls-ca", ca.as_str()];
    let spawn = |name: &str, args: &[&str]| {
        let mut all = args.to_vec();
        all.extend_from_slice(&tls);
        Proc::spawn_with(BIN.as_ref(), name, &all, die_with_parent).unwrap()
    };

    let kv = format!("127.0.0.1:{}", free_port().unwrap());
    let kv_dir = dir.join("kv").to_string_lossy().into_owned();
    let peer = format!("1={kv}");
    let mut kvstore =
        spawn("tls-kvstore", &["kvstore", "--node-id", "1", "--listen", &kv, "--peer", &peer, "--data-dir", &kv_dir]);
    kvstore.wait_line("pagoda kvstore listening on ", Duration::from_secs(30)).unwrap();
    let (a, b) = (format!("127.0.0.1:{}", free_port().unwrap()), format!("127.0.0.1:{}", free_port().unwrap()));
    let mut workers = Vec::new();
    for (id, addr) in [("wa", &a), ("wb", &b)] {
        let args =
            ["worker", "--listen", addr, "--model", &model, "--threads", "1", "--kvstore", &kv, "--worker-id", id];
        workers.push(spawn(&format!("tls-{id}"), &args));
    }
    for w in &mut workers {
        w.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    }
    let rargs = [
        "router",
        "--listen",
        "127.0.0.1:0",
        "--model",
        &model,
        "--worker",
        &a,
        "--worker",
        &b,
        "--kvstore",
        &kv,
        "--placement",
        "round_robin",
    ];
    let mut router = spawn("tls-router", &rargs);
    let http = Http::new(router.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap());
    http.wait_ready(Duration::from_secs(60)).await.unwrap();

    // The test's own client holds the cluster's certificate.
    let ours = || {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&cluster_pki.ca))
            .identity(Identity::from_pem(&cluster_pki.cert, &cluster_pki.key))
            .domain_name("127.0.0.1")
    };

    // Router → worker, twice: round robin sends the second to the other worker, which pulls the prefix from the
    // first (worker → worker) and answers the same.
    let body = chat(&river_log_prompt(), json!({"temperature": 0, "max_tokens": 8}));
    let (s, first) = http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{first}");
    // The first answer's blocks reach the lower tier, where Transfer serves them from.
    wait_until("the first answer's blocks to be written back", Duration::from_secs(20), || async {
        let a_stats = stats_over(&a, Some(ours())).await.unwrap();
        let b_stats = stats_over(&b, Some(ours())).await.unwrap();
        a_stats.offloaded_groups_total + b_stats.offloaded_groups_total >= 20
    })
    .await;
    let (s, second) = http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{second}");
    assert_eq!(second["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);
    let fetched = stats_over(&a, Some(ours())).await.unwrap().peer_fetched_blocks_total
        + stats_over(&b, Some(ours())).await.unwrap().peer_fetched_blocks_total;
    assert!(fetched >= 20, "the second worker pulled the prefix over TLS: {fetched} blocks");

    // Worker → kvstore and router → kvstore: the router's directory feed holds the workers' reported blocks.
    let t0 = Instant::now();
    loop {
        let (_, text) = http.get("/debug/placements").await.unwrap();
        let v: Value = pagoda_e2e::serde_json::from_str(&text).unwrap();
        if v["directory"]["connected"] == true && v["directory"]["index_blocks"].as_u64().unwrap_or(0) >= 20 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "no directory over TLS: {v:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Nobody else gets in.
    let plaintext = stats_over(&a, None).await;
    assert!(plaintext.is_err(), "a plaintext client reached the worker");
    let anonymous =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&cluster_pki.ca)).domain_name("127.0.0.1");
    assert!(stats_over(&a, Some(anonymous)).await.is_err(), "a client without a certificate reached the worker");
    let rogue_pki = pki("rogue");
    let rogue = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&cluster_pki.ca))
        .identity(Identity::from_pem(&rogue_pki.cert, &rogue_pki.key))
        .domain_name("127.0.0.1");
    assert!(stats_over(&a, Some(rogue)).await.is_err(), "a certificate from another CA reached the worker");
    let wrong_ca = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&rogue_pki.ca))
        .identity(Identity::from_pem(&cluster_pki.cert, &cluster_pki.key))
        .domain_name("127.0.0.1");
    assert!(stats_over(&a, Some(wrong_ca)).await.is_err(), "the worker's certificate passed for another CA");
    assert!(stats_over(&a, Some(ours())).await.is_ok());

    // A bad identity fails the start with a clear error, before anything listens.
    let garbage = write(&dir, "garbage.pem", "not a certificate");
    let out = std::process::Command::new(BIN)
        .args(["kvstore", "--node-id", "1", "--listen", "127.0.0.1:0", "--data-dir", &kv_dir])
        .args(["--tls-cert", &garbage, "--tls-key", &key, "--tls-ca", &ca])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tls-cert") && err.contains("CERTIFICATE"), "{err}");

    router.kill();
    for w in &mut workers {
        w.kill();
    }
    kvstore.kill();
    let _ = std::fs::remove_dir_all(&dir);
}
