//! Typed, layered settings: built-in defaults, then an optional TOML file, then `ZHIHUI_`
//! environment variables (`ZHIHUI_DATABASE__URL`, `ZHIHUI_REDIS__KEY_PREFIX`, ...; a double
//! underscore separates levels).
//!
//! Every timeout and pool size is a named setting with its unit in the name. Secrets (the database
//! and Redis URLs may carry passwords) are [`SecretString`]s: their `Debug` output is redacted, so
//! logging the settings never leaks them.

use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

mod sections;
mod validate;

pub use sections::*;

/// Environment variable prefix for every setting.
pub const ENV_PREFIX: &str = "ZHIHUI";

#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    pub environment: Environment,
    pub http: HttpSettings,
    pub database: DatabaseSettings,
    pub redis: RedisSettings,
    pub event_store: EventStoreSettings,
    pub auth: AuthSettings,
    pub projections: ProjectionSettings,
    pub process_managers: ProcessManagerSettings,
    pub accounts: AccountSettings,
    pub tasks: TaskSettings,
    pub translation: TranslationSettings,
    pub dispatch: DispatchSettings,
    pub codes: CodeSettings,
    pub checkins: CheckInSettings,
    pub gallery: GallerySettings,
    pub stats: StatsSettings,
    pub promotions: PromotionSettings,
    pub labels: LabelSettings,
    pub web: WebSettings,
    pub api_keys: ApiKeySettings,
    pub webhooks: WebhookSettings,
    pub log: LogSettings,
}

/// The defaults, as TOML, so that the file format and the defaults can never disagree.
const DEFAULTS_TOML: &str = include_str!("default_settings.toml");

impl Settings {
    /// Load defaults, then `file` if given, then `ZHIHUI_*` environment variables.
    /// The built-in defaults alone (no file, no environment): tests and benchmarks.
    pub fn defaults() -> anyhow::Result<Settings> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(
                DEFAULTS_TOML,
                config::FileFormat::Toml,
            ))
            .build()
            .context("reading the default settings")?
            .try_deserialize()
            .context("the default settings do not match the expected shape")?;
        settings.validate()?;
        Ok(settings)
    }

    pub fn load(file: Option<&Path>) -> anyhow::Result<Settings> {
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULTS_TOML,
            config::FileFormat::Toml,
        ));
        if let Some(path) = file {
            builder = builder.add_source(config::File::from(path).required(true));
        }
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("_")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("dispatch.backends")
                .with_list_parse_key("webhooks.allowed_networks")
                .with_list_parse_key("webhooks.retry_schedule_ms"),
        );
        let settings: Settings = builder
            .build()
            .context("reading settings")?
            .try_deserialize()
            .context("settings do not match the expected shape")?;
        settings.validate()?;
        Ok(settings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::SecretString;

    #[test]
    fn defaults_parse_and_are_valid() {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(
                DEFAULTS_TOML,
                config::FileFormat::Toml,
            ))
            .build()
            .and_then(|c| c.try_deserialize())
            .expect("defaults deserialize");
        settings.validate().expect("defaults are valid");
        assert_eq!(settings.log.format, LogFormat::Pretty);
    }

    #[test]
    fn production_refuses_the_development_code_key_and_keys_never_print() {
        let mut settings = Settings::load(None).expect("defaults load");
        settings.environment = Environment::Production;
        let refused = settings
            .validate()
            .expect_err("the development key is refused");
        assert!(refused.to_string().contains("codes.keys.0"), "{refused}");
        settings.codes.keys.insert(
            "0".into(),
            SecretString::from("a production secret of at least thirty-two bytes"),
        );
        // The development label key is refused too, naming its setting.
        let refused = settings
            .validate()
            .expect_err("the development label key is refused");
        assert!(
            refused.to_string().contains("labels.signing_key"),
            "{refused}"
        );
        settings.labels.signing_key =
            SecretString::from("a production label key of at least thirty-two bytes");
        // The development webhook key (every endpoint's secret derives from it) is refused too.
        let refused = settings
            .validate()
            .expect_err("the development webhook key is refused");
        assert!(
            refused.to_string().contains("webhooks.signing_key"),
            "{refused}"
        );
        settings.webhooks.signing_key =
            SecretString::from("a production webhook key of at least thirty-two bytes");
        // The log code sender is refused outside development, naming its setting.
        let refused = settings
            .validate()
            .expect_err("the log code sender is refused");
        assert!(
            refused.to_string().contains("auth.code_sender"),
            "{refused}"
        );
        settings.auth.code_sender = CodeSenderKind::Disabled;
        settings.validate().expect("real keys are accepted");
        assert!(!format!("{:?}", settings.codes).contains("production secret"));
        assert!(!format!("{:?}", settings.labels).contains("production label key"));
        assert!(!format!("{:?}", settings.webhooks).contains("production webhook key"));
        settings
            .codes
            .keys
            .insert("1".into(), SecretString::from("too short"));
        assert!(settings.validate().is_err());
    }

    #[test]
    fn debug_output_never_shows_the_database_password() {
        let settings = DatabaseSettings {
            url: SecretString::from("postgres://u:hunter2@localhost/db"),
            pool_max_size: 1,
            worker_pool_max_size: 1,
            pool_wait_timeout_ms: 1,
            connect_timeout_ms: 1,
            migrate_on_start: true,
            failover_wait_ms: 1,
        };
        let printed = format!("{settings:?}");
        assert!(!printed.contains("hunter2"), "{printed}");
    }

    #[test]
    fn a_model_reads_as_its_configured_name_else_its_file_name_without_extension() {
        let mut settings = Settings::load(None).expect("defaults load");
        let tasks = &mut settings.tasks;
        assert_eq!(
            tasks.model_name("majicmixRealistic_v7.safetensors"),
            "麦橘写实 v7"
        );
        // An English page reads the English name where there is one, else the same name.
        assert_eq!(
            tasks.model_name_in("majicmixRealistic_v7.safetensors", true),
            "majicMIX realistic v7"
        );
        assert_eq!(
            tasks.model_name_in("anythingelseV4_v45.safetensors", true),
            "Anything V4.5"
        );
        tasks.model_names.clear();
        tasks.model_names_en.clear();
        assert_eq!(
            tasks.model_name("majicmixRealistic_v7.safetensors"),
            "majicmixRealistic v7"
        );
        assert_eq!(tasks.model_name("sd_xl_base_1.0.CKPT"), "sd xl base 1.0");
        assert_eq!(tasks.model_name("国风_v3"), "国风 v3");
        // A name that is nothing but an extension stays as it is.
        assert_eq!(tasks.model_name(".safetensors"), ".safetensors");
        // A name for a model that is not offered, or one of two lines, is refused at start.
        tasks
            .model_names
            .insert("missing.safetensors".into(), "不存在".into());
        let refused = settings.validate().expect_err("an unknown model's name");
        assert!(
            refused.to_string().contains("tasks.model_names"),
            "{refused}"
        );
        settings.tasks.model_names.clear();
        settings.tasks.model_names.insert(
            "majicmixRealistic_v7.safetensors".into(),
            "两行\n名字".into(),
        );
        let refused = settings.validate().expect_err("a name of two lines");
        assert!(refused.to_string().contains("one line"), "{refused}");
        settings.tasks.model_names.clear();
        settings
            .tasks
            .model_names_en
            .insert("missing.safetensors".into(), "Missing".into());
        let refused = settings
            .validate()
            .expect_err("an unknown model's English name");
        assert!(
            refused.to_string().contains("tasks.model_names_en"),
            "{refused}"
        );
    }
}
