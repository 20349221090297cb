//! Pixels and PNG files. The simulator has no diffusion model, so "generated" images are
//! deterministic pictures (a solid colour or a seed-coloured gradient) of the requested size:
//! enough for a dispatcher to fetch, verify and tell apart.

use std::io::Write;
use std::path::Path;

/// An 8-bit RGB image, the simulator's stand-in for ComfyUI's `IMAGE` tensor rows.
#[derive(Clone, Debug)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

impl RgbImage {
    pub fn solid(width: u32, height: u32, rgb: [u8; 3]) -> RgbImage {
        let n = width as usize * height as usize;
        let mut pixels = Vec::with_capacity(n * 3);
        for _ in 0..n {
            pixels.extend_from_slice(&rgb);
        }
        RgbImage {
            width,
            height,
            pixels,
        }
    }

    /// A diagonal gradient from `rgb` to its complement, so different seeds give different files.
    pub fn gradient(width: u32, height: u32, rgb: [u8; 3]) -> RgbImage {
        let span = u64::from(width.max(1)) + u64::from(height.max(1));
        // A pixel's colour depends on x + y only: row y is the slice of this diagonal that
        // starts at y (cheap enough for a simulator at zero latency).
        let mut diagonal = Vec::with_capacity((width as usize + height as usize) * 3);
        for d in 0..u64::from(width) + u64::from(height) {
            let t = d * 255 / span;
            for c in rgb {
                let from = u64::from(c);
                let to = 255 - from;
                diagonal.push(((from * (255 - t) + to * t) / 255) as u8);
            }
        }
        let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
        for y in 0..height as usize {
            pixels.extend_from_slice(&diagonal[y * 3..(y + width as usize) * 3]);
        }
        RgbImage {
            width,
            height,
            pixels,
        }
    }

    /// Nearest-neighbour resize (ImageScale; the method name is accepted but not honoured).
    pub fn resized(&self, width: u32, height: u32) -> RgbImage {
        let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
        for y in 0..height {
            let sy = (u64::from(y) * u64::from(self.height) / u64::from(height.max(1))) as usize;
            for x in 0..width {
                let sx = (u64::from(x) * u64::from(self.width) / u64::from(width.max(1))) as usize;
                let at = (sy * self.width as usize + sx) * 3;
                pixels.extend_from_slice(&self.pixels[at..at + 3]);
            }
        }
        RgbImage {
            width,
            height,
            pixels,
        }
    }

    /// Encode as PNG with `texts` as `tEXt` chunks (ComfyUI's `prompt` and `workflow`), so files
    /// look like the real ones. `tEXt` is Latin-1: the png crate refuses other text, as Pillow
    /// would write it as `iTXt` instead; ComfyUI's texts are ASCII JSON.
    pub fn encode_png(&self, texts: &[(String, String)], fast: bool) -> anyhow::Result<Vec<u8>> {
        let mut out = Vec::new();
        {
            let mut encoder = png::Encoder::new(&mut out, self.width, self.height);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            encoder.set_compression(if fast {
                png::Compression::Fast
            } else {
                png::Compression::Default
            });
            for (keyword, text) in texts {
                encoder.add_text_chunk(keyword.clone(), text.clone())?;
            }
            let mut writer = encoder.write_header()?;
            writer.write_image_data(&self.pixels)?;
            writer.finish()?;
        }
        Ok(out)
    }

    pub fn save_png(
        &self,
        path: &Path,
        texts: &[(String, String)],
        fast: bool,
    ) -> anyhow::Result<()> {
        let bytes = self.encode_png(texts, fast)?;
        let mut file = std::fs::File::create(path)?;
        file.write_all(&bytes)?;
        Ok(())
    }
}

/// A colour derived from a seed (splitmix64), so neighbouring seeds look different.
pub fn seed_colour(seed: u64, salt: &str) -> [u8; 3] {
    let mut z = seed
        ^ salt.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    [(z >> 16) as u8, (z >> 8) as u8, z as u8]
}
