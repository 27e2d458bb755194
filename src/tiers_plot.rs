//! The PNG chart of `pagoda bench tiers --workload zipf`, the EvicPress paper's Figure 7: mean time to first token
//! against quality, one labelled point per configuration (recompute, LRU, each codec + LRU, EvicPress).

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;

use crate::bench_plot::{COLORS, FONT, draw_legend, register_font};

/// The EvicPress paper's Figure 7 for `pagoda bench tiers --workload zipf`: mean TTFT (x) against quality (y),
/// one labelled point per configuration; lower right is better.
pub fn draw_tiers(report: &pagoda_worker::bench_zipf::ZipfReport, path: &Path) -> Result<()> {
    register_font()?;
    if report.results.is_empty() {
        return Err(anyhow!("nothing to plot: the report has no configurations"));
    }
    let root = BitMapBackend::new(path, (900, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let o = &report.options;
    let arrivals = if o.arrival_rate > 0.0 { format!(", {} arrivals/s", o.arrival_rate) } else { String::new() };
    let title = format!(
        "TTFT vs quality: {} contexts of {}-{} tokens, {} requests{arrivals}, Zipf({}) ({})",
        o.contexts, o.min_tokens, o.max_tokens, o.requests, o.zipf_s, report.model
    );
    let ttfts = || report.results.iter().map(|r| r.ttft_ms_mean.max(1.0));
    let (x_min, x_max) = (ttfts().fold(f64::MAX, f64::min), ttfts().fold(0.0, f64::max));
    let y_min = report.results.iter().map(|r| r.quality).fold(1.0, f64::min).min(0.9) - 0.05;
    let y_range = y_min.max(0.0)..1.02;
    let mut builder = ChartBuilder::on(&root);
    builder.caption(title, (FONT, 18)).margin(18).x_label_area_size(44).y_label_area_size(60);
    // An overloaded configuration (recompute under arrivals waits minutes) would squash every other point
    // against the axis: past a 20x spread the TTFT axis is logarithmic.
    if x_max > 20.0 * x_min {
        let chart = builder
            .build_cartesian_2d((x_min / 1.5..x_max * 1.5).log_scale(), y_range)
            .map_err(|e| anyhow!("{e:?}"))?;
        draw_points(chart, report, "mean time to first token (ms, log scale)")?;
    } else {
        let chart = builder.build_cartesian_2d(0.0..x_max * 1.15, y_range).map_err(|e| anyhow!("{e:?}"))?;
        draw_points(chart, report, "mean time to first token (ms)")?;
    }
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The mesh, one labelled point per configuration and the legend, on either TTFT axis.
fn draw_points<'a, X>(
    mut chart: ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
    report: &pagoda_worker::bench_zipf::ZipfReport,
    x_desc: &str,
) -> Result<()>
where
    X: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("quality (answer-token agreement with recompute)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    for (i, r) in report.results.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let at = (r.ttft_ms_mean.max(1.0), r.quality);
        let size = if r.name.starts_with(pagoda_worker::bench_zipf::EVICPRESS) { 9 } else { 6 };
        chart
            .draw_series(std::iter::once(Circle::new(at, size, color.filled())))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(format!("{} ({:.0} ms, {:.3})", r.name, r.ttft_ms_mean, r.quality))
            .legend(move |(x, y)| Circle::new((x + 8, y), 5, color.filled()));
        chart
            .draw_series(std::iter::once(Text::new(r.name.clone(), at, (FONT, 13).into_font().color(&BLACK))))
            .map_err(|e| anyhow!("{e:?}"))?;
    }
    draw_legend(&mut chart, 13)
}
