//! The PNG chart of `pagoda bench kernels`: decode-attention bandwidth (GB/s of K and V read) against context
//! length, one panel per batch size and one line per KV format, with the machine's copy bandwidth dashed as the
//! ceiling.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use pagoda_kernels::attention_bench::AttnBenchPoint;
use plotters::prelude::*;

use crate::bench_plot::{COLORS, FONT, draw_legend_at, register_font};

/// Draws `points` (every batch × context × format of one run) to `path`; `title` names the device and shape.
pub fn draw_kernels(points: &[AttnBenchPoint], copy_bytes_per_s: f64, title: &str, path: &Path) -> Result<()> {
    register_font()?;
    let mut batches: Vec<usize> = points.iter().map(|p| p.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let mut contexts: Vec<f64> = points.iter().map(|p| p.context as f64).collect();
    contexts.sort_by(f64::total_cmp);
    contexts.dedup();
    let (Some(&x_lo), Some(&x_hi)) = (contexts.first(), contexts.last()) else {
        return Err(anyhow!("nothing to plot: the report has no points"));
    };
    let (x_min, x_max) = if x_hi > x_lo { (x_lo / 1.2, x_hi * 1.2) } else { (x_lo / 2.0, x_lo * 2.0) };
    let mut formats: Vec<&str> = Vec::new();
    for p in points {
        if !formats.contains(&p.format.as_str()) {
            formats.push(&p.format);
        }
    }
    let copy = copy_bytes_per_s / 1e9;
    let y_top = points.iter().map(|p| p.bytes_per_s / 1e9).fold(copy, f64::max) * 1.1;
    let width = (520 * batches.len()).clamp(600, 2200) as u32;
    let root = BitMapBackend::new(path, (width, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let root = root.titled(title, (FONT, 20)).map_err(|e| anyhow!("{e}"))?;
    for (area, &batch) in root.split_evenly((1, batches.len())).iter().zip(&batches) {
        let err = |e: DrawingAreaErrorKind<_>| anyhow!("{e:?}");
        let mut chart = ChartBuilder::on(area)
            .caption(format!("batch {batch}"), (FONT, 18))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d((x_min..x_max).log_scale().with_key_points(contexts.clone()), 0.0..y_top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("context (tokens, log scale)")
            .y_desc("GB/s of K and V read")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new([(x_min, copy), (x_max, copy)], 10, 6, BLACK.stroke_width(2)))
            .map_err(err)?
            .label(format!("memory copy ({copy:.1} GB/s)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.stroke_width(2)));
        for (i, f) in formats.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let mut line: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.batch == batch && p.format == *f)
                .map(|p| (p.context as f64, p.bytes_per_s / 1e9))
                .collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(f.to_string())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
            chart.draw_series(line.into_iter().map(|at| Circle::new(at, 4, color.filled()))).map_err(err)?;
        }
        // The slow formats run along the bottom and the copy line across the top: the legend goes between.
        draw_legend_at(&mut chart, 12, SeriesLabelPosition::MiddleRight)?;
    }
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
