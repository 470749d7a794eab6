//! The console: a few static files under `/admin/ui/` (HTML, CSS, vanilla JavaScript, an SVG
//! icon) compiled into the binary, that read and change memory through the admin API from the
//! browser. No build step, no framework, nothing fetched from another origin.
//!
//! The files are the shell only: they carry no data, so they are served without the admin
//! token (a browser cannot put a bearer token on a navigation), but only when the admin API is
//! on (with no token configured `/admin/ui/` is 404 like every `/admin` path). The page asks
//! for the token once, keeps it in the tab's `sessionStorage` and sends it as
//! `Authorization: Bearer` on each `fetch` of the admin API: no cookie exists, so no other
//! site can ride one. Every answer here carries a strict Content-Security-Policy (scripts,
//! styles, images and connections from this origin only, no inline script or style, no
//! framing, no form posts) and `nosniff`, `no-referrer`.

use http::{HeaderValue, Method, Response, StatusCode, header};

use super::AdminError;
use crate::body::{ProxyBody, empty, full};

/// The console's path prefix.
pub const PREFIX: &str = "/admin/ui/";

/// The Content-Security-Policy of every console answer.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
form-action 'none'; frame-ancestors 'none'";

/// The console's files: path under [`PREFIX`], content type, bytes.
const ASSETS: &[(&str, &str, &[u8])] = &[
    (
        "",
        "text/html; charset=utf-8",
        include_bytes!("ui/index.html"),
    ),
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_bytes!("ui/app.js"),
    ),
    (
        "pages.js",
        "text/javascript; charset=utf-8",
        include_bytes!("ui/pages.js"),
    ),
    (
        "app.css",
        "text/css; charset=utf-8",
        include_bytes!("ui/app.css"),
    ),
    ("icon.svg", "image/svg+xml", include_bytes!("ui/icon.svg")),
];

/// True when `path` is the console's (`/admin/ui` or under it).
pub fn is_console(path: &str) -> bool {
    path == "/admin/ui" || path.starts_with(PREFIX)
}

/// Answers a request for a console file: `GET` or `HEAD` only; `/admin/ui` is redirected to
/// `/admin/ui/` (the files' relative links need the slash).
pub fn serve(method: &Method, path: &str) -> Response<ProxyBody> {
    if *method != Method::GET && *method != Method::HEAD {
        return secured(AdminError::MethodNotAllowed("GET, HEAD".into()).into_response());
    }
    if path == "/admin/ui" {
        let mut response = Response::new(empty());
        *response.status_mut() = StatusCode::PERMANENT_REDIRECT;
        response
            .headers_mut()
            .insert(header::LOCATION, HeaderValue::from_static(PREFIX));
        return secured(response);
    }
    let name = path.strip_prefix(PREFIX).unwrap_or(path);
    let Some((_, content_type, bytes)) = ASSETS.iter().find(|(asset, _, _)| *asset == name) else {
        return secured(AdminError::NotFound(format!("no console file {path}")).into_response());
    };
    let body = if *method == Method::HEAD {
        empty()
    } else {
        full(*bytes)
    };
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    secured(response)
}

/// Adds the console's security headers to `response`.
fn secured(mut response: Response<ProxyBody>) -> Response<ProxyBody> {
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        // The files change only with the binary; a stale shell after an upgrade would call
        // routes the new binary may have changed.
        (header::CACHE_CONTROL, "no-cache"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_console_file_holds_an_inline_script_or_style_or_another_origin() {
        for (name, _, bytes) in ASSETS {
            // The SVG namespace is a name, never an address fetched.
            let text = std::str::from_utf8(bytes)
                .unwrap_or_default()
                .replace("http://www.w3.org/2000/svg", "");
            for banned in [
                "<script>",
                "style=\"",
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
                "http://",
                "https://",
                "localStorage",
                "document.cookie",
            ] {
                assert!(!text.contains(banned), "{name} holds {banned}");
            }
        }
    }
}
