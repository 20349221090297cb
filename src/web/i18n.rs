//! The pages' words in Chinese (the default) and English: one flat catalog per language
//! (`i18n/zh.toml`, `i18n/en.toml`, compiled in), looked up by key with `{name}` placeholders.
//! A page's language: `?lang=` (remembered in the `lang` cookie), else the cookie, else the
//! browser's `Accept-Language`, else Chinese.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use actix_web::HttpRequest;
use zhihui_domain::rule::Broken;

use crate::http::ApiError;

/// The cookie that remembers a chosen language.
pub const LANG_COOKIE: &str = "lang";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    Zh,
    En,
}

impl Lang {
    pub const ALL: [Lang; 2] = [Lang::Zh, Lang::En];

    pub fn code(self) -> &'static str {
        match self {
            Lang::Zh => "zh",
            Lang::En => "en",
        }
    }

    /// The `lang` attribute of the page.
    pub fn tag(self) -> &'static str {
        match self {
            Lang::Zh => "zh-CN",
            Lang::En => "en",
        }
    }

    pub fn parse(code: &str) -> Option<Lang> {
        match code {
            "zh" => Some(Lang::Zh),
            "en" => Some(Lang::En),
            _ => None,
        }
    }

    /// The request's language (see the module comment).
    pub fn of_request(request: &HttpRequest) -> Lang {
        let chosen = request
            .query_string()
            .split('&')
            .find_map(|pair| pair.strip_prefix("lang="))
            .and_then(Lang::parse);
        if let Some(lang) = chosen {
            return lang;
        }
        if let Some(lang) = request
            .cookie(LANG_COOKIE)
            .and_then(|cookie| Lang::parse(cookie.value()))
        {
            return lang;
        }
        request
            .headers()
            .get(actix_web::http::header::ACCEPT_LANGUAGE)
            .and_then(|value| value.to_str().ok())
            .map_or(Lang::Zh, Lang::from_accept_language)
    }

    /// The first of the browser's languages we have (weights honoured), else Chinese.
    pub fn from_accept_language(header: &str) -> Lang {
        Lang::preferred_in(header).unwrap_or(Lang::Zh)
    }

    /// The first of an `Accept-Language`'s languages we have (weights honoured), if any.
    pub fn preferred_in(header: &str) -> Option<Lang> {
        let mut ranked: Vec<(f32, Lang)> = header
            .split(',')
            .filter_map(|part| {
                let mut pieces = part.trim().split(';');
                let tag = pieces.next()?.trim().to_ascii_lowercase();
                let weight = pieces
                    .find_map(|piece| piece.trim().strip_prefix("q="))
                    .and_then(|q| q.parse::<f32>().ok())
                    .unwrap_or(1.0);
                let primary = tag.split('-').next()?;
                Lang::parse(primary).map(|lang| (weight, lang))
            })
            .filter(|(weight, _)| *weight > 0.0)
            .collect();
        // Stable: equal weights keep the header's order.
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
        ranked.first().map(|(_, lang)| *lang)
    }

    fn catalog(self) -> &'static BTreeMap<String, String> {
        match self {
            Lang::Zh => &ZH,
            Lang::En => &EN,
        }
    }

    /// The text of `key`, `{name}` placeholders filled from `arguments`; the key itself when
    /// the catalog lacks it (a test keeps both catalogs complete). A count of one takes the
    /// key's `_one` form when it has one ("1 follower", not "1 followers"): used when every
    /// argument is `1`.
    pub fn text(self, key: &str, arguments: &[(&str, String)]) -> String {
        let one = !arguments.is_empty() && arguments.iter().all(|(_, value)| value == "1");
        let singular = one
            .then(|| self.catalog().get(&format!("{key}_one")))
            .flatten();
        let Some(template) = singular.or_else(|| self.catalog().get(key)) else {
            return key.to_owned();
        };
        let mut text = template.clone();
        for (name, value) in arguments {
            text = text.replace(&format!("{{{name}}}"), value);
        }
        text
    }

    pub fn has(self, key: &str) -> bool {
        self.catalog().contains_key(key)
    }

    /// An API error in the reader's words: a named rule's own text when the catalog has one
    /// (`error.<rule>`), else the rule's detail; a field error names the field.
    pub fn message_of(self, error: &ApiError) -> String {
        match error {
            ApiError::Validation { field, broken } => self.field_message(field, broken),
            ApiError::InvalidFields(fields) => self.fields_message(
                fields
                    .iter()
                    .map(|(field, broken)| (field.as_str(), broken)),
            ),
            ApiError::NotFound(_) => self.text("error.not_found", &[]),
            ApiError::Unexpected(_) => self.text("error.unexpected", &[]),
            ApiError::Unavailable { .. } => self.text("error.unavailable", &[]),
            ApiError::Overdue { .. } => self.text("error.overdue", &[]),
            ApiError::Refused {
                rule,
                window: Some((from, until)),
                ..
            } if self.has(&format!("error.{rule}")) => {
                let at = |time: &chrono::DateTime<chrono::Utc>| {
                    time.format("%Y-%m-%d %H:%M UTC").to_string()
                };
                self.text(
                    &format!("error.{rule}"),
                    &[("from", at(from)), ("until", at(until))],
                )
            }
            ApiError::Unauthorized { rule, detail }
            | ApiError::Forbidden { rule, detail }
            | ApiError::Conflict { rule, detail }
            | ApiError::TooManyRequests { rule, detail, .. }
            | ApiError::Refused { rule, detail, .. } => {
                let key = format!("error.{rule}");
                if self.has(&key) {
                    self.text(&key, &[])
                } else {
                    detail.clone()
                }
            }
        }
    }

    /// `field` broke `broken`, said in the reader's language: the field's name and the rule's
    /// sentence both from the catalog (`field.<name>`, `rule.<key>`).
    pub fn field_message(self, field: &str, broken: &Broken) -> String {
        let mut broken = broken.clone();
        // `other` and `with` name another field: said by its name too.
        for (name, value) in &mut broken.args {
            if matches!(*name, "other" | "with") {
                *value = self.field_name(value);
            }
        }
        let rule = broken.fill(&self.text(&format!("rule.{}", broken.rule.key()), &[]));
        self.text(
            "error.field",
            &[("field", self.field_name(field)), ("message", rule)],
        )
    }

    /// `error`'s problem+json body with its words in this language.
    pub fn problem_of(self, error: &ApiError) -> crate::http::problem::Problem {
        let mut problem = error.problem();
        let title = match error {
            ApiError::Validation { .. } | ApiError::InvalidFields(_) => "validation",
            ApiError::Unauthorized { .. } => "unauthorized",
            ApiError::Forbidden { .. } => "forbidden",
            ApiError::NotFound(_) => "not_found",
            ApiError::Conflict { .. } => "conflict",
            ApiError::TooManyRequests { .. } => "too_many",
            ApiError::Refused { .. } => "refused",
            ApiError::Unavailable { .. } => "unavailable",
            ApiError::Overdue { .. } => "overdue",
            ApiError::Unexpected(_) => "internal",
        };
        problem.title = self.text(&format!("api_title.{title}"), &[]);
        problem.detail = self.message_of(error);
        if let (ApiError::InvalidFields(fields), Some(errors)) = (error, problem.errors.as_mut()) {
            for ((field, broken), said) in fields.iter().zip(errors.iter_mut()) {
                said.message = self.field_message(field, broken);
            }
        }
        problem
    }

    /// A field's name in the reader's language; the API's own name when the catalog has none.
    fn field_name(self, field: &str) -> String {
        let key = format!("field.{field}");
        if self.has(&key) {
            self.text(&key, &[])
        } else {
            field.to_owned()
        }
    }

    /// Several fields' messages in one line.
    pub fn fields_message<'a>(
        &self,
        fields: impl IntoIterator<Item = (&'a str, &'a Broken)>,
    ) -> String {
        fields
            .into_iter()
            .map(|(field, broken)| self.field_message(field, broken))
            .collect::<Vec<_>>()
            .join(&self.text("error.separator", &[]))
    }
}

static ZH: LazyLock<BTreeMap<String, String>> =
    LazyLock::new(|| flatten(include_str!("i18n/zh.toml")));
static EN: LazyLock<BTreeMap<String, String>> =
    LazyLock::new(|| flatten(include_str!("i18n/en.toml")));

/// A TOML catalog as `dotted.key -> text`. The catalogs are compiled in and tested: a broken
/// one is a programmer's error.
fn flatten(source: &str) -> BTreeMap<String, String> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, String>) {
        for (key, value) in table {
            let path = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}.{key}")
            };
            match value {
                toml::Value::String(text) => {
                    out.insert(path, text.clone());
                }
                toml::Value::Table(inner) => walk(&path, inner, out),
                other => panic!("i18n: {path} is {other:?}, not text"),
            }
        }
    }
    let table: toml::Table = source
        .parse()
        .unwrap_or_else(|error| panic!("i18n catalog: {error}"));
    let mut out = BTreeMap::new();
    walk("", &table, &mut out);
    out
}

/// The API answers its problems in English unless the client's `Accept-Language` prefers
/// another language we have (Chinese): then `title`, `detail` and each field's `message` are
/// said in it, as the pages say them; `type`, `rule`, `field` and the other members stay the
/// stable names and values programs match on.
pub async fn localise_api_problems(
    request: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody + 'static>,
) -> Result<actix_web::dev::ServiceResponse<actix_web::body::BoxBody>, actix_web::Error> {
    use actix_web::http::header;
    let lang = request
        .path()
        .starts_with("/api/")
        .then(|| {
            request
                .headers()
                .get(header::ACCEPT_LANGUAGE)
                .and_then(|value| value.to_str().ok())
                .and_then(Lang::preferred_in)
        })
        .flatten()
        // English is the API's own: its texts say more than the pages' catalog does.
        .filter(|lang| *lang != Lang::En);
    let mut response = next.call(request).await?.map_into_boxed_body();
    let Some(lang) = lang else {
        return Ok(response);
    };
    let problem = response
        .response()
        .error()
        .and_then(|error| error.as_error::<ApiError>())
        .map(|error| lang.problem_of(error));
    let Some(problem) = problem else {
        return Ok(response);
    };
    let Ok(body) = serde_json::to_vec(&problem) else {
        return Ok(response);
    };
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_LANGUAGE,
        header::HeaderValue::from_static(lang.tag()),
    );
    headers.append(
        header::VARY,
        header::HeaderValue::from_static("accept-language"),
    );
    headers.remove(header::CONTENT_LENGTH);
    Ok(response.map_body(|_, _| actix_web::body::BoxBody::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::unwrap_used)]
    fn a_refusal_with_a_window_says_its_times() {
        let at = |text: &str| chrono::DateTime::parse_from_rfc3339(text).unwrap().to_utc();
        let error = ApiError::Refused {
            status: actix_web::http::StatusCode::CONFLICT,
            rule: "code-not-valid-now",
            detail: "not yet".into(),
            window: Some((at("2026-12-01T02:00:00Z"), at("2026-12-31T16:00:00Z"))),
        };
        assert_eq!(
            Lang::Zh.message_of(&error),
            "这个兑换码现在不能使用：有效期为 2026-12-01 02:00 UTC 至 2026-12-31 16:00 UTC。"
        );
    }

    #[test]
    fn a_count_of_one_is_said_in_the_singular_where_the_catalog_has_it() {
        let count = |n: &str| [("count", n.to_owned())];
        assert_eq!(
            Lang::En.text("gallery.followers", &count("1")),
            "1 follower"
        );
        assert_eq!(
            Lang::En.text("gallery.followers", &count("0")),
            "0 followers"
        );
        assert_eq!(
            Lang::En.text("gallery.followers", &count("11")),
            "11 followers"
        );
        assert_eq!(Lang::Zh.text("gallery.followers", &count("1")), "1 位粉丝");
        assert_eq!(
            Lang::En.text("card.steps", &[("steps", "1".to_owned())]),
            "1 step"
        );
    }

    #[test]
    fn every_read_model_is_named_in_both_languages() {
        for projection in zhihui_projections::ProjectionName::ALL {
            let key = format!("projection.{}", projection.as_str());
            assert!(
                ZH.contains_key(&key) && EN.contains_key(&key),
                "{key} is missing"
            );
        }
    }

    #[test]
    fn every_rule_a_field_can_break_is_said_in_both_languages() {
        for rule in zhihui_domain::rule::Rule::ALL {
            let key = format!("rule.{}", rule.key());
            assert!(ZH.contains_key(&key), "{key} is missing in Chinese");
            // The English page says what the API says.
            assert_eq!(
                EN.get(&key).map(String::as_str),
                Some(rule.english()),
                "{key}"
            );
        }
    }

    /// Every rule a refusal names (`rule: "..."`) and every field a validation error names is in
    /// both catalogs, so no page shows the API's English in a Chinese page.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn every_refusal_and_field_the_code_names_is_said_in_both_languages() {
        let rule = regex::Regex::new(r#"rule: "([a-z0-9-]+)""#).unwrap();
        let field =
            regex::Regex::new(r#"(?:invalid(?:_by)?\(\s*|field: )"([A-Za-z_-]+)""#).unwrap();
        let mut missing = Vec::new();
        let mut files = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src"
        ))];
        while let Some(path) = files.pop() {
            if path.is_dir() {
                for entry in std::fs::read_dir(&path).unwrap() {
                    files.push(entry.unwrap().path());
                }
                continue;
            }
            if path.extension().is_none_or(|extension| extension != "rs") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            let keys = rule
                .captures_iter(&source)
                .map(|found| format!("error.{}", &found[1]))
                .chain(
                    field
                        .captures_iter(&source)
                        .map(|found| format!("field.{}", &found[1])),
                );
            for key in keys {
                if !(ZH.contains_key(&key) && EN.contains_key(&key)) {
                    missing.push(format!("{key} ({})", path.display()));
                }
            }
        }
        missing.sort();
        missing.dedup();
        assert!(missing.is_empty(), "not in the catalogs: {missing:#?}");
    }

    #[test]
    fn both_catalogs_have_the_same_keys_and_placeholders() {
        let zh: Vec<&String> = ZH.keys().collect();
        let en: Vec<&String> = EN.keys().collect();
        assert_eq!(zh, en, "the catalogs differ in their keys");
        let placeholders = |text: &str| {
            let mut names: Vec<String> = text
                .split('{')
                .skip(1)
                .filter_map(|rest| rest.split_once('}').map(|(name, _)| name.to_owned()))
                .collect();
            names.sort();
            names
        };
        for (key, zh_text) in ZH.iter() {
            assert_eq!(
                placeholders(zh_text),
                placeholders(&EN[key]),
                "{key}: the placeholders differ"
            );
        }
    }

    #[test]
    fn the_browsers_language_is_honoured_by_weight_and_chinese_is_the_default() {
        assert_eq!(Lang::from_accept_language("en-US,en;q=0.9"), Lang::En);
        assert_eq!(
            Lang::from_accept_language("zh-CN,zh;q=0.9,en;q=0.8"),
            Lang::Zh
        );
        assert_eq!(
            Lang::from_accept_language("fr-FR,en;q=0.5,zh;q=0.7"),
            Lang::Zh
        );
        assert_eq!(Lang::from_accept_language("fr-FR"), Lang::Zh);
        assert_eq!(Lang::from_accept_language(""), Lang::Zh);
        assert_eq!(Lang::from_accept_language("en;q=0"), Lang::Zh);
    }

    #[test]
    fn placeholders_are_filled() {
        assert_eq!(
            Lang::En.text("generate.missing_points", &[("missing", "3.00".into())]),
            "3.00 points short: check in, redeem a code or join a flash sale to get more."
        );
        assert_eq!(Lang::Zh.text("no.such.key", &[]), "no.such.key");
    }
}
