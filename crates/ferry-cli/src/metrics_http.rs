//! `--metrics-listen ADDR` of `ferry serve` and `ferry bench`: `GET
//! /metrics` answers the text exposition of Ferry's metrics (encoded by
//! `prometheus-client`), for a Prometheus to scrape.
//!
//! HTTP/1.1 by hyper on the CLI's runtime; one route, no body read, at
//! most [`MAX_CONNECTIONS`] connections at once (more wait in the kernel's
//! backlog), each dropped if its request head takes over
//! [`HEADER_TIMEOUT`]. Anything but `GET`/`HEAD` is `405`, any other path
//! `404`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry::layer::metrics::CONTENT_TYPE;
use ferry::Metrics;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE as CONTENT_TYPE_HEADER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 16;

/// Longest wait for a request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds `addr` and serves `metrics` there on a task of its own for as
/// long as the runtime runs. Returns the bound address (port 0 picks one).
pub async fn start(addr: &str, metrics: Metrics) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
    let bound = listener.local_addr()?;
    tokio::spawn(serve(listener, metrics));
    Ok(bound)
}

async fn serve(listener: TcpListener, metrics: Metrics) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: wait, do not spin.
                tracing::warn!("metrics endpoint: accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = respond(&metrics, &req);
                async move { Ok::<_, Infallible>(response) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(%peer, "metrics endpoint: connection closed: {e}");
            }
            drop(permit);
        });
    }
}

fn respond(metrics: &Metrics, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let status = |code: StatusCode| {
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = code;
        r
    };
    if req.uri().path() != "/metrics" {
        return status(StatusCode::NOT_FOUND);
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = status(StatusCode::METHOD_NOT_ALLOWED);
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let body = if req.method() == Method::HEAD {
        Bytes::new()
    } else {
        Bytes::from(metrics.encode())
    };
    let mut r = Response::new(Full::new(body));
    r.headers_mut()
        .insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(CONTENT_TYPE));
    r
}

#[cfg(all(test, feature = "tcp"))]
mod tests {
    use std::sync::Arc;

    use ferry::{Engine, EngineConfig, RegisteredBuffer, TransferEngine, TransferRequest};
    use prometheus_parse::{Scrape, Value};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// One request on a fresh connection; the whole response.
    async fn get(addr: SocketAddr, method: &str, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn get_metrics_serves_an_exposition_prometheus_parsers_read() {
        let metrics = Metrics::new();
        let open = || async {
            let config = EngineConfig::from_url("tcp://127.0.0.1:0")
                .unwrap()
                .metrics(Some(metrics.clone()));
            Arc::new(Engine::start(config).await.unwrap())
        };
        let (a, b) = (open().await, open().await);
        let src = RegisteredBuffer::new(Arc::clone(&a), 8192).await.unwrap();
        let dst = RegisteredBuffer::new(Arc::clone(&b), 8192).await.unwrap();
        let peer = a.open_segment(b.segment_name()).await.unwrap();
        let requests = [
            TransferRequest::write(src.addr(), dst.addr(), 4096),
            TransferRequest::write(src.addr() + 4096, dst.addr() + 4096, 1000),
        ];
        a.batch_transfer(peer, &requests, None)
            .await
            .unwrap()
            .into_result()
            .unwrap();

        let addr = start("127.0.0.1:0", metrics.clone()).await.unwrap();
        let response = get(addr, "GET", "/metrics").await;
        let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/openmetrics-text"),
            "{head}"
        );
        let scrape = Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).unwrap();
        let bytes: Vec<f64> = scrape
            .samples
            .iter()
            .filter(|s| {
                s.metric == "ferry_transfer_bytes_total"
                    && s.labels.get("engine") == Some(a.segment_name())
                    && s.labels.get("peer") == Some(b.segment_name())
                    && s.labels.get("op") == Some("write")
            })
            .map(|s| match s.value {
                Value::Counter(v) | Value::Untyped(v) => v,
                ref other => panic!("not a counter: {other:?}"),
            })
            .collect();
        assert_eq!(bytes, [5096.0]);
        let requests = scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == "ferry_transfer_requests_total"
                    && s.labels.get("engine") == Some(a.segment_name())
                    && s.labels.get("result") == Some("ok")
            })
            .map(|s| match s.value {
                Value::Counter(v) | Value::Untyped(v) => v,
                ref other => panic!("not a counter: {other:?}"),
            });
        assert_eq!(requests, Some(2.0));

        assert!(get(addr, "GET", "/").await.starts_with("HTTP/1.1 404"));
        let post = get(addr, "POST", "/metrics").await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    }
}
