//! A small W3C WebDriver client over HTTP (reqwest) for the browser tests: it starts Debian's `chromedriver` on a
//! free loopback port, opens one headless Chromium session, and offers the few commands the tests need
//! (navigate, find, text, type, click, run a script, screenshot). Dropping the [`Browser`] ends the session and
//! kills the chromedriver process group it started (chromedriver and the Chromium it launched), and nothing else.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use base64::Engine as _;
use serde_json::{Value, json};

/// Where Debian's `chromium` and `chromium-driver` packages put their binaries.
pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// The W3C key of a found element in a WebDriver answer.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// Fails with installation instructions when Chromium or chromedriver is missing: the browser tests must not
/// silently skip.
pub fn require_chromium() -> Result<(PathBuf, PathBuf)> {
    let missing: Vec<&str> = [CHROMIUM, CHROMEDRIVER].into_iter().filter(|p| !Path::new(p).is_file()).collect();
    if !missing.is_empty() {
        bail!(
            "{} missing: the dashboard browser test needs Debian's headless Chromium. Install it with \
             `apt-get install -y chromium chromium-driver` (scripts/test.sh does this).",
            missing.join(" and ")
        );
    }
    Ok((PathBuf::from(CHROMIUM), PathBuf::from(CHROMEDRIVER)))
}

/// One headless Chromium session driven through chromedriver.
pub struct Browser {
    driver: Child,
    http: reqwest::Client,
    /// `http://127.0.0.1:<port>/session/<id>`.
    session: String,
    profile: PathBuf,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a fresh profile and a `width`×`height` window.
    pub async fn start(width: u32, height: u32) -> Result<Browser> {
        let (chromium, chromedriver) = require_chromium()?;
        let port = crate::free_port()?;
        let profile = std::env::temp_dir().join(format!("pagoda-chromium-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&profile).with_context(|| format!("create {}", profile.display()))?;
        let mut cmd = Command::new(&chromedriver);
        cmd.arg(format!("--port={port}")).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // Its own process group, so that the drop can end chromedriver and the browser it started together.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let driver = cmd.spawn().with_context(|| format!("spawn {}", chromedriver.display()))?;
        let http = reqwest::Client::builder().timeout(COMMAND_TIMEOUT).build()?;
        let base = format!("http://127.0.0.1:{port}");
        let mut browser = Browser { driver, http, session: String::new(), profile };
        browser.wait_driver(&base, Duration::from_secs(30)).await?;
        let args = [
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            "--hide-scrollbars".into(),
            format!("--window-size={width},{height}"),
            format!("--user-data-dir={}", browser.profile.display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "pageLoadStrategy": "normal",
            "timeouts": {"pageLoad": 30_000, "script": 10_000, "implicit": 0},
            "goog:chromeOptions": {"binary": chromium, "args": args},
        }}});
        let v = browser.call(reqwest::Method::POST, &format!("{base}/session"), Some(caps)).await?;
        let id = v["sessionId"].as_str().ok_or_else(|| anyhow!("no session id in {v}"))?;
        browser.session = format!("{base}/session/{id}");
        Ok(browser)
    }

    async fn wait_driver(&mut self, base: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.driver.try_wait()? {
                bail!("chromedriver exited ({status}) before it was ready");
            }
            if let Ok(r) = self.http.get(format!("{base}/status")).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == true
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("chromedriver not ready within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One WebDriver command; returns its `value`, or the WebDriver error as an error.
    async fn call(&self, method: reqwest::Method, url: &str, body: Option<Value>) -> Result<Value> {
        let mut req = self.http.request(method.clone(), url);
        if let Some(b) = body {
            req = req.json(&b);
        } else if method == reqwest::Method::POST {
            req = req.json(&json!({}));
        }
        let r = req.send().await.with_context(|| format!("WebDriver {method} {url}"))?;
        let status = r.status();
        let v: Value = r.json().await.with_context(|| format!("WebDriver {method} {url}: answer is not JSON"))?;
        if !status.is_success() {
            bail!("WebDriver {method} {url}: {status}: {}", v["value"]);
        }
        Ok(v["value"].clone())
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value> {
        self.call(reqwest::Method::POST, &format!("{}{path}", self.session), Some(body)).await
    }

    async fn get(&self, path: &str) -> Result<Value> {
        self.call(reqwest::Method::GET, &format!("{}{path}", self.session), None).await
    }

    /// Navigates and waits for the page to load.
    pub async fn goto(&self, url: &str) -> Result<()> {
        self.post("/url", json!({"url": url})).await.map(drop)
    }

    pub async fn current_url(&self) -> Result<String> {
        Ok(self.get("/url").await?.as_str().unwrap_or_default().to_string())
    }

    /// The first element matching `css`, if any.
    pub async fn find(&self, css: &str) -> Result<Option<String>> {
        let found = self.post("/elements", json!({"using": "css selector", "value": css})).await?;
        Ok(found.as_array().and_then(|a| a.first()).and_then(|e| e[ELEMENT_KEY].as_str()).map(str::to_string))
    }

    async fn must_find(&self, css: &str) -> Result<String> {
        self.find(css).await?.ok_or_else(|| anyhow!("no element matches `{css}`"))
    }

    /// The rendered text of the first element matching `css`.
    pub async fn text(&self, css: &str) -> Result<String> {
        let id = self.must_find(css).await?;
        Ok(self.get(&format!("/element/{id}/text")).await?.as_str().unwrap_or_default().to_string())
    }

    /// Types `text` into the first element matching `css`.
    pub async fn type_into(&self, css: &str, text: &str) -> Result<()> {
        let id = self.must_find(css).await?;
        self.post(&format!("/element/{id}/clear"), json!({})).await?;
        self.post(&format!("/element/{id}/value"), json!({"text": text})).await.map(drop)
    }

    pub async fn click(&self, css: &str) -> Result<()> {
        let id = self.must_find(css).await?;
        self.post(&format!("/element/{id}/click"), json!({})).await.map(drop)
    }

    /// Runs `script` (a function body) in the page and returns what it returns.
    pub async fn execute(&self, script: &str) -> Result<Value> {
        self.post("/execute/sync", json!({"script": script, "args": []})).await
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Result<Vec<u8>> {
        let b64 = self.get("/screenshot").await?;
        let b64 = b64.as_str().ok_or_else(|| anyhow!("screenshot is not a string"))?;
        base64::engine::general_purpose::STANDARD.decode(b64).context("screenshot is not base64")
    }

    /// Polls `check` every 200 ms until it returns `Some`, or fails after `timeout` with `what`.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, timeout: Duration, mut check: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>>>,
    {
        let deadline = Instant::now() + timeout;
        let mut last_err = None;
        loop {
            match check().await {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => last_err = Some(e),
            }
            if Instant::now() > deadline {
                let why = last_err.map(|e| format!(" (last error: {e:#})")).unwrap_or_default();
                bail!("timed out after {timeout:?} waiting for {what}{why}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Ends the session (closing Chromium) and stops chromedriver.
    pub async fn quit(mut self) -> Result<()> {
        let url = std::mem::take(&mut self.session);
        if !url.is_empty() {
            self.call(reqwest::Method::DELETE, &url, None).await?;
        }
        Ok(())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The process group chromedriver leads (see `start`): chromedriver and the Chromium processes it launched.
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
