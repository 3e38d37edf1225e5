//! How a call's work is cut: the pairs grouped by expert (an expert's rows are read from memory once for all of its
//! tokens; the other tokens find them in the cache), the rows cut into tasks for the pool.

use crate::Pair;

/// The pairs of one expert: `order[start..end]` (indices into the call's pairs, by token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) expert: usize,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// The pairs' indices sorted by (expert, token), and the groups of equal experts in that order.
pub(crate) fn group_by_expert(pairs: &[Pair]) -> (Vec<usize>, Vec<Group>) {
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_unstable_by_key(|&p| (pairs[p].expert, pairs[p].token));
    let mut groups: Vec<Group> = Vec::new();
    for (q, &p) in order.iter().enumerate() {
        let expert = pairs[p].expert as usize;
        match groups.last_mut() {
            Some(g) if g.expert == expert => g.end = q + 1,
            _ => groups.push(Group { expert, start: q, end: q + 1 }),
        }
    }
    (order, groups)
}

/// A few tasks a thread, so that a slow or late thread's share is taken over by the others.
const TASKS_PER_THREAD: usize = 4;
/// Fewer rows than this a task and the pool's hand-off costs more than the rows do.
const MIN_ROWS: usize = 16;

/// Rows a task takes when `units` units (experts) of `rows` rows each are cut for `threads` threads: a multiple of
/// the kernels' row block (4).
pub(crate) fn rows_per_task(rows: usize, units: usize, threads: usize) -> usize {
    let tasks_per_unit = (TASKS_PER_THREAD * threads).div_ceil(units.max(1)).max(1);
    rows.div_ceil(tasks_per_unit).max(MIN_ROWS).div_ceil(4) * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_experts_then_tokens() {
        let p = |token, expert| Pair { token, expert, weight: 1.0 };
        let pairs = [p(0, 5), p(0, 2), p(1, 5), p(1, 3), p(2, 2)];
        let (order, groups) = group_by_expert(&pairs);
        assert_eq!(order, vec![1, 4, 3, 0, 2]);
        let g = |expert, start, end| Group { expert, start, end };
        assert_eq!(groups, vec![g(2, 0, 2), g(3, 2, 3), g(5, 3, 5)]);
    }

    #[test]
    fn rows_per_task_is_a_row_block_multiple() {
        assert_eq!(rows_per_task(512, 1, 16), 16);
        assert_eq!(rows_per_task(2048, 1, 16), 32);
        assert_eq!(rows_per_task(2048, 1, 1), 512);
        assert_eq!(rows_per_task(50, 1, 1), 16);
        assert_eq!(rows_per_task(3, 8, 2), 16);
    }
}
