//! SVG plots (plotters): the simulated timelines, and a sweep's cost / wait frontier.

use std::path::Path;

use anyhow::{anyhow, Result};
use onoff_sim::sweep::SweepResult;
use onoff_sim::Comparison;
use plotters::prelude::*;

/// A named line of the workers panel.
type Series = (&'static str, RGBColor, fn(&onoff_sim::TimelineRow) -> u32);

/// A legend key: a short line in `color`.
fn legend_line<C: Color + Copy + 'static>(color: C) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color)
}

/// The chart's legend box, drawn over its series.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(chart: &mut ChartContext<'a, DB, CT>) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e}"))
}

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
            .legend(legend_line(color));
    }
    draw_legend(&mut chart)?;

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
                .legend(legend_line(color));
        }
        draw_legend(&mut chart)?;
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// A sweep's runs as points of (p95 wait, total $), each labelled with its value, joined in the
/// order given; the points on the (cost, p95 wait) frontier are filled and joined by a second line.
pub fn frontier_svg(path: &Path, r: &SweepResult) -> Result<()> {
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let pts: Vec<(f64, f64)> = r.points.iter().map(|p| (p.wait_p95_s, p.total_usd)).collect();
    let span = |v: &mut dyn Iterator<Item = f64>| {
        let (lo, hi) = v.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
        let pad = ((hi - lo) * 0.1).max(hi.abs() * 0.01).max(1e-6);
        (lo - pad).max(0.0)..hi + pad
    };
    let xs = span(&mut pts.iter().map(|p| p.0));
    let ys = span(&mut pts.iter().map(|p| p.1));
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{} on {}: cost against p95 wait by {}", r.strategy, r.trace, r.key),
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(xs, ys)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("wait p95, s")
        .y_desc("total $")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .draw_series(LineSeries::new(pts.iter().copied(), BLUE.mix(0.3).stroke_width(1)))
        .map_err(|e| anyhow!("{e}"))?
        .label("runs, in the order given")
        .legend(legend_line(BLUE.mix(0.3)));
    let mut front: Vec<(f64, f64)> = r
        .points
        .iter()
        .filter(|p| p.on_frontier)
        .map(|p| (p.wait_p95_s, p.total_usd))
        .collect();
    front.sort_by(|a, b| a.0.total_cmp(&b.0));
    chart
        .draw_series(LineSeries::new(front, RED.stroke_width(2)))
        .map_err(|e| anyhow!("{e}"))?
        .label("frontier")
        .legend(legend_line(RED));
    for p in &r.points {
        let style = if p.on_frontier {
            RED.filled()
        } else {
            BLUE.mix(0.6).filled()
        };
        chart
            .draw_series(std::iter::once(Circle::new((p.wait_p95_s, p.total_usd), 4, style)))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{}", p.value),
                (p.wait_p95_s, p.total_usd),
                ("sans-serif", 13),
            )))
            .map_err(|e| anyhow!("{e}"))?;
    }
    draw_legend(&mut chart)?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
