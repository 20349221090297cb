//! The image store: images downloaded from ComfyUI and labelled (`crate::labels`: `put` takes
//! only a [`LabelledImage`]), kept on local disk, content-addressed
//! (`blobs/<sha256[0..2]>/<sha256>`), with one small record per image id naming its owner
//! (`images/<image id>.json`). The unlabelled original is kept only when `labels.keep_original`
//! says so, and only the admin route reads it. Users fetch images from zhihui by id, owner only; a ComfyUI
//! address never reaches them.
//!
//! The record is written, and made durable, before the task's `TaskSucceeded` event names the
//! image, so an image a user is told about (and charged for) always exists, also after a power
//! loss; a crash in between leaves an unreferenced file, never a missing one. Image ids are derived from the task id and the output's position, so a retried
//! completion stores the same ids again.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use uuid::Uuid;
use zhihui_domain::task::TaskId;
use zhihui_domain::user::UserId;

use crate::labels::LabelledImage;

const IMAGE_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_696d_6167_6573);

/// The id of the `index`-th output image of a task.
pub fn image_id(task_id: TaskId, index: usize) -> Uuid {
    Uuid::new_v5(&IMAGE_NAMESPACE, format!("{task_id}/{index}").as_bytes())
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    pub image_id: Uuid,
    pub owner: Uuid,
    pub task_id: TaskId,
    pub sha256: String,
    pub content_type: String,
    pub bytes: u64,
    /// The image as ComfyUI produced it (admins only), when kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_sha256: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ImageStore {
    root: PathBuf,
}

impl ImageStore {
    pub fn new(root: impl Into<PathBuf>) -> ImageStore {
        ImageStore { root: root.into() }
    }

    fn blob_path(&self, sha256: &str) -> PathBuf {
        self.root.join("blobs").join(&sha256[..2]).join(sha256)
    }

    fn record_path(&self, image_id: Uuid) -> PathBuf {
        self.root.join("images").join(format!("{image_id}.json"))
    }

    /// Store a blob once per content; its sha256.
    async fn put_blob(&self, bytes: &[u8]) -> anyhow::Result<String> {
        let sha256: String = Sha256::digest(bytes)
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        let blob = self.blob_path(&sha256);
        if tokio::fs::metadata(&blob).await.is_err() {
            write_atomically(&blob, bytes).await?;
        }
        Ok(sha256)
    }

    /// Store a labelled image's bytes (once per content), its original when kept, and its record.
    pub async fn put(
        &self,
        image_id: Uuid,
        owner: UserId,
        task_id: TaskId,
        image: &LabelledImage,
    ) -> anyhow::Result<ImageRecord> {
        let sha256 = self.put_blob(image.bytes()).await?;
        let original_sha256 = match image.original() {
            Some(original) => Some(self.put_blob(original).await?),
            None => None,
        };
        let record = ImageRecord {
            image_id,
            owner: owner.as_uuid(),
            task_id,
            sha256,
            content_type: image.content_type().to_owned(),
            bytes: image.bytes().len() as u64,
            original_sha256,
        };
        let json = serde_json::to_vec(&record).context("encoding an image record")?;
        write_atomically(&self.record_path(image_id), &json).await?;
        Ok(record)
    }

    /// An image's record, `None` when there is no such image.
    pub async fn record(&self, image_id: Uuid) -> anyhow::Result<Option<ImageRecord>> {
        match tokio::fs::read(self.record_path(image_id)).await {
            Ok(json) => serde_json::from_slice::<ImageRecord>(&json)
                .map(Some)
                .with_context(|| format!("image record {image_id} is damaged")),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error).context("reading an image record"),
        }
    }

    /// An image's record and its (labelled) file opened for reading (to stream it), `None` when
    /// there is no such image.
    pub async fn open(
        &self,
        image_id: Uuid,
    ) -> anyhow::Result<Option<(ImageRecord, tokio::fs::File)>> {
        let Some(record) = self.record(image_id).await? else {
            return Ok(None);
        };
        let file = tokio::fs::File::open(self.blob_path(&record.sha256))
            .await
            .with_context(|| format!("opening the bytes of image {image_id}"))?;
        Ok(Some((record, file)))
    }

    /// An image's original as ComfyUI produced it, when kept (admins only: it has no label).
    pub async fn original(&self, image_id: Uuid) -> anyhow::Result<Option<Vec<u8>>> {
        let Some(sha256) = self
            .record(image_id)
            .await?
            .and_then(|record| record.original_sha256)
        else {
            return Ok(None);
        };
        tokio::fs::read(self.blob_path(&sha256))
            .await
            .map(Some)
            .with_context(|| format!("reading the original of image {image_id}"))
    }

    /// An image's record and (labelled) bytes, `None` when there is no such image.
    pub async fn get(&self, image_id: Uuid) -> anyhow::Result<Option<(ImageRecord, Vec<u8>)>> {
        let Some(record) = self.record(image_id).await? else {
            return Ok(None);
        };
        let bytes = tokio::fs::read(self.blob_path(&record.sha256))
            .await
            .with_context(|| format!("reading the bytes of image {image_id}"))?;
        Ok(Some((record, bytes)))
    }
}

/// Write to a temporary name, flush it to disk, then rename and flush the directory: a reader
/// never sees half a file, and once this returns the file survives a power loss. Without the
/// flushes the file system may commit the rename before the data (ext4 allocates late), leaving
/// an empty file under the final name after a crash: an image the user paid for, lost, and a
/// blob `put` would then never write again.
async fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let directory = path.parent().context("an image path has a directory")?;
    tokio::fs::create_dir_all(directory)
        .await
        .with_context(|| format!("creating {}", directory.display()))?;
    let temporary = directory.join(format!(".{}.tmp", Uuid::new_v4().simple()));
    let mut file = tokio::fs::File::create(&temporary)
        .await
        .with_context(|| format!("creating {}", temporary.display()))?;
    file.write_all(bytes)
        .await
        .with_context(|| format!("writing {}", temporary.display()))?;
    file.sync_all()
        .await
        .with_context(|| format!("flushing {}", temporary.display()))?;
    drop(file);
    tokio::fs::rename(&temporary, path)
        .await
        .with_context(|| format!("renaming into {}", path.display()))?;
    tokio::fs::File::open(directory)
        .await
        .with_context(|| format!("opening {}", directory.display()))?
        .sync_all()
        .await
        .with_context(|| format!("flushing {}", directory.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::labels::Labeller;

    /// A plain PNG of one colour, as a server would send it.
    fn png(colour: [u8; 3]) -> Vec<u8> {
        let image = image::RgbImage::from_pixel(64, 64, image::Rgb(colour));
        let mut out = std::io::Cursor::new(Vec::new());
        image.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn labelled(keep_original: bool, bytes: &[u8], task: TaskId, index: usize) -> LabelledImage {
        let mut settings = crate::platform::configuration::Settings::defaults()
            .unwrap()
            .labels;
        settings.keep_original = keep_original;
        Labeller::new(&settings)
            .unwrap()
            .label_now(bytes, task, index, image_id(task, index))
            .unwrap()
    }

    #[tokio::test]
    async fn images_are_stored_once_per_content_and_found_by_id() {
        let root = std::env::temp_dir().join(format!("zhihui-images-{}", Uuid::new_v4()));
        let store = ImageStore::new(&root);
        let task = Uuid::now_v7();
        let owner = UserId::from_uuid(Uuid::now_v7());
        let image = labelled(false, &png([10, 20, 30]), task, 0);
        let first = store
            .put(image_id(task, 0), owner, task, &image)
            .await
            .unwrap();
        let second = store
            .put(image_id(task, 1), owner, task, &image)
            .await
            .unwrap();
        assert_eq!(first.sha256, second.sha256);
        let (record, bytes) = store.get(image_id(task, 1)).await.unwrap().unwrap();
        assert_eq!(record.owner, owner.as_uuid());
        assert_eq!(bytes, image.bytes());
        assert!(store.get(Uuid::now_v7()).await.unwrap().is_none());
        assert_ne!(image_id(task, 0), image_id(task, 1));
        // No original unless asked for.
        assert!(record.original_sha256.is_none());
        assert!(store.original(image_id(task, 1)).await.unwrap().is_none());
        tokio::fs::remove_dir_all(root).await.unwrap();
    }

    #[tokio::test]
    async fn the_original_is_kept_beside_the_labelled_image_only_when_configured() {
        let root = std::env::temp_dir().join(format!("zhihui-images-{}", Uuid::new_v4()));
        let store = ImageStore::new(&root);
        let task = Uuid::now_v7();
        let owner = UserId::from_uuid(Uuid::now_v7());
        let original = png([200, 100, 0]);
        let image = labelled(true, &original, task, 0);
        store
            .put(image_id(task, 0), owner, task, &image)
            .await
            .unwrap();
        assert_eq!(
            store.original(image_id(task, 0)).await.unwrap().unwrap(),
            original
        );
        let (_, served) = store.get(image_id(task, 0)).await.unwrap().unwrap();
        assert_ne!(served, original);
        assert!(
            crate::labels::metadata::read(&served)
                .unwrap()
                .png_text
                .is_some()
        );
        tokio::fs::remove_dir_all(root).await.unwrap();
    }

    #[tokio::test]
    async fn a_stored_again_record_replaces_the_old_one_and_no_temporary_file_is_left() {
        let root = std::env::temp_dir().join(format!("zhihui-images-{}", Uuid::new_v4()));
        let store = ImageStore::new(&root);
        let task = Uuid::now_v7();
        let owner = UserId::from_uuid(Uuid::now_v7());
        let id = image_id(task, 0);
        let first = labelled(false, &png([1, 1, 1]), task, 0);
        store.put(id, owner, task, &first).await.unwrap();
        // A retried completion stores the same id again (here with other bytes).
        let second = labelled(false, &png([2, 2, 2]), task, 0);
        store.put(id, owner, task, &second).await.unwrap();
        let (record, bytes) = store.get(id).await.unwrap().unwrap();
        assert_eq!(bytes, second.bytes());
        assert_eq!(record.bytes, second.bytes().len() as u64);
        let mut pending = vec![root.clone()];
        while let Some(directory) = pending.pop() {
            let mut entries = tokio::fs::read_dir(&directory).await.unwrap();
            while let Some(entry) = entries.next_entry().await.unwrap() {
                let name = entry.file_name().to_string_lossy().into_owned();
                assert!(!name.ends_with(".tmp"), "left behind: {name}");
                if entry.file_type().await.unwrap().is_dir() {
                    pending.push(entry.path());
                }
            }
        }
        tokio::fs::remove_dir_all(root).await.unwrap();
    }
}
