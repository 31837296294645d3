#![no_main]
//! What an operator sends: a console query string (as a user who may only read, so nothing
//! acts) or an HTTP API request (method, path and query, a bearer token, a body), against a
//! pgherd whose nodes cannot be reached. The first byte chooses which.
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use pgherd_proxy::app::App;
use tower::ServiceExt;

const CONFIG: &str = r#"
[[nodes]]
name = "pg1"
host = "127.0.0.1"
port = 1

[api]
token = "a-token-no-input-guesses-0123456789abcdef"
"#;

struct Fixture {
    runtime: tokio::runtime::Runtime,
    app: Arc<App>,
    shared: Arc<pgherd_proxy::clients::ClientShared>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let config = pgherd_config::Config::parse(CONFIG, std::path::Path::new("fuzz.toml"))
            .expect("the fuzz config");
        let app = runtime.block_on(async { App::new(config).expect("app") });
        let shared = app.clients.register(
            "127.0.0.1:5000".parse().unwrap(),
            "reader",
            "pgherd",
            false,
            None,
        );
        Fixture {
            runtime,
            app,
            shared,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&choice, rest)) = data.split_first() else {
        return;
    };
    let f = fixture();
    if choice % 2 == 0 {
        if let Ok(text) = std::str::from_utf8(rest) {
            let _ = f
                .runtime
                .block_on(pgherd_proxy::admin::answer_reader(&f.app, &f.shared, text));
        }
        return;
    }
    // method, then the target up to a newline, then the body.
    let method = match choice / 2 % 4 {
        0 => "GET",
        1 => "POST",
        2 => "HEAD",
        _ => "DELETE",
    };
    let (target, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let Ok(target) = std::str::from_utf8(target) else {
        return;
    };
    let Ok(request) = http::Request::builder()
        .method(method)
        .uri(target)
        .header("authorization", "Bearer wrong")
        .body(axum::body::Body::from(body.to_vec()))
    else {
        return;
    };
    let router = pgherd_proxy::http::router(f.app.clone());
    let _ = f.runtime.block_on(router.oneshot(request));
});
