//! The `scaler` Lambda's handler as a library, so `onoff local` runs the same code in process.
#![warn(missing_docs)]

pub mod handler;
