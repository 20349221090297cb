//! The catalog check of a submit: every requested value against the configured catalog and its
//! bounds (`[tasks]` settings), every problem reported with the field it belongs to. After
//! [`Catalog::check`] a task's parameters are valid by construction ([`CheckedTask`]).

use rust_decimal::Decimal;
use zhihui_domain::points::Amount;
use zhihui_domain::rule::{Broken, Rule};
use zhihui_domain::task::{PromptText, TaskSpec};

use crate::platform::configuration::TaskSettings;

/// Largest seed: 2^53 - 1, so that JavaScript clients read it exactly.
pub const SEED_MAX: u64 = (1 << 53) - 1;
/// Decimal places a CFG value may have (ComfyUI steps it by 0.1 in its UI).
pub const CFG_SCALE_MAX: u32 = 1;

/// What a user asked for; `None` means "the default". Serializable for its digest (a retry with
/// the same `Idempotency-Key` must ask for the same thing).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RequestedTask {
    pub prompt: String,
    pub negative_prompt: Option<String>,
    pub images: Option<i64>,
    pub model: Option<String>,
    pub resolution: Option<String>,
    pub steps: Option<i64>,
    pub cfg: Option<Decimal>,
    pub sampler: Option<String>,
    pub scheduler: Option<String>,
    pub seed: Option<i64>,
}

/// A field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: &'static str,
    pub broken: Broken,
}

/// A request that passed the catalog: its parameters and its price.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedTask {
    pub spec: TaskSpec,
    pub prompt: PromptText,
    pub negative_prompt: PromptText,
    pub price: Amount,
}

pub use crate::platform::configuration::parse_resolution;

#[derive(Debug, Clone)]
pub struct Catalog {
    settings: TaskSettings,
}

fn one_of(
    field: &'static str,
    value: Option<&String>,
    allowed: &[String],
    default: &str,
    errors: &mut Vec<FieldError>,
) -> String {
    match value {
        None => default.to_owned(),
        Some(value) if allowed.contains(value) => value.clone(),
        Some(value) => {
            errors.push(FieldError {
                field,
                broken: Broken::new(Rule::OneOf)
                    .with("value", format!("{value:?}"))
                    .with("allowed", allowed.join(", ")),
            });
            default.to_owned()
        }
    }
}

fn within(
    field: &'static str,
    value: Option<i64>,
    min: u32,
    max: u32,
    default: u32,
    errors: &mut Vec<FieldError>,
) -> u32 {
    match value {
        None => default,
        Some(value) => match u32::try_from(value) {
            Ok(value) if (min..=max).contains(&value) => value,
            _ => {
                errors.push(FieldError {
                    field,
                    broken: Broken::new(Rule::IntegerBetween)
                        .with("min", min)
                        .with("max", max)
                        .with("value", value),
                });
                default
            }
        },
    }
}

impl Catalog {
    pub fn new(settings: TaskSettings) -> Catalog {
        Catalog { settings }
    }

    pub fn settings(&self) -> &TaskSettings {
        &self.settings
    }

    /// Check every field; `random_seed` is used when the request has none.
    pub fn check(
        &self,
        request: &RequestedTask,
        random_seed: u64,
    ) -> Result<CheckedTask, Vec<FieldError>> {
        let settings = &self.settings;
        let mut errors = Vec::new();
        let prompt = PromptText::parse(&request.prompt, settings.prompt_length_max, false)
            .map_err(|error| {
                errors.push(FieldError {
                    field: "prompt",
                    broken: error.0,
                })
            })
            .ok();
        let negative_prompt = PromptText::parse(
            request.negative_prompt.as_deref().unwrap_or(""),
            settings.negative_prompt_length_max,
            true,
        )
        .map_err(|error| {
            errors.push(FieldError {
                field: "negative_prompt",
                broken: error.0,
            })
        })
        .ok();
        let images = within(
            "images",
            request.images,
            1,
            settings.images_per_task_max,
            1,
            &mut errors,
        );
        let model = one_of(
            "model",
            request.model.as_ref(),
            &settings.models,
            &settings.models[0],
            &mut errors,
        );
        let resolution = one_of(
            "resolution",
            request.resolution.as_ref(),
            &settings.resolution_presets,
            &settings.default_resolution,
            &mut errors,
        );
        let (width, height) = parse_resolution(&resolution)
            .unwrap_or_else(|| unreachable!("presets are checked when settings load"));
        let steps = within(
            "steps",
            request.steps,
            settings.steps_min,
            settings.steps_max,
            settings.default_steps,
            &mut errors,
        );
        let cfg = match request.cfg {
            None => settings.default_cfg,
            Some(cfg)
                if cfg >= settings.cfg_min
                    && cfg <= settings.cfg_max
                    && cfg.normalize().scale() <= CFG_SCALE_MAX =>
            {
                cfg.normalize()
            }
            Some(cfg) => {
                errors.push(FieldError {
                    field: "cfg",
                    broken: Broken::new(Rule::DecimalBetween)
                        .with("min", settings.cfg_min)
                        .with("max", settings.cfg_max)
                        .with("places", CFG_SCALE_MAX)
                        .with("value", cfg),
                });
                settings.default_cfg
            }
        };
        let sampler = one_of(
            "sampler",
            request.sampler.as_ref(),
            &settings.samplers,
            &settings.default_sampler,
            &mut errors,
        );
        let scheduler = one_of(
            "scheduler",
            request.scheduler.as_ref(),
            &settings.schedulers,
            &settings.default_scheduler,
            &mut errors,
        );
        let seed = match request.seed {
            None => random_seed % (SEED_MAX + 1),
            Some(seed) => match u64::try_from(seed) {
                Ok(seed) if seed <= SEED_MAX => seed,
                _ => {
                    errors.push(FieldError {
                        field: "seed",
                        broken: Broken::new(Rule::IntegerBetween)
                            .with("min", 0)
                            .with("max", SEED_MAX)
                            .with("value", seed),
                    });
                    0
                }
            },
        };
        let (Some(prompt), Some(negative_prompt), true) =
            (prompt, negative_prompt, errors.is_empty())
        else {
            return Err(errors);
        };
        let price =
            Amount::parse(settings.price_per_image * Decimal::from(images)).map_err(|_| {
                vec![FieldError {
                    field: "images",
                    broken: Broken::new(Rule::NotPayable).with("images", images),
                }]
            })?;
        Ok(CheckedTask {
            spec: TaskSpec {
                model,
                width,
                height,
                steps,
                cfg,
                sampler,
                scheduler,
                seed,
                images,
            },
            prompt,
            negative_prompt,
            price,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::platform::configuration::Settings;

    fn catalog() -> Catalog {
        Catalog::new(Settings::load(None).unwrap().tasks)
    }

    #[test]
    fn defaults_fill_what_the_request_leaves_out_and_the_price_is_per_image() {
        let checked = catalog()
            .check(
                &RequestedTask {
                    prompt: "a cat".into(),
                    images: Some(3),
                    ..RequestedTask::default()
                },
                7,
            )
            .unwrap();
        assert_eq!(checked.spec.model, "majicmixRealistic_v7.safetensors");
        assert_eq!((checked.spec.width, checked.spec.height), (512, 512));
        assert_eq!(checked.spec.scheduler, "karras");
        assert_eq!(checked.spec.seed, 7);
        assert_eq!(checked.price, Amount::whole(3));
    }

    #[test]
    fn every_bad_field_is_named() {
        let errors = catalog()
            .check(
                &RequestedTask {
                    prompt: " ".into(),
                    images: Some(0),
                    model: Some("sdxl.safetensors".into()),
                    resolution: Some("1024x1024".into()),
                    steps: Some(500),
                    cfg: Some(Decimal::new(755, 2)),
                    sampler: Some("ddim".into()),
                    scheduler: Some("fast".into()),
                    seed: Some(-1),
                    negative_prompt: Some("x".repeat(1001)),
                },
                0,
            )
            .unwrap_err();
        let fields: Vec<_> = errors.iter().map(|error| error.field).collect();
        assert_eq!(
            fields,
            [
                "prompt",
                "negative_prompt",
                "images",
                "model",
                "resolution",
                "steps",
                "cfg",
                "sampler",
                "scheduler",
                "seed"
            ]
        );
    }

    #[test]
    fn resolutions_are_multiples_of_eight_within_bounds() {
        assert_eq!(parse_resolution("512x768"), Some((512, 768)));
        assert_eq!(parse_resolution("513x768"), None);
        assert_eq!(parse_resolution("8x8"), None);
        assert_eq!(parse_resolution("512"), None);
    }
}
