//! Spreading independent pieces of a run over the machine's cores without changing what it
//! computes: every piece is a pure function of its index (its own random stream, its own
//! world), and results come back in index order or are combined by a commutative sum.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The machine's cores: how many pieces run at once (a shrink's or a hunt's batch).
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Workers for `items` pieces: one per core, never more than there are pieces.
fn workers(items: usize) -> usize {
    cores().min(items).max(1)
}

/// Runs `work(&mut acc, item)` for every item in `0..items`; each worker takes the next
/// item when it finishes one and folds it into its own accumulator (made by `init`). Returns
/// the workers' accumulators, for the caller to combine in a way that does not depend on
/// which worker did what.
pub(crate) fn fold<A: Send>(
    items: usize,
    init: impl Fn() -> A + Sync,
    work: impl Fn(&mut A, usize) + Sync,
) -> Vec<A> {
    let next = AtomicUsize::new(0);
    let worker = || {
        let mut acc = init();
        loop {
            let item = next.fetch_add(1, Ordering::Relaxed);
            if item >= items {
                return acc;
            }
            work(&mut acc, item);
        }
    };
    std::thread::scope(|scope| {
        let others: Vec<_> = (1..workers(items)).map(|_| scope.spawn(worker)).collect();
        let mut accs = vec![worker()];
        accs.extend(
            others
                .into_iter()
                .map(|w| w.join().expect("a simulation worker panicked")),
        );
        accs
    })
}

/// `f(i)` for every `i` in `order` (which holds each of `0..order.len()` once), computed in
/// parallel; the results are indexed by `i`. Items are started in the order given, so the
/// longest can go first.
pub(crate) fn map<T: Send>(order: &[usize], f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let parts = fold(order.len(), Vec::new, |done: &mut Vec<(usize, T)>, k| {
        let i = order[k];
        done.push((i, f(i)));
    });
    let mut all: Vec<(usize, T)> = parts.into_iter().flatten().collect();
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, t)| t).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_keeps_index_order_whatever_the_start_order() {
        assert_eq!(map(&[3, 0, 2, 1], |i| i * 10), vec![0, 10, 20, 30]);
    }

    #[test]
    fn fold_visits_every_item_once() {
        let parts = fold(1_000, Vec::new, |seen: &mut Vec<usize>, i| seen.push(i));
        let mut all: Vec<usize> = parts.into_iter().flatten().collect();
        all.sort_unstable();
        assert_eq!(all, (0..1_000).collect::<Vec<_>>());
    }
}
