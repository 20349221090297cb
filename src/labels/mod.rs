//! AI-generated content labels (the Measures for Labelling AI-Generated Synthetic Content and
//! GB 45438-2025): every image zhihui stores carries a visible mark ([`mark`]) and the implicit
//! label in its metadata ([`metadata`]), both applied between the download from ComfyUI and the
//! store, before any URL exists. [`LabelledImage`] can only be made here and
//! [`crate::dispatch::images::ImageStore::put`] takes nothing else: there is no way to store,
//! and so no route to serve, an unlabelled image.
//!
//! Labelling decodes the image, draws the mark and encodes it again: tens of milliseconds of
//! CPU. It runs on the blocking pool, at most `labels.workers` at once, never on the async
//! runtime's threads, and never while a GPU waits: the dispatcher frees a server's slot when its
//! prompt finishes, before the results are fetched.

/// The type of an image file from its first bytes: PNG, JPEG or WebP; `None` for anything else.
pub fn image_content_type(head: &[u8]) -> Option<&'static str> {
    if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if head.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if head.len() >= 12 && &head[..4] == b"RIFF" && &head[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

pub mod mark;
pub mod metadata;

use std::io::Cursor;
use std::sync::Arc;

use anyhow::Context;
use secrecy::ExposeSecret;
use uuid::Uuid;
use zhihui_domain::task::TaskId;

use crate::platform::configuration::{LabelSettings, PngCompression};
use mark::Mark;
use metadata::{AigcLabel, PNG_KEYWORD, XMP_KEYWORD};

/// An image with both labels, ready to store.
#[derive(Debug, Clone)]
pub struct LabelledImage {
    bytes: Vec<u8>,
    content_type: &'static str,
    original: Option<Vec<u8>>,
    label: AigcLabel,
}

impl LabelledImage {
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn content_type(&self) -> &'static str {
        self.content_type
    }

    /// The image as the server sent it, kept only when `labels.keep_original` says so.
    pub fn original(&self) -> Option<&[u8]> {
        self.original.as_deref()
    }

    pub fn label(&self) -> &AigcLabel {
        &self.label
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    /// The bytes are no image we can read: retrying will not change them.
    #[error("the image server returned an image that cannot be read ({0})")]
    Unreadable(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// Labels images: the mark, the key and a bound on how many run at once.
#[derive(Debug, Clone)]
pub struct Labeller {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: LabelSettings,
    mark: Mark,
    permits: tokio::sync::Semaphore,
}

/// Images larger than this (in either side) are refused before decoding.
const SIDE_MAX: u32 = 8192;
/// Memory a decode may take.
const DECODE_BYTES_MAX: u64 = 512 * 1024 * 1024;

impl Labeller {
    pub fn new(settings: &LabelSettings) -> anyhow::Result<Labeller> {
        let mark = Mark::new(&settings.text, settings.corner, settings.height_ratio)?;
        Ok(Labeller {
            inner: Arc::new(Inner {
                settings: settings.clone(),
                mark,
                permits: tokio::sync::Semaphore::new(settings.workers.max(1)),
            }),
        })
    }

    /// Label one output of a task, on the blocking pool (waiting for a permit first).
    pub async fn label(
        &self,
        bytes: Vec<u8>,
        task_id: TaskId,
        index: usize,
        image_id: Uuid,
    ) -> Result<LabelledImage, LabelError> {
        let _permit = self
            .inner
            .permits
            .acquire()
            .await
            .context("the labelling permits are closed")?;
        let labeller = self.clone();
        tokio::task::spawn_blocking(move || labeller.label_now(&bytes, task_id, index, image_id))
            .await
            .context("a labelling job panicked")?
    }

    /// Label an image on this thread (the blocking part of [`Labeller::label`]; benchmarks).
    pub fn label_now(
        &self,
        bytes: &[u8],
        task_id: TaskId,
        index: usize,
        image_id: Uuid,
    ) -> Result<LabelledImage, LabelError> {
        let settings = &self.inner.settings;
        let (content_type, format) = match crate::labels::image_content_type(bytes) {
            Some(kind @ "image/png") => (kind, image::ImageFormat::Png),
            Some(kind @ "image/jpeg") => (kind, image::ImageFormat::Jpeg),
            Some(kind @ "image/webp") => (kind, image::ImageFormat::WebP),
            _ => {
                return Err(LabelError::Unreadable(
                    "not a PNG, JPEG or WebP file".into(),
                ));
            }
        };
        let mut reader = image::ImageReader::with_format(Cursor::new(bytes), format);
        let mut limits = image::Limits::default();
        limits.max_image_width = Some(SIDE_MAX);
        limits.max_image_height = Some(SIDE_MAX);
        limits.max_alloc = Some(DECODE_BYTES_MAX);
        reader.limits(limits);
        let decoded = reader
            .decode()
            .map_err(|error| LabelError::Unreadable(error.to_string()))?;
        let (width, height) = (decoded.width(), decoded.height());
        // JPEG has no alpha; elsewhere an alpha channel is kept.
        let alpha = decoded.color().has_alpha() && format != image::ImageFormat::Jpeg;
        let (mut pixels, channels) = if alpha {
            (decoded.into_rgba8().into_raw(), 4)
        } else {
            (decoded.into_rgb8().into_raw(), 3)
        };
        self.inner.mark.draw(&mut pixels, width, height, channels);

        let key = settings.signing_key.expose_secret().as_bytes();
        let propagate_id = if settings.content_propagator.is_empty() {
            String::new()
        } else {
            image_id.to_string()
        };
        let label = AigcLabel::signed(
            key,
            &settings.content_producer,
            format!("{task_id}-{index}"),
            &settings.content_propagator,
            propagate_id,
            &settings.reserved_code2,
        );
        let xmp = label.to_xmp();
        let encoded = match format {
            image::ImageFormat::Png => {
                let kept = if settings.keep_comfy_metadata {
                    comfy_text_chunks(bytes)
                } else {
                    Vec::new()
                };
                let compression = match settings.png_compression {
                    PngCompression::Fast => png::Compression::Fast,
                    PngCompression::Balanced => png::Compression::Balanced,
                    PngCompression::High => png::Compression::High,
                };
                encode_png(
                    &pixels,
                    width,
                    height,
                    alpha,
                    compression,
                    &label,
                    &xmp,
                    kept,
                )?
            }
            image::ImageFormat::Jpeg => {
                let mut out = Vec::new();
                image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 92)
                    .encode(&pixels, width, height, image::ExtendedColorType::Rgb8)
                    .context("encoding the labelled JPEG")?;
                metadata::jpeg_with_xmp(out, &xmp)?
            }
            _ => {
                let mut out = Vec::new();
                let mut encoder = image_webp::WebPEncoder::new(&mut out);
                encoder.set_xmp_metadata(xmp.into_bytes());
                let colour = if alpha {
                    image_webp::ColorType::Rgba8
                } else {
                    image_webp::ColorType::Rgb8
                };
                encoder
                    .encode(&pixels, width, height, colour)
                    .context("encoding the labelled WebP")?;
                out
            }
        };
        Ok(LabelledImage {
            bytes: encoded,
            content_type,
            original: settings.keep_original.then(|| bytes.to_vec()),
            label,
        })
    }

    /// Read a file's labels and check each one's `ReservedCode1` against our key.
    pub fn inspect(&self, bytes: &[u8]) -> anyhow::Result<Inspection> {
        let found = metadata::read(bytes)?;
        let key = self.inner.settings.signing_key.expose_secret().as_bytes();
        Ok(Inspection {
            content_type: crate::labels::image_content_type(bytes).unwrap_or("unknown"),
            png_text_checks_out: found.png_text.as_ref().map(|label| label.verify(key)),
            xmp_checks_out: found.xmp.as_ref().map(|label| label.verify(key)),
            labels: found,
        })
    }
}

/// What `zhihui images inspect` reports.
#[derive(Debug, Clone)]
pub struct Inspection {
    pub content_type: &'static str,
    pub labels: metadata::FileLabels,
    pub png_text_checks_out: Option<bool>,
    pub xmp_checks_out: Option<bool>,
}

impl Inspection {
    /// Labelled by us: every label present checks out, and the one the format needs is there.
    pub fn is_ours(&self) -> bool {
        let xmp_ok = self.xmp_checks_out == Some(true);
        if self.content_type == "image/png" {
            xmp_ok && self.png_text_checks_out == Some(true)
        } else {
            xmp_ok
        }
    }
}

/// ComfyUI's own text chunks of a PNG (`prompt`, `workflow`), to keep when configured.
/// `bytes` as anyone may fetch them: a PNG without the text chunks kept from ComfyUI (with
/// `labels.keep_comfy_metadata` on, the stored file carries the whole workflow, prompts
/// included, which only its owner may see). The AIGC label and its XMP stay; every other
/// chunk is copied as it is (no re-encoding). Anything not a PNG is returned as it is.
pub fn public_copy(bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if !bytes.starts_with(SIGNATURE) {
        return std::borrow::Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    out.extend_from_slice(SIGNATURE);
    let mut at = SIGNATURE.len();
    let mut dropped = false;
    // A chunk: length (4), kind (4), data (length), CRC (4).
    while let Some(length_bytes) = bytes.get(at..at + 4) {
        let length = u32::from_be_bytes([
            length_bytes[0],
            length_bytes[1],
            length_bytes[2],
            length_bytes[3],
        ]) as usize;
        let Some(chunk) = bytes.get(at..at + 12 + length) else {
            // Cut short: what follows cannot be told apart, so it is not served.
            dropped = true;
            break;
        };
        let kind = &chunk[4..8];
        let keyword = chunk[8..8 + length].split(|byte| *byte == 0).next();
        let ours = keyword.is_some_and(|keyword| {
            keyword == PNG_KEYWORD.as_bytes() || keyword == XMP_KEYWORD.as_bytes()
        });
        if matches!(kind, b"tEXt" | b"zTXt" | b"iTXt") && !ours {
            dropped = true;
        } else {
            out.extend_from_slice(chunk);
        }
        at += 12 + length;
    }
    if dropped {
        std::borrow::Cow::Owned(out)
    } else {
        std::borrow::Cow::Borrowed(bytes)
    }
}

fn comfy_text_chunks(bytes: &[u8]) -> Vec<(String, String)> {
    let mut decoder = png::Decoder::new(Cursor::new(bytes));
    decoder.set_ignore_text_chunk(false);
    let Ok(reader) = decoder.read_info() else {
        return Vec::new();
    };
    let info = reader.info();
    let plain = info
        .uncompressed_latin1_text
        .iter()
        .map(|chunk| (chunk.keyword.clone(), chunk.text.clone()));
    let compressed = info
        .compressed_latin1_text
        .iter()
        .filter_map(|chunk| Some((chunk.keyword.clone(), chunk.get_text().ok()?)));
    plain
        .chain(compressed)
        .filter(|(keyword, _)| keyword != PNG_KEYWORD && keyword != XMP_KEYWORD)
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn encode_png(
    pixels: &[u8],
    width: u32,
    height: u32,
    alpha: bool,
    compression: png::Compression,
    label: &AigcLabel,
    xmp: &str,
    kept: Vec<(String, String)>,
) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(pixels.len() / 2);
    {
        let mut encoder = png::Encoder::new(&mut out, width, height);
        encoder.set_color(if alpha {
            png::ColorType::Rgba
        } else {
            png::ColorType::Rgb
        });
        encoder.set_depth(png::BitDepth::Eight);
        encoder.set_compression(compression);
        encoder
            .add_text_chunk(PNG_KEYWORD.into(), label.to_ascii_json())
            .context("adding the AIGC text chunk")?;
        encoder
            .add_itxt_chunk(XMP_KEYWORD.into(), xmp.into())
            .context("adding the XMP chunk")?;
        for (keyword, text) in kept {
            encoder
                .add_text_chunk(keyword, text)
                .context("keeping a text chunk")?;
        }
        let mut writer = encoder.write_header().context("writing the PNG header")?;
        writer
            .write_image_data(pixels)
            .context("writing the PNG pixels")?;
        writer.finish().context("finishing the PNG")?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_content_type_comes_from_the_files_own_bytes() {
        assert_eq!(
            image_content_type(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"),
            Some("image/png")
        );
        assert_eq!(
            image_content_type(&[0xFF, 0xD8, 0xFF, 0xE0]),
            Some("image/jpeg")
        );
        assert_eq!(
            image_content_type(b"RIFF\x10\0\0\0WEBPVP8 "),
            Some("image/webp")
        );
        assert_eq!(image_content_type(b"<html><script>"), None);
        assert_eq!(image_content_type(b"GIF89a"), None);
        assert_eq!(image_content_type(b""), None);
    }

    fn labeller(customise: impl FnOnce(&mut LabelSettings)) -> Labeller {
        let mut settings = crate::platform::configuration::Settings::defaults()
            .unwrap()
            .labels;
        customise(&mut settings);
        Labeller::new(&settings).unwrap()
    }

    /// A 300x200 gradient in `format`, with ComfyUI's `prompt` chunk when PNG.
    fn picture(format: image::ImageFormat) -> Vec<u8> {
        let image = image::RgbImage::from_fn(300, 200, |x, y| {
            image::Rgb([(x % 256) as u8, (y % 256) as u8, 128])
        });
        let mut out = Vec::new();
        if format == image::ImageFormat::Png {
            let mut encoder = png::Encoder::new(&mut out, 300, 200);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            encoder
                .add_text_chunk(
                    "prompt".into(),
                    r#"{"3": {"class_type": "KSampler"}}"#.into(),
                )
                .unwrap();
            let mut writer = encoder.write_header().unwrap();
            writer.write_image_data(image.as_raw()).unwrap();
            writer.finish().unwrap();
        } else {
            image.write_to(&mut Cursor::new(&mut out), format).unwrap();
        }
        out
    }

    #[test]
    fn png_jpeg_and_webp_keep_their_format_and_size_and_carry_a_label_that_checks_out() {
        let labeller = labeller(|_| {});
        let key = crate::platform::configuration::DEVELOPMENT_LABEL_KEY.as_bytes();
        let task = Uuid::now_v7();
        for (format, kind) in [
            (image::ImageFormat::Png, "image/png"),
            (image::ImageFormat::Jpeg, "image/jpeg"),
            (image::ImageFormat::WebP, "image/webp"),
        ] {
            let labelled = labeller
                .label_now(&picture(format), task, 1, Uuid::now_v7())
                .unwrap();
            assert_eq!(labelled.content_type(), kind);
            assert!(labelled.original().is_none());
            let decoded = image::load_from_memory(labelled.bytes()).unwrap();
            assert_eq!((decoded.width(), decoded.height()), (300, 200));
            let inspection = labeller.inspect(labelled.bytes()).unwrap();
            assert!(inspection.is_ours(), "{kind}: {inspection:?}");
            let xmp = inspection.labels.xmp.unwrap();
            assert_eq!(xmp.produce_id, format!("{task}-1"));
            assert!(xmp.verify(key));
            assert_eq!(&xmp, labelled.label());
            if kind == "image/png" {
                assert_eq!(inspection.labels.png_text.unwrap(), xmp);
                assert!(inspection.labels.other_text_keywords.is_empty());
            }
        }
    }

    #[test]
    fn comfyuis_chunks_are_dropped_unless_configured_and_the_propagator_names_the_image() {
        let kept = labeller(|settings| {
            settings.keep_comfy_metadata = true;
            settings.content_propagator = "智绘平台".into();
            settings.reserved_code2 = "model:sd15".into();
        });
        let image_id = Uuid::now_v7();
        let labelled = kept
            .label_now(
                &picture(image::ImageFormat::Png),
                Uuid::now_v7(),
                0,
                image_id,
            )
            .unwrap();
        let inspection = kept.inspect(labelled.bytes()).unwrap();
        assert_eq!(inspection.labels.other_text_keywords, ["prompt"]);
        let label = inspection.labels.png_text.unwrap();
        assert_eq!(label.content_propagator, "智绘平台");
        assert_eq!(label.propagate_id, image_id.to_string());
        assert_eq!(label.reserved_code2, "model:sd15");
        assert!(inspection.png_text_checks_out == Some(true));
    }

    #[test]
    fn a_label_edited_or_signed_with_another_key_does_not_check_out() {
        let ours = labeller(|_| {});
        let theirs = labeller(|settings| {
            settings.signing_key = "another key of at least thirty-two bytes".into();
        });
        let labelled = theirs
            .label_now(
                &picture(image::ImageFormat::Png),
                Uuid::now_v7(),
                0,
                Uuid::now_v7(),
            )
            .unwrap();
        let inspection = ours.inspect(labelled.bytes()).unwrap();
        assert_eq!(inspection.png_text_checks_out, Some(false));
        assert!(!inspection.is_ours());
        // The same label with one field edited, written into a file again.
        let mut edited = labelled.label().clone();
        edited.content_producer = "someone else".into();
        let decoded = image::load_from_memory(labelled.bytes())
            .unwrap()
            .into_rgb8();
        let forged = encode_png(
            decoded.as_raw(),
            300,
            200,
            false,
            png::Compression::Fast,
            &edited,
            &edited.to_xmp(),
            Vec::new(),
        )
        .unwrap();
        let inspection = theirs.inspect(&forged).unwrap();
        assert_eq!(inspection.png_text_checks_out, Some(false));
        assert_eq!(inspection.xmp_checks_out, Some(false));
    }

    #[test]
    fn what_is_not_an_image_or_is_too_large_is_unreadable_not_stored() {
        let labeller = labeller(|_| {});
        let task = Uuid::now_v7();
        let html = b"<html><body>not an image</body></html>";
        assert!(matches!(
            labeller.label_now(html, task, 0, Uuid::now_v7()),
            Err(LabelError::Unreadable(_))
        ));
        let png = picture(image::ImageFormat::Png);
        assert!(matches!(
            labeller.label_now(&png[..png.len() / 2], task, 0, Uuid::now_v7()),
            Err(LabelError::Unreadable(_))
        ));
        // A header that declares 60000 x 60000 pixels: refused before any allocation.
        let mut huge = Vec::new();
        {
            let mut encoder = png::Encoder::new(&mut huge, 60_000, 60_000);
            encoder.set_color(png::ColorType::Rgb);
            let writer = encoder.write_header().unwrap();
            drop(writer);
        }
        assert!(matches!(
            labeller.label_now(&huge, task, 0, Uuid::now_v7()),
            Err(LabelError::Unreadable(_))
        ));
    }
}
