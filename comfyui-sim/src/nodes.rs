//! The node classes the simulator knows, their `/object_info` entries, and ComfyUI's prompt
//! validation (execution.py `validate_prompt` / `validate_inputs`, 0.3.64) reproduced error for
//! error, because a dispatcher's handling of 400s is only as good as the 400s it was tested with.
//! What each class *does* at run time lives in `engine.rs`.

use crate::obj;
use crate::ojson::{OMap, OValue, PyNum, py_str_repr};

/// How an input is typed: the primitive widgets ComfyUI converts, a combo, or a link type.
#[derive(Clone, Debug)]
pub enum InputType {
    Int,
    Float,
    String,
    Combo(Vec<String>),
    /// A link-only type such as `IMAGE`; `*` accepts anything.
    Link(&'static str),
}

impl InputType {
    /// The first element of the `[type, options]` pair in `/object_info` and `input_config`.
    fn to_value(&self) -> OValue {
        match self {
            InputType::Int => "INT".into(),
            InputType::Float => "FLOAT".into(),
            InputType::String => "STRING".into(),
            InputType::Combo(items) => {
                OValue::Array(items.iter().map(|s| s.as_str().into()).collect())
            }
            InputType::Link(t) => (*t).into(),
        }
    }
    /// The name used in "Failed to convert an input value to a X value" and type checks.
    fn name(&self) -> String {
        match self {
            InputType::Combo(items) => {
                OValue::Array(items.iter().map(|s| s.as_str().into()).collect()).py_repr()
            }
            other => other.to_value().py_str(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct InputDef {
    pub name: &'static str,
    pub ty: InputType,
    pub opts: OValue,
}

impl InputDef {
    fn info(&self) -> OValue {
        OValue::Array(vec![self.ty.to_value(), self.opts.clone()])
    }
    fn opt(&self, key: &str) -> Option<PyNum> {
        self.opts.get(key).and_then(OValue::as_num)
    }
}

#[derive(Clone, Debug)]
pub struct NodeDef {
    pub name: &'static str,
    pub display_name: &'static str,
    pub description: &'static str,
    pub python_module: &'static str,
    pub category: &'static str,
    pub required: Vec<InputDef>,
    pub optional: Vec<InputDef>,
    pub hidden: Vec<(&'static str, &'static str)>,
    pub outputs: Vec<&'static str>,
    pub output_tooltips: Vec<&'static str>,
    pub output_node: bool,
}

impl NodeDef {
    /// ComfyUI puts the node id into the cache signature of nodes with a `UNIQUE_ID` input.
    pub fn uses_unique_id(&self) -> bool {
        self.hidden.iter().any(|(_, t)| *t == "UNIQUE_ID")
    }

    pub fn input(&self, name: &str) -> Option<&InputDef> {
        self.required
            .iter()
            .chain(&self.optional)
            .find(|i| i.name == name)
    }

    /// The class's `/object_info` entry, in ComfyUI's key order.
    pub fn object_info(&self) -> OValue {
        let section = |defs: &[InputDef]| {
            let mut m = OMap::new();
            for d in defs {
                m.insert(d.name, d.info());
            }
            OValue::Object(m)
        };
        let names = |defs: &[InputDef]| OValue::Array(defs.iter().map(|d| d.name.into()).collect());
        let mut input = OMap::new();
        let mut order = OMap::new();
        input.insert("required", section(&self.required));
        order.insert("required", names(&self.required));
        if !self.optional.is_empty() {
            input.insert("optional", section(&self.optional));
            order.insert("optional", names(&self.optional));
        }
        if !self.hidden.is_empty() {
            let mut h = OMap::new();
            for (k, t) in &self.hidden {
                h.insert(*k, OValue::from(*t));
            }
            input.insert("hidden", OValue::Object(h));
            order.insert(
                "hidden",
                OValue::Array(self.hidden.iter().map(|(k, _)| (*k).into()).collect()),
            );
        }
        let mut m = OMap::new();
        m.insert("input", OValue::Object(input));
        m.insert("input_order", OValue::Object(order));
        m.insert("output", OValue::from(self.outputs.clone()));
        m.insert(
            "output_is_list",
            OValue::Array(self.outputs.iter().map(|_| false.into()).collect()),
        );
        m.insert("output_name", OValue::from(self.outputs.clone()));
        m.insert("name", OValue::from(self.name));
        m.insert("display_name", OValue::from(self.display_name));
        m.insert("description", OValue::from(self.description));
        m.insert("python_module", OValue::from(self.python_module));
        m.insert("category", OValue::from(self.category));
        m.insert("output_node", OValue::from(self.output_node));
        if !self.output_tooltips.is_empty() {
            m.insert(
                "output_tooltips",
                OValue::from(self.output_tooltips.clone()),
            );
        }
        OValue::Object(m)
    }
}

/// KSampler's `sampler_name` list in ComfyUI 0.3.64 (comfy/samplers.py `SAMPLER_NAMES`).
pub const SAMPLERS: &[&str] = &[
    "euler",
    "euler_cfg_pp",
    "euler_ancestral",
    "euler_ancestral_cfg_pp",
    "heun",
    "heunpp2",
    "dpm_2",
    "dpm_2_ancestral",
    "lms",
    "dpm_fast",
    "dpm_adaptive",
    "dpmpp_2s_ancestral",
    "dpmpp_2s_ancestral_cfg_pp",
    "dpmpp_sde",
    "dpmpp_sde_gpu",
    "dpmpp_2m",
    "dpmpp_2m_cfg_pp",
    "dpmpp_2m_sde",
    "dpmpp_2m_sde_gpu",
    "dpmpp_2m_sde_heun",
    "dpmpp_2m_sde_heun_gpu",
    "dpmpp_3m_sde",
    "dpmpp_3m_sde_gpu",
    "ddpm",
    "lcm",
    "ipndm",
    "ipndm_v",
    "deis",
    "res_multistep",
    "res_multistep_cfg_pp",
    "res_multistep_ancestral",
    "res_multistep_ancestral_cfg_pp",
    "gradient_estimation",
    "gradient_estimation_cfg_pp",
    "er_sde",
    "seeds_2",
    "seeds_3",
    "sa_solver",
    "sa_solver_pece",
    "ddim",
    "uni_pc",
    "uni_pc_bh2",
];

/// KSampler's `scheduler` list in ComfyUI 0.3.64 (comfy/samplers.py `SCHEDULER_NAMES`).
pub const SCHEDULERS: &[&str] = &[
    "simple",
    "sgm_uniform",
    "karras",
    "exponential",
    "ddim_uniform",
    "beta",
    "normal",
    "linear_quadratic",
    "kl_optimal",
];

fn input(name: &'static str, ty: InputType, opts: OValue) -> InputDef {
    InputDef { name, ty, opts }
}

fn combo(items: &[&str]) -> InputType {
    InputType::Combo(items.iter().map(|s| (*s).to_owned()).collect())
}

/// Every class the simulator serves, in a fixed order (the order of `GET /object_info`).
#[derive(Clone, Debug)]
pub struct Catalog {
    pub nodes: Vec<NodeDef>,
}

impl Catalog {
    pub fn new(models: &[String]) -> Catalog {
        use InputType::*;
        let u64_max = OValue::Number(u64::MAX.into());
        let save_hidden = vec![("prompt", "PROMPT"), ("extra_pnginfo", "EXTRA_PNGINFO")];
        let nodes = vec![
            NodeDef {
                name: "CheckpointLoaderSimple",
                display_name: "Load Checkpoint",
                description: "Loads a diffusion model checkpoint, diffusion models are used to denoise latents.",
                python_module: "nodes",
                category: "loaders",
                required: vec![input(
                    "ckpt_name",
                    InputType::Combo(models.to_vec()),
                    obj![("tooltip", "The name of the checkpoint (model) to load.")],
                )],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["MODEL", "CLIP", "VAE"],
                output_tooltips: vec![
                    "The model used for denoising latents.",
                    "The CLIP model used for encoding text prompts.",
                    "The VAE model used for encoding and decoding images to and from latent space.",
                ],
                output_node: false,
            },
            NodeDef {
                name: "CLIPTextEncode",
                display_name: "CLIP Text Encode (Prompt)",
                description: "Encodes a text prompt using a CLIP model into an embedding that can be used to guide the diffusion model towards generating specific images.",
                python_module: "nodes",
                category: "conditioning",
                required: vec![
                    input(
                        "text",
                        String,
                        obj![
                            ("multiline", true),
                            ("dynamicPrompts", true),
                            ("tooltip", "The text to be encoded.")
                        ],
                    ),
                    input(
                        "clip",
                        Link("CLIP"),
                        obj![("tooltip", "The CLIP model used for encoding the text.")],
                    ),
                ],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["CONDITIONING"],
                output_tooltips: vec![
                    "A conditioning containing the embedded text used to guide the diffusion model.",
                ],
                output_node: false,
            },
            NodeDef {
                name: "EmptyLatentImage",
                display_name: "Empty Latent Image",
                description: "Create a new batch of empty latent images to be denoised via sampling.",
                python_module: "nodes",
                category: "latent",
                required: vec![
                    input(
                        "width",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 16i64),
                            ("max", 16384i64),
                            ("step", 8i64),
                            ("tooltip", "The width of the latent images in pixels.")
                        ],
                    ),
                    input(
                        "height",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 16i64),
                            ("max", 16384i64),
                            ("step", 8i64),
                            ("tooltip", "The height of the latent images in pixels.")
                        ],
                    ),
                    input(
                        "batch_size",
                        Int,
                        obj![
                            ("default", 1i64),
                            ("min", 1i64),
                            ("max", 4096i64),
                            ("tooltip", "The number of latent images in the batch.")
                        ],
                    ),
                ],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["LATENT"],
                output_tooltips: vec!["The empty latent image batch."],
                output_node: false,
            },
            NodeDef {
                name: "KSampler",
                display_name: "KSampler",
                description: "Uses the provided model, positive and negative conditioning to denoise the latent image.",
                python_module: "nodes",
                category: "sampling",
                required: vec![
                    input(
                        "model",
                        Link("MODEL"),
                        obj![("tooltip", "The model used for denoising the input latent.")],
                    ),
                    input(
                        "seed",
                        Int,
                        obj![
                            ("default", 0i64),
                            ("min", 0i64),
                            ("max", u64_max),
                            ("control_after_generate", true),
                            ("tooltip", "The random seed used for creating the noise.")
                        ],
                    ),
                    input(
                        "steps",
                        Int,
                        obj![
                            ("default", 20i64),
                            ("min", 1i64),
                            ("max", 10000i64),
                            (
                                "tooltip",
                                "The number of steps used in the denoising process."
                            )
                        ],
                    ),
                    input(
                        "cfg",
                        Float,
                        obj![
                            ("default", 8.0),
                            ("min", 0.0),
                            ("max", 100.0),
                            ("step", 0.1),
                            ("round", 0.01),
                            (
                                "tooltip",
                                "The Classifier-Free Guidance scale balances creativity and adherence to the prompt. Higher values result in images more closely matching the prompt however too high values will negatively impact quality."
                            )
                        ],
                    ),
                    input(
                        "sampler_name",
                        combo(SAMPLERS),
                        obj![(
                            "tooltip",
                            "The algorithm used when sampling, this can affect the quality, speed, and style of the generated output."
                        )],
                    ),
                    input(
                        "scheduler",
                        combo(SCHEDULERS),
                        obj![(
                            "tooltip",
                            "The scheduler controls how noise is gradually removed to form the image."
                        )],
                    ),
                    input(
                        "positive",
                        Link("CONDITIONING"),
                        obj![(
                            "tooltip",
                            "The conditioning describing the attributes you want to include in the image."
                        )],
                    ),
                    input(
                        "negative",
                        Link("CONDITIONING"),
                        obj![(
                            "tooltip",
                            "The conditioning describing the attributes you want to exclude from the image."
                        )],
                    ),
                    input(
                        "latent_image",
                        Link("LATENT"),
                        obj![("tooltip", "The latent image to denoise.")],
                    ),
                    input(
                        "denoise",
                        Float,
                        obj![
                            ("default", 1.0),
                            ("min", 0.0),
                            ("max", 1.0),
                            ("step", 0.01),
                            (
                                "tooltip",
                                "The amount of denoising applied, lower values will maintain the structure of the initial image allowing for image to image sampling."
                            )
                        ],
                    ),
                ],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["LATENT"],
                output_tooltips: vec!["The denoised latent."],
                output_node: false,
            },
            NodeDef {
                name: "VAEDecode",
                display_name: "VAE Decode",
                description: "Decodes latent images back into pixel space images.",
                python_module: "nodes",
                category: "latent",
                required: vec![
                    input(
                        "samples",
                        Link("LATENT"),
                        obj![("tooltip", "The latent to be decoded.")],
                    ),
                    input(
                        "vae",
                        Link("VAE"),
                        obj![("tooltip", "The VAE model used for decoding the latent.")],
                    ),
                ],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["IMAGE"],
                output_tooltips: vec!["The decoded image."],
                output_node: false,
            },
            NodeDef {
                name: "SaveImage",
                display_name: "Save Image",
                description: "Saves the input images to your ComfyUI output directory.",
                python_module: "nodes",
                category: "image",
                required: vec![
                    input(
                        "images",
                        Link("IMAGE"),
                        obj![("tooltip", "The images to save.")],
                    ),
                    input(
                        "filename_prefix",
                        String,
                        obj![
                            ("default", "ComfyUI"),
                            (
                                "tooltip",
                                "The prefix for the file to save. This may include formatting information such as %date:yyyy-MM-dd% or %Empty Latent Image.width% to include values from nodes."
                            )
                        ],
                    ),
                ],
                optional: vec![],
                hidden: save_hidden.clone(),
                outputs: vec![],
                output_tooltips: vec![],
                output_node: true,
            },
            NodeDef {
                name: "PreviewImage",
                display_name: "Preview Image",
                description: "Saves the input images to your ComfyUI output directory.",
                python_module: "nodes",
                category: "image",
                required: vec![input("images", Link("IMAGE"), obj![])],
                optional: vec![],
                hidden: save_hidden,
                outputs: vec![],
                output_tooltips: vec![],
                output_node: true,
            },
            NodeDef {
                name: "EmptyImage",
                display_name: "EmptyImage",
                description: "",
                python_module: "nodes",
                category: "image",
                required: vec![
                    input(
                        "width",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 1i64),
                            ("max", 16384i64),
                            ("step", 1i64)
                        ],
                    ),
                    input(
                        "height",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 1i64),
                            ("max", 16384i64),
                            ("step", 1i64)
                        ],
                    ),
                    input(
                        "batch_size",
                        Int,
                        obj![("default", 1i64), ("min", 1i64), ("max", 4096i64)],
                    ),
                    input(
                        "color",
                        Int,
                        obj![
                            ("default", 0i64),
                            ("min", 0i64),
                            ("max", 16777215i64),
                            ("step", 1i64),
                            ("display", "color")
                        ],
                    ),
                ],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["IMAGE"],
                output_tooltips: vec![],
                output_node: false,
            },
            NodeDef {
                name: "ImageScale",
                display_name: "Upscale Image",
                description: "",
                python_module: "nodes",
                category: "image/upscaling",
                required: vec![
                    input("image", Link("IMAGE"), obj![]),
                    input(
                        "upscale_method",
                        combo(&["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]),
                        obj![],
                    ),
                    input(
                        "width",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 0i64),
                            ("max", 16384i64),
                            ("step", 1i64)
                        ],
                    ),
                    input(
                        "height",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 0i64),
                            ("max", 16384i64),
                            ("step", 1i64)
                        ],
                    ),
                    input("crop", combo(&["disabled", "center"]), obj![]),
                ],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["IMAGE"],
                output_tooltips: vec![],
                output_node: false,
            },
            NodeDef {
                name: "SolidMask",
                display_name: "SolidMask",
                description: "",
                python_module: "comfy_extras.nodes_mask",
                category: "mask",
                required: vec![
                    input(
                        "value",
                        Float,
                        obj![("default", 1.0), ("min", 0.0), ("max", 1.0), ("step", 0.01)],
                    ),
                    input(
                        "width",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 1i64),
                            ("max", 16384i64),
                            ("step", 1i64)
                        ],
                    ),
                    input(
                        "height",
                        Int,
                        obj![
                            ("default", 512i64),
                            ("min", 1i64),
                            ("max", 16384i64),
                            ("step", 1i64)
                        ],
                    ),
                ],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["MASK"],
                output_tooltips: vec![],
                output_node: false,
            },
            NodeDef {
                name: "TestSleep",
                display_name: "Test Sleep",
                description: "",
                python_module: "custom_nodes.testing-pack",
                category: "_for_testing",
                required: vec![
                    input("value", Link("*"), obj![]),
                    input(
                        "seconds",
                        Float,
                        obj![
                            ("default", 1.0),
                            ("min", 0.0),
                            ("max", 9999.0),
                            ("step", 0.01),
                            ("tooltip", "The amount of seconds to sleep.")
                        ],
                    ),
                ],
                optional: vec![],
                hidden: vec![("unique_id", "UNIQUE_ID")],
                outputs: vec!["*"],
                output_tooltips: vec![],
                output_node: false,
            },
            NodeDef {
                name: "TestSyncError",
                display_name: "Test Sync Error",
                description: "",
                python_module: "custom_nodes.testing-pack",
                category: "_for_testing/async",
                required: vec![input("value", Link("*"), obj![])],
                optional: vec![],
                hidden: vec![],
                outputs: vec!["*"],
                output_tooltips: vec![],
                output_node: false,
            },
        ];
        Catalog { nodes }
    }

    pub fn get(&self, class_type: &str) -> Option<&NodeDef> {
        self.nodes.iter().find(|n| n.name == class_type)
    }

    pub fn object_info(&self) -> OValue {
        let mut m = OMap::new();
        for n in &self.nodes {
            m.insert(n.name, n.object_info());
        }
        OValue::Object(m)
    }
}

/// The outcome of `validate_prompt`: what `POST /prompt` answers.
#[derive(Debug)]
pub enum Validation {
    /// Queue the prompt with these outputs; `node_errors` may still be non-empty (partial run).
    Valid {
        outputs: Vec<String>,
        node_errors: OMap<OValue>,
    },
    Invalid {
        error: OValue,
        node_errors: OMap<OValue>,
    },
}

/// A Python exception raised while validating (ComfyUI reports its type and `str()`).
struct PyError {
    exception_type: &'static str,
    message: String,
    traceback: Vec<String>,
}

type Validated = OMap<(bool, Vec<OValue>)>;

fn error_obj(kind: &str, message: &str, details: &str, extra: OValue) -> OValue {
    obj![
        ("type", kind),
        ("message", message),
        ("details", details),
        ("extra_info", extra)
    ]
}

/// execution.py `validate_prompt`. Mutates `prompt`: ComfyUI writes converted INT/FLOAT/STRING
/// values back (a posted `10` for a FLOAT comes back from `/history` as `10.0`).
pub fn validate_prompt(
    catalog: &Catalog,
    prompt: &mut OMap<OValue>,
    partial_targets: Option<&[String]>,
) -> Validation {
    let mut outputs = Vec::new();
    for (id, node) in prompt.iter() {
        let invalid = |message: String| Validation::Invalid {
            error: error_obj(
                "invalid_prompt",
                &message,
                &format!("Node ID '#{id}'"),
                obj![],
            ),
            node_errors: OMap::new(),
        };
        let Some(class_value) = node.get("class_type") else {
            return invalid(
                "Cannot execute because a node is missing the class_type property.".into(),
            );
        };
        let def = class_value.as_str().and_then(|c| catalog.get(c));
        let Some(def) = def else {
            return invalid(format!(
                "Cannot execute because node {} does not exist.",
                class_value.py_str()
            ));
        };
        if def.output_node && partial_targets.is_none_or(|t| t.contains(id)) {
            outputs.push(id.clone());
        }
    }
    if outputs.is_empty() {
        return Validation::Invalid {
            error: error_obj("prompt_no_outputs", "Prompt has no outputs", "", obj![]),
            node_errors: OMap::new(),
        };
    }

    let mut good = Vec::new();
    let mut errors: Vec<Vec<OValue>> = Vec::new();
    let mut node_errors: OMap<OValue> = OMap::new();
    let mut validated: Validated = OMap::new();
    for o in &outputs {
        let (valid, reasons) = match validate_inputs(catalog, prompt, o, &mut validated) {
            Ok(r) => r,
            Err(ex) => {
                let reasons = vec![error_obj(
                    "exception_during_validation",
                    "Exception when validating node",
                    &ex.message,
                    obj![
                        ("exception_type", ex.exception_type),
                        ("traceback", ex.traceback)
                    ],
                )];
                validated.insert(o.clone(), (false, reasons.clone()));
                (false, reasons)
            }
        };
        if valid {
            good.push(o.clone());
            continue;
        }
        tracing::warn!(output = %o, "failed to validate prompt for output");
        errors.push(reasons);
        // Like ComfyUI, every failing output is added as dependent of every failing node seen
        // so far (not only of its own ancestors).
        for (node_id, (ok, reasons)) in validated.iter() {
            if *ok || reasons.is_empty() {
                continue;
            }
            if !node_errors.contains_key(node_id) {
                let class_type = prompt
                    .get(node_id)
                    .and_then(|n| n.get("class_type"))
                    .cloned()
                    .unwrap_or(OValue::Null);
                node_errors.insert(
                    node_id.clone(),
                    obj![
                        ("errors", OValue::Array(reasons.clone())),
                        ("dependent_outputs", OValue::Array(vec![])),
                        ("class_type", class_type)
                    ],
                );
            }
            if let Some(OValue::Object(entry)) = node_errors.get_mut(node_id)
                && let Some(OValue::Array(deps)) = entry.get_mut("dependent_outputs")
            {
                deps.push(o.as_str().into());
            }
        }
    }
    if good.is_empty() {
        let details: Vec<String> = errors
            .iter()
            .flatten()
            .map(|e| {
                format!(
                    "{}: {}",
                    e.get("message").map(OValue::py_str).unwrap_or_default(),
                    e.get("details").map(OValue::py_str).unwrap_or_default()
                )
            })
            .collect();
        return Validation::Invalid {
            error: error_obj(
                "prompt_outputs_failed_validation",
                "Prompt outputs failed validation",
                &details.join("\n"),
                obj![],
            ),
            node_errors,
        };
    }
    Validation::Valid {
        outputs: good,
        node_errors,
    }
}

fn key_error(key: &OValue, line: &str) -> PyError {
    PyError {
        exception_type: "KeyError",
        message: key.py_repr(),
        traceback: vec![
            "  File \"/opt/ComfyUI/execution.py\", line 1010, in validate_prompt\n    m = await validate_inputs(prompt_id, prompt, o, validated)\n        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n".to_owned(),
            format!("  File \"/opt/ComfyUI/execution.py\", line 788, in validate_inputs\n    {line}\n"),
        ],
    }
}

/// execution.py `validate_inputs`: validates `unique_id` and (recursively) its ancestors.
fn validate_inputs(
    catalog: &Catalog,
    prompt: &mut OMap<OValue>,
    unique_id: &str,
    validated: &mut Validated,
) -> Result<(bool, Vec<OValue>), PyError> {
    if let Some(done) = validated.get(unique_id) {
        return Ok(done.clone());
    }
    let node = prompt.get(unique_id).ok_or_else(|| {
        key_error(
            &unique_id.into(),
            "o_class_type = prompt[o_id]['class_type']",
        )
    })?;
    let class_type = node
        .get("class_type")
        .and_then(OValue::as_str)
        .unwrap_or_default()
        .to_owned();
    let Some(def) = catalog.get(&class_type) else {
        return Err(key_error(
            &class_type.as_str().into(),
            "obj_class = nodes.NODE_CLASS_MAPPINGS[class_type]",
        ));
    };
    let inputs = match node.get("inputs") {
        Some(OValue::Object(m)) => m.clone(),
        Some(_) => OMap::new(),
        None => {
            return Err(key_error(
                &"inputs".into(),
                "inputs = prompt[unique_id]['inputs']",
            ));
        }
    };

    let mut errors = Vec::new();
    let mut valid = true;
    let mut converted: Vec<(String, OValue)> = Vec::new();
    let all_inputs: Vec<(&InputDef, bool)> = def
        .required
        .iter()
        .map(|d| (d, true))
        .chain(def.optional.iter().map(|d| (d, false)))
        .collect();
    for (idef, required) in all_inputs {
        let x = idef.name;
        let info = idef.info();
        let Some(val) = inputs.get(x) else {
            if required {
                errors.push(error_obj(
                    "required_input_missing",
                    "Required input is missing",
                    x,
                    obj![("input_name", x)],
                ));
            }
            continue;
        };
        if let OValue::Array(link) = val {
            if link.len() != 2 {
                errors.push(error_obj(
                    "bad_linked_input",
                    "Bad linked input, must be a length-2 list of [node_id, slot_index]",
                    x,
                    obj![
                        ("input_name", x),
                        ("input_config", info),
                        ("received_value", val.clone())
                    ],
                ));
                continue;
            }
            let o_id = link[0].clone();
            let src = o_id.as_str().and_then(|id| prompt.get(id));
            let Some(src) = src else {
                return Err(key_error(
                    &o_id,
                    "o_class_type = prompt[o_id]['class_type']\n                   ~~~~~~^^^^^^",
                ));
            };
            let src_class = src
                .get("class_type")
                .and_then(OValue::as_str)
                .unwrap_or_default();
            let Some(src_def) = catalog.get(src_class) else {
                return Err(key_error(
                    &src_class.into(),
                    "r = nodes.NODE_CLASS_MAPPINGS[o_class_type].RETURN_TYPES",
                ));
            };
            let slot = match link[1].as_num() {
                Some(PyNum::Int(i)) => i,
                _ => {
                    return Err(PyError {
                        exception_type: "TypeError",
                        message: format!(
                            "tuple indices must be integers or slices, not {}",
                            link[1].py_type()
                        ),
                        traceback: vec![],
                    });
                }
            };
            let len = src_def.outputs.len() as i128;
            let index = if slot < 0 { slot + len } else { slot };
            if index < 0 || index >= len {
                return Err(PyError {
                    exception_type: "IndexError",
                    message: "tuple index out of range".into(),
                    traceback: vec![],
                });
            }
            let received = src_def.outputs[index as usize];
            if !types_compatible(received, &idef.ty) {
                errors.push(error_obj(
                    "return_type_mismatch",
                    "Return type mismatch between linked nodes",
                    &format!(
                        "{x}, received_type({received}) mismatch input_type({})",
                        idef.ty.name()
                    ),
                    obj![
                        ("input_name", x),
                        ("input_config", info),
                        ("received_type", received),
                        ("linked_node", val.clone())
                    ],
                ));
                continue;
            }
            let o_id = o_id.as_str().unwrap_or_default().to_owned();
            match validate_inputs(catalog, prompt, &o_id, validated) {
                Ok((false, _)) => valid = false,
                Ok(_) => {}
                Err(ex) => {
                    valid = false;
                    let reasons = vec![error_obj(
                        "exception_during_inner_validation",
                        "Exception when validating inner node",
                        &ex.message,
                        obj![
                            ("input_name", x),
                            ("input_config", info),
                            ("exception_message", ex.message.clone()),
                            ("exception_type", ex.exception_type),
                            ("traceback", ex.traceback),
                            ("linked_node", val.clone())
                        ],
                    )];
                    validated.insert(o_id, (false, reasons));
                }
            }
            continue;
        }

        let mut val = val.clone();
        if let Some(inner) = val.get("__value__") {
            val = inner.clone();
            converted.push((x.to_owned(), val.clone()));
        }
        let conversion = match &idef.ty {
            InputType::Int => Some(py_int(&val).map(|n| n.to_value())),
            InputType::Float => Some(py_float_of(&val).map(|f| PyNum::Float(f).to_value())),
            InputType::String => Some(Ok(OValue::String(val.py_str()))),
            _ => None,
        };
        match conversion {
            Some(Ok(v)) => {
                val = v;
                converted.push((x.to_owned(), val.clone()));
            }
            Some(Err(message)) => {
                errors.push(error_obj(
                    "invalid_input_type",
                    &format!(
                        "Failed to convert an input value to a {} value",
                        idef.ty.name()
                    ),
                    &format!("{x}, {}, {message}", val.py_str()),
                    obj![
                        ("input_name", x),
                        ("input_config", info),
                        ("received_value", val.clone()),
                        ("exception_message", message)
                    ],
                ));
                continue;
            }
            None => {}
        }
        if let Some(n) = val.as_num() {
            if let Some(min) = idef.opt("min")
                && n.lt(min)
            {
                errors.push(error_obj(
                    "value_smaller_than_min",
                    &format!("Value {n} smaller than min of {min}"),
                    x,
                    obj![
                        ("input_name", x),
                        ("input_config", info),
                        ("received_value", val.clone())
                    ],
                ));
                continue;
            }
            if let Some(max) = idef.opt("max")
                && max.lt(n)
            {
                errors.push(error_obj(
                    "value_bigger_than_max",
                    &format!("Value {n} bigger than max of {max}"),
                    x,
                    obj![
                        ("input_name", x),
                        ("input_config", info),
                        ("received_value", val.clone())
                    ],
                ));
                continue;
            }
        }
        if let InputType::Combo(options) = &idef.ty {
            let found = val.as_str().is_some_and(|s| options.iter().any(|o| o == s));
            if !found {
                // ComfyUI does not echo lists longer than 20 (e.g. hundreds of model files).
                let (list_info, input_config) = if options.len() > 20 {
                    (format!("(list of length {})", options.len()), OValue::Null)
                } else {
                    (idef.ty.name(), info)
                };
                errors.push(error_obj(
                    "value_not_in_list",
                    "Value not in list",
                    &format!("{x}: '{}' not in {list_info}", val.py_str()),
                    obj![
                        ("input_name", x),
                        ("input_config", input_config),
                        ("received_value", val.clone())
                    ],
                ));
                continue;
            }
        }
    }

    if !converted.is_empty()
        && let Some(OValue::Object(node)) = prompt.get_mut(unique_id)
        && let Some(OValue::Object(inputs)) = node.get_mut("inputs")
    {
        for (k, v) in converted {
            inputs.insert(k, v);
        }
    }

    let result = if !errors.is_empty() || !valid {
        (false, errors)
    } else {
        (true, vec![])
    };
    validated.insert(unique_id.to_owned(), result.clone());
    Ok(result)
}

/// execution.py `validate_node_input`: exact match, `*` on either side, or overlapping unions.
fn types_compatible(received: &str, input: &InputType) -> bool {
    let InputType::Link(wanted) = input else {
        return match input {
            InputType::Int => received == "INT",
            InputType::Float => received == "FLOAT",
            InputType::String => received == "STRING",
            _ => false,
        };
    };
    if received == *wanted {
        return true;
    }
    let r: Vec<&str> = received.split(',').map(str::trim).collect();
    let w: Vec<&str> = wanted.split(',').map(str::trim).collect();
    if r.contains(&"*") || w.contains(&"*") {
        return true;
    }
    r.iter().all(|t| w.contains(t))
}

/// Python `int(x)` for a JSON value; the error text is Python's.
fn py_int(val: &OValue) -> Result<PyNum, String> {
    match val {
        OValue::Bool(b) => Ok(PyNum::Int(i128::from(*b))),
        OValue::Number(n) => match PyNum::from_number(n) {
            PyNum::Float(f) => Ok(PyNum::Int(f.trunc() as i128)),
            int => Ok(int),
        },
        OValue::String(s) => {
            let t = s.trim().replace('_', "");
            t.parse::<i128>()
                .map(PyNum::Int)
                .map_err(|_| format!("invalid literal for int() with base 10: {}", py_str_repr(s)))
        }
        other => Err(format!(
            "int() argument must be a string, a bytes-like object or a real number, not '{}'",
            other.py_type()
        )),
    }
}

/// Python `float(x)` for a JSON value.
fn py_float_of(val: &OValue) -> Result<f64, String> {
    match val {
        OValue::Bool(b) => Ok(if *b { 1.0 } else { 0.0 }),
        OValue::Number(n) => Ok(PyNum::from_number(n).as_f64()),
        OValue::String(s) => {
            let t = s.trim().to_ascii_lowercase();
            let parsed = match t.as_str() {
                "inf" | "+inf" | "infinity" => Some(f64::INFINITY),
                "-inf" | "-infinity" => Some(f64::NEG_INFINITY),
                "nan" => Some(f64::NAN),
                _ => t.parse::<f64>().ok(),
            };
            parsed.ok_or_else(|| format!("could not convert string to float: {}", py_str_repr(s)))
        }
        other => Err(format!(
            "float() argument must be a string or a real number, not '{}'",
            other.py_type()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(json: &str) -> OMap<OValue> {
        serde_json::from_str(json).expect("prompt json")
    }

    #[test]
    fn converts_and_reports_like_comfyui() {
        let cat = Catalog::new(&["a.safetensors".into()]);
        let mut p = prompt(
            r#"{"1":{"class_type":"EmptyImage","inputs":{"width":0,"height":"abc","batch_size":1,"color":0}},
                "2":{"class_type":"SaveImage","inputs":{"images":["1",0],"filename_prefix":"x"}}}"#,
        );
        let Validation::Invalid { error, node_errors } = validate_prompt(&cat, &mut p, None) else {
            panic!("expected invalid");
        };
        assert_eq!(error.get("details"), Some(&OValue::from("")));
        let errs = crate::ojson::to_string(&node_errors);
        assert!(
            errs.contains("invalid literal for int() with base 10: 'abc'"),
            "{errs}"
        );
        assert!(errs.contains("Value 0 smaller than min of 1"), "{errs}");
    }
}
