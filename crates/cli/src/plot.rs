//! SVG plot of the simulated timelines (plotters).

use std::path::Path;

use anyhow::{anyhow, Result};
use onoff_sim::Comparison;
use plotters::prelude::*;

/// A named line of the workers panel.
type Series = (&'static str, RGBColor, fn(&onoff_sim::TimelineRow) -> u32);

/// Two panels: spend rate ($/h) of every policy over time, and onoff's backlog and workers by state.
pub fn timeline_svg(path: &Path, c: &Comparison) -> Result<()> {
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (top, bottom) = root.split_vertically(400);
    let hours = |m: u64| m as f64 / 60.0;
    let max_h = c
        .policies
        .iter()
        .flat_map(|p| p.timeline.last())
        .map(|r| hours(r.minute))
        .fold(1.0, f64::max);
    let max_usd = c
        .policies
        .iter()
        .flat_map(|p| p.timeline.iter())
        .map(|r| r.usd_per_h)
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&top)
        .caption(format!("Spend rate by policy ({})", c.trace), ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_h, 0.0..max_usd * 1.05)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("hours since first arrival")
        .y_desc("$/h")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, p) in c.policies.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                p.timeline.iter().map(|r| (hours(r.minute), r.usd_per_h)),
                color.stroke_width(1),
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(p.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;

    if let Some(p) = c.policies.iter().find(|p| p.name == "onoff").or(c.policies.first()) {
        let max_n = p
            .timeline
            .iter()
            .map(|r| r.backlog.max(r.busy + r.idle + r.pending))
            .max()
            .unwrap_or(1)
            .max(1);
        let mut chart = ChartBuilder::on(&bottom)
            .caption(format!("{}: backlog and workers by state", p.name), ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_h, 0u32..max_n + 1)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("hours since first arrival")
            .y_desc("count")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        let series: [Series; 4] = [
            ("backlog", RED, |r| r.backlog),
            ("busy", BLUE, |r| r.busy),
            ("idle", GREEN, |r| r.idle),
            ("booting", MAGENTA, |r| r.pending),
        ];
        for (name, color, f) in series {
            chart
                .draw_series(LineSeries::new(
                    p.timeline.iter().map(|r| (hours(r.minute), f(r))),
                    color.stroke_width(1),
                ))
                .map_err(|e| anyhow!("{e}"))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
