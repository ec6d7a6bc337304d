//! [`CheckpointStore`] on S3: files streamed from disk (multipart above [`PART_SIZE`] bytes), the
//! manifest written last; the latest checkpoint is the highest sequence number with a manifest.
//!
//! Layout: `checkpoints/<job-id>/<seq as 20 digits>/<relative path>` and
//! `checkpoints/<job-id>/<seq>/_manifest.json` = `{"seq": N, "files": [["path", size], ...]}`.
//!
//! Transfers are concurrent: a checkpoint's small files, and the parts of its large ones (ranged
//! GETs on the way down), go [`CONCURRENCY`] at a time, each a tokio task, so one checkpoint of
//! many GB uses the instance's bandwidth rather than one connection's. Dropping an upload or a
//! download aborts its tasks (an abandoned multipart upload is cleaned up by the bucket's
//! lifecycle rule).
//!
//! Why not the AWS transfer manager (`aws-sdk-s3-transfer-manager`): it is a developer preview
//! (0.x, "not recommended for production"), needs a newer toolchain than the workspace's
//! `rust-version`, and pulls its own HTTP, DNS and telemetry stack next to the SDK's. Bounded
//! tasks over the SDK's own calls do what a checkpoint needs.

use std::path::{Path, PathBuf};

use aws_sdk_s3::primitives::{ByteStream, Length};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use onoff_control::ports::{CheckpointRef, CheckpointStore, StoreError};
use tokio::io::{AsyncSeekExt, AsyncWriteExt};
use tokio::task::JoinSet;

/// Multipart part size, bytes (8 MiB; S3's minimum part is 5 MiB). A file too large for 10,000
/// parts of it (S3's limit) gets larger parts.
pub const PART_SIZE: u64 = 8 * 1024 * 1024;
/// Name of the manifest object in a checkpoint's prefix.
pub const MANIFEST: &str = "_manifest.json";
/// Requests in flight at once for one checkpoint (files and parts together).
pub const CONCURRENCY: usize = 8;
/// S3's limit on the parts of one multipart upload.
const MAX_PARTS: u64 = 10_000;

/// Checkpoints in one bucket.
#[derive(Debug, Clone)]
pub struct S3Checkpoints {
    client: aws_sdk_s3::Client,
    bucket: String,
    part_size: u64,
    concurrency: usize,
}

fn s3_error<E>(what: &str, e: &aws_sdk_s3::error::SdkError<E>) -> StoreError
where
    E: aws_sdk_s3::error::ProvideErrorMetadata + std::error::Error + 'static,
{
    StoreError::Other(format!("{what}: {}", crate::errors::describe(e)))
}

fn io_error(what: &str, path: &Path, e: &dyn std::fmt::Display) -> StoreError {
    StoreError::Other(format!("{what} {}: {e}", path.display()))
}

/// Files under `dir`, recursively, as (relative path with `/`, absolute path, size).
fn list_files(dir: &Path) -> Result<Vec<(String, PathBuf, u64)>, StoreError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| io_error("reading", &d, &e))? {
            let entry = entry.map_err(|e| io_error("reading", &d, &e))?;
            let path = entry.path();
            let meta = entry.metadata().map_err(|e| io_error("reading", &path, &e))?;
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let rel = path
                    .strip_prefix(dir)
                    .map_err(|e| io_error("relative path of", &path, &e))?
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join("/");
                out.push((rel, path, meta.len()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Run `tasks` as tokio tasks, at most `limit` at once; their outputs in completion order, or
/// the first error (the tasks still running are aborted).
async fn bounded<T, F>(tasks: impl IntoIterator<Item = F>, limit: usize) -> Result<Vec<T>, StoreError>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
{
    async fn next<T: 'static>(set: &mut JoinSet<Result<T, StoreError>>) -> Option<Result<T, StoreError>> {
        set.join_next()
            .await
            .map(|joined| joined.unwrap_or_else(|e| Err(StoreError::Other(format!("transfer task: {e}")))))
    }
    // Dropped on an early return: JoinSet aborts what still runs.
    let mut set = JoinSet::new();
    let mut out = Vec::new();
    for task in tasks {
        if set.len() >= limit.max(1) {
            if let Some(r) = next(&mut set).await {
                out.push(r?);
            }
        }
        set.spawn(task);
    }
    while let Some(r) = next(&mut set).await {
        out.push(r?);
    }
    Ok(out)
}

/// `(offset, length)` of each part of a `size`-byte object cut in `part`-byte pieces.
fn parts(size: u64, part: u64) -> Vec<(u64, u64)> {
    let part = part.max(1);
    (0..size.div_ceil(part))
        .map(|i| (i * part, part.min(size - i * part)))
        .collect()
}

/// One request of an upload.
enum Put {
    /// A whole file in one PutObject.
    File { key: String, path: PathBuf },
    /// Part `number` (from 1) of multipart upload `upload` (an index into the upload's list).
    Part {
        upload: usize,
        key: String,
        upload_id: String,
        path: PathBuf,
        number: i32,
        offset: u64,
        len: u64,
    },
}

/// A multipart upload in progress.
struct Multipart {
    key: String,
    upload_id: String,
}

impl S3Checkpoints {
    /// Checkpoints in `bucket`.
    pub fn new(client: aws_sdk_s3::Client, bucket: impl Into<String>) -> Self {
        Self {
            client,
            bucket: bucket.into(),
            part_size: PART_SIZE,
            concurrency: CONCURRENCY,
        }
    }

    /// Use `bytes` parts (at least 5 MiB) for multipart uploads and ranged downloads.
    pub fn with_part_size(mut self, bytes: u64) -> Self {
        self.part_size = bytes.max(5 * 1024 * 1024);
        self
    }

    /// At most `n` (at least 1) requests in flight per checkpoint.
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Upload every file under `dir` to `<prefix><relative path>` (multipart above the part size,
    /// [`CONCURRENCY`] requests at a time); returns the number of files. For a job's outputs.
    ///
    /// # Errors
    /// A file cannot be read, or S3 refused an upload.
    pub async fn upload_dir(&self, dir: &Path, prefix: &str) -> Result<usize, StoreError> {
        let files = list_files(dir)?;
        self.put_files(prefix, &files).await?;
        Ok(files.len())
    }

    fn prefix(job_id: &str, seq: u64) -> String {
        onoff_control::ports::checkpoint_prefix(job_id, seq)
    }

    /// Part size for a `size`-byte file: the configured one, or larger when 10,000 parts of it
    /// would not hold the file (8 MiB parts hold 80 GB).
    fn part_size_for(&self, size: u64) -> u64 {
        self.part_size.max(size.div_ceil(MAX_PARTS))
    }

    /// Upload `files` under `prefix`: small files whole, large ones in parts, all
    /// [`Self::with_concurrency`] at a time; then complete the multipart uploads.
    async fn put_files(&self, prefix: &str, files: &[(String, PathBuf, u64)]) -> Result<(), StoreError> {
        // A key S3 would refuse fails the whole upload before any byte goes up (a checkpoint
        // with a file left out could not be resumed from).
        if let Some((rel, _, _)) = files
            .iter()
            .find(|(rel, _, _)| prefix.len() + rel.len() > crate::limits::MAX_S3_KEY_BYTES)
        {
            return Err(StoreError::Invalid(format!(
                // The reason first: a row keeps only the first 2 KiB of it, and the path may be
                // most of that.
                "a key of {} bytes, where S3 takes at most {} (Amazon S3 User Guide, \"Naming \
                 Amazon S3 objects\"): use a shorter path for file {rel} (under {prefix})",
                prefix.len() + rel.len(),
                crate::limits::MAX_S3_KEY_BYTES
            )));
        }
        let mut multiparts: Vec<Multipart> = Vec::new();
        let result = async {
            let mut puts = Vec::new();
            for (rel, path, size) in files {
                let key = format!("{prefix}{rel}");
                if *size <= self.part_size {
                    puts.push(Put::File {
                        key,
                        path: path.clone(),
                    });
                    continue;
                }
                let up = self
                    .client
                    .create_multipart_upload()
                    .bucket(&self.bucket)
                    .key(&key)
                    .send()
                    .await
                    .map_err(|e| s3_error("start multipart upload", &e))?;
                let upload_id = up.upload_id().unwrap_or_default().to_string();
                let upload = multiparts.len();
                multiparts.push(Multipart {
                    key: key.clone(),
                    upload_id: upload_id.clone(),
                });
                for (i, (offset, len)) in parts(*size, self.part_size_for(*size)).into_iter().enumerate() {
                    puts.push(Put::Part {
                        upload,
                        key: key.clone(),
                        upload_id: upload_id.clone(),
                        path: path.clone(),
                        number: i32::try_from(i + 1).unwrap_or(i32::MAX),
                        offset,
                        len,
                    });
                }
            }
            let client = &self.client;
            let done = bounded(
                puts.into_iter().map(|p| put(client.clone(), self.bucket.clone(), p)),
                self.concurrency,
            )
            .await?;
            let mut completed: Vec<Vec<CompletedPart>> = vec![Vec::new(); multiparts.len()];
            for (upload, part) in done.into_iter().flatten() {
                completed[upload].push(part);
            }
            for (m, mut parts) in multiparts.iter().zip(completed) {
                parts.sort_by_key(|p| p.part_number());
                self.client
                    .complete_multipart_upload()
                    .bucket(&self.bucket)
                    .key(&m.key)
                    .upload_id(&m.upload_id)
                    .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
                    .send()
                    .await
                    .map_err(|e| s3_error("complete multipart upload", &e))?;
            }
            Ok::<(), StoreError>(())
        }
        .await;
        if result.is_err() {
            // Leave no half-uploaded parts behind (best effort; the lifecycle rule is the backstop).
            for m in &multiparts {
                let _ = self
                    .client
                    .abort_multipart_upload()
                    .bucket(&self.bucket)
                    .key(&m.key)
                    .upload_id(&m.upload_id)
                    .send()
                    .await;
            }
        }
        result
    }
}

/// Send one request of an upload; a part returns its upload's index and the completed part.
async fn put(client: aws_sdk_s3::Client, bucket: String, p: Put) -> Result<Option<(usize, CompletedPart)>, StoreError> {
    match p {
        Put::File { key, path } => {
            let body = ByteStream::from_path(&path)
                .await
                .map_err(|e| io_error("reading", &path, &e))?;
            client
                .put_object()
                .bucket(bucket)
                .key(key)
                .body(body)
                .send()
                .await
                .map_err(|e| s3_error("put checkpoint file", &e))?;
            Ok(None)
        }
        Put::Part {
            upload,
            key,
            upload_id,
            path,
            number,
            offset,
            len,
        } => {
            let body = ByteStream::read_from()
                .path(&path)
                .offset(offset)
                .length(Length::Exact(len))
                .build()
                .await
                .map_err(|e| io_error("reading", &path, &e))?;
            let part = client
                .upload_part()
                .bucket(bucket)
                .key(key)
                .upload_id(upload_id)
                .part_number(number)
                .body(body)
                .send()
                .await
                .map_err(|e| s3_error("upload part", &e))?;
            Ok(Some((
                upload,
                CompletedPart::builder()
                    .part_number(number)
                    .set_e_tag(part.e_tag().map(str::to_string))
                    .build(),
            )))
        }
    }
}

/// One GET of a download: the whole object, or `len` bytes at `offset` (a ranged GET), written
/// at the same offset of `path` (created at its full size beforehand).
struct Get {
    key: String,
    path: PathBuf,
    range: Option<u64>,
    len: u64,
}

async fn get(client: aws_sdk_s3::Client, bucket: String, g: Get) -> Result<(), StoreError> {
    let mut req = client.get_object().bucket(bucket).key(&g.key);
    if let Some(offset) = g.range {
        req = req.range(format!("bytes={offset}-{}", offset + g.len - 1));
    }
    let obj = req.send().await.map_err(|e| s3_error("get checkpoint file", &e))?;
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .open(&g.path)
        .await
        .map_err(|e| io_error("opening", &g.path, &e))?;
    file.seek(std::io::SeekFrom::Start(g.range.unwrap_or(0)))
        .await
        .map_err(|e| io_error("seeking in", &g.path, &e))?;
    let mut body = obj.body.into_async_read();
    let n = tokio::io::copy(&mut body, &mut file)
        .await
        .map_err(|e| io_error("writing", &g.path, &e))?;
    file.flush().await.map_err(|e| io_error("writing", &g.path, &e))?;
    if n != g.len {
        return Err(StoreError::Other(format!(
            "{}: got {n} bytes, the manifest says {}",
            g.key, g.len
        )));
    }
    Ok(())
}

impl CheckpointStore for S3Checkpoints {
    async fn upload(&self, job_id: &str, seq: u64, dir: &Path) -> Result<CheckpointRef, StoreError> {
        let files = list_files(dir)?;
        let prefix = Self::prefix(job_id, seq);
        self.put_files(&prefix, &files).await?;
        let listed: Vec<(String, u64)> = files.into_iter().map(|(r, _, s)| (r, s)).collect();
        let manifest = serde_json::json!({ "seq": seq, "files": listed }).to_string();
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(format!("{prefix}{MANIFEST}"))
            .body(ByteStream::from(manifest.into_bytes()))
            .content_type("application/json")
            .send()
            .await
            .map_err(|e| s3_error("put checkpoint manifest", &e))?;
        Ok(CheckpointRef {
            job_id: job_id.into(),
            seq,
            files: listed,
        })
    }

    async fn latest(&self, job_id: &str) -> Result<Option<CheckpointRef>, StoreError> {
        let base = format!("checkpoints/{job_id}/");
        let mut best: Option<u64> = None;
        // URL-encoded keys: a file name XML 1.0 cannot carry (a control character) would fail
        // the whole listing, and the job could never resume.
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(&base)
            .encoding_type(aws_sdk_s3::types::EncodingType::Url)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| s3_error("list checkpoints", &e))?;
            for o in page.contents() {
                let key = o.key().map(crate::objects::url_decoded_key);
                let Some(rest) = key.as_deref().and_then(|k| k.strip_prefix(&base)) else {
                    continue;
                };
                if let Some((seq, name)) = rest.split_once('/') {
                    if name == MANIFEST {
                        if let Ok(seq) = seq.parse::<u64>() {
                            best = Some(best.map_or(seq, |b| b.max(seq)));
                        }
                    }
                }
            }
        }
        let Some(seq) = best else { return Ok(None) };
        let obj = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(format!("{}{MANIFEST}", Self::prefix(job_id, seq)))
            .send()
            .await
            .map_err(|e| s3_error("get checkpoint manifest", &e))?;
        let bytes = obj
            .body
            .collect()
            .await
            .map_err(|e| StoreError::Other(format!("read manifest: {e}")))?
            .into_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| StoreError::Other(format!("manifest of {job_id}/{seq}: {e}")))?;
        let files = serde_json::from_value(v["files"].clone())
            .map_err(|e| StoreError::Other(format!("manifest of {job_id}/{seq}: {e}")))?;
        Ok(Some(CheckpointRef {
            job_id: job_id.into(),
            seq,
            files,
        }))
    }

    async fn download(&self, r: &CheckpointRef, dest: &Path) -> Result<(), StoreError> {
        let prefix = Self::prefix(&r.job_id, r.seq);
        let mut gets = Vec::new();
        for (rel, size) in &r.files {
            if rel.split('/').any(|c| c == ".." || c.is_empty()) {
                return Err(StoreError::Other(format!("refusing checkpoint path {rel:?}")));
            }
            let path = dest.join(rel);
            if let Some(parent) = path.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| io_error("creating", parent, &e))?;
            }
            // At its full size, so that the ranges can land in any order.
            let file = tokio::fs::File::create(&path)
                .await
                .map_err(|e| io_error("creating", &path, &e))?;
            file.set_len(*size).await.map_err(|e| io_error("sizing", &path, &e))?;
            let key = format!("{prefix}{rel}");
            if *size <= self.part_size {
                gets.push(Get {
                    key,
                    path,
                    range: None,
                    len: *size,
                });
            } else {
                for (offset, len) in parts(*size, self.part_size_for(*size)) {
                    gets.push(Get {
                        key: key.clone(),
                        path: path.clone(),
                        range: Some(offset),
                        len,
                    });
                }
            }
        }
        let client = &self.client;
        bounded(
            gets.into_iter().map(|g| get(client.clone(), self.bucket.clone(), g)),
            self.concurrency,
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn parts_cover_the_object_and_stay_under_the_part_limit() {
        assert_eq!(parts(0, 8), vec![]);
        assert_eq!(parts(8, 8), vec![(0, 8)]);
        assert_eq!(parts(20, 8), vec![(0, 8), (8, 8), (16, 4)]);
        let client = aws_sdk_s3::Client::from_conf(
            aws_sdk_s3::Config::builder()
                .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
                .build(),
        );
        let store = S3Checkpoints::new(client, "b");
        assert_eq!(store.part_size_for(20 * 1024 * 1024 * 1024), PART_SIZE);
        // 200 GB: 8 MiB parts would be 23,842 of them; S3 takes 10,000.
        let size = 200_000_000_000;
        let part = store.part_size_for(size);
        assert!(
            part > PART_SIZE && parts(size, part).len() as u64 <= MAX_PARTS,
            "{part}"
        );
    }

    #[tokio::test]
    async fn bounded_runs_at_most_the_limit_at_once_and_stops_at_the_first_error() {
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let task = |i: u64, fail: bool| {
            let (now, most) = (now.clone(), most.clone());
            async move {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5 + i % 3)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                if fail {
                    Err(StoreError::Other(format!("task {i}")))
                } else {
                    Ok(i)
                }
            }
        };
        let mut out = bounded((0..40).map(|i| task(i, false)), 4).await.unwrap();
        out.sort_unstable();
        assert_eq!(out, (0..40).collect::<Vec<_>>());
        assert_eq!(most.load(Ordering::SeqCst), 4, "concurrent, never more than 4");
        let err = bounded((0..40).map(|i| task(i, i == 5)), 4).await.unwrap_err();
        assert!(err.to_string().contains("task 5"), "{err}");
    }
}
