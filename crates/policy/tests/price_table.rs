//! Property test: the [`PriceTable`] (and so [`choice::top`], which uses one) ranks and prices
//! exactly as the scan does, [`choice::rank`] with [`choice::eligible`] and
//! [`choice::expected_cost_per_job`], bit for bit, over random
//! catalogues (1-8 GPUs, both capacity types, every interruption bucket, GPU models of several
//! speeds, equal prices), configurations (price, interruption and type filters, oversize) and
//! requests, with random offerings unavailable (and one the catalogue lacks), and each offering
//! in one to three zones (the table prices equal offerings once).

use onoff_policy::choice::{self, Request};
use onoff_policy::{
    CapacityPreference, CapacityType, InterruptionBucket, OfferConfig, Offering, OfferingKey, PriceTable,
    UnavailableOffering,
};
use proptest::prelude::*;

const MODELS: [&str; 3] = ["NVIDIA A", "NVIDIA B", "NVIDIA C"];
const BUCKETS: [Option<InterruptionBucket>; 6] = [
    None,
    Some(InterruptionBucket::Under5),
    Some(InterruptionBucket::From5To10),
    Some(InterruptionBucket::From10To15),
    Some(InterruptionBucket::From15To20),
    Some(InterruptionBucket::Over20),
];
const CAPACITY: [CapacityPreference; 3] = [
    CapacityPreference::SpotFirst,
    CapacityPreference::SpotOnly,
    CapacityPreference::OnDemand,
];

/// (GPUs exponent, memory choice, spot, bucket, model, price in tenths of a dollar: few values, so
/// equal costs are common).
type RawOffering = (u32, usize, bool, usize, usize, u32);

/// The offerings of `raw`, each in `zones` zones (its copies one after the other, equal but for
/// the zone, as the simulator's catalogue has them).
fn catalogue(raw: &[RawOffering], zones: usize) -> Vec<Offering> {
    raw.iter()
        .flat_map(|r| std::iter::repeat_n(r, zones))
        .enumerate()
        .map(|(i, &(g, mem, spot, bucket, model, tenths))| Offering {
            key: OfferingKey {
                instance_type: format!("t{}", (i / zones) % 5),
                zone: format!("z{i}"),
                capacity_type: if spot {
                    CapacityType::Spot
                } else {
                    CapacityType::OnDemand
                },
            },
            gpus: 1 << g,
            gpu_model: MODELS[model].into(),
            gpu_memory_gib: [16.0, 24.0, 48.0][mem],
            vcpus: 8,
            price_usd_per_h: f64::from(tenths) / 10.0,
            interruption: BUCKETS[bucket],
        })
        .collect()
}

fn config() -> impl Strategy<Value = OfferConfig> {
    (
        prop::option::of(1u32..30),
        prop::option::of(1usize..6),
        any::<bool>(),
        1u32..3,
        any::<bool>(),
    )
        .prop_map(|(max_price, max_bucket, types, oversize, speeds)| {
            let mut cfg = OfferConfig {
                max_price_usd_per_h: max_price.map(|t| f64::from(t) / 10.0),
                max_interruption: max_bucket.and_then(|b| BUCKETS[b]),
                max_gpu_oversize: oversize,
                ..OfferConfig::default()
            };
            if types {
                cfg.allowed_instance_types = vec!["t0".into(), "t3".into()];
            }
            if speeds {
                cfg.gpu_speed.insert("NVIDIA B".into(), 2.0);
                cfg.gpu_speed.insert("NVIDIA C".into(), 0.7);
            }
            cfg
        })
}

fn request() -> impl Strategy<Value = Request> {
    (0u32..4, 0usize..3, 0usize..3, 1u32..4, 1.0f64..100_000.0).prop_map(|(g, mem, cap, instances, runtime_s)| {
        Request {
            gpus: [1, 2, 3, 8][g as usize],
            min_mem_gib: [0.0, 20.0, 40.0][mem],
            capacity: CAPACITY[cap],
            instances,
            runtime_s,
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_table_ranks_and_prices_as_the_scan_does(
        raw in prop::collection::vec((0u32..4, 0usize..3, any::<bool>(), 0usize..6, 0usize..3, 1u32..30), 0..40),
        cfg in config(),
        req in request(),
        gone in prop::collection::vec((0usize..120, 0.0f64..200.0), 0..12),
        k in 0usize..6,
        zones in 1usize..4,
    ) {
        let offs = catalogue(&raw, zones);
        let now = 100.0;
        let mut unavailable: Vec<UnavailableOffering> = gone
            .iter()
            .filter(|(i, _)| *i < offs.len())
            .map(|&(i, until)| UnavailableOffering { key: offs[i].key.clone(), until })
            .collect();
        // A mark for an offering the catalogue lacks (another region's, or one since retired):
        // it blocks nothing.
        unavailable.push(UnavailableOffering {
            key: OfferingKey {
                instance_type: "t0".into(),
                zone: "elsewhere".into(),
                capacity_type: CapacityType::Spot,
            },
            until: 1.0e9,
        });
        let table = PriceTable::new(&offs, &cfg);
        prop_assert_eq!(table.len(), offs.len());

        let key = |v: &[(&Offering, f64)]| v.iter().map(|(o, c)| (o.key.zone.clone(), c.to_bits())).collect::<Vec<_>>();
        // The head of the full scan, stably sorted by cost: what `top` is defined to return.
        let mut want = choice::rank(&offs, &req, &cfg, &unavailable, now);
        want.truncate(k);
        let got = table.top(&offs, &req, &unavailable, now, k);
        prop_assert_eq!(key(&got), key(&want));
        prop_assert_eq!(key(&choice::top(&offs, &req, &cfg, &unavailable, now, k)), key(&want));

        // The cheapest of each capacity type, whatever the request's preference and availability.
        let any = Request { capacity: CapacityPreference::SpotFirst, ..req };
        let (mut spot, mut od) = (f64::INFINITY, f64::INFINITY);
        for o in offs.iter().filter(|o| choice::eligible(o, &any, &cfg, &[], now)) {
            let c = choice::expected_cost_per_job(o, req.runtime_s, req.instances, &cfg);
            match o.key.capacity_type {
                CapacityType::Spot => spot = spot.min(c),
                CapacityType::OnDemand => od = od.min(c),
            }
        }
        let (t_spot, t_od) = table.cheapest_by_capacity(&req);
        prop_assert_eq!((t_spot.to_bits(), t_od.to_bits()), (spot.to_bits(), od.to_bits()));
    }
}
