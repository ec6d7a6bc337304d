//! Keep-alive (idle timeout) rules.
//!
//! Keep-alive is ski rental (Karlin et al. 1988): an idle worker costs r $/s, a cold start costs
//! B $. Releasing after T = B / r costs at most twice the offline optimum. Here r is the worker's
//! price and B the billed cold start (boot seconds x price) plus the value of the wait it adds
//! (boot seconds x `wait_value_usd_per_h`), so T = boot x (1 + wait value / price): cheap GPUs
//! are kept longer than expensive ones. When the gap histogram of the job shapes the worker
//! serves is representative, the keep-alive is cut to its `gap_quantile` gap where that is
//! shorter (Serverless in the Wild, ATC'20): past the p99 gap the next arrival is unlikely to
//! come soon, so waiting longer buys little.

use crate::config::{KeepAliveMode, ScaleDownConfig};
use crate::observation::GapHistogram;

/// Ski-rental break-even idle timeout, seconds, for a worker billed `price_usd_per_h`:
/// `boot_s x (1 + wait_value_usd_per_h / price)` (just `boot_s` for a free worker's price of 0
/// would be infinite, so a price of 0 is treated as 1e-9 $/h).
pub fn break_even_s(boot_s: f64, price_usd_per_h: f64, cfg: &ScaleDownConfig) -> f64 {
    boot_s * (1.0 + cfg.wait_value_usd_per_h / price_usd_per_h.max(1e-9))
}

/// Keep-alive in force now for a worker billed `price_usd_per_h`, seconds, for the configured mode
/// (for cooldown-with-decay: the time of the final release step). `gaps`: the arrival-gap
/// histogram of the job shapes the worker serves, if any.
pub fn keep_alive_s(gaps: Option<&GapHistogram>, boot_s: f64, price_usd_per_h: f64, cfg: &ScaleDownConfig) -> f64 {
    match cfg.mode {
        KeepAliveMode::Fixed => cfg.fixed_idle_timeout_s,
        KeepAliveMode::CooldownDecay => cfg.release_rest_at_s,
        KeepAliveMode::Adaptive => {
            let be = break_even_s(boot_s, price_usd_per_h, cfg);
            let t = match gaps.and_then(|g| g.quantile(cfg.gap_quantile).map(|q| (q, g.samples()))) {
                Some((q, n)) if n >= cfg.min_gap_samples => q.min(be),
                _ => be,
            };
            t.clamp(cfg.min_keep_alive_s, cfg.max_keep_alive_s)
        }
    }
}

/// Cooldown with decay: does an idle worker with launch sequence `seq` belong to the share released
/// at the first step? A Weyl sequence over `seq` spreads consecutive launches evenly, so about
/// `fraction` of any run of workers is in it, without state.
pub fn in_first_release(seq: u64, fraction: f64) -> bool {
    let u = (seq.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as f64 / (1u64 << 53) as f64;
    u < fraction
}
