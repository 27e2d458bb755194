//! End-to-end test of the operator dashboard (`/dashboard`) in Debian's headless Chromium, driven over W3C
//! WebDriver, against the real `pagoda up` binary with an admin key and the real model: the page and its JSON refuse
//! a missing or wrong admin key (401), the login trades the key for an HttpOnly SameSite=Strict cookie, and the
//! numbers on the page follow live chat traffic (requests answered, KV blocks held, placement decisions, latency
//! charts, prefix hits).
//!
//! Chromium must be installed (`apt-get install -y chromium chromium-driver`; scripts/test.sh does it): without it
//! the test fails, it does not skip. `PAGODA_UPDATE_SCREENSHOT=1` also writes the screenshot to docs/dashboard.png.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use common::{chat, river_log_prompt, start_up};
use pagoda_e2e::reqwest;
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::webdriver::{Browser, require_chromium};

const ADMIN: &str = "sk-admin-dashboard-0123456789";
const WRONG: &str = "sk-admin-dashboard-0123456780";
/// Long enough to fill several 16-token blocks, so that later requests hit the cached prefix.
const SYSTEM: &str = "You are a terse assistant for a railway timetable office. Answer every question in one short \
                      sentence, never mention that you are an assistant, and prefer numbers to words whenever a \
                      number answers the question.";

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("pagoda-dash-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn write(&self, name: &str, text: &str) -> String {
        let p = self.0.join(name);
        std::fs::File::create(&p).unwrap().write_all(text.as_bytes()).unwrap();
        p.to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An HTTP client that shows redirects instead of following them.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

async fn get(c: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = c.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = r.status().as_u16();
    let h = r.headers().clone();
    (status, h, r.text().await.unwrap())
}

async fn post_login(c: &reqwest::Client, base: &str, key: &str) -> (u16, reqwest::header::HeaderMap, String) {
    let r = c
        .post(format!("{base}/dashboard/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("key={key}"))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let h = r.headers().clone();
    (status, h, r.text().await.unwrap())
}

/// Checks the refusals and the login over plain HTTP; returns the session cookie (`name=value`).
async fn check_access_over_http(base: &str) -> String {
    let c = client();
    let page = format!("{base}/dashboard");
    let api = format!("{base}/dashboard/api/state");
    let bearer_wrong = format!("Bearer {WRONG}");
    let bearer_admin = format!("Bearer {ADMIN}");
    let forged = "pagoda_dashboard=4102444800.0000000000000000000000000000000000000000000000000000000000000000";

    let (s, h, body) = get(&c, &page, &[]).await;
    assert_eq!(s, 401, "page without a key: {body}");
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"), "{h:?}");
    assert!(body.contains("id=\"login-form\"") && !body.contains("id=\"requests-total\""), "{body}");
    assert!(h["content-security-policy"].to_str().unwrap().contains("frame-ancestors 'none'"));
    for (case, header) in
        [("wrong bearer", ("authorization", bearer_wrong.as_str())), ("forged cookie", ("cookie", forged))]
    {
        let (s, _, body) = get(&c, &page, &[header]).await;
        assert_eq!(s, 401, "page with a {case}: {body}");
        assert!(body.contains("id=\"login-form\""), "{case}: {body}");
    }
    for (case, headers) in [
        ("no key", vec![]),
        ("wrong bearer", vec![("authorization", bearer_wrong.as_str())]),
        ("forged cookie", vec![("cookie", forged)]),
        ("garbage cookie", vec![("cookie", "pagoda_dashboard=x.y; other=1")]),
    ] {
        let (s, h, body) = get(&c, &api, &headers).await;
        assert_eq!(s, 401, "state JSON with {case}: {body}");
        let v: Value = pagoda_e2e::serde_json::from_str(&body).unwrap_or_else(|e| panic!("{case}: {e}: {body}"));
        assert_eq!(v["error"]["code"], "invalid_api_key", "{case}: {v}");
        assert_eq!(h["www-authenticate"], "Bearer", "{case}");
    }

    let (s, h, body) = get(&c, &api, &[("authorization", &bearer_admin)]).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(h["cache-control"], "no-store");
    let v: Value = pagoda_e2e::serde_json::from_str(&body).unwrap();
    assert_eq!(v["workers"][0]["ready"], true, "{v}");
    assert_eq!(v["workers"][0]["role"], "both", "{v}");
    assert_eq!(v["workers"][0]["scheduling"], "fcfs", "the worker's Health says how it orders requests: {v}");
    assert_eq!(v["workers"][0]["lora_adapters"], json!([]), "{v}");
    assert_eq!(v["timeline"]["window_s"], 5, "{v}");

    let (s, h, body) = post_login(&c, base, WRONG).await;
    assert_eq!(s, 401, "{body}");
    assert!(h.get("set-cookie").is_none(), "a wrong key got a cookie: {h:?}");
    assert!(body.contains("Wrong admin key"), "{body}");

    let (s, h, _) = post_login(&c, base, ADMIN).await;
    assert_eq!(s, 303);
    assert_eq!(h["location"], "/dashboard");
    let set = h["set-cookie"].to_str().unwrap().to_string();
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/dashboard", "Max-Age=43200"] {
        assert!(set.contains(attr), "cookie lacks {attr}: {set}");
    }
    assert!(!set.contains(ADMIN), "the cookie holds the admin key: {set}");
    let cookie = set.split(';').next().unwrap().trim().to_string();
    let (s, _, body) = get(&c, &api, &[("cookie", &cookie)]).await;
    assert_eq!(s, 200, "state JSON with the session cookie: {body}");
    let (s, _, body) = get(&c, &page, &[("cookie", &cookie)]).await;
    assert_eq!(s, 200, "{body}");
    assert!(body.contains("id=\"requests-total\""), "{body}");
    let (s, h, _) = get(&c, &format!("{base}/dashboard/dashboard.js"), &[]).await;
    assert_eq!(s, 200);
    assert!(h["content-type"].to_str().unwrap().starts_with("text/javascript"));
    cookie
}

/// An integer shown on the page ("1,234" → 1234).
async fn number(b: &Browser, css: &str) -> anyhow::Result<u64> {
    let text = b.text(css).await?;
    let digits: String = text.chars().filter(char::is_ascii_digit).collect();
    digits.parse().map_err(|_| anyhow::anyhow!("`{css}` shows {text:?}, not a number"))
}

/// The URL and the start of the page's text, for failure messages.
async fn page_summary(b: &Browser) -> String {
    let url = b.current_url().await.unwrap_or_else(|e| format!("(no URL: {e})"));
    let text = b.execute("return document.documentElement.outerHTML.slice(0, 2000)").await;
    format!("{url}: {}", text.map(|v| v.to_string()).unwrap_or_else(|e| e.to_string()))
}

async fn script_u64(b: &Browser, script: &str) -> anyhow::Result<u64> {
    let v = b.execute(script).await?;
    v.as_u64().or_else(|| v.as_str().and_then(|s| s.parse().ok())).ok_or_else(|| anyhow::anyhow!("{script}: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_chromium_follows_live_traffic() {
    // Fail first, and clearly, when the browser is missing.
    require_chromium().unwrap();
    let dir = TempDir::new("admin");
    let admin_file = dir.write("admin.txt", &format!("# dashboard test admin key\n{ADMIN}\n"));
    // EvicPress places the host tier, so that its panel has a worker to show.
    let args =
        ["--admin-key-file", admin_file.as_str(), "--tier-placement", "evicpress", "--evicpress-keep-ratios", "none"];
    let up = start_up("dashboard", &args).await.unwrap();
    let base = up.http.base.clone();
    check_access_over_http(&base).await;

    let browser = Browser::start(1400, 1500).await.unwrap();
    let b = &browser;
    let page = format!("{base}/dashboard");

    // The login page, a wrong key, then the right one.
    b.goto(&page).await.unwrap();
    let login = b.text("#login-message").await;
    assert!(login.as_ref().is_ok_and(|m| m.contains("admin key")), "{login:?} on {}", page_summary(b).await);
    b.type_into("#admin-key", WRONG).await.unwrap();
    b.click("#login-submit").await.unwrap();
    let msg = b
        .wait_for("the wrong-key message", Duration::from_secs(10), || async {
            let m = b.text("#login-message").await?;
            Ok(m.contains("Wrong admin key").then_some(m))
        })
        .await
        .unwrap();
    assert!(b.find("#requests-total").await.unwrap().is_none(), "{msg}");
    b.type_into("#admin-key", ADMIN).await.unwrap();
    b.click("#login-submit").await.unwrap();
    b.wait_for("the dashboard's first update", Duration::from_secs(20), || async {
        Ok((script_u64(b, "return document.body.dataset.polls").await? >= 1).then_some(()))
    })
    .await
    .unwrap();
    assert!(b.current_url().await.unwrap().ends_with("/dashboard"));
    assert_eq!(b.execute("return document.cookie").await.unwrap(), json!(""), "the session cookie is HttpOnly");
    assert_eq!(b.text("#workers-ready").await.unwrap(), "1 / 1");
    let workers = b.text("#workers").await.unwrap();
    assert!(workers.contains(&up.worker) && workers.contains("fcfs"), "the worker's address and scheduling: {workers}");
    // `pagoda up` embeds a one-voter kvstore: the panel shows it as its own leader.
    b.wait_for("the embedded kvstore's leader", Duration::from_secs(20), || async {
        Ok(b.text("#kvstore").await?.contains("leader node").then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(b.text("#strategy").await.unwrap(), "kv");

    let requests_before = number(b, "#requests-total").await.unwrap();
    let held_before = number(b, "#kv-blocks-held").await.unwrap();
    let placements_before = number(b, "#placements-total").await.unwrap();
    eprintln!("before: requests {requests_before}, blocks held {held_before}, placements {placements_before}");

    // Live traffic: chats sharing a long system prompt (so later ones hit the cached prefix), one streamed.
    let questions = ["How many minutes are in two hours?", "How many days are in a week?", "How many legs has a cat?"];
    let mut last_id = String::new();
    for (i, q) in questions.iter().enumerate() {
        let body = json!({
            "model": pagoda_e2e::MODEL_ID,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            "max_tokens": 12, "temperature": 0, "stream": i == 1,
        });
        let r = up.http.client.post(up.http.url("/v1/chat/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        if i != 1 {
            let v: Value = pagoda_e2e::serde_json::from_str(&text).unwrap();
            last_id = v["id"].as_str().unwrap().to_string();
        }
    }
    let (s, v) = up.http.post_json("/v1/chat/completions", &chat("Say hi.", json!({"max_tokens": 4}))).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let sent = questions.len() as u64 + 1;

    // The page follows: requests counted, blocks held, the last request's placement shown, latency percentiles.
    let (requests, held, placements) = b
        .wait_for("the page to show the new traffic", Duration::from_secs(30), || async {
            let requests = number(b, "#requests-total").await?;
            let held = number(b, "#kv-blocks-held").await?;
            let placements = number(b, "#placements-total").await?;
            let table = b.text("#placements").await?;
            let done = requests >= requests_before + sent
                && held > held_before
                && placements >= placements_before + sent
                && table.contains(&last_id);
            Ok(done.then_some((requests, held, placements)))
        })
        .await
        .unwrap();
    eprintln!("after: requests {requests}, blocks held {held}, placements {placements}");
    let ttft = b.text("#ttft-p50").await.unwrap();
    assert!(ttft.ends_with("ms") || ttft.ends_with(" s"), "TTFT p50 shows {ttft:?}");
    assert!(script_u64(b, "return document.querySelectorAll('#chart-requests rect').length").await.unwrap() >= 1);
    assert!(script_u64(b, "return document.querySelectorAll('#chart-ttft path').length").await.unwrap() == 3);
    assert!(script_u64(b, "return document.querySelectorAll('#chart-itl path').length").await.unwrap() == 3);
    let tiers = b.text("#tiers").await.unwrap();
    assert!(tiers.contains("device"), "{tiers}");
    // The device tier's codec (named after the KV dtype) has its colour in the legend.
    assert!(script_u64(b, "return document.querySelectorAll('#tiers .legend .swatch').length").await.unwrap() >= 1);
    let device_hits = b
        .execute(
            "const r = [...document.querySelectorAll('#prefix-hits .row')]\
               .find(r => r.firstChild.textContent === 'device'); return r ? r.lastChild.textContent : ''",
        )
        .await
        .unwrap();
    let device_hits = device_hits.as_str().unwrap_or_default();
    assert!(
        device_hits.contains("tok") && !device_hits.starts_with("0 tok"),
        "the shared system prompt should hit the device tier: {device_hits:?}"
    );
    // The worker ran a step per request at least, each computing one sequence or more.
    let workers = b.text("#workers").await.unwrap();
    let batch = workers.split_once(" overall").and_then(|(t, _)| t.rsplit(char::is_whitespace).next());
    assert!(batch.and_then(|b| b.parse::<f64>().ok()).is_some_and(|b| b >= 1.0), "the mean batch: {workers}");
    let placements_text = b.text("#placements").await.unwrap();
    assert!(placements_text.contains("lowest cost"), "{placements_text}");
    // Auth is off: every request is tenant `default`, whose prompt and completion tokens the tenants table counts.
    let tenant_row = b
        .execute("const r = document.querySelector('#tenants tbody tr'); return r ? [...r.cells].map(c => c.textContent) : []")
        .await
        .unwrap();
    let cells: Vec<&str> = tenant_row.as_array().unwrap().iter().filter_map(|c| c.as_str()).collect();
    assert_eq!(cells.first().copied(), Some("default"), "{cells:?}");
    let count = |s: &str| s.replace(',', "").parse::<u64>().unwrap_or(0);
    assert!(count(cells[1]) > 0 && count(cells[2]) >= sent, "{cells:?}");

    // A long context is profiled while the worker is idle, on the training query its request gave; the EvicPress
    // panel shows the profile and a quality bar per variant measured.
    let training = json!({"profile_queries": ["Which entry mentions 10 stones?"]});
    let (s, v) = up
        .http
        .post_json("/v1/chat/completions", &chat(&river_log_prompt(), json!({"max_tokens": 2, "kv": training})))
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    let evicpress = b
        .wait_for("the EvicPress panel to show a profile", Duration::from_secs(90), || async {
            let bars = script_u64(b, "return document.querySelectorAll('#evicpress .row').length").await?;
            let text = b.text("#evicpress").await?;
            // The lossless native variant's bar is there from the start (quality 1 by definition); a codec's
            // appears once a profile measured it.
            let own = text
                .split_once(" on the contexts' own queries")
                .and_then(|(t, _)| t.rsplit(char::is_whitespace).next());
            let profiled_on_its_query = own.and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 1);
            Ok((bars >= 2 && text.contains(&up.worker) && profiled_on_its_query).then_some(text))
        })
        .await
        .unwrap();
    assert!(evicpress.contains("profiles"), "{evicpress}");
    assert!(evicpress.contains("embedding similarity"), "a codec's bar gives both scores: {evicpress}");

    let png = b.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "{} bytes", png.len());
    if std::env::var("PAGODA_UPDATE_SCREENSHOT").is_ok_and(|v| v == "1") {
        let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/dashboard.png");
        std::fs::write(&out, &png).unwrap();
        eprintln!("wrote {}", out.display());
    }

    // Logging out ends the session in the browser: the page asks for the key again.
    b.click("#logout").await.unwrap();
    b.wait_for("the login page after logout", Duration::from_secs(10), || async {
        Ok(b.find("#login-form").await?.map(drop))
    })
    .await
    .unwrap();
    browser.quit().await.unwrap();
}
