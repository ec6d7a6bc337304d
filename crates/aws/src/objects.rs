//! Job spec objects on S3: the size (HeadObject) and the bytes (GetObject) of the object version a
//! submission event names, with S3's errors classified.
//!
//! An ObjectCreated event names a version (`versionId`, on a bucket with versioning, as the
//! template's): it is read by that id, so an overwrite that lands before the read cannot swap the
//! content. Without a version id the current object is read only while its ETag is still the
//! event's (`If-Match`); otherwise [`ObjectError::Changed`].
//!
//! IAM: `s3:GetObject` for reads without a version id, `s3:GetObjectVersion` for reads by
//! version id (HeadObject needs the same actions as GetObject).

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};

/// The submission an S3 ObjectCreated record names, as the submit function takes it: the key
/// decoded ([`url_decoded_key`]), the version id kept unless empty or `null` (a bucket without
/// versioning); `None` for an object outside `jobs/`, which is no submission.
#[must_use]
pub fn s3_submission(
    bucket: &str,
    raw_key: &str,
    etag: &str,
    version_id: Option<&str>,
) -> Option<onoff_control::submit::Source> {
    let key = url_decoded_key(raw_key);
    key.starts_with("jobs/").then(|| onoff_control::submit::Source::S3 {
        bucket: bucket.to_string(),
        key,
        etag: etag.to_string(),
        version: version_id.filter(|v| !v.is_empty() && *v != "null").map(str::to_string),
    })
}

/// Every version under `prefix` of `bucket`, page after page of at most `page_size` (S3 answers
/// 1,000 versions a ListObjectVersions call at most: `IsTruncated`, then `NextKeyMarker` and
/// `NextVersionIdMarker` for the next; Amazon S3 API Reference, ListObjectVersions). For the
/// local stack, which plays a versioned bucket's events from the listing.
///
/// # Errors
/// The first call S3 refuses.
pub async fn list_versions(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    prefix: &str,
    page_size: i32,
) -> Result<
    Vec<aws_sdk_s3::types::ObjectVersion>,
    SdkError<aws_sdk_s3::operation::list_object_versions::ListObjectVersionsError>,
> {
    let mut all = Vec::new();
    let (mut key_marker, mut version_marker) = (None, None);
    loop {
        let page = s3
            .list_object_versions()
            .bucket(bucket)
            .prefix(prefix)
            .max_keys(page_size)
            .set_key_marker(key_marker)
            .set_version_id_marker(version_marker)
            .send()
            .await?;
        all.extend(page.versions().iter().cloned());
        if page.is_truncated() != Some(true) || page.next_key_marker().is_none() {
            return Ok(all);
        }
        key_marker = page.next_key_marker().map(str::to_string);
        version_marker = page.next_version_id_marker().map(str::to_string);
    }
}

/// A key as S3 gives it URL-encoded, decoded: an event's `s3.object.key`, or a listing asked with
/// `EncodingType=url` (which a key XML 1.0 cannot carry, e.g. with a control character, needs:
/// ListObjectsV2, `EncodingType`). `+` is a space, `%xx` a byte (as botocore's `unquote_plus`
/// reads them); a `%` not followed by two hex digits is kept.
#[must_use]
pub fn url_decoded_key(key: &str) -> String {
    percent_encoding::percent_decode_str(&key.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

/// One object version, as a submission event names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRef {
    /// Bucket.
    pub bucket: String,
    /// Key (decoded).
    pub key: String,
    /// Version id; `None` on a bucket without versioning.
    pub version: Option<String>,
    /// ETag as the event gives it (with or without quotes); `None` or empty: not checked.
    pub etag: Option<String>,
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)?;
        if let Some(v) = &self.version {
            write!(f, "?versionId={v}")?;
        }
        Ok(())
    }
}

/// Why an object could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ObjectError {
    /// No such key or version (deleted, or not visible yet).
    #[error("{0}")]
    NotFound(String),
    /// Read without a version id: the object's ETag is no longer the event's, it was overwritten
    /// and the event's content is gone.
    #[error("{0}")]
    Changed(String),
    /// Anything else (access denied, throttling, network): retrying may help.
    #[error("{0}")]
    Other(String),
}

/// Classify an S3 error by code and HTTP status (HeadObject errors carry no body, so no code).
fn object_error<E>(what: &str, obj: &ObjectRef, e: &SdkError<E>) -> ObjectError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let status = e.raw_response().map(|r| r.status().as_u16());
    let code = e.code().unwrap_or("Unknown");
    let text = format!("{what} {obj}: {code}: {}", crate::errors::error_text(e));
    match (code, status) {
        ("NoSuchKey" | "NoSuchVersion" | "NotFound", _) | (_, Some(404)) => ObjectError::NotFound(text),
        ("PreconditionFailed", _) | (_, Some(412)) => ObjectError::Changed(text),
        _ => ObjectError::Other(text),
    }
}

/// The ETag for `If-Match`: quoted, as HTTP wants it (S3 events give it without quotes).
fn if_match(obj: &ObjectRef) -> Option<String> {
    match (&obj.version, &obj.etag) {
        (None, Some(e)) if !e.trim_matches('"').is_empty() => Some(format!("\"{}\"", e.trim_matches('"'))),
        _ => None,
    }
}

/// Job spec objects on S3.
#[derive(Debug, Clone)]
pub struct S3Objects {
    client: aws_sdk_s3::Client,
}

impl S3Objects {
    /// Over `client`.
    pub fn new(client: aws_sdk_s3::Client) -> Self {
        Self { client }
    }

    /// Size of the object version, bytes (HeadObject: nothing is downloaded).
    ///
    /// # Errors
    /// [`ObjectError`] as classified above.
    pub async fn size(&self, obj: &ObjectRef) -> Result<u64, ObjectError> {
        let out = self
            .client
            .head_object()
            .bucket(&obj.bucket)
            .key(&obj.key)
            .set_version_id(obj.version.clone())
            .set_if_match(if_match(obj))
            .send()
            .await
            .map_err(|e| object_error("HeadObject", obj, &e))?;
        Ok(out.content_length().unwrap_or(0).max(0) as u64)
    }

    /// The object version's bytes (GetObject).
    ///
    /// # Errors
    /// [`ObjectError`] as classified above; a body cut off midway is [`ObjectError::Other`].
    pub async fn read(&self, obj: &ObjectRef) -> Result<Vec<u8>, ObjectError> {
        let out = self
            .client
            .get_object()
            .bucket(&obj.bucket)
            .key(&obj.key)
            .set_version_id(obj.version.clone())
            .set_if_match(if_match(obj))
            .send()
            .await
            .map_err(|e| object_error("GetObject", obj, &e))?;
        let body = out
            .body
            .collect()
            .await
            .map_err(|e| ObjectError::Other(format!("GetObject {obj}: body: {e}")))?;
        Ok(body.into_bytes().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_url_decoded() {
        assert_eq!(url_decoded_key("jobs/my+run%3A1.json"), "jobs/my run:1.json");
        assert_eq!(url_decoded_key("jobs/100%"), "jobs/100%");
        assert_eq!(url_decoded_key("a%2Bb%20c%07%C3%BC"), "a+b c\u{7}ü");
    }

    #[test]
    fn the_etag_is_checked_only_without_a_version_id() {
        let mut o = ObjectRef {
            bucket: "b".into(),
            key: "jobs/a b.json".into(),
            version: None,
            etag: Some("abc".into()),
        };
        assert_eq!(if_match(&o).as_deref(), Some("\"abc\""));
        assert_eq!(o.to_string(), "s3://b/jobs/a b.json");
        o.etag = Some("\"abc\"".into());
        assert_eq!(if_match(&o).as_deref(), Some("\"abc\""));
        o.version = Some("v1".into());
        assert_eq!(if_match(&o), None);
        assert_eq!(o.to_string(), "s3://b/jobs/a b.json?versionId=v1");
    }
}
