use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::*;

fn made(exchange: &Exchange<u32>, max_total: u32) {
    assert!(matches!(exchange.next(max_total), Ok(Next::Make)));
    exchange.made();
}

fn waiting(exchange: &Exchange<u32>, max_total: u32) -> oneshot::Receiver<Handoff<u32>> {
    match exchange.next(max_total) {
        Ok(Next::Wait(rx)) => rx,
        other => panic!("expected to wait, got {other:?}"),
    }
}

fn always(_: &u32) -> bool {
    true
}

#[test]
fn items_are_lent_last_given_back_first_and_counted_once() {
    let exchange = Exchange::default();
    made(&exchange, 2);
    made(&exchange, 2);
    assert_eq!(
        exchange.counts(),
        Counts {
            idle: 0,
            lent: 2,
            connecting: 0,
            waiting: 0,
            total: 2
        }
    );
    exchange.give_back(1, always).unwrap();
    exchange.give_back(2, always).unwrap();
    assert_eq!(exchange.try_take(), Some(2));
    let counts = exchange.counts();
    assert_eq!((counts.idle, counts.lent, counts.total), (1, 1, 2));
    // Below the limit with one idle: the idle one, not a new slot.
    assert!(matches!(exchange.next(3), Ok(Next::Take(1))));
    assert!(exchange.try_take().is_none());
}

#[test]
fn a_slot_being_made_is_counted_until_made_or_given_up() {
    let exchange: Exchange<u32> = Exchange::default();
    assert!(matches!(exchange.next(1), Ok(Next::Make)));
    assert_eq!(exchange.counts().connecting, 1);
    let rx = waiting(&exchange, 1);
    exchange.unmade();
    assert_eq!(exchange.counts().total, 0);
    assert!(matches!(rx.blocking_recv(), Ok(Handoff::Retry)));
    assert_eq!(exchange.reserve(1), Ok(true));
    assert_eq!(exchange.reserve(1), Ok(false));
}

#[test]
fn a_waiting_client_gets_the_next_item_before_any_newcomer() {
    let exchange = Exchange::default();
    made(&exchange, 1);
    let mut rx = waiting(&exchange, 1);
    // An item in a lane while a client waits: a give-back on its way to that client.
    exchange.lanes[stripe()].0.lock().push(9);
    assert!(
        exchange.try_take().is_none(),
        "a newcomer must not pass a waiting client"
    );
    assert_eq!(exchange.lanes[stripe()].0.lock().pop(), Some(9));
    exchange.give_back(7, always).unwrap();
    assert!(matches!(rx.try_recv(), Ok(Handoff::Item(7))));
    let counts = exchange.counts();
    assert_eq!((counts.lent, counts.waiting, counts.idle), (1, 0, 0));
}

#[test]
fn clients_that_gave_up_waiting_are_passed_over() {
    let exchange = Exchange::default();
    made(&exchange, 1);
    drop(waiting(&exchange, 1));
    let mut second = waiting(&exchange, 1);
    exchange.give_back(7, always).unwrap();
    assert!(matches!(second.try_recv(), Ok(Handoff::Item(7))));
    // Nobody left waiting: the next one stays idle.
    made(&exchange, 2);
    drop(waiting(&exchange, 2));
    exchange.give_back(8, always).unwrap();
    let counts = exchange.counts();
    assert_eq!((counts.idle, counts.lent, counts.waiting), (1, 1, 0));
    assert_eq!(exchange.try_take(), Some(8));
}

#[test]
fn a_discarded_item_lets_the_first_waiting_client_retry() {
    let exchange: Exchange<u32> = Exchange::default();
    made(&exchange, 1);
    let mut first = waiting(&exchange, 1);
    let mut second = waiting(&exchange, 1);
    exchange.discard();
    assert!(matches!(first.try_recv(), Ok(Handoff::Retry)));
    assert!(second.try_recv().is_err());
    assert_eq!(exchange.total(), 0);
    // The first gives its retry up: it passes to the second.
    exchange.pass_retry_on();
    assert!(matches!(second.try_recv(), Ok(Handoff::Retry)));
}

#[test]
fn refused_items_and_items_after_closing_come_back_to_be_closed() {
    let exchange = Exchange::default();
    for _ in 0..3 {
        made(&exchange, 3);
    }
    assert_eq!(exchange.give_back(1, |&item| item != 1), Err(1));
    exchange.discard();
    exchange.give_back(2, always).unwrap();
    assert_eq!(exchange.close(), vec![2]);
    assert_eq!(exchange.counts().total, 1, "3 is still lent");
    assert_eq!(exchange.give_back(3, always), Err(3));
    exchange.discard();
    assert_eq!(exchange.counts(), Counts::default());
    assert!(matches!(exchange.next(3), Err(Closed)));
    assert_eq!(exchange.reserve(3), Err(Closed));
    assert!(!exchange.adopt());
    assert!(exchange.try_take().is_none());

    let exchange: Exchange<u32> = Exchange::default();
    made(&exchange, 1);
    let mut rx = waiting(&exchange, 1);
    exchange.close();
    assert!(
        rx.try_recv().is_err(),
        "a client waiting on a closed exchange is let go"
    );
}

#[test]
fn idle_items_are_kept_or_dropped_with_the_total_as_it_stands() {
    let exchange = Exchange::default();
    for _ in 0..4 {
        made(&exchange, 4);
    }
    for item in 1..=4 {
        exchange.give_back(item, always).unwrap();
    }
    let mut seen = Vec::new();
    // Drop down to two, least recently given back first.
    let dropped = exchange.retain_idle(|&item, total| {
        seen.push((item, total));
        total <= 2
    });
    assert_eq!(dropped, vec![1, 2]);
    assert_eq!(seen, vec![(1, 4), (2, 3), (3, 2), (4, 2)]);
    let mut idle = exchange.map_idle(|&item| item);
    idle.sort_unstable();
    assert_eq!(idle, vec![3, 4]);
    let (taken, counts) = exchange.take_idle();
    assert_eq!(taken.len(), 2);
    assert_eq!(counts, Counts::default());
}

#[test]
fn waiting_clients_all_retry_when_the_limit_grows() {
    let exchange: Exchange<u32> = Exchange::default();
    made(&exchange, 1);
    let receivers: Vec<_> = (0..3).map(|_| waiting(&exchange, 1)).collect();
    exchange.wake_all_to_retry();
    for rx in receivers {
        assert!(matches!(rx.blocking_recv(), Ok(Handoff::Retry)));
    }
    assert_eq!(exchange.counts().waiting, 0);
}

/// Many tasks on several threads (so several lanes) lend, give back and discard through a
/// small exchange. A give-back that crossed a client starting to wait and left it waiting
/// while an item sat idle shows as a wait that times out once the others are done.
#[test]
fn under_contention_no_client_waits_while_an_item_is_idle() {
    const MAX_TOTAL: u32 = 2;
    const TASKS: u64 = 16;
    const ROUNDS: u64 = 2_000;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let exchange = Arc::new(Exchange::<u64>::default());
    let timeouts = Arc::new(AtomicU64::new(0));
    let next_item = Arc::new(AtomicU64::new(0));
    runtime.block_on(async {
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let exchange = exchange.clone();
                let timeouts = timeouts.clone();
                let next_item = next_item.clone();
                tokio::spawn(async move {
                    let mut seed = task * 7919 + 1;
                    for _ in 0..ROUNDS {
                        let Some(item) = lend(&exchange, &next_item, &timeouts, MAX_TOTAL).await
                        else {
                            continue;
                        };
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        if seed % 4 == 0 {
                            tokio::task::yield_now().await;
                        }
                        if seed % 23 == 0 {
                            exchange.discard();
                        } else {
                            exchange.give_back(item, |_| true).unwrap();
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
    });
    assert_eq!(
        timeouts.load(Ordering::SeqCst),
        0,
        "a client was left waiting"
    );
    let counts = exchange.counts();
    assert_eq!((counts.lent, counts.connecting, counts.waiting), (0, 0, 0));
    assert_eq!(counts.idle, counts.total);
    assert!(counts.total <= MAX_TOTAL);
}

async fn lend(
    exchange: &Exchange<u64>,
    next_item: &AtomicU64,
    timeouts: &AtomicU64,
    max_total: u32,
) -> Option<u64> {
    if let Some(item) = exchange.try_take() {
        return Some(item);
    }
    loop {
        match exchange.next(max_total).unwrap() {
            Next::Take(item) => return Some(item),
            Next::Make => {
                exchange.made();
                return Some(next_item.fetch_add(1, Ordering::Relaxed));
            }
            Next::Wait(rx) => match tokio::time::timeout(Duration::from_secs(5), rx).await {
                Ok(Ok(Handoff::Item(item))) => return Some(item),
                Ok(Ok(Handoff::Retry)) => continue,
                Ok(Err(_)) => panic!("the exchange let a client go without closing"),
                Err(_) => {
                    timeouts.fetch_add(1, Ordering::SeqCst);
                    return None;
                }
            },
        }
    }
}

/// The crossings the module's comment describes, driven step by step with the functions
/// `next` and `give_back` are made of.
#[test]
fn a_give_back_that_missed_a_new_waiter_still_reaches_it() {
    let exchange = Exchange::default();
    made(&exchange, 1);
    // The give-back read "nobody waits"; then a client looked, found nothing and waited.
    let mut rx = waiting(&exchange, 1);
    exchange.put_idle(7, &always).unwrap();
    assert!(matches!(rx.try_recv(), Ok(Handoff::Item(7))));
    assert_eq!(exchange.counts().idle, 0);
}

#[test]
fn a_client_that_looked_before_a_give_back_still_gets_the_item() {
    let exchange = Exchange::default();
    made(&exchange, 1);
    let mut central = exchange.central.lock();
    assert!(matches!(
        exchange.take_or_reserve(&mut central, 1),
        Ok(None)
    ));
    // The give-back runs whole between the client's look and its wait.
    exchange.give_back(7, always).unwrap();
    let mut rx = exchange.enqueue(&mut central, 1);
    drop(central);
    assert!(matches!(rx.try_recv(), Ok(Handoff::Item(7))));
}

#[test]
fn a_client_that_looked_before_a_discard_is_told_to_retry() {
    let exchange: Exchange<u32> = Exchange::default();
    made(&exchange, 1);
    let mut central = exchange.central.lock();
    assert!(matches!(
        exchange.take_or_reserve(&mut central, 1),
        Ok(None)
    ));
    exchange.discard();
    let mut rx = exchange.enqueue(&mut central, 1);
    drop(central);
    assert!(matches!(rx.try_recv(), Ok(Handoff::Retry)));
}
