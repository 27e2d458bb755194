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
    let title = format!(
        "TTFT vs quality: {} contexts of {}-{} tokens, {} requests, Zipf({}) ({})",
        o.contexts, o.min_tokens, o.max_tokens, o.requests, o.zipf_s, report.model
    );
    let x_max = report.results.iter().map(|r| r.ttft_ms_mean).fold(0.0, f64::max).max(1.0) * 1.15;
    let y_min = report.results.iter().map(|r| r.quality).fold(1.0, f64::min).min(0.9) - 0.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 18))
        .margin(18)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, y_min.max(0.0)..1.02)
        .map_err(|e| anyhow!("{e:?}"))?;
    chart
        .configure_mesh()
        .x_desc("mean time to first token (ms)")
        .y_desc("quality (answer-token agreement with recompute)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    for (i, r) in report.results.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let at = (r.ttft_ms_mean, r.quality);
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
    draw_legend(&mut chart, 13)?;
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
