//! The PNG chart of `pagoda bench eviction`: generated tokens/s against KV budget per policy, and the largest
//! running batch against budget, each with full cache as a horizontal reference line.
//!
//! Drawing lives in the binary so that the worker library does not carry a plotting stack. Text is rendered with
//! an embedded font (Noto Sans through ab_glyph) rather than system fonts, so the chart renders the same on any
//! machine, CI included.

use std::path::Path;
use std::sync::Once;

use anyhow::{Context, Result, anyhow};
use pagoda_worker::bench_eviction::{ConfigResult, EvictionReport};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

pub(crate) const FONT: &str = "sans-serif";

/// Tableau 10 without its grey: distinct on white, unlike the pale yellows a generic palette hands out.
pub(crate) const COLORS: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The legend of every chart here: the series labels in the lower right, on a translucent white box.
pub(crate) fn draw_legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    font_size: u32,
) -> Result<()> {
    draw_legend_at(chart, font_size, SeriesLabelPosition::LowerRight)
}

/// [`draw_legend`] at another position (for charts whose lines run along the bottom).
pub(crate) fn draw_legend_at<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    font_size: u32,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .label_font((FONT, font_size))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))
}

pub(crate) fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| {
        res = plotters::style::register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR)
            .map_err(|_| anyhow!("the embedded Noto Sans font does not parse"));
    });
    res
}

/// One panel: a metric per configuration.
struct Panel<'a> {
    title: &'a str,
    y_label: &'a str,
    /// Decimals on the y axis (the batch is an integer).
    y_decimals: usize,
    value: fn(&ConfigResult) -> f64,
}

/// Policies often tie (every budget that the pool admits alike gives the same batch), and a tied line hides the
/// one under it: each policy's points are shifted by this factor on the log x axis, centred on the true budget.
const DODGE: f64 = 0.025;

/// Draws the two panels into a PNG at `path`.
pub fn draw_eviction(report: &EvictionReport, path: &Path) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(path, (1400, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let o = &report.options;
    let title = format!(
        "{}: {} requests of {}+{} tokens on a pool for {} full sequences ({} threads)",
        report.model, o.requests, o.prompt_tokens, o.new_tokens, o.pool_seqs, report.threads
    );
    let root = root.titled(&title, (FONT, 22)).map_err(|e| anyhow!("{e}"))?;
    let panels = root.split_evenly((1, 2));
    let specs = [
        Panel { title: "Generated tokens/s", y_label: "tokens/s", y_decimals: 1, value: |r| r.tokens_per_s },
        Panel { title: "Largest running batch", y_label: "sequences", y_decimals: 0, value: |r| r.peak_running as f64 },
    ];
    for (area, spec) in panels.iter().zip(&specs) {
        draw_panel(area, report, spec)?;
    }
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    report: &EvictionReport,
    panel: &Panel<'_>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let mut budgets: Vec<f64> = report.results.iter().filter_map(|r| r.budget_tokens).map(|b| b as f64).collect();
    budgets.sort_by(f64::total_cmp);
    budgets.dedup();
    let (x_min, x_max) = match (budgets.first(), budgets.last()) {
        (Some(&a), Some(&b)) if b > a => (a / 1.3, b * 1.3),
        (Some(&a), _) => (a / 2.0, a * 2.0),
        _ => (16.0, 1024.0),
    };
    let full = report.full().map(panel.value);
    let y_top = report.results.iter().map(panel.value).fold(0.0, f64::max).max(1.0) * 1.2;
    let x_axis = (x_min..x_max).log_scale().with_key_points(budgets.clone());
    draw_chart(area, panel, x_axis, y_top, report, full, (x_min, x_max))
}

fn draw_chart<DB, X>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel<'_>,
    x_axis: X,
    y_top: f64,
    report: &EvictionReport,
    full: Option<f64>,
    (x_min, x_max): (f64, f64),
) -> Result<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    X: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e:?}");
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, (FONT, 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x_axis, 0.0..y_top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("KV budget (tokens per layer and kv-head, log scale; points dodged per policy)")
        .y_desc(panel.y_label)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.*}", panel.y_decimals))
        // An integer axis gets at most one label per unit, so that rounding never repeats a label.
        .y_labels(if panel.y_decimals == 0 { (y_top as usize + 1).clamp(2, 11) } else { 10 })
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(err)?;
    if let Some(f) = full {
        chart
            .draw_series(DashedLineSeries::new([(x_min, f), (x_max, f)], 10, 6, BLACK.stroke_width(2)))
            .map_err(err)?
            .label(format!("full cache ({f:.*})", panel.y_decimals))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.stroke_width(2)));
    }
    let mut kinds: Vec<&str> = Vec::new();
    for r in report.results.iter().filter(|r| r.budget_tokens.is_some()) {
        if !kinds.contains(&r.policy.as_str()) {
            kinds.push(&r.policy);
        }
    }
    let mid = (kinds.len() as f64 - 1.0) / 2.0;
    for (i, kind) in kinds.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let dodge = (1.0 + DODGE).powf(i as f64 - mid);
        let mut points: Vec<(f64, f64)> = report
            .results
            .iter()
            .filter(|r| r.policy == *kind)
            .filter_map(|r| r.budget_tokens.map(|b| (b as f64 * dodge, (panel.value)(r))))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(*kind)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(err)?;
    }
    draw_legend(&mut chart, 14)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_worker::bench_eviction::EvictionBenchOptions;

    fn row(policy: &str, budget: Option<usize>, tps: f64, peak: u64) -> ConfigResult {
        ConfigResult {
            policy: policy.into(),
            budget_tokens: budget,
            requests: 4,
            completed: 4,
            short_requests: 0,
            generated_tokens: 64,
            seconds: 1.0,
            tokens_per_s: tps,
            tokens_per_s_runs: vec![tps],
            computed_tokens: 1,
            peak_running: peak,
            steps: 16,
            mean_batch: 4.0,
            ttft_ms_p50: 1.0,
            ttft_ms_p99: 2.0,
            tpot_ms_p50: 1.0,
            tpot_ms_p99: 2.0,
            blocks_total: 10,
            peak_blocks_used: 10,
            peak_pool_frac: 1.0,
            preemptions: 0,
            evicted_blocks: 0,
            evicted_slots: 0,
            tokens_per_s_vs_full: None,
            concurrency_vs_full: None,
        }
    }

    #[test]
    fn draws_a_png() {
        let report = EvictionReport {
            model: "m".into(),
            model_path: "m.gguf".into(),
            backend: "cpu".into(),
            threads: 2,
            group_blocks: 90,
            kv_blocks: 900,
            prompt_source: "test".into(),
            results: vec![
                row("full", None, 30.0, 2),
                row("snapkv", Some(128), 50.0, 6),
                row("snapkv", Some(256), 40.0, 4),
                row("streaming", Some(128), 55.0, 7),
                row("streaming", Some(256), 42.0, 4),
            ],
            peak_rss_bytes: 0,
            options: EvictionBenchOptions::default(),
        };
        let dir = std::env::temp_dir().join(format!("pagoda-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("eviction.png");
        draw_eviction(&report, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 10_000, "a chart with text and lines, not a blank image: {} bytes", bytes.len());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
