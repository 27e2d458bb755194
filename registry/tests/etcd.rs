//! The registry against a real etcd on loopback: register, watch, lose the lease, come back.

use std::time::Duration;

use pagoda_registry::local::LocalEtcd;
use pagoda_registry::{Member, MembershipEvent, RegistryConfig, Role};

async fn next(rx: &mut tokio::sync::mpsc::Receiver<MembershipEvent>) -> MembershipEvent {
    tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.expect("no registry event within 15 s").unwrap()
}

#[tokio::test]
async fn a_revoked_lease_leaves_and_the_member_registers_again() {
    let etcd = LocalEtcd::start("registry-test").await.unwrap();
    let cfg = RegistryConfig::new(vec![etcd.client_url.clone()], "/pagoda/t").unwrap();
    let (mut rx, _task) = pagoda_registry::watch(cfg.clone(), Role::Worker);
    assert_eq!(next(&mut rx).await, MembershipEvent::Listed(vec![]));

    let me = Member { id: "w1".into(), address: "127.0.0.1:7".into(), epoch: 5, node_id: None };
    let mut reg = pagoda_registry::register(cfg.clone(), Role::Worker, me.clone()).unwrap();
    reg.wait_registered(Duration::from_secs(10)).await.unwrap();
    assert_eq!(next(&mut rx).await, MembershipEvent::Joined(me.clone()));
    let first = reg.status();
    assert_eq!(first.grants, 1);

    // Another client revokes the lease (as an operator would with etcdctl): the key goes, the watcher sees the
    // member leave, and the registration task grants a new lease and puts the key back.
    let mut admin = pagoda_registry::connect(&cfg).await.unwrap();
    admin.lease_revoke(first.lease).await.unwrap();
    assert_eq!(next(&mut rx).await, MembershipEvent::Left("w1".into()));
    assert_eq!(next(&mut rx).await, MembershipEvent::Joined(me.clone()));
    // The put that the watcher saw comes just before the task publishes its new status.
    let t0 = std::time::Instant::now();
    while !(reg.status().registered && reg.status().grants == 2) && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = reg.status();
    assert!(second.registered && second.grants == 2 && second.lease != first.lease, "{second:?}");
    let (members, _) = pagoda_registry::list(&mut admin, &cfg, Role::Worker).await.unwrap();
    assert_eq!(members, vec![me]);

    // A graceful stop revokes the lease: the member leaves at once, not a TTL later.
    reg.stop().await;
    assert_eq!(next(&mut rx).await, MembershipEvent::Left("w1".into()));
    let members = pagoda_registry::wait_for_members(&cfg, Role::Kvstore, 0, Duration::from_secs(1)).await.unwrap();
    assert!(members.is_empty());
    assert!(pagoda_registry::wait_for_members(&cfg, Role::Kvstore, 1, Duration::from_millis(500)).await.is_err());
}
