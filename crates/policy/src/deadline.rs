//! Deadlines on spot: when a job's deadline is at risk, and where such a job may run.
//!
//! The rule is Can't Be Late's (Wu et al., NSDI'24): run a deadline job on spot while its slack
//! covers one interruption and a restart, switch to on-demand for good once it no longer does.
//! Slack is `deadline - now - expected run time`, seconds; it stays constant while the job runs
//! and shrinks while it waits or loses work to an interruption.
//!
//! Two decisions use it, and every runner of jobs applies the same functions:
//! - **Launch** ([`at_risk_slack_s`]): an unmet job whose slack is under [`at_risk_threshold_s`]
//!   gets on-demand capacity of its own (`decide`'s scale-up phase).
//!   That capacity is pinned to the job: its agent claims the job by id when it boots, and while
//!   it boots no other job counts it.
//! - **Placement** ([`keeps_off_spot`]): a job whose slack no longer covers one interruption
//!   on a spot worker already up ([`spot_start_slack_s`]: the threshold less the spot launch's
//!   cold start) does not start on one while the on-demand capacity launched for it can still
//!   meet its deadline. In a lane that may use spot, the policy's matching counts only idle
//!   on-demand workers for it (a booting one may go to a job queued ahead), the simulator's
//!   dispatch gives it only on-demand workers, and the agent on a spot instance hands it back
//!   unrun (`AttemptEnd::Deferred`). A job that had less slack than a cold start when it queued
//!   takes any worker already up, spot or not: no launch can meet it.
//!
//! Measured (`docs/policy.md`, the README's deadline tables): on the busy week with measured
//! preemptions, placement and pinning took the deadlines missed by jobs with more slack than the
//! longest cold start from 68 to 0 (S 1.5), at 0.49 x the all-on-demand cost instead of 0.62 x.

use crate::config::PolicyConfig;

/// Slack below which a job with a deadline goes to on-demand, seconds: a spot start must leave
/// room for one interruption (the work since the last checkpoint, at most one interval, and the
/// replacement's cold start) and then an on-demand cold start, plus the margin:
/// `2 x offers.boot_estimate_s + offers.checkpoint_interval_s + limits.deadline_margin_s`
/// (1,980 s with the defaults: 2 x 390 + 600 + 600).
#[must_use]
pub fn at_risk_threshold_s(cfg: &PolicyConfig) -> f64 {
    2.0 * cfg.offers.boot_estimate_s + cfg.offers.checkpoint_interval_s + cfg.limits.deadline_margin_s
}

/// The slack of a job whose deadline is at risk on spot, seconds (negative once even an
/// immediate start is late); `None` without a deadline or with slack of at least
/// [`at_risk_threshold_s`]. `deadline` and `now` on one clock (seconds), `runtime_s` the
/// expected run time left.
#[must_use]
pub fn at_risk_slack_s(deadline: Option<f64>, runtime_s: f64, now: f64, cfg: &PolicyConfig) -> Option<f64> {
    deadline
        .map(|d| d - now - runtime_s)
        .filter(|s| *s < at_risk_threshold_s(cfg))
}

/// Slack a job needs to start on a spot worker that is already up, seconds: one interruption
/// (the work since the last checkpoint) and then an on-demand cold start, plus the margin:
/// [`at_risk_threshold_s`] less the spot launch's own cold start (1,590 s with the defaults).
#[must_use]
pub fn spot_start_slack_s(cfg: &PolicyConfig) -> f64 {
    at_risk_threshold_s(cfg) - cfg.offers.boot_estimate_s
}

/// True when a job must not start on a spot worker now: its slack (`deadline - now -
/// runtime_s`) is under [`spot_start_slack_s`], it can still be met (slack at least 0), and an
/// on-demand launch made when the job queued (`queued_at`, seconds; the policy launches
/// on-demand capacity for an at-risk job as soon as it sees it) would have been up in time: its
/// slack then was at least one cold start (`offers.boot_estimate_s`). False without a deadline,
/// with slack enough for one interruption, once the deadline is lost, and for a job that had
/// less slack than a cold start when it queued (then any worker already up is its best chance,
/// spot or not).
#[must_use]
pub fn keeps_off_spot(deadline: Option<f64>, runtime_s: f64, now: f64, queued_at: f64, cfg: &PolicyConfig) -> bool {
    let Some(slack) = deadline.map(|d| d - now - runtime_s) else {
        return false;
    };
    let slack_when_queued = slack + (now - queued_at).max(0.0);
    (0.0..spot_start_slack_s(cfg)).contains(&slack) && slack_when_queued >= cfg.offers.boot_estimate_s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_two_cold_starts_a_checkpoint_interval_and_the_margin() {
        let mut cfg = PolicyConfig::default();
        assert_eq!(at_risk_threshold_s(&cfg), 2.0 * 390.0 + 600.0 + 600.0);
        assert_eq!(spot_start_slack_s(&cfg), 390.0 + 600.0 + 600.0);
        cfg.offers.boot_estimate_s = 100.0;
        cfg.offers.checkpoint_interval_s = 50.0;
        cfg.limits.deadline_margin_s = 10.0;
        assert_eq!(at_risk_threshold_s(&cfg), 260.0);
    }

    #[test]
    fn placement_keeps_a_job_off_spot_only_while_on_demand_can_still_make_it() {
        let cfg = PolicyConfig::default();
        let (now, runtime) = (1_000.0, 3_600.0);
        // (what, slack now, waited since it queued, at risk, keeps off spot)
        let rows = [
            ("ample slack", 5_000.0, 0.0, false, false),
            ("at the threshold", 1_980.0, 0.0, false, false),
            (
                "under it, but enough for one interruption on a spot worker up",
                1_979.0,
                0.0,
                true,
                false,
            ),
            ("at that", 1_590.0, 0.0, true, false),
            ("just under that", 1_589.0, 0.0, true, true),
            ("one cold start left", 390.0, 0.0, true, true),
            ("less than a cold start when it queued", 389.0, 0.0, true, false),
            (
                "less than a cold start now, more when it queued",
                100.0,
                500.0,
                true,
                true,
            ),
            ("the deadline lost", -10.0, 5_000.0, true, false),
        ];
        for (what, slack, waited, at_risk, off_spot) in rows {
            let deadline = Some(now + runtime + slack);
            let queued_at = now - waited;
            assert_eq!(
                at_risk_slack_s(deadline, runtime, now, &cfg).is_some(),
                at_risk,
                "{what}"
            );
            assert_eq!(
                keeps_off_spot(deadline, runtime, now, queued_at, &cfg),
                off_spot,
                "{what}"
            );
        }
        assert!(!keeps_off_spot(None, runtime, now, now, &cfg), "no deadline");
        assert_eq!(
            at_risk_slack_s(Some(now + runtime + 700.0), runtime, now, &cfg),
            Some(700.0)
        );
    }
}
