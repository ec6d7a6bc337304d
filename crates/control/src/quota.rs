//! EC2's vCPU quotas: which instance families share one limit of running vCPUs per region, and
//! what the limit is called, so a launch refused for the quota (EC2 `VcpuLimitExceeded` on
//! on-demand, `MaxSpotInstanceCountExceeded` on spot) falls back out of the whole bucket at once and
//! the operator is told which quota to raise.
//!
//! Source: EC2 User Guide, "Amazon EC2 instance type quotas" (on-demand: one quota of running
//! vCPUs per bucket of families, per region) and "Spot Instance quotas" (spot: one per bucket, apart
//! from on-demand's). The Service Quotas codes are the ones `aws service-quotas list-service-quotas
//! --service-code ec2` lists.

use onoff_policy::{CapacityType, Offering, OfferingKey, UnavailableOffering};

/// A bucket of instance families that share one vCPU quota (one for on-demand, one for spot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuotaBucket {
    /// A, C, D, H, I, M, R, T, Z (and any family not listed below).
    Standard,
    /// DL (Gaudi, Qualcomm AI 100).
    Dl,
    /// F (FPGA).
    F,
    /// G and VT (including GR).
    GAndVt,
    /// HPC (on-demand only).
    Hpc,
    /// High Memory (`u-`; on-demand only).
    HighMemory,
    /// Inf (Inferentia).
    Inf,
    /// P.
    P,
    /// Trn (Trainium).
    Trn,
    /// X.
    X,
}

impl QuotaBucket {
    /// The bucket of `instance_type` (`g5.xlarge`, `p4d.24xlarge`, `inf2.xlarge`, `u-6tb1.metal`),
    /// by its family letters: the letters before the first digit or `-`.
    pub fn of(instance_type: &str) -> Self {
        let end = instance_type
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(instance_type.len());
        match instance_type[..end].to_ascii_lowercase().as_str() {
            "dl" => Self::Dl,
            "f" => Self::F,
            "g" | "gr" | "vt" => Self::GAndVt,
            "hpc" => Self::Hpc,
            "u" => Self::HighMemory,
            "inf" => Self::Inf,
            "p" => Self::P,
            "trn" => Self::Trn,
            "x" => Self::X,
            _ => Self::Standard,
        }
    }

    /// Every bucket.
    pub const ALL: [QuotaBucket; 10] = [
        Self::Standard,
        Self::Dl,
        Self::F,
        Self::GAndVt,
        Self::Hpc,
        Self::HighMemory,
        Self::Inf,
        Self::P,
        Self::Trn,
        Self::X,
    ];

    /// A short stable name, for stored marks ([`QuotaMark`]).
    pub fn id(self) -> &'static str {
        match self {
            Self::Standard => "standard",
            Self::Dl => "dl",
            Self::F => "f",
            Self::GAndVt => "g-vt",
            Self::Hpc => "hpc",
            Self::HighMemory => "high-memory",
            Self::Inf => "inf",
            Self::P => "p",
            Self::Trn => "trn",
            Self::X => "x",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Standard => "Standard (A, C, D, H, I, M, R, T, Z)",
            Self::Dl => "DL",
            Self::F => "F",
            Self::GAndVt => "G and VT",
            Self::Hpc => "HPC",
            Self::HighMemory => "High Memory",
            Self::Inf => "Inf",
            Self::P => "P",
            Self::Trn => "Trn",
            Self::X => "X",
        }
    }

    /// The quota's name in Service Quotas, e.g. `Running On-Demand G and VT instances` or `All G
    /// and VT Spot Instance Requests`.
    pub fn name(self, capacity: CapacityType) -> String {
        match capacity {
            CapacityType::OnDemand => format!("Running On-Demand {} instances", self.label()),
            CapacityType::Spot => format!("All {} Spot Instance Requests", self.label()),
        }
    }

    /// The quota's Service Quotas code (service `ec2`); `None` for spot HPC and High Memory, which
    /// have no spot quota.
    pub fn code(self, capacity: CapacityType) -> Option<&'static str> {
        Some(match (self, capacity) {
            (Self::Standard, CapacityType::OnDemand) => "L-1216C47A",
            (Self::Dl, CapacityType::OnDemand) => "L-6E869C2A",
            (Self::F, CapacityType::OnDemand) => "L-74FC7D96",
            (Self::GAndVt, CapacityType::OnDemand) => "L-DB2E81BA",
            (Self::Hpc, CapacityType::OnDemand) => "L-F7808C92",
            (Self::HighMemory, CapacityType::OnDemand) => "L-43DA4232",
            (Self::Inf, CapacityType::OnDemand) => "L-1945791B",
            (Self::P, CapacityType::OnDemand) => "L-417A185B",
            (Self::Trn, CapacityType::OnDemand) => "L-2C3B7624",
            (Self::X, CapacityType::OnDemand) => "L-7295265B",
            (Self::Standard, CapacityType::Spot) => "L-34B43A08",
            (Self::Dl, CapacityType::Spot) => "L-85EED4F7",
            (Self::F, CapacityType::Spot) => "L-88CF9481",
            (Self::GAndVt, CapacityType::Spot) => "L-3819A6DF",
            (Self::Inf, CapacityType::Spot) => "L-B5D1601B",
            (Self::P, CapacityType::Spot) => "L-7212CCBC",
            (Self::Trn, CapacityType::Spot) => "L-6B0D517C",
            (Self::X, CapacityType::Spot) => "L-E3A00192",
            (Self::Hpc | Self::HighMemory, CapacityType::Spot) => return None,
        })
    }

    /// What an operator reads when a launch of `vcpus` vCPUs found this quota full: which quota,
    /// and the command that asks for more.
    pub fn advice(self, capacity: CapacityType, vcpus: u32) -> String {
        let name = self.name(capacity);
        match self.code(capacity) {
            Some(code) => format!(
                "the account's vCPU quota \"{name}\" ({code}) in this region has no room for {vcpus} more vCPUs; \
                 raise it: aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} \
                 --desired-value <vCPUs>"
            ),
            None => format!("the account's vCPU quota \"{name}\" in this region has no room for {vcpus} more vCPUs"),
        }
    }
}

/// A vCPU quota found full: launches of `capacity` offerings of `bucket` with at least `vcpus`
/// vCPUs were refused, and are not tried again before `until` (unix seconds).
///
/// Kept among the unavailable offerings, under a key no offering has ([`QuotaMark::key`]:
/// instance type `quota:<bucket>:<vcpus>`, or `quota:<bucket>:<vcpus>:<ceiling>`, zone `*`), so it
/// costs no store of its own: the reconciler reads it back with the rest ([`QuotaMark::split`]).
/// While no live worker of this deployment holds any of that quota (nothing of ours will free
/// it), the offerings it covers are left out of the catalogue the policy decides on
/// ([`without_full_quotas`]): a job does not wait for spot capacity a zero spot quota will never
/// give it, and runs on on-demand, or on another family, from the next run on. The offerings at
/// or above its `ceiling` are left out even while workers of ours hold the quota: they would not
/// fit were every one of those workers gone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuotaMark {
    /// The bucket.
    pub bucket: QuotaBucket,
    /// Its capacity type.
    pub capacity: CapacityType,
    /// The fewest vCPUs refused.
    pub vcpus: u32,
    /// Until when, unix seconds.
    pub until: f64,
    /// vCPUs no launch of ours can have room for while the quota and the account's other use of
    /// it stay as they are: the vCPUs this deployment's live workers of the bucket and capacity
    /// type held when EC2 refused `vcpus` more, plus `vcpus` (the room left to us was less than
    /// that). `None` when those holdings were not known (the registry unread, a worker's type
    /// not in the catalogue), or for a mark an older build stored.
    pub ceiling: Option<u32>,
}

impl QuotaMark {
    /// The key it is stored under among the unavailable offerings.
    pub fn key(&self) -> OfferingKey {
        OfferingKey {
            instance_type: match self.ceiling {
                Some(c) => format!("quota:{}:{}:{c}", self.bucket.id(), self.vcpus),
                None => format!("quota:{}:{}", self.bucket.id(), self.vcpus),
            },
            zone: "*".into(),
            capacity_type: self.capacity,
        }
    }

    /// The mark stored as `u`, if `u` is one.
    pub fn from_unavailable(u: &UnavailableOffering) -> Option<Self> {
        let mut parts = u.key.instance_type.strip_prefix("quota:")?.split(':');
        let (id, vcpus, ceiling) = (parts.next()?, parts.next()?, parts.next());
        if parts.next().is_some() {
            return None;
        }
        Some(Self {
            bucket: QuotaBucket::ALL.into_iter().find(|b| b.id() == id)?,
            capacity: u.key.capacity_type,
            vcpus: vcpus.parse().ok()?,
            until: u.until,
            ceiling: match ceiling {
                Some(c) => Some(c.parse().ok()?),
                None => None,
            },
        })
    }

    /// `unavailable` split into the quota marks and the unavailable offerings proper.
    pub fn split(unavailable: Vec<UnavailableOffering>) -> (Vec<QuotaMark>, Vec<UnavailableOffering>) {
        let mut marks = Vec::new();
        let mut rest = Vec::with_capacity(unavailable.len());
        for u in unavailable {
            match Self::from_unavailable(&u) {
                Some(m) => marks.push(m),
                None => rest.push(u),
            }
        }
        (marks, rest)
    }

    /// Whether launching `o` would meet this full quota.
    pub fn covers(&self, o: &OfferingKey, vcpus: u32) -> bool {
        o.capacity_type == self.capacity && vcpus >= self.vcpus && QuotaBucket::of(&o.instance_type) == self.bucket
    }

    /// Whether `o` (of `vcpus` vCPUs) would not fit this quota even with every worker of ours
    /// gone: of its bucket and capacity type, at or above its [`QuotaMark::ceiling`].
    pub fn never_fits(&self, o: &OfferingKey, vcpus: u32) -> bool {
        self.ceiling.is_some_and(|c| vcpus >= c && self.covers(o, vcpus))
    }
}

/// `offerings` without those a mark in `marks` covers whose quota no live worker holds (`held`:
/// the offerings of this deployment's live workers): nothing of ours will free such a quota, so
/// neither waiting for those offerings nor launching them helps until the operator raises it.
/// Nor those a mark says never fit ([`QuotaMark::never_fits`]), held or not: in a 32-vCPU spot
/// quota that our 1-GPU workers fill, an 8-GPU job does not wait for a 192-vCPU spot type each
/// time a mark lapses, but runs on on-demand or another family. `None` when nothing is left out.
pub fn without_full_quotas(
    offerings: &[Offering],
    marks: &[QuotaMark],
    held: &[&OfferingKey],
) -> Option<Vec<Offering>> {
    let futile: Vec<&QuotaMark> = marks
        .iter()
        .filter(|m| {
            !held
                .iter()
                .any(|k| k.capacity_type == m.capacity && QuotaBucket::of(&k.instance_type) == m.bucket)
        })
        .collect();
    if futile.is_empty() && marks.iter().all(|m| m.ceiling.is_none()) {
        return None;
    }
    let kept: Vec<Offering> = offerings
        .iter()
        .filter(|o| {
            !futile.iter().any(|m| m.covers(&o.key, o.vcpus)) && !marks.iter().any(|m| m.never_fits(&o.key, o.vcpus))
        })
        .cloned()
        .collect();
    (kept.len() < offerings.len()).then_some(kept)
}

/// Launches of one lane and shape (queued jobs', or its warm pool's) the decision held for want of
/// any offering (`Reason::NoOffering`) while full vCPU quotas had left offerings that could take
/// them out of the run's catalogue ([`without_full_quotas`]): the quotas to raise, not a job to
/// fix.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockedByQuotas {
    /// The lane's name.
    pub lane: String,
    /// GPUs per instance asked for.
    pub gpus: u32,
    /// GPU memory per GPU asked for, GiB.
    pub min_gpu_memory_gib: f64,
    /// Jobs (or warm-pool workers) held.
    pub held: u32,
    /// The full quotas behind it, each once.
    pub quotas: Vec<QuotaMark>,
}

impl std::fmt::Display for BlockedByQuotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "lane {}: {} held for want of an offering of {} GPU(s) per instance, a full vCPU quota leaving out every one: ",
            self.lane, self.held, self.gpus
        )?;
        for (i, m) in self.quotas.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            f.write_str(&m.bucket.advice(m.capacity, m.vcpus))?;
        }
        Ok(())
    }
}

/// The marks of `marks` behind `left_out` (offerings [`without_full_quotas`] left out of the
/// catalogue) holding an offering `eligible` says a job could otherwise run on: each mark once,
/// in `marks`' order. Empty when no such offering was left out, so the job's lack of one has
/// another cause (its GPUs, the lane's capacity types, a price or type filter).
pub fn quotas_behind<'a>(
    marks: &'a [QuotaMark],
    left_out: &[&Offering],
    eligible: impl Fn(&Offering) -> bool,
) -> Vec<&'a QuotaMark> {
    let runnable: Vec<&&Offering> = left_out.iter().filter(|o| eligible(o)).collect();
    marks
        .iter()
        .filter(|m| runnable.iter().any(|o| m.covers(&o.key, o.vcpus)))
        .collect()
}

/// The vCPUs a quota mark's ceiling counts as held in each bucket and capacity type: those of
/// `live` (this deployment's live workers' offerings, in every state the registry lists: a
/// stopped or terminating one is counted too, so a ceiling errs high, towards trying), each
/// looked up by instance type in `offerings`. `None` when a worker's type is not in `offerings`
/// (its vCPUs unknown: no ceiling is set).
pub fn held_vcpus(live: &[&OfferingKey], offerings: &[Offering]) -> Option<Vec<(QuotaBucket, CapacityType, u32)>> {
    let mut held: Vec<(QuotaBucket, CapacityType, u32)> = Vec::new();
    for k in live {
        let vcpus = offerings.iter().find(|o| o.key.instance_type == k.instance_type)?.vcpus;
        let bucket = QuotaBucket::of(&k.instance_type);
        match held.iter_mut().find(|(b, c, _)| *b == bucket && *c == k.capacity_type) {
            Some((_, _, n)) => *n += vcpus,
            None => held.push((bucket, k.capacity_type, vcpus)),
        }
    }
    Some(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1-GPU offering of type `t` in zone z1.
    fn offering(t: &str, vcpus: u32, c: CapacityType) -> Offering {
        Offering {
            key: OfferingKey {
                instance_type: t.into(),
                zone: "z1".into(),
                capacity_type: c,
            },
            gpus: 1,
            gpu_model: "X".into(),
            gpu_memory_gib: 24.0,
            vcpus,
            price_usd_per_h: 1.0,
            interruption: None,
        }
    }

    #[test]
    fn families_fall_in_their_buckets() {
        for (ty, bucket) in [
            ("g5.xlarge", QuotaBucket::GAndVt),
            ("g6e.12xlarge", QuotaBucket::GAndVt),
            ("gr6.4xlarge", QuotaBucket::GAndVt),
            ("vt1.3xlarge", QuotaBucket::GAndVt),
            ("p4d.24xlarge", QuotaBucket::P),
            ("p6e-gb200.36xlarge", QuotaBucket::P),
            ("inf2.xlarge", QuotaBucket::Inf),
            ("trn1n.32xlarge", QuotaBucket::Trn),
            ("dl2q.24xlarge", QuotaBucket::Dl),
            ("f1.2xlarge", QuotaBucket::F),
            ("x2idn.16xlarge", QuotaBucket::X),
            ("hpc7g.16xlarge", QuotaBucket::Hpc),
            ("u-6tb1.metal", QuotaBucket::HighMemory),
            // Standard, including families that begin with a bucket's letter.
            ("t3.micro", QuotaBucket::Standard),
            ("im4gn.large", QuotaBucket::Standard),
            ("i4i.large", QuotaBucket::Standard),
            ("d3en.xlarge", QuotaBucket::Standard),
            ("c7gn.large", QuotaBucket::Standard),
        ] {
            assert_eq!(QuotaBucket::of(ty), bucket, "{ty}");
        }
    }

    #[test]
    fn a_quota_mark_is_stored_as_an_unavailable_offering_and_read_back() {
        let m = QuotaMark {
            bucket: QuotaBucket::GAndVt,
            capacity: CapacityType::Spot,
            vcpus: 4,
            until: 100.0,
            ceiling: None,
        };
        let stored = UnavailableOffering {
            key: m.key(),
            until: 100.0,
        };
        let plain = UnavailableOffering {
            key: OfferingKey {
                instance_type: "g5.xlarge".into(),
                zone: "z1".into(),
                capacity_type: CapacityType::Spot,
            },
            until: 50.0,
        };
        let (marks, rest) = QuotaMark::split(vec![plain.clone(), stored]);
        assert_eq!((marks, rest), (vec![m], vec![plain.clone()]));
        for b in QuotaBucket::ALL {
            for ceiling in [None, Some(36)] {
                let m = QuotaMark {
                    bucket: b,
                    ceiling,
                    ..m
                };
                assert_eq!(
                    QuotaMark::from_unavailable(&UnavailableOffering {
                        key: m.key(),
                        until: 100.0
                    }),
                    Some(m)
                );
            }
        }
        assert_eq!(
            QuotaMark { ceiling: Some(36), ..m }.key().instance_type,
            "quota:g-vt:4:36"
        );
        // Not a mark: read as a plain (and harmless) unavailable offering.
        for bad in ["quota:g-vt:4:36:1", "quota:g-vt:x", "quota:g-vt:4:x", "quota:nope:4"] {
            let u = UnavailableOffering {
                key: OfferingKey {
                    instance_type: bad.into(),
                    ..m.key()
                },
                until: 100.0,
            };
            assert_eq!(QuotaMark::from_unavailable(&u), None, "{bad}");
        }
        // Covers its bucket and capacity type from its size up.
        let key = |t: &str, c| OfferingKey {
            instance_type: t.into(),
            zone: "z9".into(),
            capacity_type: c,
        };
        assert!(m.covers(&key("g6.2xlarge", CapacityType::Spot), 8));
        assert!(!m.covers(&key("g6.2xlarge", CapacityType::OnDemand), 8));
        assert!(!m.covers(&key("p3.2xlarge", CapacityType::Spot), 8));
        let big = QuotaMark { vcpus: 32, ..m };
        assert!(!big.covers(&key("g5.xlarge", CapacityType::Spot), 4));
    }

    #[test]
    fn a_full_quota_leaves_the_choice_only_while_nothing_of_ours_holds_it() {
        let offs = [
            offering("g5.xlarge", 4, CapacityType::Spot),
            offering("g5.8xlarge", 32, CapacityType::Spot),
            offering("g5.xlarge", 4, CapacityType::OnDemand),
            offering("p3.2xlarge", 8, CapacityType::Spot),
        ];
        let mark = QuotaMark {
            bucket: QuotaBucket::GAndVt,
            capacity: CapacityType::Spot,
            vcpus: 32,
            until: 100.0,
            ceiling: None,
        };
        let kept = without_full_quotas(&offs, &[mark], &[]).expect("the 32-vCPU spot type is left out");
        assert_eq!(kept.len(), 3);
        assert!(!kept.iter().any(|o| o.key == offs[1].key));
        // A worker of ours on G spot holds the quota: it frees as that worker ends.
        assert_eq!(without_full_quotas(&offs, &[mark], &[&offs[0].key]), None);
        // One on G on-demand or P spot holds another quota.
        assert!(without_full_quotas(&offs, &[mark], &[&offs[2].key, &offs[3].key]).is_some());
    }

    #[test]
    fn a_type_above_a_full_quotas_ceiling_is_left_out_even_while_ours_hold_the_quota() {
        let offs = [
            offering("g5.xlarge", 4, CapacityType::Spot),
            offering("g5.12xlarge", 48, CapacityType::Spot),
            offering("g5.48xlarge", 192, CapacityType::Spot),
            offering("g5.48xlarge", 192, CapacityType::OnDemand),
        ];
        // Refused 4 more vCPUs while our workers held 32: room for us under 36.
        let mark = QuotaMark {
            bucket: QuotaBucket::GAndVt,
            capacity: CapacityType::Spot,
            vcpus: 4,
            until: 100.0,
            ceiling: Some(36),
        };
        let held = [&offs[0].key];
        let kept = without_full_quotas(&offs, &[mark], &held).expect("the big spot types are left out");
        let kept: Vec<String> = kept.iter().map(|o| o.key.to_string()).collect();
        assert_eq!(kept, [offs[0].key.to_string(), offs[3].key.to_string()]);
        // Without a ceiling, a held quota leaves everything in (it frees as our workers end).
        assert_eq!(
            without_full_quotas(&offs, &[QuotaMark { ceiling: None, ..mark }], &held),
            None
        );
        // A ceiling above every type of the bucket leaves nothing out.
        assert_eq!(
            without_full_quotas(
                &offs,
                &[QuotaMark {
                    ceiling: Some(500),
                    ..mark
                }],
                &held
            ),
            None
        );
        assert!(mark.never_fits(&offs[1].key, 48));
        assert!(!mark.never_fits(&offs[3].key, 192), "on-demand is another quota");
        assert!(!mark.never_fits(&offs[0].key, 4));
    }

    #[test]
    fn held_vcpus_add_up_per_bucket_and_capacity_type_and_need_every_type_known() {
        let offs = [
            offering("g5.xlarge", 4, CapacityType::Spot),
            offering("g5.2xlarge", 8, CapacityType::OnDemand),
            offering("p3.2xlarge", 8, CapacityType::Spot),
        ];
        // A worker in another zone or of the other capacity type is found by its type.
        let other_zone = OfferingKey {
            zone: "z2".into(),
            ..offs[0].key.clone()
        };
        let on_demand_g5 = OfferingKey {
            capacity_type: CapacityType::OnDemand,
            ..offs[0].key.clone()
        };
        let held = held_vcpus(&[&offs[0].key, &other_zone, &on_demand_g5, &offs[2].key], &offs).unwrap();
        assert_eq!(
            held,
            [
                (QuotaBucket::GAndVt, CapacityType::Spot, 8),
                (QuotaBucket::GAndVt, CapacityType::OnDemand, 4),
                (QuotaBucket::P, CapacityType::Spot, 8),
            ]
        );
        let unknown = OfferingKey {
            instance_type: "g6.xlarge".into(),
            ..offs[0].key.clone()
        };
        assert_eq!(held_vcpus(&[&offs[0].key, &unknown], &offs), None);
        assert_eq!(held_vcpus(&[], &offs), Some(vec![]));
    }

    #[test]
    fn the_gpu_quotas_are_named_as_service_quotas_names_them() {
        let g = QuotaBucket::GAndVt;
        assert_eq!(g.name(CapacityType::OnDemand), "Running On-Demand G and VT instances");
        assert_eq!(g.code(CapacityType::OnDemand), Some("L-DB2E81BA"));
        assert_eq!(g.name(CapacityType::Spot), "All G and VT Spot Instance Requests");
        assert_eq!(g.code(CapacityType::Spot), Some("L-3819A6DF"));
        assert_eq!(QuotaBucket::P.code(CapacityType::OnDemand), Some("L-417A185B"));
        assert_eq!(QuotaBucket::P.code(CapacityType::Spot), Some("L-7212CCBC"));
        assert_eq!(QuotaBucket::Hpc.code(CapacityType::Spot), None);
        let a = g.advice(CapacityType::Spot, 48);
        assert!(
            a.contains("L-3819A6DF") && a.contains("48 more vCPUs") && a.contains("request-service-quota-increase")
        );
    }
}
