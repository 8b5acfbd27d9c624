//! A client for the relay's admin API (`/api/v1/`), for the console tests.

use serde_json::Value;

pub struct Admin {
    http: reqwest::Client,
    pub base: String,
}

/// A reply: the status and the body as JSON (`Value::Null` when it is not JSON).
pub type Reply = (u16, Value);

impl Admin {
    /// The API of the relay whose HTTP server is at `addr` (`host:port`).
    pub fn new(addr: &str) -> Admin {
        Admin {
            http: reqwest::Client::new(),
            base: format!("http://{addr}"),
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Reply {
        let response = request.send().await.expect("the relay answers");
        let status = response.status().as_u16();
        let bytes = response.bytes().await.expect("a body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(self.http.get(format!("{}{path}", self.base)))
            .await
    }

    /// The body as text, whatever it is.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("the relay answers");
        let status = response.status().as_u16();
        (status, response.text().await.expect("a body"))
    }

    /// `POST path` with `body` (sent as it is) and, when given, the bearer token.
    pub async fn post(&self, path: &str, body: &str, token: Option<&str>) -> Reply {
        let mut request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        self.send(request).await
    }

    /// `GET /api/v1/status`, which must succeed.
    pub async fn status(&self) -> Value {
        let (code, body) = self.get("/api/v1/status").await;
        assert_eq!(code, 200, "status: {body}");
        body
    }
}
