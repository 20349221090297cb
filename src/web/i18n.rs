//! The pages' words in Chinese (the default) and English: one flat catalog per language
//! (`i18n/zh.toml`, `i18n/en.toml`, compiled in), looked up by key with `{name}` placeholders.
//! A page's language: `?lang=` (remembered in the `lang` cookie), else the cookie, else the
//! browser's `Accept-Language`, else Chinese.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use actix_web::HttpRequest;

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
        ranked.first().map_or(Lang::Zh, |(_, lang)| *lang)
    }

    fn catalog(self) -> &'static BTreeMap<String, String> {
        match self {
            Lang::Zh => &ZH,
            Lang::En => &EN,
        }
    }

    /// The text of `key`, `{name}` placeholders filled from `arguments`; the key itself when
    /// the catalog lacks it (a test keeps both catalogs complete).
    pub fn text(self, key: &str, arguments: &[(&str, String)]) -> String {
        let Some(template) = self.catalog().get(key) else {
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

#[cfg(test)]
mod tests {
    use super::*;

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
