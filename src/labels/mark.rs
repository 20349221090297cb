//! The explicit label: a short text ("AI生成" by default) drawn in a corner of the image, on a
//! translucent dark plate so it reads on light and dark images alike. Its ink is at least 5 % of
//! the image's shorter side high (GB 45438-2025 asks for that much for a visible text label).
//!
//! The font is a subset of Noto Sans CJK SC Bold shipped under `assets/fonts/` (SIL OFL 1.1);
//! a text with a character it lacks is refused when the mark is built, at start-up, not on the
//! first image.

use ab_glyph::{Font, FontRef, Glyph, GlyphId, PxScale, ScaleFont, point};

static FONT: &[u8] = include_bytes!("../../assets/fonts/ZhihuiLabelSansSC-Bold.otf");

/// The smallest ink height the rules allow, as a share of the shorter side.
pub const HEIGHT_RATIO_MIN: f32 = 0.05;

pub use crate::platform::configuration::Corner;

/// The plate behind the text: black at this opacity. 0.6 keeps white text above a 5:1 contrast
/// on a white image and leaves most of what lies under the plate visible.
const PLATE_OPACITY: f32 = 0.6;

/// A ready-to-draw mark: the font, the text's glyphs and their ink height at a reference size.
#[derive(Debug, Clone)]
pub struct Mark {
    font: FontRef<'static>,
    glyphs: Vec<GlyphId>,
    corner: Corner,
    height_ratio: f32,
    /// The text's ink height in pixels at [`REFERENCE_PX`]; ink scales linearly with the size.
    reference_ink: f32,
}

const REFERENCE_PX: f32 = 100.0;

/// Where the mark went on one image (for tests and the samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The plate: left, top, width, height.
    pub plate: (i64, i64, i64, i64),
    /// The text's ink height the mark aimed for, in pixels.
    pub ink_height: u32,
}

impl Mark {
    pub fn new(text: &str, corner: Corner, height_ratio: f32) -> anyhow::Result<Mark> {
        let font = FontRef::try_from_slice(FONT)
            .map_err(|error| anyhow::anyhow!("the label font cannot be read: {error}"))?;
        anyhow::ensure!(
            !text.trim().is_empty() && text.chars().count() <= 16,
            "labels.text must have 1 to 16 characters"
        );
        anyhow::ensure!(
            (HEIGHT_RATIO_MIN..=0.25).contains(&height_ratio),
            "labels.height_ratio must be {HEIGHT_RATIO_MIN} to 0.25 (the rules ask for at least 5 % of the shorter side)"
        );
        let mut glyphs = Vec::new();
        for character in text.chars() {
            let id = font.glyph_id(character);
            anyhow::ensure!(
                id.0 != 0 || character == ' ',
                "labels.text: the label font has no glyph for {character:?} (see assets/fonts/README.md to add it)"
            );
            glyphs.push(id);
        }
        let mut mark = Mark {
            font,
            glyphs,
            corner,
            height_ratio,
            reference_ink: 0.0,
        };
        let (_, top, _, bottom) = mark
            .ink_bounds(&mark.layout(REFERENCE_PX))
            .ok_or_else(|| anyhow::anyhow!("labels.text draws no ink"))?;
        mark.reference_ink = bottom - top;
        Ok(mark)
    }

    /// The glyphs laid out on one line at `px`, the baseline at the ascent.
    fn layout(&self, px: f32) -> Vec<Glyph> {
        let scale = PxScale::from(px);
        let scaled = self.font.as_scaled(scale);
        let mut caret = 0.0;
        let mut previous: Option<GlyphId> = None;
        self.glyphs
            .iter()
            .map(|&id| {
                if let Some(previous) = previous {
                    caret += scaled.kern(previous, id);
                }
                let glyph = id.with_scale_and_position(scale, point(caret, scaled.ascent()));
                caret += scaled.h_advance(id);
                previous = Some(id);
                glyph
            })
            .collect()
    }

    /// The union of the glyphs' ink boxes (left, top, right, bottom), whole pixels.
    fn ink_bounds(&self, glyphs: &[Glyph]) -> Option<(f32, f32, f32, f32)> {
        glyphs
            .iter()
            .filter_map(|glyph| self.font.outline_glyph(glyph.clone()))
            .map(|outlined| outlined.px_bounds())
            .fold(None, |acc, b| {
                Some(match acc {
                    None => (b.min.x, b.min.y, b.max.x, b.max.y),
                    Some((l, t, r, bo)) => (
                        l.min(b.min.x),
                        t.min(b.min.y),
                        r.max(b.max.x),
                        bo.max(b.max.y),
                    ),
                })
            })
    }

    /// Draw the mark on an 8-bit image of `channels` (3: RGB, 4: RGBA) interleaved samples.
    pub fn draw(&self, pixels: &mut [u8], width: u32, height: u32, channels: usize) -> Placement {
        let shorter = width.min(height);
        // One pixel above the ratio: anti-aliased edges may leave the outermost row unlit.
        let ink_height = (self.height_ratio * shorter as f32).ceil() as u32 + 1;
        let px = REFERENCE_PX * ink_height as f32 / self.reference_ink;
        let glyphs = self.layout(px);
        let Some((left, top, right, bottom)) = self.ink_bounds(&glyphs) else {
            return Placement {
                plate: (0, 0, 0, 0),
                ink_height,
            };
        };
        let pad = (ink_height as f32 * 0.3).round() as i64;
        let margin = ((shorter as f32 * 0.02).round() as i64).max(2);
        let plate_width = (right - left) as i64 + 2 * pad;
        let plate_height = (bottom - top) as i64 + 2 * pad;
        let (width_i, height_i) = (i64::from(width), i64::from(height));
        let plate_left = match self.corner {
            Corner::TopLeft | Corner::BottomLeft => margin,
            Corner::TopRight | Corner::BottomRight => width_i - margin - plate_width,
        };
        let plate_top = match self.corner {
            Corner::TopLeft | Corner::TopRight => margin,
            Corner::BottomLeft | Corner::BottomRight => height_i - margin - plate_height,
        };
        let mut canvas = Canvas {
            pixels,
            width: width_i,
            height: height_i,
            channels,
        };
        for y in plate_top..plate_top + plate_height {
            for x in plate_left..plate_left + plate_width {
                canvas.blend(x, y, [0, 0, 0], PLATE_OPACITY);
            }
        }
        // Whole-pixel shift from layout space to the plate: the ink keeps its height exactly.
        let shift_x = plate_left + pad - left as i64;
        let shift_y = plate_top + pad - top as i64;
        for glyph in glyphs {
            let Some(outlined) = self.font.outline_glyph(glyph) else {
                continue;
            };
            let bounds = outlined.px_bounds();
            outlined.draw(|gx, gy, coverage| {
                let x = bounds.min.x as i64 + i64::from(gx) + shift_x;
                let y = bounds.min.y as i64 + i64::from(gy) + shift_y;
                canvas.blend(x, y, [255, 255, 255], coverage.clamp(0.0, 1.0));
            });
        }
        Placement {
            plate: (plate_left, plate_top, plate_width, plate_height),
            ink_height,
        }
    }
}

struct Canvas<'a> {
    pixels: &'a mut [u8],
    width: i64,
    height: i64,
    channels: usize,
}

impl Canvas<'_> {
    /// Paint `colour` at `opacity` over the pixel (source-over); outside the image, nothing.
    fn blend(&mut self, x: i64, y: i64, colour: [u8; 3], opacity: f32) {
        if x < 0 || y < 0 || x >= self.width || y >= self.height || opacity <= 0.0 {
            return;
        }
        let at = ((y * self.width + x) as usize) * self.channels;
        let Some(pixel) = self.pixels.get_mut(at..at + self.channels) else {
            return;
        };
        if self.channels == 4 {
            let below = f32::from(pixel[3]) / 255.0;
            let alpha = opacity + below * (1.0 - opacity);
            if alpha <= 0.0 {
                return;
            }
            for channel in 0..3 {
                let mixed = (f32::from(colour[channel]) * opacity
                    + f32::from(pixel[channel]) * below * (1.0 - opacity))
                    / alpha;
                pixel[channel] = mixed.round().clamp(0.0, 255.0) as u8;
            }
            pixel[3] = (alpha * 255.0).round() as u8;
        } else {
            for channel in 0..3 {
                let mixed = f32::from(colour[channel]) * opacity
                    + f32::from(pixel[channel]) * (1.0 - opacity);
                pixel[channel] = mixed.round().clamp(0.0, 255.0) as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The bounding box (left, top, right, bottom, inclusive) of the pixels `lit` picks.
    fn bounding_box(
        pixels: &[u8],
        width: u32,
        lit: impl Fn(&[u8]) -> bool,
    ) -> Option<(u32, u32, u32, u32)> {
        let mut found: Option<(u32, u32, u32, u32)> = None;
        for (index, pixel) in pixels.chunks(3).enumerate() {
            if lit(pixel) {
                let (x, y) = (index as u32 % width, index as u32 / width);
                found = Some(match found {
                    None => (x, y, x, y),
                    Some((l, t, r, b)) => (l.min(x), t.min(y), r.max(x), b.max(y)),
                });
            }
        }
        found
    }

    #[test]
    fn the_text_is_at_least_five_percent_of_the_shorter_side_on_black_and_on_white() {
        let mark = Mark::new("AI生成", Corner::BottomRight, HEIGHT_RATIO_MIN).unwrap();
        for (width, height) in [(512u32, 512u32), (768, 512), (512, 768), (1024, 1024)] {
            let shorter = f64::from(width.min(height));
            // On black the plate is invisible: what changed is the text.
            let mut black = vec![0u8; (width * height * 3) as usize];
            let placement = mark.draw(&mut black, width, height, 3);
            let (left, top, right, bottom) = bounding_box(&black, width, |p| p[0] > 0).unwrap();
            let text_height = f64::from(bottom - top + 1);
            assert!(
                text_height >= 0.05 * shorter,
                "{width}x{height}: text {text_height} px"
            );
            // In the bottom-right corner, inside the image, small.
            assert!(left > width / 2 && top > height / 2 && right < width && bottom < height);
            assert!(text_height <= 0.1 * shorter);
            // On white the plate darkens the corner and the text stays white on it.
            let mut white = vec![255u8; (width * height * 3) as usize];
            mark.draw(&mut white, width, height, 3);
            let (pl, pt, pr, pb) = bounding_box(&white, width, |p| p[0] < 255).unwrap();
            assert_eq!(
                (i64::from(pl), i64::from(pt)),
                (placement.plate.0, placement.plate.1)
            );
            let plate_grey = white[((pt * width + pl) * 3) as usize];
            assert!(
                plate_grey < 110,
                "plate {plate_grey}: too light for white text"
            );
            // The text inside the plate: every pixel its ink lightened.
            let mut text = (u32::MAX, u32::MAX, 0, 0);
            for y in pt..=pb {
                for x in pl..=pr {
                    if white[((y * width + x) * 3) as usize] > plate_grey {
                        text = (text.0.min(x), text.1.min(y), text.2.max(x), text.3.max(y));
                    }
                }
            }
            assert!(f64::from(text.3 - text.1 + 1) >= 0.05 * shorter);
        }
    }

    #[test]
    fn a_text_the_font_cannot_draw_or_a_mark_below_the_rules_is_refused() {
        let error = Mark::new("AI生成 ✓", Corner::TopLeft, 0.06).unwrap_err();
        assert!(error.to_string().contains("labels.text"), "{error}");
        let error = Mark::new("AI生成", Corner::TopLeft, 0.04).unwrap_err();
        assert!(error.to_string().contains("labels.height_ratio"), "{error}");
        Mark::new("人工智能生成", Corner::TopLeft, 0.05).unwrap();
    }

    #[test]
    fn the_mark_shows_on_a_transparent_image() {
        let mark = Mark::new("AI生成", Corner::TopLeft, 0.05).unwrap();
        let mut clear = vec![0u8; 256 * 256 * 4];
        let placement = mark.draw(&mut clear, 256, 256, 4);
        let (left, top, _, _) = placement.plate;
        let at = ((top * 256 + left) * 4) as usize;
        assert_eq!(clear[at + 3], (PLATE_OPACITY * 255.0).round() as u8);
        assert!(clear.chunks(4).any(|p| p[0] > 200 && p[3] > 200));
    }
}
