//! onoff local.
