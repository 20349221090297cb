//! Benchmark of AI-generated labelling (`zhihui::labels`), on one thread, nothing else running:
//!
//! For 512x512 and 1024x1024 PNGs like a server's (a smooth picture with grain, so deflate has
//! real work, written at ComfyUI's compression with a `prompt` chunk), ITERATIONS times each:
//! - `label fast`: what zhihui does by default (decode, draw the mark, encode with the fast
//!   PNG compression and both label chunks);
//! - `label balanced`: the same with `labels.png_compression = "balanced"`;
//! - the peer, `re-encode only`: decode and encode again (fast) with no mark and no label, the
//!   floor any pixel-level label pays; and `decode only`, its first half.
//!
//! Each prints the median and p90 wall time per image, the process CPU time per image
//! (`/proc/self/stat`) and the output's size beside the input's.
//!
//!     cargo run --release -p zhihui-bench --bin bench_labels [-- ITERATIONS] [--samples DIR]
//!
//! `--samples DIR` also writes labelled samples (512x512 light, also as JPEG and WebP; 768x512
//! dark; 1024x1024 colour) there: `docs/labels/` holds the committed ones.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Cursor;
use std::time::Instant;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use uuid::Uuid;
use zhihui::labels::Labeller;
use zhihui::platform::configuration::{PngCompression, Settings};

/// One benchmarked case: label or re-encode the input once, answering the output's size.
type Case<'a> = Box<dyn Fn() -> anyhow::Result<usize> + 'a>;

fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let mut iterations = 20usize;
    let mut samples = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--samples" {
            samples = Some(args.next().context("--samples needs a directory")?);
        } else {
            iterations = arg.parse().context("ITERATIONS must be a number")?;
        }
    }
    let settings = Settings::defaults()?;
    let fast = Labeller::new(&settings.labels)?;
    let mut balanced_settings = settings.labels.clone();
    balanced_settings.png_compression = PngCompression::Balanced;
    let balanced = Labeller::new(&balanced_settings)?;

    if let Some(directory) = samples {
        write_samples(&balanced, std::path::Path::new(&directory))?;
    }

    println!("bench_labels: {iterations} images per row, one thread");
    println!(
        "{:<10} {:<16} {:>10} {:>10} {:>12} {:>12} {:>12}",
        "size", "case", "p50 ms", "p90 ms", "cpu ms/img", "in bytes", "out bytes"
    );
    let mut result = 0.0;
    for side in [512u32, 1024] {
        let input = server_png(side, side);
        let task = Uuid::now_v7();
        let rows: [(&str, Case); 4] = [
            (
                "label fast",
                Box::new(|| {
                    Ok(fast
                        .label_now(&input, task, 0, Uuid::now_v7())?
                        .bytes()
                        .len())
                }),
            ),
            (
                "label balanced",
                Box::new(|| {
                    Ok(balanced
                        .label_now(&input, task, 0, Uuid::now_v7())?
                        .bytes()
                        .len())
                }),
            ),
            ("re-encode only", Box::new(|| reencode(&input))),
            (
                "decode only",
                Box::new(|| {
                    let decoded =
                        image::load_from_memory_with_format(&input, image::ImageFormat::Png)?;
                    Ok(decoded.as_bytes().len())
                }),
            ),
        ];
        for (name, run) in rows {
            let mut times = Vec::with_capacity(iterations);
            let mut out_bytes = 0;
            run()?; // warm up
            let cpu_before = process_cpu_ms()?;
            for _ in 0..iterations {
                let started = Instant::now();
                out_bytes = run()?;
                times.push(started.elapsed().as_secs_f64() * 1000.0);
            }
            let cpu = (process_cpu_ms()? - cpu_before) / iterations as f64;
            times.sort_by(f64::total_cmp);
            let p50 = times[times.len() / 2];
            let p90 = times[(times.len() * 9 / 10).min(times.len() - 1)];
            println!(
                "{:<10} {name:<16} {p50:>10.1} {p90:>10.1} {cpu:>12.1} {:>12} {out_bytes:>12}",
                format!("{side}x{side}"),
                input.len()
            );
            if side == 1024 && name == "label fast" {
                result = p50;
            }
        }
    }
    println!("RESULT bench_labels_1024_p50 {result:.1} ms");
    Ok(())
}

/// A picture like a generated one: smooth shapes plus grain, as PNG at ComfyUI's level with
/// its `prompt` text chunk.
fn server_png(width: u32, height: u32) -> Vec<u8> {
    let mut random = rand::rngs::StdRng::seed_from_u64(u64::from(width) * 7 + u64::from(height));
    let mut pixels = Vec::with_capacity((width * height * 3) as usize);
    for y in 0..height {
        for x in 0..width {
            let (fx, fy) = (x as f32 / width as f32, y as f32 / height as f32);
            let base = [
                200.0 * fx + 30.0,
                120.0 + 80.0 * (fy * 6.0).sin(),
                180.0 * (1.0 - fy) + 40.0 * (fx * 9.0).cos(),
            ];
            for value in base {
                let grain: f32 = random.random_range(-12.0..12.0);
                pixels.push((value + grain).clamp(0.0, 255.0) as u8);
            }
        }
    }
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Balanced);
    #[allow(clippy::expect_used)]
    {
        encoder
            .add_text_chunk(
                "prompt".into(),
                "{\"3\": {\"class_type\": \"KSampler\"}}".repeat(60),
            )
            .expect("a text chunk");
        let mut writer = encoder.write_header().expect("a PNG header");
        writer.write_image_data(&pixels).expect("PNG pixels");
        writer.finish().expect("a PNG");
    }
    out
}

/// The peer: decode and encode again, no mark, no label.
fn reencode(input: &[u8]) -> anyhow::Result<usize> {
    let decoded = image::load_from_memory_with_format(input, image::ImageFormat::Png)?.into_rgb8();
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, decoded.width(), decoded.height());
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Fast);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(decoded.as_raw())?;
    writer.finish()?;
    Ok(out.len())
}

/// User plus system CPU time of this process so far, in milliseconds.
fn process_cpu_ms() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // Fields after the command name (which may hold spaces) start at state (field 3).
    let after = stat.rsplit_once(')').context("a stat line")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: f64 = fields.get(11).context("utime")?.parse()?;
    let stime: f64 = fields.get(12).context("stime")?.parse()?;
    // Linux reports clock ticks of 1/100 s (USER_HZ) here.
    Ok((utime + stime) * 10.0)
}

/// Three labelled samples for readers: light, dark and coloured scenes, no grain (small files).
fn write_samples(labeller: &Labeller, directory: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(directory)?;
    type Shade = fn(f32, f32) -> [f32; 3];
    let scenes: [(u32, u32, &str, Shade); 3] = [
        (512, 512, "light", |_, y| {
            [235.0 + 20.0 * y, 240.0 + 15.0 * y, 250.0]
        }),
        (768, 512, "dark", |x, y| {
            [10.0 + 20.0 * x, 12.0 + 10.0 * y, 35.0 + 30.0 * (1.0 - y)]
        }),
        (1024, 1024, "colour", |x, y| {
            [
                255.0 * x,
                160.0 + 90.0 * (y * 5.0).sin(),
                255.0 * (1.0 - x) * y + 60.0,
            ]
        }),
    ];
    for (width, height, name, shade) in scenes {
        let image = image::RgbImage::from_fn(width, height, |x, y| {
            let colour = shade(x as f32 / width as f32, y as f32 / height as f32);
            image::Rgb(colour.map(|value| value.clamp(0.0, 255.0) as u8))
        });
        // The small one also as JPEG and WebP, the formats a server may send besides PNG.
        let formats: &[(image::ImageFormat, &str)] = if width == 512 {
            &[
                (image::ImageFormat::Png, "png"),
                (image::ImageFormat::Jpeg, "jpg"),
                (image::ImageFormat::WebP, "webp"),
            ]
        } else {
            &[(image::ImageFormat::Png, "png")]
        };
        for &(format, extension) in formats {
            let mut encoded = Vec::new();
            image.write_to(&mut Cursor::new(&mut encoded), format)?;
            let labelled = labeller.label_now(&encoded, Uuid::nil(), 0, Uuid::nil())?;
            let path = directory.join(format!("sample-{width}x{height}-{name}.{extension}"));
            std::fs::write(&path, labelled.bytes())?;
            println!(
                "wrote {} ({} bytes)",
                path.display(),
                labelled.bytes().len()
            );
        }
    }
    Ok(())
}
