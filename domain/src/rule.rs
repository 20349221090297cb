//! The rules a value can break, each with a name.
//!
//! A refusal that only carried an English sentence could be shown to a person in one language
//! only. A [`Broken`] names its [`Rule`] and the values the sentence needs: programs read the
//! English sentence (its `Display`), the web app says the same rule from its catalogs in the
//! reader's language (`rule.<key>`, the same `{name}` placeholders). The catalogs are tested
//! against [`Rule::ALL`], so a rule added here without its words fails a test, not a reader.

use std::fmt;

macro_rules! rules {
    ($($rule:ident => $key:literal, $english:literal;)*) => {
        /// A rule a value broke; [`Rule::english`] is its sentence for programs.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Rule {
            $($rule,)*
        }

        impl Rule {
            pub const ALL: &'static [Rule] = &[$(Rule::$rule,)*];

            /// The rule's name in the catalogs (`rule.<key>`) and in problem details.
            pub fn key(self) -> &'static str {
                match self {
                    $(Rule::$rule => $key,)*
                }
            }

            /// The English sentence, `{name}` placeholders unfilled.
            pub fn english(self) -> &'static str {
                match self {
                    $(Rule::$rule => $english,)*
                }
            }
        }
    };
}

rules! {
    Required => "required", "is required";
    RequiredWith => "required_with", "is required with {with}";
    NotEmpty => "not_empty", "must not be empty";
    NotOnlySpaces => "not_only_spaces", "must not be only spaces";
    LengthBetween => "length_between", "must be {min} to {max} characters long";
    LengthAtLeast => "length_at_least", "must be at least {min} characters long";
    LengthAtMost => "length_at_most", "must be at most {max} characters long";
    LengthAtMostGot => "length_at_most_got", "must be at most {max} characters, got {length}";
    OneLine => "one_line", "must be one line without control characters";
    NoControlCharacters => "no_control_characters", "must not contain control characters other than line breaks and tabs";
    NoControlCharacter => "no_control_character", "must not contain the control character {character}";
    NotContain => "not_contain", "must not contain {character}";
    VisibleAscii => "visible_ascii", "must be 1 to {max} visible ASCII characters";
    Between => "between", "must be {min} to {max}";
    IntegerBetween => "integer_between", "must be an integer from {min} to {max}, got {value}";
    DecimalBetween => "decimal_between", "must be from {min} to {max} with at most {places} decimal place, got {value}";
    WholeNumber => "whole_number", "must be a whole number, got {value}";
    PlainDecimal => "plain_decimal", "must be written in plain digits, like 12 or 12.5, got {value}";
    OutOfRange => "out_of_range", "{value} is out of range";
    GreaterThanZero => "greater_than_zero", "must be greater than zero";
    AtMost => "at_most", "must be at most {max}";
    DecimalPlaces => "decimal_places", "must have at most {places} decimal places";
    NotPayable => "not_payable", "the price of {images} images is not payable";
    OneOf => "one_of", "{value} is not one of {allowed}";
    NotScope => "not_scope", "{value} is not a scope; the scopes are {allowed}";
    NotEventType => "not_event_type", "{value} is not an event type; they are {allowed}";
    NotTaskStatus => "not_task_status", "is not a task status: {value}";
    After => "after", "must be after {other}";
    NotAfter => "not_after", "must not be after {other} ({value})";
    InFuture => "in_future", "must be in the future";
    SpanAtMost => "span_at_most", "a report spans at most {days} days";
    Month => "month", "must be a month as YYYY-MM, got {value}";
    Day => "day", "must be a day as YYYY-MM-DD, got {value}";
    Cursor => "cursor", "is not a cursor this API returned";
    NextOfEarlierPage => "next_of_earlier_page", "must be the `next` of an earlier page";
    Unreadable => "unreadable", "cannot be read: {detail}";
    JsonContentType => "json_content_type", "must be application/json";
    UsernameStartsWithLetter => "username_starts_with_letter", "must start with a Latin letter (a-z)";
    UsernameCharacters => "username_characters", "may only contain Latin letters (a-z), digits, '_', '-' and '.', not {character}";
    PhoneDigits => "phone_digits", "must be digits, optionally after a leading '+'";
    PhoneCountryCode => "phone_country_code", "needs a country code (+...) unless it is an 11-digit mainland mobile number";
    PhoneLength => "phone_length", "must be '+', a country code and {min} to {max} digits in all";
    PasswordHash => "password_hash", "must be an argon2id PHC string";
    PasswordUnchanged => "password_unchanged", "must differ from the current password";
    LoginEither => "login_either", "give username and password, or phone and code";
    LoginNotBoth => "login_not_both", "give username and password, or phone and code, not both";
    MessageOrWindow => "message_or_window", "give message_id, or since and until";
    ServerName => "server_name", "{value}: a server's name is 1 to {max} letters, digits, - and _";
    ServerUrl => "server_url", "{value} is not an http(s) URL of at most {max} characters";
    HttpUrl => "http_url", "must be an http(s) URL of at most {max} characters";
    UrlMalformed => "url_malformed", "not an http(s) URL ({detail})";
    UrlCredentials => "url_credentials", "credentials in a URL are not taken";
    UrlForbidden => "url_forbidden", "{host} is {address} ({reason}), where webhooks never go";
    UrlUnresolved => "url_unresolved", "{host} does not resolve";
    AtLeastOneEventType => "at_least_one_event_type", "at least one of {allowed}";
    AtLeastOneScope => "at_least_one_scope", "a key needs at least one scope";
    AdminScope => "admin_scope", "only an admin's key may hold the admin scope";
    AtLeastOne => "at_least_one", "must be at least 1";
    StockAfter => "stock_after", "must be 1 to {max} (the stock stays at most {stock_max})";
    WorkNoImages => "work_no_images", "a work shows at least one image";
    WorkTooManyImages => "work_too_many_images", "a work shows at most {max} images";
    WorkUnknownImage => "work_unknown_image", "image {image} is not one this task made";
    WorkImageTwice => "work_image_twice", "image {image} is named twice";
    ReportNoteRequired => "report_note_required", "is required when the reason is \"other\"";
}

/// A rule broken, with the values its sentence names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    pub rule: Rule,
    pub args: Vec<(&'static str, String)>,
}

impl Broken {
    pub fn new(rule: Rule) -> Broken {
        Broken {
            rule,
            args: Vec::new(),
        }
    }

    /// `{name}` in the rule's sentence is `value`.
    pub fn with(mut self, name: &'static str, value: impl fmt::Display) -> Broken {
        self.args.push((name, value.to_string()));
        self
    }

    /// The rule's sentence in `template` (English or a catalog's), placeholders filled.
    pub fn fill(&self, template: &str) -> String {
        let mut text = template.to_owned();
        for (name, value) in &self.args {
            text = text.replace(&format!("{{{name}}}"), value);
        }
        text
    }
}

impl fmt::Display for Broken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.fill(self.rule.english()))
    }
}

impl std::error::Error for Broken {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_rule_says_its_sentence_with_its_values() {
        let broken = Broken::new(Rule::Between).with("min", 1).with("max", 100);
        assert_eq!(broken.to_string(), "must be 1 to 100");
    }

    #[test]
    fn every_rule_has_its_own_key() {
        let mut keys: Vec<&str> = Rule::ALL.iter().map(|rule| rule.key()).collect();
        keys.sort_unstable();
        let count = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), count, "two rules share a key");
    }
}
