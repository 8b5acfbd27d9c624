//! The operator commands over every store: listing, retrying and purging dead letters,
//! paging them and showing one event, and replaying and pruning retained events in
//! batches.

use super::*;

pub async fn operator_lists_retries_and_purges_dead_letters(h: &dyn Harness) {
    let (store, seq) = store_with(
        h,
        &[
            ("a", Some("k1"), "t", 1),
            ("a", Some("k2"), "t", 2),
            ("b", None, "u", 3),
        ],
    )
    .await;
    let ops = h.operations();
    let node = NodeId::random();
    store.claim(request(&node, 10)).await.unwrap();
    let dead = dead_letters(&seq, 4, |s| format!("boom {s}"));
    assert_eq!(
        store
            .dead_letter(LeaseHolder::unfenced(node), dead)
            .await
            .unwrap(),
        3
    );

    let all = ops.dead_list(dead_query(None, 100)).await.unwrap();
    assert_eq!(all.iter().map(|d| d.sequence_id).collect::<Vec<_>>(), seq);
    assert_eq!(all[2].destination, "b");
    assert_eq!(all[2].event_type, "u");
    assert_eq!(all[2].attempts, 4);
    assert_eq!(all[2].last_error, format!("boom {}", seq[2]));
    assert_eq!(
        ops.dead_list(dead_query(Some("a"), 100))
            .await
            .unwrap()
            .len(),
        2
    );
    assert_eq!(ops.dead_list(dead_query(None, 1)).await.unwrap().len(), 1);
    let stats = ops.destination_stats().await.unwrap();
    assert_eq!(
        stats
            .iter()
            .map(|s| (s.destination.as_str(), s.dead))
            .collect::<Vec<_>>(),
        vec![("a", 2), ("b", 1)]
    );

    // Retry one by id: it is back, same sequence id and event id, attempts reset.
    assert_eq!(
        ops.dead_retry(DeadSelector::Ids(vec![seq[0]]))
            .await
            .unwrap(),
        DeadRetried { moved: 1, left: 0 }
    );
    let again = store.claim(request(&NodeId::random(), 10)).await.unwrap();
    assert_eq!(ids(&again), vec![seq[0]]);
    match &again[0] {
        Claimed::Event(e) => {
            assert_eq!(e.event_id, all[0].event_id);
            assert_eq!(e.attempts, 0);
        }
        other => panic!("expected an event, got {other:?}"),
    }
    assert_eq!(
        ops.dead_retry(DeadSelector::Destination("a".into()))
            .await
            .unwrap(),
        DeadRetried { moved: 1, left: 0 }
    );
    assert_eq!(ops.dead_purge(DeadSelector::All).await.unwrap(), 1);
    assert!(ops
        .dead_list(dead_query(None, 100))
        .await
        .unwrap()
        .is_empty());
    let stats = ops.destination_stats().await.unwrap();
    let a = stats.iter().find(|s| s.destination == "a").unwrap();
    assert_eq!((a.pending, a.dead), (2, 0));
}

fn dead_query(destination: Option<&str>, limit: u32) -> DeadQuery {
    DeadQuery {
        destination: destination.map(String::from),
        limit,
        ..DeadQuery::default()
    }
}

/// `dead_list` filters by destination and type and pages with `after`; `event` finds one
/// event, with its payload and state, wherever it is.
pub async fn operator_pages_dead_letters_and_shows_one_event(h: &dyn Harness) {
    let (store, seq) = store_with(
        h,
        &[
            ("a", Some("k1"), "created", 1),
            ("a", Some("k2"), "deleted", 2),
            ("b", Some("k3"), "created", 3),
            ("b", Some("k4"), "created", 4),
            ("c", Some("k5"), "created", 5),
        ],
    )
    .await;
    let ops = h.operations();
    let node = NodeId::random();
    let claimed = store.claim(request(&node, 10)).await.unwrap();
    assert_eq!(ids(&claimed), seq);
    let dead = dead_letters(&seq[..4], 3, |s| format!("broker said no to {s}"));
    assert_eq!(
        store
            .dead_letter(LeaseHolder::unfenced(node.clone()), dead)
            .await
            .unwrap(),
        4
    );
    assert_eq!(store.release(node, vec![seq[4]]).await.unwrap(), 1);

    let page = |q: DeadQuery| {
        let ops = ops.clone();
        async move {
            ops.dead_list(q)
                .await
                .unwrap()
                .iter()
                .map(|d| d.sequence_id)
                .collect::<Vec<_>>()
        }
    };
    let created = |after, limit| DeadQuery {
        event_type: Some("created".into()),
        after,
        limit,
        ..DeadQuery::default()
    };
    assert_eq!(page(created(0, 10)).await, vec![seq[0], seq[2], seq[3]]);
    // Pages of two: the second starts after the first's last id; then an empty page.
    assert_eq!(page(created(0, 2)).await, vec![seq[0], seq[2]]);
    assert_eq!(page(created(seq[2], 2)).await, vec![seq[3]]);
    assert!(page(created(seq[3], 2)).await.is_empty());
    let both = DeadQuery {
        destination: Some("a".into()),
        ..created(0, 10)
    };
    assert_eq!(page(both).await, vec![seq[0]]);
    assert!(page(dead_query(Some("nowhere"), 10)).await.is_empty());

    let dead = ops.event(seq[1]).await.unwrap().expect("the dead event");
    assert_eq!(dead.state, EventState::Dead);
    assert_eq!(
        (dead.destination.as_str(), dead.event_type.as_str()),
        ("a", "deleted")
    );
    assert_eq!(dead.ordering_key.as_deref(), Some("k2"));
    assert_payload(dead.payload.as_deref(), 2);
    assert_eq!(dead.attempts, 3);
    assert_eq!(
        dead.last_error.as_deref(),
        Some(format!("broker said no to {}", seq[1]).as_str())
    );
    let listed = ops.dead_list(dead_query(None, 10)).await.unwrap();
    assert_eq!(dead.event_id, listed[1].event_id);

    let pending = ops.event(seq[4]).await.unwrap().expect("the pending event");
    assert_eq!(pending.state, EventState::Pending);
    assert_eq!(pending.destination, "c");
    assert!(pending.dead_at.is_none());
    assert_payload(pending.payload.as_deref(), 5);

    assert!(ops.event(seq[4] + 1000).await.unwrap().is_none());
    // Retried, it is pending again under the same id.
    ops.dead_retry(DeadSelector::Ids(vec![seq[1]]))
        .await
        .unwrap();
    let back = ops.event(seq[1]).await.unwrap().expect("the retried event");
    assert_eq!(back.state, EventState::Pending);
    assert_eq!(back.event_id, dead.event_id);
}

pub async fn operator_replays_and_prunes_in_batches(h: &dyn Harness) {
    let store = h.retaining_store();
    let ops = h.operations();
    let seq = store
        .insert(
            (0..5)
                .map(|n| event("d", Some(&format!("k{n}")), "t", n))
                .collect(),
        )
        .await
        .unwrap();
    let node = NodeId::random();
    store.claim(request(&node, 10)).await.unwrap();
    assert_eq!(
        store
            .ack(LeaseHolder::unfenced(node.clone()), seq.clone())
            .await
            .unwrap(),
        5
    );
    let (since, until) = (
        std::time::SystemTime::now() - Duration::from_secs(60),
        std::time::SystemTime::now() + Duration::from_secs(60),
    );
    let selector = |destination: Option<&str>| ReplaySelector {
        since,
        until,
        destination: destination.map(String::from),
    };
    assert_eq!(ops.count_replayable(selector(None)).await.unwrap(), 5);
    assert_eq!(
        ops.count_replayable(selector(Some("other"))).await.unwrap(),
        0
    );
    let mut after = 0;
    let mut batches = Vec::new();
    loop {
        let (n, last) = ops
            .replay_batch(ReplayPage {
                selector: selector(None),
                after,
                size: 2,
            })
            .await
            .unwrap();
        if n == 0 {
            break;
        }
        batches.push(n);
        after = last;
    }
    assert_eq!(batches, vec![2, 2, 1]);
    let relay = NodeId::random();
    let replayed = store.claim(request(&relay, 10)).await.unwrap();
    assert_eq!(
        ids(&replayed),
        seq,
        "replayed events are delivered again, in order"
    );
    assert_eq!(
        store
            .ack(LeaseHolder::unfenced(relay), seq.clone())
            .await
            .unwrap(),
        5
    );

    // Prune delivered rows and dead letters older than a cut-off, in small batches.
    let extra = store.insert(vec![event("d", None, "t", 9)]).await.unwrap();
    let node = NodeId::random();
    store.claim(request(&node, 10)).await.unwrap();
    let dead = dead_letters(&extra, 1, |_| "x".into());
    assert_eq!(
        store
            .dead_letter(LeaseHolder::unfenced(node), dead)
            .await
            .unwrap(),
        1
    );
    let later = std::time::SystemTime::now() + Duration::from_secs(60);
    assert_eq!(
        ops.count_prunable(Some(since), Some(since)).await.unwrap(),
        (0, 0),
        "nothing that old"
    );
    assert_eq!(
        ops.count_prunable(Some(later), Some(later)).await.unwrap(),
        (5, 1)
    );
    let mut pruned = Vec::new();
    loop {
        let n = ops.prune_delivered(later, 2).await.unwrap();
        if n == 0 {
            break;
        }
        pruned.push(n);
    }
    assert_eq!(pruned, vec![2, 2, 1]);
    assert_eq!(ops.prune_dead(later, 2).await.unwrap(), 1);
    assert_eq!(
        ops.count_prunable(Some(later), Some(later)).await.unwrap(),
        (0, 0)
    );
}

/// `dead retry` over dead letters, one of which the application wrote again (its event id
/// back in the outbox): the insert of that one failed the whole retry, and no dead letter
/// moved. It is left dead and counted, and the others move. For stores whose dead letters
/// have a table of their own; a store that makes dead rows pending where they are has
/// nothing to collide with.
pub async fn operator_retry_leaves_a_dead_letter_whose_event_came_back(h: &dyn Harness) {
    let (store, seq) = store_with(h, &[("a", Some("k1"), "t", 1), ("a", Some("k2"), "t", 2)]).await;
    let ops = h.operations();
    let node = NodeId::random();
    store.claim(request(&node, 10)).await.unwrap();
    let dead = dead_letters(&seq, 4, |s| format!("boom {s}"));
    store
        .dead_letter(LeaseHolder::unfenced(node), dead)
        .await
        .unwrap();
    let first = ops.dead_list(dead_query(None, 100)).await.unwrap()[0].clone();
    store
        .insert(vec![outbox_core::event::NewEvent {
            event_id: Some(first.event_id),
            destination: "a".into(),
            partition_key: Some("k1".into()),
            event_type: "t".into(),
            payload: Some("{}".into()),
            headers: Default::default(),
            mutation_id: None,
        }])
        .await
        .unwrap();
    assert_eq!(
        ops.dead_retry(DeadSelector::All).await.unwrap(),
        DeadRetried { moved: 1, left: 1 }
    );
    let still: Vec<SequenceId> = ops
        .dead_list(dead_query(None, 100))
        .await
        .unwrap()
        .iter()
        .map(|d| d.sequence_id)
        .collect();
    assert_eq!(still, vec![seq[0]]);
}
