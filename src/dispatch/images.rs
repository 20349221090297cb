//! The image store: images downloaded from ComfyUI, kept on local disk, content-addressed
//! (`blobs/<sha256[0..2]>/<sha256>`), with one small record per image id naming its owner
//! (`images/<image id>.json`). Users fetch images from zhihui by id, owner only; a ComfyUI
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

    /// Store an image's bytes (once per content) and its record.
    pub async fn put(
        &self,
        image_id: Uuid,
        owner: UserId,
        task_id: TaskId,
        bytes: &[u8],
        content_type: &str,
    ) -> anyhow::Result<ImageRecord> {
        let sha256: String = Sha256::digest(bytes)
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        let blob = self.blob_path(&sha256);
        if tokio::fs::metadata(&blob).await.is_err() {
            write_atomically(&blob, bytes).await?;
        }
        let record = ImageRecord {
            image_id,
            owner: owner.as_uuid(),
            task_id,
            sha256,
            content_type: content_type.to_owned(),
            bytes: bytes.len() as u64,
        };
        let json = serde_json::to_vec(&record).context("encoding an image record")?;
        write_atomically(&self.record_path(image_id), &json).await?;
        Ok(record)
    }

    /// An image's record and its file opened for reading (to stream it), `None` when there is no
    /// such image.
    pub async fn open(
        &self,
        image_id: Uuid,
    ) -> anyhow::Result<Option<(ImageRecord, tokio::fs::File)>> {
        let record = match tokio::fs::read(self.record_path(image_id)).await {
            Ok(json) => serde_json::from_slice::<ImageRecord>(&json)
                .with_context(|| format!("image record {image_id} is damaged"))?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error).context("reading an image record"),
        };
        let file = tokio::fs::File::open(self.blob_path(&record.sha256))
            .await
            .with_context(|| format!("opening the bytes of image {image_id}"))?;
        Ok(Some((record, file)))
    }

    /// An image's record and bytes, `None` when there is no such image.
    pub async fn get(&self, image_id: Uuid) -> anyhow::Result<Option<(ImageRecord, Vec<u8>)>> {
        let record = match tokio::fs::read(self.record_path(image_id)).await {
            Ok(json) => serde_json::from_slice::<ImageRecord>(&json)
                .with_context(|| format!("image record {image_id} is damaged"))?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error).context("reading an image record"),
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

    #[tokio::test]
    async fn images_are_stored_once_per_content_and_found_by_id() {
        let root = std::env::temp_dir().join(format!("zhihui-images-{}", Uuid::new_v4()));
        let store = ImageStore::new(&root);
        let task = Uuid::now_v7();
        let owner = UserId::from_uuid(Uuid::now_v7());
        let first = store
            .put(image_id(task, 0), owner, task, b"png bytes", "image/png")
            .await
            .unwrap();
        let second = store
            .put(image_id(task, 1), owner, task, b"png bytes", "image/png")
            .await
            .unwrap();
        assert_eq!(first.sha256, second.sha256);
        let (record, bytes) = store.get(image_id(task, 1)).await.unwrap().unwrap();
        assert_eq!(record.owner, owner.as_uuid());
        assert_eq!(bytes, b"png bytes");
        assert!(store.get(Uuid::now_v7()).await.unwrap().is_none());
        assert_ne!(image_id(task, 0), image_id(task, 1));
        tokio::fs::remove_dir_all(root).await.unwrap();
    }

    #[tokio::test]
    async fn a_stored_again_record_replaces_the_old_one_and_no_temporary_file_is_left() {
        let root = std::env::temp_dir().join(format!("zhihui-images-{}", Uuid::new_v4()));
        let store = ImageStore::new(&root);
        let task = Uuid::now_v7();
        let owner = UserId::from_uuid(Uuid::now_v7());
        let id = image_id(task, 0);
        store
            .put(id, owner, task, b"first", "image/png")
            .await
            .unwrap();
        // A retried completion stores the same id again (here with other bytes).
        store
            .put(id, owner, task, b"second", "image/png")
            .await
            .unwrap();
        let (record, bytes) = store.get(id).await.unwrap().unwrap();
        assert_eq!(bytes, b"second");
        assert_eq!(record.bytes, 6);
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
