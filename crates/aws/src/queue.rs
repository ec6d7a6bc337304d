//! Lane queues on SQS: backlog as KEDA's SQS scaler counts it, send with delay, long-poll
//! receive, visibility extension, delete. Each lane has its own queue with a dead-letter queue
//! (the redrive policy lives in the template).

use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use onoff_policy::LaneBacklog;

/// An SQS failure, with the queue's lane and SQS's code and message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("queue {lane}: {message}")]
pub struct QueueError {
    /// Lane whose queue failed.
    pub lane: String,
    /// `Code: message`, or what is wrong with the lane.
    pub message: String,
}

/// A received message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// SQS message id.
    pub message_id: String,
    /// Receipt handle (for delete and visibility changes).
    pub receipt: String,
    /// Body.
    pub body: String,
    /// How many times it has been received (ApproximateReceiveCount), 1 the first time.
    pub receive_count: u32,
}

/// The lanes' queues.
#[derive(Debug, Clone)]
pub struct SqsQueues {
    client: aws_sdk_sqs::Client,
    urls: Vec<(String, String)>,
}

fn err<E>(lane: &str, e: &aws_sdk_sqs::error::SdkError<E>) -> QueueError
where
    E: aws_sdk_sqs::error::ProvideErrorMetadata + std::error::Error + 'static,
{
    QueueError {
        lane: lane.to_string(),
        message: crate::errors::describe(e),
    }
}

impl SqsQueues {
    /// `urls`: (lane, queue URL) pairs.
    pub fn new(client: aws_sdk_sqs::Client, urls: Vec<(String, String)>) -> Self {
        Self { client, urls }
    }

    fn url(&self, lane: &str) -> Result<&str, QueueError> {
        self.urls
            .iter()
            .find(|(l, _)| l == lane)
            .map(|(_, u)| u.as_str())
            .ok_or_else(|| QueueError {
                lane: lane.to_string(),
                message: "no queue configured for this lane".into(),
            })
    }

    /// Lanes with a queue.
    pub fn lanes(&self) -> impl Iterator<Item = &str> {
        self.urls.iter().map(|(l, _)| l.as_str())
    }

    /// Backlog of `lane`: ApproximateNumberOfMessages (visible), ...NotVisible (in flight) and
    /// ...Delayed.
    ///
    /// # Errors
    /// SQS failures or an unknown lane.
    pub async fn backlog(&self, lane: &str) -> Result<LaneBacklog, QueueError> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(self.url(lane)?)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .map_err(|e| err(lane, &e))?;
        let get = |a: QueueAttributeName| {
            out.attributes()
                .and_then(|m| m.get(&a))
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0)
        };
        Ok(LaneBacklog {
            visible: get(QueueAttributeName::ApproximateNumberOfMessages),
            in_flight: get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            delayed: get(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
        })
    }

    /// Send `body` to `lane`, visible after `delay_s` (0..=900). Returns the message id.
    ///
    /// # Errors
    /// SQS failures or an unknown lane.
    pub async fn send(&self, lane: &str, body: &str, delay_s: u32) -> Result<String, QueueError> {
        let out = self
            .client
            .send_message()
            .queue_url(self.url(lane)?)
            .message_body(body)
            .delay_seconds(delay_s.min(900) as i32)
            .send()
            .await
            .map_err(|e| err(lane, &e))?;
        Ok(out.message_id().unwrap_or_default().to_string())
    }

    /// Long-poll `lane` for up to `max` (1..=10) messages, waiting up to `wait_s` (0..=20), hiding
    /// them for `visibility_s`.
    ///
    /// # Errors
    /// SQS failures or an unknown lane.
    pub async fn receive(
        &self,
        lane: &str,
        max: u32,
        wait_s: u32,
        visibility_s: u32,
    ) -> Result<Vec<Received>, QueueError> {
        let out = self
            .client
            .receive_message()
            .queue_url(self.url(lane)?)
            .max_number_of_messages(max.clamp(1, 10) as i32)
            .wait_time_seconds(wait_s.min(20) as i32)
            .visibility_timeout(visibility_s as i32)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await
            .map_err(|e| err(lane, &e))?;
        Ok(out
            .messages()
            .iter()
            .map(|m| Received {
                message_id: m.message_id().unwrap_or_default().to_string(),
                receipt: m.receipt_handle().unwrap_or_default().to_string(),
                body: m.body().unwrap_or_default().to_string(),
                receive_count: m
                    .attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1),
            })
            .collect())
    }

    /// Hide a received message for another `visibility_s` from now (0 releases it at once).
    ///
    /// # Errors
    /// SQS failures (an expired receipt among them) or an unknown lane.
    pub async fn set_visibility(&self, lane: &str, receipt: &str, visibility_s: u32) -> Result<(), QueueError> {
        self.client
            .change_message_visibility()
            .queue_url(self.url(lane)?)
            .receipt_handle(receipt)
            .visibility_timeout(visibility_s as i32)
            .send()
            .await
            .map_err(|e| err(lane, &e))?;
        Ok(())
    }

    /// Delete a received message (its job is done). Idempotent on SQS's side.
    ///
    /// # Errors
    /// SQS failures or an unknown lane.
    pub async fn delete(&self, lane: &str, receipt: &str) -> Result<(), QueueError> {
        self.client
            .delete_message()
            .queue_url(self.url(lane)?)
            .receipt_handle(receipt)
            .send()
            .await
            .map_err(|e| err(lane, &e))?;
        Ok(())
    }
}
