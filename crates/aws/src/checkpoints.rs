//! [`CheckpointStore`] on S3: files streamed from disk (multipart above [`PART_SIZE`] bytes), the
//! manifest written last; the latest checkpoint is the highest sequence number with a manifest.
//!
//! Layout: `checkpoints/<job-id>/<seq as 20 digits>/<relative path>` and
//! `checkpoints/<job-id>/<seq>/_manifest.json` = `{"seq": N, "files": [["path", size], ...]}`.

use std::path::{Path, PathBuf};

use aws_sdk_s3::primitives::{ByteStream, Length};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use onoff_control::ports::{CheckpointRef, CheckpointStore, StoreError};

/// Multipart part size, bytes (8 MiB; S3's minimum part is 5 MiB).
pub const PART_SIZE: u64 = 8 * 1024 * 1024;
/// Name of the manifest object in a checkpoint's prefix.
pub const MANIFEST: &str = "_manifest.json";

/// Checkpoints in one bucket.
#[derive(Debug, Clone)]
pub struct S3Checkpoints {
    client: aws_sdk_s3::Client,
    bucket: String,
    part_size: u64,
}

fn s3_error<E>(what: &str, e: &aws_sdk_s3::error::SdkError<E>) -> StoreError
where
    E: aws_sdk_s3::error::ProvideErrorMetadata + std::error::Error + 'static,
{
    use aws_sdk_s3::error::ProvideErrorMetadata;
    StoreError::Other(format!(
        "{what}: {}: {}",
        e.code().unwrap_or("Unknown"),
        e.message().map_or_else(|| e.to_string(), str::to_string)
    ))
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

impl S3Checkpoints {
    /// Checkpoints in `bucket`.
    pub fn new(client: aws_sdk_s3::Client, bucket: impl Into<String>) -> Self {
        Self {
            client,
            bucket: bucket.into(),
            part_size: PART_SIZE,
        }
    }

    /// Use `bytes` parts (at least 5 MiB) for multipart uploads.
    pub fn with_part_size(mut self, bytes: u64) -> Self {
        self.part_size = bytes.max(5 * 1024 * 1024);
        self
    }

    fn prefix(job_id: &str, seq: u64) -> String {
        onoff_control::ports::checkpoint_prefix(job_id, seq)
    }

    async fn put_file(&self, key: &str, path: &Path, size: u64) -> Result<(), StoreError> {
        if size <= self.part_size {
            let body = ByteStream::from_path(path)
                .await
                .map_err(|e| io_error("reading", path, &e))?;
            self.client
                .put_object()
                .bucket(&self.bucket)
                .key(key)
                .body(body)
                .send()
                .await
                .map_err(|e| s3_error("put checkpoint file", &e))?;
            return Ok(());
        }
        let up = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| s3_error("start multipart upload", &e))?;
        let upload_id = up.upload_id().unwrap_or_default().to_string();
        let result = async {
            let mut parts = Vec::new();
            let mut offset = 0;
            let mut number = 1;
            while offset < size {
                let len = self.part_size.min(size - offset);
                let body = ByteStream::read_from()
                    .path(path)
                    .offset(offset)
                    .length(Length::Exact(len))
                    .build()
                    .await
                    .map_err(|e| io_error("reading", path, &e))?;
                let part = self
                    .client
                    .upload_part()
                    .bucket(&self.bucket)
                    .key(key)
                    .upload_id(&upload_id)
                    .part_number(number)
                    .body(body)
                    .send()
                    .await
                    .map_err(|e| s3_error("upload part", &e))?;
                parts.push(
                    CompletedPart::builder()
                        .part_number(number)
                        .set_e_tag(part.e_tag().map(str::to_string))
                        .build(),
                );
                offset += len;
                number += 1;
            }
            self.client
                .complete_multipart_upload()
                .bucket(&self.bucket)
                .key(key)
                .upload_id(&upload_id)
                .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
                .send()
                .await
                .map_err(|e| s3_error("complete multipart upload", &e))?;
            Ok::<(), StoreError>(())
        }
        .await;
        if result.is_err() {
            // Leave no half-uploaded parts behind (best effort; the lifecycle rule is the backstop).
            let _ = self
                .client
                .abort_multipart_upload()
                .bucket(&self.bucket)
                .key(key)
                .upload_id(&upload_id)
                .send()
                .await;
        }
        result
    }
}

impl CheckpointStore for S3Checkpoints {
    async fn upload(&self, job_id: &str, seq: u64, dir: &Path) -> Result<CheckpointRef, StoreError> {
        let files = list_files(dir)?;
        let prefix = Self::prefix(job_id, seq);
        for (rel, path, size) in &files {
            self.put_file(&format!("{prefix}{rel}"), path, *size).await?;
        }
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
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(&base)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| s3_error("list checkpoints", &e))?;
            for o in page.contents() {
                let Some(rest) = o.key().and_then(|k| k.strip_prefix(&base)) else {
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
        for (rel, _) in &r.files {
            if rel.split('/').any(|c| c == ".." || c.is_empty()) {
                return Err(StoreError::Other(format!("refusing checkpoint path {rel:?}")));
            }
            let path = dest.join(rel);
            if let Some(parent) = path.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| io_error("creating", parent, &e))?;
            }
            let obj = self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(format!("{prefix}{rel}"))
                .send()
                .await
                .map_err(|e| s3_error("get checkpoint file", &e))?;
            let mut file = tokio::fs::File::create(&path)
                .await
                .map_err(|e| io_error("creating", &path, &e))?;
            let mut body = obj.body.into_async_read();
            tokio::io::copy(&mut body, &mut file)
                .await
                .map_err(|e| io_error("writing", &path, &e))?;
        }
        Ok(())
    }
}
