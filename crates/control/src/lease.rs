//! How long an invocation holds the reconcile lease ([`crate::ports::Lease`]).
//!
//! The lease must not expire while the invocation that holds it may still act, or a second
//! scaler would act on the same backlog: the TTL is the time left until the invocation's deadline
//! (Lambda's `Context::deadline`, so the function's `Timeout` at most) plus [`LEASE_MARGIN_S`],
//! capped at [`MAX_LEASE_TTL_S`] so a bogus deadline cannot lock the control plane out for long.
//! A function `Timeout` above `MAX_LEASE_TTL_S - LEASE_MARGIN_S` breaks the rule; the template test
//! (`tests/tests/template.rs`) checks every function's `Timeout` against [`lease_ttl_s`].

/// Kept past the deadline, seconds: clock skew between invocations and a call still in flight
/// when the deadline hits.
pub const LEASE_MARGIN_S: f64 = 15.0;

/// The longest lease, seconds (5 minutes).
pub const MAX_LEASE_TTL_S: f64 = 300.0;

/// The lease TTL, seconds, for an invocation with `remaining_s` left before its deadline:
/// `min(max(remaining_s, 0) + LEASE_MARGIN_S, MAX_LEASE_TTL_S)`.
pub fn lease_ttl_s(remaining_s: f64) -> f64 {
    let remaining = if remaining_s.is_finite() {
        remaining_s.max(0.0)
    } else {
        MAX_LEASE_TTL_S
    };
    (remaining + LEASE_MARGIN_S).min(MAX_LEASE_TTL_S)
}

/// The lease TTL, seconds, for an invocation whose deadline is `deadline_ms` (milliseconds since
/// the Unix epoch, as Lambda gives it) at `now` (Unix seconds). A deadline of 0 means none is
/// known (a handler called outside Lambda): `fallback_s` then.
pub fn lease_ttl_for_deadline(deadline_ms: u64, now: f64, fallback_s: f64) -> f64 {
    if deadline_ms == 0 {
        return fallback_s;
    }
    lease_ttl_s(deadline_ms as f64 / 1000.0 - now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_outlives_the_deadline_by_the_margin_up_to_the_cap() {
        assert_eq!(lease_ttl_s(60.0), 75.0);
        assert_eq!(lease_ttl_s(-3.0), LEASE_MARGIN_S);
        assert_eq!(lease_ttl_s(10_000.0), MAX_LEASE_TTL_S);
        assert_eq!(lease_ttl_s(f64::NAN), MAX_LEASE_TTL_S);
        // 59.5 s left at now = 1000.5.
        assert_eq!(lease_ttl_for_deadline(1_060_000, 1000.5, 60.0), 59.5 + LEASE_MARGIN_S);
        assert_eq!(lease_ttl_for_deadline(0, 1000.0, 42.0), 42.0);
    }
}
