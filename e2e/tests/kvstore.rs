//! Three `pagoda kvstore` processes on loopback: publish under a bounded load while the leader is SIGKILLed, then
//! check that every acknowledged event is on every surviving node, and on the killed one after it restarts from
//! its data dir.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pagoda_e2e::{Proc, free_port};
use pagoda_kvstore::Client;
use pagoda_kvstore::proto as pb;

const BIN: &str = env!("CARGO_BIN_EXE_pagoda");

fn spawn_node(id: u64, peers: &BTreeMap<u64, String>, data: &std::path::Path) -> Proc {
    let mut args: Vec<String> = vec![
        "kvstore".into(),
        "--node-id".into(),
        id.to_string(),
        "--listen".into(),
        peers[&id].clone(),
        "--advertise".into(),
        peers[&id].clone(),
        "--data-dir".into(),
        data.join(format!("n{id}")).to_string_lossy().into_owned(),
        "--snapshot-every".into(),
        "50".into(),
    ];
    for (pid, addr) in peers {
        args.push("--peer".into());
        args.push(format!("{pid}={addr}"));
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut p = Proc::spawn(BIN.as_ref(), &format!("kvstore{id}"), &refs).unwrap();
    p.wait_line("pagoda kvstore listening on ", Duration::from_secs(30)).unwrap();
    p
}

async fn leader_of(addrs: &[String]) -> String {
    pagoda_e2e::kvstore_leader(addrs, Duration::from_secs(30)).await.unwrap()
}

fn stored(hash: u64) -> pb::BlockEvent {
    pb::BlockEvent {
        kind: Some(pb::block_event::Kind::Stored(pb::Stored {
            hash,
            tier: pb::Tier::Device as i32,
            codec: "f16".into(),
            bytes: 1024,
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_the_leader_under_load_loses_no_acknowledged_event() {
    let tmp = std::env::temp_dir().join(format!("pagoda-e2e-kvstore-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let peers: BTreeMap<u64, String> = (1..=3).map(|i| (i, format!("127.0.0.1:{}", free_port().unwrap()))).collect();
    let addrs: Vec<String> = peers.values().cloned().collect();
    let mut procs: BTreeMap<u64, Proc> = peers.keys().map(|id| (*id, spawn_node(*id, &peers, &tmp))).collect();

    let leader = leader_of(&addrs).await;
    let leader_id = *peers.iter().find(|(_, a)| **a == leader).unwrap().0;
    let mut client = Client::new(addrs.clone()).unwrap();
    client.register("w", "10.0.0.9:7000", 1).await.unwrap();

    // Bounded load: 4 publishers, 40 batches of 50 events each; the leader dies after the 10th batch of publisher 0.
    let (kill_tx, kill_rx) = tokio::sync::oneshot::channel::<()>();
    let mut kill_tx = Some(kill_tx);
    let mut tasks = Vec::new();
    for p in 0..4u64 {
        let addrs = addrs.clone();
        let kill = if p == 0 { kill_tx.take() } else { None };
        tasks.push(tokio::spawn(async move {
            let mut c = Client::new(addrs).unwrap();
            let worker = format!("p{p}");
            c.register(&worker, "10.0.0.1:1", 1).await.unwrap();
            let mut acked = Vec::new();
            let mut seq = 1;
            let mut kill = kill;
            for b in 0..40u64 {
                let hashes: Vec<u64> = (0..50).map(|i| (p << 32) | (b * 50 + i)).collect();
                let req = pb::PublishRequest {
                    worker: worker.clone(),
                    epoch: 1,
                    first_seq: seq,
                    events: hashes.iter().map(|h| stored(*h)).collect(),
                    load: None,
                };
                let r = c.publish(req).await.unwrap();
                assert_eq!(r.applied + r.skipped, 50, "{r:?}");
                seq += 50;
                acked.extend(hashes);
                if b == 10
                    && let Some(k) = kill.take()
                {
                    let _ = k.send(());
                }
            }
            acked
        }));
    }
    kill_rx.await.unwrap();
    procs.get_mut(&leader_id).unwrap().kill();

    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    acked.sort_unstable();
    assert_eq!(acked.len(), 4 * 40 * 50);

    // Every acknowledged event is on both survivors (read linearizably on each).
    let survivors: Vec<String> = addrs.iter().filter(|a| **a != leader).cloned().collect();
    let new_leader = leader_of(&survivors).await;
    assert_ne!(new_leader, leader);
    let read = |addr: String, hashes: Vec<u64>| async move {
        let mut c = Client::new(vec![addr]).unwrap();
        let r = c.read(pb::ReadRequest { hashes, prefix_chain: vec![], workers: true }).await.unwrap();
        let mut held: Vec<u64> = r.blocks.iter().filter(|b| !b.copies.is_empty()).map(|b| b.hash).collect();
        held.sort_unstable();
        (held, r.workers)
    };
    let (_, reference_workers) = read(new_leader.clone(), vec![]).await;
    for a in &survivors {
        let (held, workers) = read(a.clone(), acked.clone()).await;
        assert_eq!(held.len(), acked.len(), "{a} lost acknowledged events");
        assert_eq!(held, acked);
        assert_eq!(workers, reference_workers);
    }

    // The killed leader restarts from its data dir and converges.
    procs.insert(leader_id, spawn_node(leader_id, &peers, &tmp));
    let target = Client::status_of(&new_leader).await.unwrap().commit_index;
    let t0 = Instant::now();
    while Client::status_of(&leader).await.map(|s| s.applied_index).unwrap_or(0) < target {
        assert!(t0.elapsed() < Duration::from_secs(30), "restarted node did not catch up to {target}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (held, workers) = read(leader.clone(), acked.clone()).await;
    assert_eq!(held, acked);
    assert_eq!(workers, reference_workers);
    drop(procs);
    let _ = std::fs::remove_dir_all(&tmp);
}
