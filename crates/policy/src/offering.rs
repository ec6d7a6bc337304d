//! Offerings: what can be launched, and how to choose between them by expected cost per job.
//!
//! An offering is one (instance type, availability zone, capacity type) triple with its price. The
//! choice is made on *expected cost per job*, not on hourly price: price x expected runtime on that
//! type x overhead of expected interruptions (lost work since the last checkpoint plus a restart).

use serde::{Deserialize, Serialize};

/// On-demand or spot capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapacityType {
    /// Spot capacity: cheaper, may be interrupted with a 2-minute notice.
    Spot,
    /// On-demand capacity: list price, not interrupted.
    OnDemand,
}

impl CapacityType {
    /// The name EC2 uses (`spot`, `on-demand`).
    pub fn as_str(self) -> &'static str {
        match self {
            CapacityType::Spot => "spot",
            CapacityType::OnDemand => "on-demand",
        }
    }
}

/// Spot Instance Advisor interruption-frequency bucket (share of instances interrupted per month).
///
/// Source: the AWS Spot Instance Advisor feed (`ranges` 0..4: "<5%", "5-10%", "10-15%", "15-20%", ">20%").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum InterruptionBucket {
    /// "<5%" per month (advisor range index 0).
    Under5,
    /// "5-10%" (index 1).
    From5To10,
    /// "10-15%" (index 2).
    From10To15,
    /// "15-20%" (index 3).
    From15To20,
    /// ">20%" (index 4).
    Over20,
}

impl InterruptionBucket {
    /// Parse the advisor label (`<5%`, `5-10%`, `10-15%`, `15-20%`, `>20%`).
    pub fn from_label(label: &str) -> Option<Self> {
        match label.trim() {
            "<5%" => Some(Self::Under5),
            "5-10%" => Some(Self::From5To10),
            "10-15%" => Some(Self::From10To15),
            "15-20%" => Some(Self::From15To20),
            ">20%" => Some(Self::Over20),
            _ => None,
        }
    }

    /// Advisor range index, 0 (most reliable) ..= 4.
    pub fn index(self) -> u8 {
        self as u8
    }

    /// From the advisor range index 0..=4.
    pub fn from_index(i: u8) -> Option<Self> {
        [
            Self::Under5,
            Self::From5To10,
            Self::From10To15,
            Self::From15To20,
            Self::Over20,
        ]
        .get(i as usize)
        .copied()
    }

    /// The advisor label.
    pub fn label(self) -> &'static str {
        ["<5%", "5-10%", "10-15%", "15-20%", ">20%"][self as usize]
    }

    /// Monthly interruption probability used for estimates: the bucket's midpoint
    /// (2.5 %, 7.5 %, 12.5 %, 17.5 %) and 25 % for ">20%" (an assumption: the feed gives no upper bound).
    pub fn monthly_probability(self) -> f64 {
        [0.025, 0.075, 0.125, 0.175, 0.25][self as usize]
    }

    /// Interruption rate in events per second of running time, from [`Self::monthly_probability`]
    /// with a month of 730 h: `-ln(1 - p) / (730 * 3600)`.
    pub fn rate_per_s(self) -> f64 {
        // Precomputed from the formula above (a hot path of offering ranking); a unit test checks it.
        [
            9.633869096000722e-09,
            2.9665731152858374e-08,
            5.081103220111211e-08,
            7.320087239248711e-08,
            1.0946806409885119e-07,
        ][self as usize]
    }
}

/// Identifies an offering: (instance type, availability zone, capacity type).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OfferingKey {
    /// EC2 instance type, e.g. `g5.xlarge`.
    pub instance_type: String,
    /// Availability zone, e.g. `us-east-1a`.
    pub zone: String,
    /// Spot or on-demand.
    pub capacity_type: CapacityType,
}

impl std::fmt::Display for OfferingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.instance_type,
            self.zone,
            self.capacity_type.as_str()
        )
    }
}

/// One launchable offering with its specs and price.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Offering {
    /// (type, zone, capacity type).
    pub key: OfferingKey,
    /// Whole GPUs on the instance (fractional-GPU types are not offerings).
    pub gpus: u32,
    /// GPU model as the catalogue names it, e.g. `NVIDIA A10G`.
    pub gpu_model: String,
    /// GPU memory per GPU, GiB.
    pub gpu_memory_gib: f64,
    /// vCPUs of the instance.
    pub vcpus: u32,
    /// Price, $/h (on-demand list price, or the spot price for spot offerings).
    pub price_usd_per_h: f64,
    /// Spot Advisor interruption bucket; `None` for on-demand (never interrupted).
    pub interruption: Option<InterruptionBucket>,
}

impl Offering {
    /// Expected interruptions per second of running time (0 for on-demand).
    pub fn interruption_rate_per_s(&self) -> f64 {
        match (self.key.capacity_type, self.interruption) {
            (CapacityType::OnDemand, _) => 0.0,
            (CapacityType::Spot, Some(b)) => b.rate_per_s(),
            // Unknown spot reliability: assume the worst bucket.
            (CapacityType::Spot, None) => InterruptionBucket::Over20.rate_per_s(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::InterruptionBucket;

    #[test]
    fn rate_table_matches_the_formula() {
        for i in 0..5 {
            let b = InterruptionBucket::from_index(i).unwrap();
            let want = -(1.0 - b.monthly_probability()).ln() / (730.0 * 3600.0);
            assert!((b.rate_per_s() - want).abs() <= want * 1e-12, "{b:?}");
            assert_eq!(InterruptionBucket::from_label(b.label()), Some(b));
        }
    }
}
