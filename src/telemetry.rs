//! The process's tracing subscriber: fmt logging to stderr filtered by `RUST_LOG` (as always), plus, when an OTLP
//! endpoint is configured, an OpenTelemetry layer exporting Pagoda's spans over OTLP/gRPC. Owns the exporter's
//! lifetime: [`Telemetry::shutdown`] flushes what is buffered before the process exits.
//!
//! Configuration is the standard OpenTelemetry environment: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (neither set: no exporter), `OTEL_SERVICE_NAME` (default: `pagoda-<role>`),
//! `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_{HEADERS,TIMEOUT}`.

use std::time::Duration;

use anyhow::{Context, Result};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// The crates whose spans are exported. Everything else (tonic, hyper, h2, the exporter itself) stays out of the
/// traces: their spans would be noise, and the exporter's own would feed back into the exporter.
const TRACED_CRATES: [&str; 4] = ["pagoda", "pagoda_router", "pagoda_worker", "pagoda_proto"];

/// How long shutdown waits for the last batch to reach the collector.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The installed tracing setup. Call [`Telemetry::shutdown`] before exiting; dropping it without does the same.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// Runs the tonic channel the exporter sends on. The batch processor exports from its own thread, and
    /// tonic needs a live runtime under it until the final flush, after the application's runtime is gone.
    runtime: Option<tokio::runtime::Runtime>,
}

/// The OTLP traces endpoint from the environment, if one is set (an empty value counts as unset).
pub fn otlp_endpoint(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .into_iter()
        .filter_map(get)
        .map(|v| v.trim().to_string())
        .find(|v| !v.is_empty())
}

/// Installs the global subscriber and the W3C trace-context propagator. `default_service` names the process in
/// its traces unless `OTEL_SERVICE_NAME` says otherwise.
pub fn init(default_service: &str) -> Result<Telemetry> {
    // Always W3C, so that a process without an exporter still passes a client's trace on when a layer is added.
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let fmt_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(fmt_filter);
    let env = |k: &str| std::env::var(k).ok();
    let Some(endpoint) = otlp_endpoint(env) else {
        tracing_subscriber::registry().with(fmt).try_init().context("cannot install the log subscriber")?;
        return Ok(Telemetry { provider: None, runtime: None });
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .context("cannot start the OTLP exporter's runtime")?;
    let service = env("OTEL_SERVICE_NAME").filter(|s| !s.trim().is_empty()).unwrap_or_else(|| default_service.into());
    let provider = {
        // tonic's lazy channel binds to the runtime it is built in.
        let _guard = runtime.enter();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .build()
            .with_context(|| format!("cannot build the OTLP exporter for {endpoint}"))?;
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name(service.clone()).build())
            .build()
    };
    let tracer = provider.tracer("pagoda");
    let traced = TRACED_CRATES.iter().fold(Targets::new(), |t, c| t.with_target(*c, LevelFilter::INFO));
    let otel = tracing_opentelemetry::layer().with_tracer(tracer).with_filter(traced);
    tracing_subscriber::registry().with(fmt).with(otel).try_init().context("cannot install the log subscriber")?;
    tracing::info!(%endpoint, %service, "exporting traces over OTLP");
    Ok(Telemetry { provider: Some(provider), runtime: Some(runtime) })
}

impl Telemetry {
    /// Exports the spans still buffered and stops the exporter. Blocks for at most a few seconds.
    pub fn shutdown(mut self) {
        self.close();
    }

    fn close(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown_with_timeout(SHUTDOWN_TIMEOUT)
        {
            eprintln!("pagoda: flushing traces failed: {e}");
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_prefers_the_traces_variable_and_ignores_empty_values() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(otlp_endpoint(vars(&[])), None);
        assert_eq!(otlp_endpoint(vars(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])), None);
        assert_eq!(
            otlp_endpoint(vars(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317")])).as_deref(),
            Some("http://a:4317")
        );
        assert_eq!(
            otlp_endpoint(vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://b:4317")
            ]))
            .as_deref(),
            Some("http://b:4317")
        );
        assert_eq!(
            otlp_endpoint(vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
            ]))
            .as_deref(),
            Some("http://a:4317")
        );
    }
}
