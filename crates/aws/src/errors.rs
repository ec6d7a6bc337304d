//! AWS error codes classified once, into the kinds the core acts on.
//!
//! The core never branches on an AWS string: [`classify_ec2_code`] maps EC2 error codes to
//! [`FleetErrorKind`], and the adapters keep the provider's code and message in the error text.

use onoff_control::ports::{FleetError, FleetErrorKind};

/// EC2 error codes that mean "no capacity for this offering now": try the next offering and
/// mark this one unavailable for a while. Source: the EC2 API error-code reference, as
/// karpenter-provider-aws groups them.
pub const INSUFFICIENT_CAPACITY_CODES: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity",
    "SpotMaxPriceTooLow",
    "UnfulfillableCapacity",
    "Unsupported",
];

/// EC2 error codes that mean "the account's quota of running vCPUs (or, for older accounts,
/// instances) for this bucket of families and capacity type is full": EC2 User Guide, "Amazon EC2
/// instance type quotas" (`VcpuLimitExceeded`, `InstanceLimitExceeded`) and "Spot Instance quotas"
/// (`MaxSpotInstanceCountExceeded`).
pub const QUOTA_CODES: &[&str] = &[
    "VcpuLimitExceeded",
    "MaxSpotInstanceCountExceeded",
    "InstanceLimitExceeded",
];

/// EC2 error codes that mean "a limit of the whole account in this region is reached, whatever
/// the offering": MaxFleetCountExceeded. Its quota counts fleets of type maintain and request
/// only ("The number of EC2 Fleets of type instant — Unlimited", EC2 User Guide, "Quotas for EC2
/// Fleet and Spot Fleet"), so onoff's instant fleets never fill it; users of other tools that
/// launch with CreateFleet met it on new or restricted accounts (runs-on/runs-on#88,
/// coiled/feedback#225), where no other offering would fare better.
pub const ACCOUNT_LIMIT_CODES: &[&str] = &["MaxFleetCountExceeded"];

/// EC2 error codes that mean "rate limited".
pub const THROTTLING_CODES: &[&str] = &["RequestLimitExceeded", "Throttling", "ThrottlingException"];

/// The kind of an EC2 error code.
pub fn classify_ec2_code(code: &str) -> FleetErrorKind {
    if INSUFFICIENT_CAPACITY_CODES.contains(&code) {
        FleetErrorKind::InsufficientCapacity
    } else if QUOTA_CODES.contains(&code) {
        FleetErrorKind::QuotaExceeded
    } else if THROTTLING_CODES.contains(&code) {
        FleetErrorKind::Throttled
    } else if ACCOUNT_LIMIT_CODES.contains(&code) {
        FleetErrorKind::AccountLimit
    } else if code.ends_with(".NotFound") || code == "InvalidInstanceID.Malformed" {
        FleetErrorKind::NotFound
    } else {
        FleetErrorKind::Other
    }
}

/// The message of an SDK error: the service's, or, when none came (the request was never sent,
/// e.g. refused by [`crate::limits::AwsLimits`], or the connection failed), the whole chain of
/// causes, which the error's own `Display` leaves out.
pub fn error_text<E>(err: &E) -> String
where
    E: aws_smithy_types::error::metadata::ProvideErrorMetadata + std::error::Error,
{
    err.message().map_or_else(
        || aws_smithy_types::error::display::DisplayErrorContext(err).to_string(),
        str::to_string,
    )
}

/// `<code>: <message>` of an SDK error ([`error_text`]; the code `Unknown` when none came): how
/// every adapter words an AWS failure.
pub fn describe<E>(err: &E) -> String
where
    E: aws_smithy_types::error::metadata::ProvideErrorMetadata + std::error::Error,
{
    format!("{}: {}", err.code().unwrap_or("Unknown"), error_text(err))
}

/// A [`FleetError`] from any SDK error that carries error metadata (code and message).
pub fn fleet_error<E>(err: &E) -> FleetError
where
    E: aws_sdk_ec2::error::ProvideErrorMetadata + std::error::Error,
{
    FleetError {
        kind: classify_ec2_code(err.code().unwrap_or("Unknown")),
        message: describe(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_kinds() {
        for (code, kind) in [
            ("InsufficientInstanceCapacity", FleetErrorKind::InsufficientCapacity),
            ("MaxSpotInstanceCountExceeded", FleetErrorKind::QuotaExceeded),
            ("SpotMaxPriceTooLow", FleetErrorKind::InsufficientCapacity),
            ("VcpuLimitExceeded", FleetErrorKind::QuotaExceeded),
            ("InstanceLimitExceeded", FleetErrorKind::QuotaExceeded),
            ("RequestLimitExceeded", FleetErrorKind::Throttled),
            ("MaxFleetCountExceeded", FleetErrorKind::AccountLimit),
            ("InvalidInstanceID.NotFound", FleetErrorKind::NotFound),
            ("InvalidLaunchTemplateId.NotFound", FleetErrorKind::NotFound),
            ("UnauthorizedOperation", FleetErrorKind::Other),
        ] {
            assert_eq!(classify_ec2_code(code), kind, "{code}");
        }
    }
}
