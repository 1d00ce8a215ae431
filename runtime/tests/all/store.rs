//! The store, in memory, in a real Redis and in a real three-member etcd
//! cluster, each started by the test itself: the same behaviour from all,
//! leases, fencing tokens, watchers, a Redis restart in the middle, and an
//! etcd cluster losing its leader.

use crate::support::{
    runtime,
    servers::{EtcdCluster, RedisServer},
};
use edl_runtime::store::{AnyStore, Cas, Change, Lease, MemoryStore, RedisStore, Store, keys, watch};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

/// The behaviour every store must have.
/// `slow` stretches every lease and wait: etcd counts leases in whole
/// seconds (1 for Redis and memory).
async fn contract<S: Store>(store: Arc<S>, slow: u32) {
    let ms = |n: u64| Duration::from_millis(n) * slow;
    // put, get, tokens, list by prefix, delete
    let t1 = store.put("a/1", b"one", None).await.unwrap();
    let t2 = store.put("a/1", b"uno", None).await.unwrap();
    assert!(t2 > t1, "tokens grow");
    store.put("a/2", b"two", None).await.unwrap();
    store.put("b/1", b"other", None).await.unwrap();
    let e = store.get("a/1").await.unwrap().unwrap();
    assert_eq!((e.value.as_slice(), e.token), (&b"uno"[..], t2));
    let listed: Vec<String> = store.list("a/").await.unwrap().into_iter().map(|e| e.key).collect();
    assert_eq!(listed, vec!["a/1", "a/2"]);
    assert!(store.delete("a/2").await.unwrap());
    assert!(!store.delete("a/2").await.unwrap());
    // delete_if: only the holder of the token removes the key, in one step.
    let t = store.put("a/3", b"mine", None).await.unwrap();
    let next = store.put("a/3", b"the next holder's", None).await.unwrap();
    assert!(!store.delete_if("a/3", t).await.unwrap(), "an old token removed the key");
    assert_eq!(store.get("a/3").await.unwrap().unwrap().value, b"the next holder's");
    assert!(store.delete_if("a/3", next).await.unwrap());
    assert!(store.get("a/3").await.unwrap().is_none());
    assert!(!store.delete_if("a/3", next).await.unwrap());
    assert!(store.get("a/2").await.unwrap().is_none());
    // A key written again after it was deleted gets a higher token than
    // any it had: an old holder's token never becomes valid again.
    let again = store.put("a/3", b"back", None).await.unwrap();
    assert!(again > next, "{again} after {next}");

    // compare-and-set with a fencing token
    let Cas::Written(s1) = store.compare_and_set("s", None, b"v1", None).await.unwrap() else {
        panic!("the first write of a key")
    };
    assert_eq!(
        store.compare_and_set("s", None, b"v1'", None).await.unwrap(),
        Cas::Conflict { current: Some(s1) }
    );
    let Cas::Written(s2) = store.compare_and_set("s", Some(s1), b"v2", None).await.unwrap() else {
        panic!("a write with the current token")
    };
    assert!(s2 > s1);
    assert_eq!(
        store.compare_and_set("s", Some(s1), b"stale", None).await.unwrap(),
        Cas::Conflict { current: Some(s2) }
    );
    assert_eq!(
        store.compare_and_set("gone", Some(3), b"x", None).await.unwrap(),
        Cas::Conflict { current: None }
    );
    assert_eq!(store.get("s").await.unwrap().unwrap().value, b"v2");

    // A lease taken again after it expired: its token is higher than the
    // last one of the lapsed holder (who may still think it holds).
    let Cas::Written(first) = store.compare_and_set("l/fenced", None, b"a", Some(ms(100))).await.unwrap()
    else {
        panic!("a new lease")
    };
    let Cas::Written(renewed) =
        store.compare_and_set("l/fenced", Some(first), b"a", Some(ms(100))).await.unwrap()
    else {
        panic!("a renewal")
    };
    tokio::time::sleep(ms(250)).await;
    let Cas::Written(taken) = store.compare_and_set("l/fenced", None, b"b", Some(ms(100))).await.unwrap()
    else {
        panic!("the lapsed lease taken")
    };
    assert!(taken > renewed, "the new holder's token {taken} is not above the old one's {renewed}");

    // a lease lives while refreshed and vanishes after its TTL
    store.put("l/x", b"lease", Some(ms(300))).await.unwrap();
    tokio::time::sleep(ms(200)).await;
    assert!(store.refresh("l/x", ms(300)).await.unwrap());
    tokio::time::sleep(ms(200)).await;
    assert!(store.get("l/x").await.unwrap().is_some(), "refreshed lease expired early");
    tokio::time::sleep(ms(250)).await;
    assert!(store.get("l/x").await.unwrap().is_none(), "lease outlived its TTL");
    assert!(!store.refresh("l/x", ms(300)).await.unwrap());

    // a held lease stays; a released one goes
    let lease = Lease::hold(store.clone(), "l/held".into(), b"me".to_vec(), ms(300)).await.unwrap();
    tokio::time::sleep(ms(700)).await;
    assert!(store.get("l/held").await.unwrap().is_some());
    lease.release().await.unwrap();
    assert!(store.get("l/held").await.unwrap().is_none());

    // a watcher sees an addition and a removal within one second
    let mut rx = watch(store.clone(), keys::teachers("svc"), ms(100));
    let start = Instant::now();
    store.put(&keys::teacher("svc", "t1"), b"127.0.0.1:9000", Some(ms(400))).await.unwrap();
    match tokio::time::timeout(ms(1000), rx.recv()).await {
        Ok(Some(Change::Added(e))) => assert_eq!(e.value, b"127.0.0.1:9000"),
        other => panic!("no addition seen within 1 s: {other:?}"),
    }
    // Not refreshed: the lease expires and the watcher reports it.
    match tokio::time::timeout(ms(2000), rx.recv()).await {
        Ok(Some(Change::Removed(k))) => assert_eq!(k, keys::teacher("svc", "t1")),
        other => panic!("no removal seen: {other:?}"),
    }
    assert!(start.elapsed() < ms(2000));
}

#[test]
fn the_memory_store_keeps_the_contract() {
    runtime().block_on(contract(Arc::new(MemoryStore::new()), 1));
}

#[test]
fn the_redis_store_keeps_the_contract() {
    let server = RedisServer::start();
    runtime().block_on(async {
        let store = match AnyStore::open(&server.url()).unwrap() {
            AnyStore::Redis(r) => r,
            _ => unreachable!(),
        };
        contract(Arc::new(store), 1).await
    });
}

#[test]
fn the_etcd_store_keeps_the_contract() {
    let cluster = EtcdCluster::start(3);
    runtime().block_on(async {
        let store = match AnyStore::open(&cluster.url()).unwrap() {
            AnyStore::Etcd(e) => e,
            _ => unreachable!(),
        };
        contract(Arc::new(store), 10).await
    });
}

#[test]
fn an_etcd_store_that_loses_its_leader_goes_on_with_what_it_held() {
    let mut cluster = EtcdCluster::start(3);
    let rt = runtime();
    let store = rt.block_on(async { AnyStore::open(&cluster.url()).unwrap() });
    let before = rt.block_on(async {
        let Cas::Written(t) = store.compare_and_set("edl/jobs/j/state", None, b"gen 4", None).await.unwrap()
        else {
            panic!("the first write")
        };
        store.put("edl/jobs/j/workers/1", b"w1", None).await.unwrap();
        t
    });
    let leader = cluster.leader().expect("a leader");
    cluster.kill(leader);
    rt.block_on(async {
        // A blip while the others elect a new leader; then every operation
        // works, and nothing written before is lost.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut token = before;
        let after = loop {
            match store.compare_and_set("edl/jobs/j/state", Some(token), b"gen 5", None).await {
                Ok(Cas::Written(t)) => break t,
                Ok(Cas::Conflict { current }) => token = current.expect("the state is there"),
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "no write within 60 s of losing the leader: {e} (the leader now, by the members \
                     asked directly: {:?})",
                    cluster.leader()
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(after > before);
        assert_eq!(store.get("edl/jobs/j/workers/1").await.unwrap().unwrap().value, b"w1");
        let mut last = after;
        for i in 0..20 {
            let t = store.put("edl/jobs/j/workers/2", format!("{i}").as_bytes(), None).await.unwrap();
            assert!(t > last, "tokens strictly increase: {t} after {last}");
            last = t;
        }
    });
    assert!(cluster.leader().is_some_and(|l| l != leader), "a new leader");
}

#[test]
fn the_redis_store_reconnects_after_a_restart() {
    let mut server = RedisServer::start();
    let rt = runtime();
    let store = rt.block_on(async { Arc::new(RedisStore::open(&server.url()).unwrap()) });
    rt.block_on(async {
        store.put("k", b"before", None).await.unwrap();
    });
    server.stop();
    let err = rt.block_on(async {
        let start = Instant::now();
        let r = store.put("k", b"during", None).await;
        (r, start.elapsed())
    });
    let (result, took) = err;
    let e = result.expect_err("Redis is down");
    assert!(e.to_string().contains(&server.url()), "the error names the server: {e}");
    assert!(took < Duration::from_secs(5), "a failing call must not hang ({took:?})");
    server.restart();
    rt.block_on(async {
        // The data did not survive (no persistence); the connection does.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match store.put("k", b"after", None).await {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("no reconnect within 10 s: {e}"),
            }
        }
        assert_eq!(store.get("k").await.unwrap().unwrap().value, b"after");
    });
}

#[test]
fn store_urls_are_checked() {
    assert!(AnyStore::open("memory").is_ok());
    assert!(AnyStore::open("etcd://10.0.0.1:2379,10.0.0.2:2379").is_ok(), "nothing is contacted yet");
    let e = AnyStore::open("etcd://").err().expect("no member").to_string();
    assert!(e.contains("etcd://host:port"), "{e}");
    assert!(AnyStore::open("consul://x").is_err());
}
