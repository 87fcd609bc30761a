//! Merging of contiguous requests (SGLang's `group_concurrent_contiguous`,
//! done once here for every backend).

use std::ops::Range;

use crate::types::TransferRequest;

/// A batch after coalescing: the requests to issue and, for each, the range
/// of caller indices it stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoalescedBatch {
    /// Requests to issue.
    pub requests: Vec<TransferRequest>,
    /// `groups[i]` = caller indices merged into `requests[i]` (consecutive).
    pub groups: Vec<Range<usize>>,
}

impl CoalescedBatch {
    /// Number of caller requests.
    pub fn caller_len(&self) -> usize {
        self.groups.last().map_or(0, |g| g.end)
    }

    /// Spreads one result per issued request back to caller indices.
    pub fn expand<T: Clone>(&self, results: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(self.caller_len());
        for (g, r) in self.groups.iter().zip(results) {
            out.extend(std::iter::repeat_n(r, g.len()).cloned());
        }
        out
    }
}

/// Merges runs of consecutive requests with the same op whose local and
/// remote ranges both continue the previous one, up to `max_len` bytes per
/// merged request. Zero-length requests are never merged. Order is kept.
pub fn coalesce(requests: &[TransferRequest], enabled: bool, max_len: u64) -> CoalescedBatch {
    let mut out = CoalescedBatch {
        requests: Vec::with_capacity(requests.len()),
        groups: Vec::with_capacity(requests.len()),
    };
    for (i, r) in requests.iter().enumerate() {
        if enabled {
            if let (Some(last), Some(group)) = (out.requests.last_mut(), out.groups.last_mut()) {
                let adjacent = last.op == r.op
                    && last.len > 0
                    && r.len > 0
                    && last.local_addr.checked_add(last.len) == Some(r.local_addr)
                    && last.remote_addr.checked_add(last.len) == Some(r.remote_addr)
                    && last.len.checked_add(r.len).is_some_and(|n| n <= max_len);
                if adjacent {
                    last.len += r.len;
                    group.end = i + 1;
                    continue;
                }
            }
        }
        out.requests.push(*r);
        out.groups.push(i..i + 1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_only_runs_that_continue_on_both_sides() {
        let reqs = [
            TransferRequest::write(0, 100, 10),
            TransferRequest::write(10, 110, 10),
            TransferRequest::write(20, 121, 10), // remote gap
            TransferRequest::read(30, 131, 10),  // op differs
            TransferRequest::read(40, 141, 0),   // zero length
            TransferRequest::read(40, 141, 5),
        ];
        let c = coalesce(&reqs, true, u64::MAX);
        assert_eq!(c.requests.len(), 5);
        assert_eq!(c.requests[0], TransferRequest::write(0, 100, 20));
        assert_eq!(c.groups, vec![0..2, 2..3, 3..4, 4..5, 5..6]);
        assert_eq!(c.expand(&[1, 2, 3, 4, 5]), vec![1, 1, 2, 3, 4, 5]);
        let off = coalesce(&reqs, false, u64::MAX);
        assert_eq!(off.requests, reqs.to_vec());
        let capped = coalesce(&reqs[..2], true, 15);
        assert_eq!(capped.requests.len(), 2);
    }
}
