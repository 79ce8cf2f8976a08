//! `kerntun run --controller ADDR [--secret S]`: the subset of the Clash
//! HTTP API that web dashboards use (docs/controller.md), served on its own
//! single-threaded runtime on its own thread, never on the engine's.
//!
//! Handlers read the engine through the shared handle `run` keeps
//! (`Arc<RwLock<Engine>>`; only the final stop writes, after the
//! controller stopped). A delay test blocks up to its timeout, so it runs
//! on the runtime's blocking pool, which is bounded.

mod logs;
mod shapes;

pub use logs::LogHub;
pub use shapes::Static;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kerntun::{Engine, LatencyError, SelectionError};
use serde::Deserialize;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, oneshot};

use shapes::{History, message};

/// Largest request body (a `PUT /configs` payload is a whole config).
const BODY_LIMIT: usize = 1 << 20;
/// Streams (`/traffic`, `/logs`, `/connections` as a stream) open at once;
/// one more is refused with 503.
const MAX_STREAMS: usize = 32;
/// A delay test's timeout is capped at this.
const MAX_DELAY_TIMEOUT: Duration = Duration::from_secs(10);
/// A delay test's timeout when the request names none.
const DEFAULT_DELAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Threads for delay tests (each blocks up to its timeout).
const BLOCKING_THREADS: usize = 4;
/// How often streams send.
const TICK: Duration = Duration::from_secs(1);

/// Where and how the controller listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub listen: SocketAddr,
    pub secret: Option<String>,
}

/// The `[controller]` section of the command's config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Section {
    pub listen: Option<SocketAddr>,
    pub secret: Option<String>,
}

impl Settings {
    /// The flags over the config file's section; `None` when neither sets
    /// an address. Refuses a non-loopback address without a secret, and an
    /// empty secret.
    pub fn resolve(
        flag_listen: Option<SocketAddr>,
        flag_secret: Option<String>,
        section: Option<Section>,
    ) -> Result<Option<Settings>, String> {
        let section = section.unwrap_or_default();
        let Some(listen) = flag_listen.or(section.listen) else {
            if flag_secret.is_some() {
                return Err("--secret needs --controller (or [controller] listen)".into());
            }
            return Ok(None);
        };
        let secret = flag_secret.or(section.secret);
        if secret.as_deref() == Some("") {
            return Err("controller: the secret is empty".into());
        }
        if secret.is_none() && !listen.ip().is_loopback() {
            return Err(format!(
                "controller: {listen} is not a loopback address; anyone who reaches it could \
                 switch proxies and close connections, so it needs a secret (--secret or \
                 [controller] secret)"
            ));
        }
        Ok(Some(Settings { listen, secret }))
    }
}

/// The tracing filter `PATCH /configs` changes, as `run` set it up.
pub type LevelHandle = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Everything the handlers share.
struct Shared {
    engine: Arc<RwLock<Engine>>,
    st: RwLock<Static>,
    history: Arc<History>,
    logs: LogHub,
    /// The level `PATCH /configs` set last (what `GET /configs` shows).
    level: RwLock<String>,
    set_level: LevelHandle,
    secret: Option<Vec<u8>>,
    streams: Arc<Semaphore>,
    prepare: Prepare,
}

impl Shared {
    fn engine(&self) -> RwLockReadGuard<'_, Engine> {
        self.engine.read().unwrap_or_else(|p| p.into_inner())
    }

    fn st(&self) -> RwLockReadGuard<'_, Static> {
        self.st.read().unwrap_or_else(|p| p.into_inner())
    }
}

type S = State<Arc<Shared>>;

/// A running controller; stopped (its thread joined) on drop.
#[derive(Debug)]
pub struct Controller {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// What [`Controller::start`] needs besides the engine.
pub struct Parts {
    /// What `kerntun run` does to a config read from its file (its flags
    /// over it, validated): a reload's config gets the same.
    pub prepare: Prepare,
    pub settings: Settings,
    pub st: Static,
    pub logs: LogHub,
    pub level: String,
    pub set_level: LevelHandle,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts")
            .field("listen", &self.settings.listen)
            .finish_non_exhaustive()
    }
}

/// Bind the controller's address now (so a taken port fails the command
/// before the engine starts).
pub fn bind(settings: &Settings) -> Result<std::net::TcpListener, String> {
    let l = std::net::TcpListener::bind(settings.listen)
        .map_err(|e| format!("controller: binding {}: {e}", settings.listen))?;
    l.set_nonblocking(true)
        .map_err(|e| format!("controller: {e}"))?;
    Ok(l)
}

impl Controller {
    /// Serve on `listener` (from [`bind`]) until stopped. The engine's
    /// event sink becomes the controller's (group probe latencies).
    pub fn start(
        listener: std::net::TcpListener,
        engine: Arc<RwLock<Engine>>,
        parts: Parts,
    ) -> Result<Controller, String> {
        let addr = listener
            .local_addr()
            .map_err(|e| format!("controller: {e}"))?;
        let history = Arc::new(History::default());
        {
            let engine = engine.read().unwrap_or_else(|p| p.into_inner());
            engine.set_event_sink(Some(history.clone()));
            // Probes that ended before the sink was set (the first round
            // runs as the engine starts) are known by their latency only:
            // recorded with this time.
            for g in engine.groups() {
                for m in g.members {
                    if let Some(ms) = m.latency_ms {
                        history.record(&m.name, ms);
                    }
                }
            }
        }
        let shared = Arc::new(Shared {
            engine,
            st: RwLock::new(parts.st),
            history,
            logs: parts.logs,
            level: RwLock::new(parts.level),
            set_level: parts.set_level,
            secret: parts.settings.secret.map(String::into_bytes),
            streams: Arc::new(Semaphore::new(MAX_STREAMS)),
            prepare: parts.prepare,
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(BLOCKING_THREADS)
            .thread_name("kerntun-controller")
            .build()
            .map_err(|e| format!("controller: runtime: {e}"))?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let app = router(shared);
        let listener = {
            let _enter = rt.enter();
            tokio::net::TcpListener::from_std(listener).map_err(|e| format!("controller: {e}"))?
        };
        let thread = std::thread::Builder::new()
            .name("kerntun-controller".into())
            .spawn(move || {
                rt.block_on(async move {
                    let serve = axum::serve(listener, app);
                    tokio::select! {
                        r = serve => if let Err(e) = r {
                            tracing::error!("controller stopped: {e}");
                        },
                        _ = stop_rx => {}
                    }
                });
                // Open streams are tasks of this runtime: dropped here.
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(|e| format!("controller: thread: {e}"))?;
        tracing::info!("controller listening on http://{addr}");
        Ok(Controller {
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Stop serving and join the thread.
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.stop();
    }
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(|| async { Json(json!({"hello": "kerntun"})) }))
        .route("/version", get(version))
        .route("/proxies", get(proxies))
        .route("/proxies/{name}", get(proxy).put(select))
        .route("/proxies/{name}/delay", get(delay))
        .route("/group/{name}/delay", get(group_delay))
        .route("/connections", get(connections).delete(close_all))
        .route("/connections/{id}", axum::routing::delete(close_one))
        .route("/traffic", get(traffic))
        .route("/logs", get(logs_stream))
        .route("/rules", get(rules))
        // kerntun has no proxy or rule providers (servers and rules come
        // from the config); dashboards fetch these lists with /proxies and
        // /rules and read an empty one as "none".
        .route("/providers/proxies", get(no_providers))
        .route("/providers/rules", get(no_providers))
        .route(
            "/configs",
            get(configs).put(put_configs).patch(patch_configs),
        )
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn_with_state(shared.clone(), auth))
        .layer(middleware::from_fn(cors))
        .with_state(shared)
}

/// A JSON body with a status.
struct Json(Value);

impl IntoResponse for Json {
    fn into_response(self) -> Response {
        (
            [(header::CONTENT_TYPE, "application/json")],
            self.0.to_string(),
        )
            .into_response()
    }
}

fn error(status: StatusCode, text: impl Into<String>) -> Response {
    (status, Json(message(text))).into_response()
}

/// Dashboards are served from another origin: every answer allows any
/// origin (access is the secret's business), and a preflight is answered
/// here, before the secret is checked (browsers send it without one).
async fn cors(req: Request, next: Next) -> Response {
    let mut resp = if req.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    for (name, value) in [
        (header::ACCESS_CONTROL_ALLOW_ORIGIN, "*"),
        (
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            "Authorization, Content-Type",
        ),
        (
            header::ACCESS_CONTROL_ALLOW_METHODS,
            "GET, POST, PUT, PATCH, DELETE, OPTIONS",
        ),
        (header::ACCESS_CONTROL_MAX_AGE, "600"),
    ] {
        h.insert(name, HeaderValue::from_static(value));
    }
    resp
}

/// With a secret: `Authorization: Bearer SECRET`, or for a WebSocket
/// (browsers cannot set its headers) `?token=SECRET`. Compared in constant
/// time.
async fn auth(State(sh): S, req: Request, next: Next) -> Response {
    let Some(secret) = &sh.secret else {
        return next.run(req).await;
    };
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().as_bytes().to_vec());
    let is_ws = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let token = if is_ws {
        req.uri().query().and_then(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('='))
                .find(|(k, _)| *k == "token")
                .map(|(_, v)| percent_decode(v))
        })
    } else {
        None
    };
    let ok = [bearer, token]
        .into_iter()
        .flatten()
        .any(|t| bool::from(t.ct_eq(secret)));
    if ok {
        next.run(req).await
    } else {
        error(StatusCode::UNAUTHORIZED, "Unauthorized")
    }
}

/// `%XX` and `+` of a query value.
fn percent_decode(v: &str) -> Vec<u8> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(x) => {
                        out.push(x);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    out
}

async fn version() -> Json {
    Json(shapes::version_json())
}

async fn proxies(State(sh): S) -> Json {
    let groups = sh.engine().groups();
    Json(shapes::proxies_json(&sh.st(), &groups, &sh.history))
}

async fn proxy(State(sh): S, Path(name): Path<String>) -> Response {
    let groups = sh.engine().groups();
    match shapes::proxy_json(&sh.st(), &groups, &sh.history, &name) {
        Some(v) => Json(v).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no proxy named {name:?}")),
    }
}

#[derive(Deserialize)]
struct SelectBody {
    name: String,
}

async fn select(State(sh): S, Path(group): Path<String>, body: Bytes) -> Response {
    let Ok(b) = serde_json::from_slice::<SelectBody>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "body: expected {\"name\": \"MEMBER\"}",
        );
    };
    let r = sh.engine().select(&group, &b.name);
    match r {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(SelectionError::Group(kerntun::outbound::group::SelectError::UnknownGroup(_))) => {
            error(StatusCode::NOT_FOUND, format!("no group named {group:?}"))
        }
        Err(SelectionError::NotRunning) => {
            error(StatusCode::SERVICE_UNAVAILABLE, "the engine is not running")
        }
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

#[derive(Deserialize)]
struct DelayQuery {
    url: Option<String>,
    timeout: Option<String>,
}

impl DelayQuery {
    /// The URL to probe and the timeout (the URL's error first).
    fn parse(self) -> Result<(String, Duration), Box<Response>> {
        Ok((probe_url(self.url)?, delay_timeout(self.timeout)?))
    }
}

/// The probe speaks plain HTTP/1.1 (`Engine::test_latency`): an `https://`
/// URL (some dashboards' default) is probed as `http://` on the same host
/// and path, port 80.
fn probe_url(url: Option<String>) -> Result<String, Box<Response>> {
    let url = url.ok_or_else(|| Box::new(error(StatusCode::BAD_REQUEST, "url: missing")))?;
    Ok(match url.strip_prefix("https://") {
        Some(rest) => format!("http://{rest}"),
        None => url,
    })
}

fn delay_timeout(t: Option<String>) -> Result<Duration, Box<Response>> {
    match t {
        None => Ok(DEFAULT_DELAY_TIMEOUT),
        Some(t) => t
            .parse::<u64>()
            .ok()
            .filter(|&ms| ms > 0)
            .map(|ms| Duration::from_millis(ms).min(MAX_DELAY_TIMEOUT))
            .ok_or_else(|| {
                Box::new(error(
                    StatusCode::BAD_REQUEST,
                    format!("timeout: {t:?} is not a positive number of milliseconds"),
                ))
            }),
    }
}

/// One delay test on the blocking pool.
async fn measure(
    sh: &Arc<Shared>,
    name: String,
    url: String,
    timeout: Duration,
) -> Result<u32, LatencyError> {
    let sh2 = sh.clone();
    let n = name.clone();
    let r = tokio::task::spawn_blocking(move || sh2.engine().test_latency(&n, &url, timeout))
        .await
        .unwrap_or(Err(LatencyError::NotRunning));
    let ms = r.map(|d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1))?;
    sh.history.record(&name, ms);
    Ok(ms)
}

async fn delay(State(sh): S, Path(name): Path<String>, Query(q): Query<DelayQuery>) -> Response {
    let (url, timeout) = match q.parse() {
        Ok(p) => p,
        Err(r) => return *r,
    };
    match measure(&sh, name, url, timeout).await {
        Ok(ms) => Json(json!({ "delay": ms })).into_response(),
        Err(e) => {
            let status = match &e {
                LatencyError::UnknownOutbound(_) => StatusCode::NOT_FOUND,
                LatencyError::BadUrl(_) => StatusCode::BAD_REQUEST,
                LatencyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            error(status, e.to_string())
        }
    }
}

/// Every member of a group tested at once: `{member: delay}` for those
/// that answered.
async fn group_delay(
    State(sh): S,
    Path(name): Path<String>,
    Query(q): Query<DelayQuery>,
) -> Response {
    let (url, timeout) = match q.parse() {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let groups = sh.engine().groups();
    let Some(g) = groups.into_iter().find(|g| g.name == name) else {
        return error(StatusCode::NOT_FOUND, format!("no group named {name:?}"));
    };
    let tests = g.members.into_iter().map(|m| {
        let (sh, url) = (sh.clone(), url.clone());
        async move {
            let r = measure(&sh, m.name.clone(), url, timeout).await;
            (m.name, r)
        }
    });
    let mut out = HashMap::new();
    for (member, r) in futures_util::future::join_all(tests).await {
        if let Ok(ms) = r {
            out.insert(member, ms);
        }
    }
    Json(json!(out)).into_response()
}

fn connections_value(sh: &Shared) -> Value {
    let engine = sh.engine();
    let (list, stats, groups) = (engine.connections(), engine.stats(), engine.groups());
    drop(engine);
    shapes::connections_json(&list, &stats, &groups)
}

async fn connections(
    State(sh): S,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match ws {
        Ok(ws) => {
            let Some(permit) = stream_permit(&sh) else {
                return too_many();
            };
            ws.on_upgrade(move |socket| {
                ws_loop(socket, permit, move |_| Some(connections_value(&sh)))
            })
        }
        Err(_) => Json(connections_value(&sh)).into_response(),
    }
}

async fn close_all(State(sh): S) -> StatusCode {
    let engine = sh.engine();
    for c in engine.connections().connections {
        engine.close_connection(c.id);
    }
    StatusCode::NO_CONTENT
}

async fn close_one(State(sh): S, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return error(StatusCode::NOT_FOUND, format!("no connection {id:?}"));
    };
    if sh.engine().close_connection(id) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        error(StatusCode::NOT_FOUND, format!("no live connection {id}"))
    }
}

fn stream_permit(sh: &Shared) -> Option<OwnedSemaphorePermit> {
    sh.streams.clone().try_acquire_owned().ok()
}

fn too_many() -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("at most {MAX_STREAMS} streams at once"),
    )
}

/// Send `next(tick)` once a second over the WebSocket until the peer
/// closes or `next` has nothing more.
async fn ws_loop(
    mut socket: WebSocket,
    _permit: OwnedSemaphorePermit,
    mut next: impl FnMut(u64) -> Option<Value> + Send,
) {
    let mut tick = tokio::time::interval(TICK);
    let mut n = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let Some(v) = next(n) else { return };
                n += 1;
                if socket.send(Message::Text(v.to_string().into())).await.is_err() {
                    return;
                }
            }
            m = socket.recv() => match m {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            }
        }
    }
}

/// The `/traffic` stream: bytes per second since the previous sample.
fn traffic_sampler(sh: Arc<Shared>) -> impl FnMut(u64) -> Option<Value> + Send {
    let mut last = shapes::totals(&sh.engine().stats());
    move |_| {
        let now = shapes::totals(&sh.engine().stats());
        let v = json!({
            "up": now.0.saturating_sub(last.0),
            "down": now.1.saturating_sub(last.1),
        });
        last = now;
        Some(v)
    }
}

/// A chunked HTTP body of JSON lines from `next`, one a second.
fn chunked(
    permit: OwnedSemaphorePermit,
    next: impl FnMut(u64) -> Option<Value> + Send + 'static,
) -> Response {
    let stream = futures_util::stream::unfold(
        (permit, next, tokio::time::interval(TICK), 0u64),
        |(permit, mut next, mut tick, n)| async move {
            tick.tick().await;
            let v = next(n)?;
            let line = format!("{v}\n");
            Some((
                Ok::<_, std::convert::Infallible>(line),
                (permit, next, tick, n + 1),
            ))
        },
    );
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn traffic(
    State(sh): S,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let Some(permit) = stream_permit(&sh) else {
        return too_many();
    };
    let sampler = traffic_sampler(sh);
    match ws {
        Ok(ws) => ws.on_upgrade(move |socket| ws_loop(socket, permit, sampler)),
        Err(_) => chunked(permit, sampler),
    }
}

#[derive(Deserialize)]
struct LogQuery {
    level: Option<String>,
}

/// `{"type": level, "payload": text}` lines at or above `?level=`
/// (default `info`), as they come.
async fn logs_stream(
    State(sh): S,
    Query(q): Query<LogQuery>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let level = match logs::parse_level(q.level.as_deref().unwrap_or("info")) {
        Ok(l) => l,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let Some(permit) = stream_permit(&sh) else {
        return too_many();
    };
    let rx = sh.logs.subscribe();
    let hub = sh.logs.clone();
    match ws {
        Ok(ws) => ws.on_upgrade(move |socket| log_ws(socket, permit, rx, hub, level)),
        Err(_) => {
            let stream = futures_util::stream::unfold(
                (permit, rx, hub),
                move |(permit, mut rx, hub)| async move {
                    let line = next_line(&mut rx, &hub, level).await?;
                    Some((
                        Ok::<_, std::convert::Infallible>(format!("{line}\n")),
                        (permit, rx, hub),
                    ))
                },
            );
            (
                [(header::CONTENT_TYPE, "application/json")],
                Body::from_stream(stream),
            )
                .into_response()
        }
    }
}

/// The next line at or above `level` (`None`: silent, or the hub is gone).
async fn next_line(
    rx: &mut broadcast::Receiver<logs::LogLine>,
    hub: &LogHub,
    level: Option<tracing::Level>,
) -> Option<Value> {
    let level = level?;
    loop {
        match rx.recv().await {
            // tracing orders levels by verbosity: ERROR < WARN < ... < TRACE.
            Ok(l) if l.level <= level => {
                return Some(json!({"type": logs::level_name(l.level), "payload": &*l.text}));
            }
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(n)) => {
                hub.count_dropped(n);
                return Some(json!({
                    "type": "warning",
                    "payload": format!("{n} log lines dropped (this reader fell behind; {} in all)", hub.dropped()),
                }));
            }
            Err(broadcast::error::RecvError::Closed) => return None,
        }
    }
}

async fn log_ws(
    mut socket: WebSocket,
    _permit: OwnedSemaphorePermit,
    mut rx: broadcast::Receiver<logs::LogLine>,
    hub: LogHub,
    level: Option<tracing::Level>,
) {
    loop {
        tokio::select! {
            line = next_line(&mut rx, &hub, level), if level.is_some() => {
                let Some(v) = line else { return };
                if socket.send(Message::Text(v.to_string().into())).await.is_err() {
                    return;
                }
            }
            m = socket.recv() => match m {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            }
        }
    }
}

async fn no_providers() -> Json {
    Json(json!({ "providers": {} }))
}

async fn rules(State(sh): S) -> Json {
    Json(shapes::rules_json(&sh.st().rules))
}

async fn configs(State(sh): S) -> Json {
    let level = sh.level.read().unwrap_or_else(|p| p.into_inner()).clone();
    Json(shapes::configs_json(&level, sh.st().ipv6))
}

/// `PATCH /configs`: `log-level` changes the command's log filter; `mode`
/// may only be `rule`; other keys are refused by name.
async fn patch_configs(State(sh): S, body: Bytes) -> Response {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "body: expected a JSON object");
    };
    let mut level = None;
    for (k, v) in &map {
        match (k.as_str(), v.as_str()) {
            ("log-level", Some(l)) => match logs::parse_level(l) {
                Ok(_) => level = Some(l.to_ascii_lowercase()),
                Err(e) => return error(StatusCode::BAD_REQUEST, e),
            },
            ("mode", Some(m)) if m.eq_ignore_ascii_case("rule") => {}
            ("mode", _) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "mode: kerntun routes by rules only (\"rule\")",
                );
            }
            (other, _) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("{other}: not supported by kerntun (supported: log-level, mode)"),
                );
            }
        }
    }
    if let Some(l) = level {
        if let Err(e) = (sh.set_level)(&l) {
            return error(StatusCode::INTERNAL_SERVER_ERROR, e);
        }
        tracing::info!("log level set to {l} by the controller");
        *sh.level.write().unwrap_or_else(|p| p.into_inner()) = l;
    }
    StatusCode::NO_CONTENT.into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutConfigs {
    path: Option<String>,
    payload: Option<String>,
}

/// `PUT /configs`: a config to reload, by path or inline TOML.
async fn put_configs(State(sh): S, body: Bytes) -> Response {
    let Ok(b) = serde_json::from_slice::<PutConfigs>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "body: expected {\"path\": FILE} or {\"payload\": TOML}",
        );
    };
    let text = match (b.path, b.payload) {
        (Some(_), Some(_)) | (None, None) => {
            return error(
                StatusCode::BAD_REQUEST,
                "body: exactly one of \"path\" and \"payload\"",
            );
        }
        (Some(p), None) => match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("reading {p}: {e}")),
        },
        (None, Some(t)) => t,
    };
    match reload(&sh, &text) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err((status, e)) => error(status, e),
    }
}

/// The command's flags over a config (`Parts::prepare`).
pub type Prepare = Arc<dyn Fn(kerntun::Config) -> Result<kerntun::Config, String> + Send + Sync>;

/// Parse a config the way `kerntun run` does, the command's flags over it,
/// then reload the engine with it (`Engine::reload`): 400 for a config
/// that does not parse or validate, or that changes what needs a restart
/// (the message names the field); 503 once the engine stopped. On success
/// `/proxies` and `/rules` show the new config.
fn reload(sh: &Shared, text: &str) -> Result<(), (StatusCode, String)> {
    let (cfg, _section) = crate::parse_config(text).map_err(|e| (StatusCode::BAD_REQUEST, e))?;
    let cfg = (sh.prepare)(cfg).map_err(|e| (StatusCode::BAD_REQUEST, e))?;
    let st = Static::from_config(&cfg);
    match sh.engine().reload(cfg) {
        Ok(report) => {
            *sh.st.write().unwrap_or_else(|p| p.into_inner()) = st;
            tracing::info!(
                "reloaded through the controller: {} connections closed (their outbound is gone)",
                report.closed
            );
            Ok(())
        }
        Err(e @ kerntun::ReloadError::NotRunning) => {
            Err((StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
        }
        Err(e) => Err((StatusCode::BAD_REQUEST, e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Option<SocketAddr> {
        Some(s.parse().expect("addr"))
    }

    #[test]
    fn non_loopback_needs_a_secret() {
        let e = Settings::resolve(addr("0.0.0.0:9090"), None, None).expect_err("refused");
        assert!(e.contains("not a loopback") && e.contains("secret"), "{e}");
        let s = Settings::resolve(addr("0.0.0.0:9090"), Some("s".into()), None)
            .expect("ok")
            .expect("on");
        assert_eq!(s.secret.as_deref(), Some("s"));
        assert!(
            Settings::resolve(addr("[::1]:9090"), None, None)
                .expect("ok")
                .is_some()
        );
        assert!(Settings::resolve(None, None, None).expect("ok").is_none());
        assert!(Settings::resolve(None, Some("s".into()), None).is_err());
        assert!(Settings::resolve(addr("127.0.0.1:1"), Some(String::new()), None).is_err());
    }

    #[test]
    fn flags_override_the_section() {
        let section = Section {
            listen: addr("10.0.0.1:9090"),
            secret: Some("file".into()),
        };
        let s = Settings::resolve(addr("127.0.0.1:9191"), None, Some(section.clone()))
            .expect("ok")
            .expect("on");
        assert_eq!(s.listen, "127.0.0.1:9191".parse().expect("addr"));
        assert_eq!(s.secret.as_deref(), Some("file"));
        let s = Settings::resolve(None, Some("flag".into()), Some(section))
            .expect("ok")
            .expect("on");
        assert_eq!(s.listen, "10.0.0.1:9090".parse().expect("addr"));
        assert_eq!(s.secret.as_deref(), Some("flag"));
    }

    #[test]
    fn token_query_values_are_decoded() {
        assert_eq!(percent_decode("a%20b+c%2"), b"a b c%2");
        assert_eq!(percent_decode("%zz"), b"%zz");
    }
}
