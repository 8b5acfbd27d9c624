//! A headless Chromium driven through chromedriver (W3C WebDriver over HTTP): just the
//! commands the console tests use.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use outbox_testkit::eventually;
use serde_json::{json, Value};

/// The key W3C WebDriver names element references by.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

pub struct Browser {
    http: reqwest::Client,
    base: String,
    driver: Child,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session with a 1280x800 window.
    pub async fn start() -> Browser {
        outbox_testkit::install_crypto();
        for program in ["chromium", "chromedriver"] {
            crate::support::installed(program, "Debian's chromium and chromium-driver");
        }
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let mut browser = Browser {
            http,
            base: base.clone(),
            driver,
        };
        let client = browser.http.clone();
        eventually("chromedriver to be ready", Duration::from_secs(30), || {
            let request = client.get(format!("{base}/status")).send();
            async move {
                let body: Value =
                    serde_json::from_slice(&request.await.ok()?.bytes().await.ok()?).ok()?;
                body["value"]["ready"].as_bool()?.then_some(())
            }
        })
        .await;
        let session = browser
            .post(
                "/session",
                json!({"capabilities": {"alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": "/usr/bin/chromium",
                        "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                 "--disable-dev-shm-usage", "--window-size=1280,800"],
                    },
                }}}),
            )
            .await;
        let id = session["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {session}"))
            .to_string();
        browser.base = format!("{base}/session/{id}");
        browser
    }

    fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &Value,
    ) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let response = self
            .request(reqwest::Method::POST, path, &body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("WebDriver {path}: {e}"));
        let status = response.status();
        let value: Value = serde_json::from_slice(&response.bytes().await.unwrap())
            .expect("WebDriver answers JSON");
        assert!(status.is_success(), "WebDriver {path}: {status} {value}");
        value["value"].clone()
    }

    async fn get(&self, path: &str) -> Value {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap_or_else(|e| panic!("WebDriver {path}: {e}"));
        let value: Value = serde_json::from_slice(&response.bytes().await.unwrap())
            .expect("WebDriver answers JSON");
        value["value"].clone()
    }

    pub async fn goto(&self, url: &str) {
        self.post("/url", json!({ "url": url })).await;
    }

    /// Runs `script` (a function body; `arguments` holds `args`) in the page.
    pub async fn execute(&self, script: &str, args: Value) -> Value {
        self.post("/execute/sync", json!({ "script": script, "args": args }))
            .await
    }

    /// The first element matching a CSS selector, if any.
    pub async fn find(&self, css: &str) -> Option<String> {
        let query = json!({ "using": "css selector", "value": css });
        let response = self
            .request(reqwest::Method::POST, "/element", &query)
            .send()
            .await
            .ok()?;
        if !response.status().is_success() {
            return None;
        }
        let value: Value = serde_json::from_slice(&response.bytes().await.ok()?).ok()?;
        value["value"][ELEMENT].as_str().map(String::from)
    }

    /// Waits for an element matching `css`; on timeout, saves a screenshot of the page
    /// as it was (`failed-wait.png` in `shots`) and fails with the page's text.
    pub async fn wait_for(&self, shots: &Path, css: &str) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(element) = self.find(css).await {
                return element;
            }
            if tokio::time::Instant::now() >= deadline {
                self.screenshot(&shots.join("failed-wait.png")).await;
                let text = self
                    .execute("return document.body.innerText;", json!([]))
                    .await;
                panic!("no element {css} on the page after 30s; the page says:\n{text}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A real click, as a user's, on the element matching `css`. The page redraws parts of
    /// itself as it polls, so an element found may be replaced before the click lands
    /// ("stale element reference"): it is found again and clicked again.
    pub async fn click(&self, shots: &Path, css: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let element = self.wait_for(shots, css).await;
            let path = format!("/element/{element}/click");
            let response = self
                .request(reqwest::Method::POST, &path, &json!({}))
                .send()
                .await
                .unwrap_or_else(|e| panic!("WebDriver {path}: {e}"));
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            if status.is_success() {
                return;
            }
            assert!(
                body.contains("stale element") && tokio::time::Instant::now() < deadline,
                "clicking {css}: {status} {body}"
            );
        }
    }

    /// Types into an element, as a user's keyboard does.
    pub async fn type_into(&self, element: &str, text: &str) {
        self.post(
            &format!("/element/{element}/value"),
            json!({ "text": text }),
        )
        .await;
    }

    /// Saves a PNG of the window.
    pub async fn screenshot(&self, path: &Path) {
        use base64::Engine;
        let data = self.get("/screenshot").await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(data.as_str().expect("a base64 screenshot"))
            .expect("base64");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session closes Chromium; then chromedriver goes.
        let session = self.base.clone();
        let http = self.http.clone();
        let ended = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()
                .map(|rt| {
                    rt.block_on(async {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(10),
                            http.delete(session).send(),
                        )
                        .await;
                    })
                })
        });
        let _ = ended.join();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
