//! The `scaler` Lambda: tracing, settings and clients once, then the handler per event.

use scaler::handler;

use lambda_runtime::{run, service_fn, Error, LambdaEvent};

#[tokio::main]
async fn main() -> Result<(), Error> {
    lambda_runtime::tracing::init_default_subscriber();
    let settings = onoff_fn_common::Settings::from_env().map_err(|e| e.to_string())?;
    let (mut ctx, clients) = onoff_fn_common::aws_ctx(settings).await;
    // Offer only the zones the workers have a subnet in (one DescribeSubnets per cold start).
    onoff_fn_common::offer_subnet_zones(&mut ctx.settings, &ctx.fleet)
        .await
        .map_err(|e| e.to_string())?;
    let (ctx, clients) = (&ctx, &clients);
    run(service_fn(move |event: LambdaEvent<serde_json::Value>| async move {
        handler::handle(ctx, clients, event).await
    }))
    .await
}
