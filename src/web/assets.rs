//! The pages' static files, compiled in: our stylesheet and module, and vendored browser files
//! (`assets/VENDORED.md` records each one's version, source and SHA-256; a test holds the file
//! to its checksum). Each is served under its content's digest (`/assets/app.css?v=<digest>`),
//! so a page names exactly the bytes it was made with and browsers keep them for a year.

use std::sync::LazyLock;

use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, web};
use sha2::{Digest, Sha256};

struct Asset {
    name: &'static str,
    content_type: &'static str,
    bytes: &'static [u8],
}

const ASSETS: &[Asset] = &[
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        bytes: include_bytes!("assets/app.css"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("assets/app.js"),
    },
    Asset {
        name: "htmx.min.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("assets/htmx.min.js"),
    },
    Asset {
        name: "favicon.svg",
        content_type: "image/svg+xml",
        bytes: include_bytes!("assets/favicon.svg"),
    },
];

/// Each asset's digest (hex, first 16 characters: a cache key, not a security property).
static DIGESTS: LazyLock<Vec<String>> = LazyLock::new(|| {
    ASSETS
        .iter()
        .map(|asset| {
            Sha256::digest(asset.bytes)
                .iter()
                .take(8)
                .map(|byte| format!("{byte:02x}"))
                .collect()
        })
        .collect()
});

fn find(name: &str) -> Option<(usize, &'static Asset)> {
    ASSETS
        .iter()
        .enumerate()
        .find(|(_, asset)| asset.name == name)
}

/// The URL of an asset for a page (`asset("app.css")` in templates).
pub fn url(name: &str) -> String {
    match find(name) {
        Some((index, _)) => format!("/assets/{name}?v={}", DIGESTS[index]),
        None => format!("/assets/{name}"),
    }
}

/// `GET /assets/{name}`.
pub async fn serve(request: HttpRequest, path: web::Path<String>) -> HttpResponse {
    let Some((index, asset)) = find(&path) else {
        return HttpResponse::NotFound()
            .content_type("text/plain; charset=utf-8")
            .body("no such asset");
    };
    let etag = format!("\"{}\"", DIGESTS[index]);
    let fresh = request
        .headers()
        .get(header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.split(',').any(|tag| tag.trim() == etag));
    // Named with its digest: the same URL always means the same bytes.
    let versioned = request
        .query_string()
        .split('&')
        .any(|pair| pair == format!("v={}", DIGESTS[index]));
    let cache = if versioned {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    };
    if fresh {
        return HttpResponse::NotModified()
            .insert_header((header::ETAG, etag))
            .insert_header((header::CACHE_CONTROL, cache))
            .finish();
    }
    HttpResponse::Ok()
        .content_type(asset.content_type)
        .insert_header((header::ETAG, etag))
        .insert_header((header::CACHE_CONTROL, cache))
        .body(asset.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vendored file is exactly the one VENDORED.md names (version, source, checksum).
    #[test]
    fn vendored_files_match_their_recorded_checksums() {
        let record = include_str!("assets/VENDORED.md");
        let mut checked = 0;
        for line in record.lines().filter(|line| line.starts_with("| `")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`');
            let sha256 = cells[5].trim_matches('`');
            let (_, asset) = find(name).unwrap_or_else(|| panic!("{name} is not an asset"));
            let actual: String = Sha256::digest(asset.bytes)
                .iter()
                .map(|byte| format!("{byte:02x}"))
                .collect();
            assert_eq!(actual, sha256, "{name} is not the recorded file");
            checked += 1;
        }
        assert!(checked >= 1, "VENDORED.md lists no file");
    }
}
