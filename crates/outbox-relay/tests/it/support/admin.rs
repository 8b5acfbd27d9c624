//! A client for the relay's admin API (`/api/v1/`), for the console tests.

use serde_json::Value;

pub struct Admin {
    http: reqwest::Client,
    pub base: String,
    /// Sent with every read (`post` takes its own).
    token: Option<String>,
}

/// A reply: the status and the body as JSON (`Value::Null` when it is not JSON).
pub type Reply = (u16, Value);

impl Admin {
    /// The API of the relay whose HTTP server is at `addr` (`host:port`).
    pub fn new(addr: &str) -> Admin {
        Admin {
            http: reqwest::Client::new(),
            base: format!("http://{addr}"),
            token: None,
        }
    }

    /// The same, reading with the admin token.
    pub fn with_token(addr: &str, token: Option<&str>) -> Admin {
        Admin {
            token: token.map(String::from),
            ..Admin::new(addr)
        }
    }

    fn read(&self, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.get(format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.header("authorization", format!("Bearer {token}")),
            None => request,
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
        self.send(self.read(path)).await
    }

    /// `GET path` with exactly this `Authorization` header (none with `None`).
    pub async fn get_authorized(&self, path: &str, authorization: Option<&str>) -> Reply {
        let mut request = self.http.get(format!("{}{path}", self.base));
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        self.send(request).await
    }

    /// The body as text, whatever it is.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let response = self.read(path).send().await.expect("the relay answers");
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
