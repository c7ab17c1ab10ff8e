//! `nightshift demo`: a self-contained demonstration cluster (stub until it is built).

/// Runs the demo; returns the process exit code.
pub async fn run(json: bool) -> anyhow::Result<i32> {
    let _ = json;
    anyhow::bail!("demo is not built yet")
}
