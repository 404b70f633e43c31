//! The admin command line.

use super::*;

#[derive(clap::Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: AdminCmd,
}

async fn cli(id: &Identity, args: &[&str]) -> anyhow::Result<(String, String)> {
    cli_priced(id, args, None).await
}

async fn cli_priced(
    id: &Identity,
    args: &[&str],
    prices: Option<&crate::pricing::Prices>,
) -> anyhow::Result<(String, String)> {
    use clap::Parser as _;
    let cmd = Cli::try_parse_from(std::iter::once("admin").chain(args.iter().copied()))?.cmd;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    run_admin_to(cmd, id, prices, &mut out, &mut err).await?;
    Ok((String::from_utf8(out)?, String::from_utf8(err)?))
}

/// Issue 14, point 2: budgets in currency set from the command line, and
/// the usage report with each row's cost.
#[tokio::test]
async fn the_cli_sets_spend_budgets_and_prices_usage() {
    let id = mem().await;
    cli(&id, &["tenant", "create", "acme", "--spend-per-month", "12.5", "--spend-per-day", "0.75"]).await.unwrap();
    let t = id.get_tenant("acme").await.unwrap();
    use crate::pricing::Money;
    assert_eq!((t.limits.spend_per_day, t.limits.spend_per_month), (Some(Money(750_000)), Some(Money(12_500_000))));
    let err = cli(&id, &["tenant", "update", "acme", "--spend-per-day=-1"]).await.unwrap_err().to_string();
    assert!(err.contains("--spend-per-day") && err.contains("0 or more"), "{err}");
    let (out, _) = cli(&id, &["tenant", "list"]).await.unwrap();
    assert!(out.contains(r#""spend_per_day":0.75"#), "{out}");

    let mut prices = crate::pricing::Prices::default();
    prices.models.insert(
        "llama".into(),
        crate::pricing::ModelPrice { input_per_million: 1.0, cached_input_per_million: None, output_per_million: 2.0 },
    );
    id.record(rec("acme", "llama", 200, 1_000, 500, 0, now_ms()));
    id.record(rec("acme", "=cmd", 200, 5, 5, 0, now_ms()));
    id.flush().await;
    let (out, _) = cli_priced(&id, &["usage", "--csv"], Some(&prices)).await.unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens,cost,currency");
    assert!(lines.contains(&"acme,llama,1,0,1000,500,0,0.002000,USD"), "{out}");
    assert!(lines.contains(&"acme,'=cmd,1,0,5,5,0,,USD"), "a formula made inert: {out}");
    let (out, _) = cli_priced(&id, &["usage"], Some(&prices)).await.unwrap();
    assert!(out.contains("COST") && out.contains("0.002000 USD"), "{out}");
    let (out, _) = cli_priced(&id, &["usage", "--csv"], Some(&crate::pricing::Prices::default())).await.unwrap();
    assert!(!out.contains("cost"), "prices without models: no cost column: {out}");
}

#[tokio::test]
async fn the_cli_manages_tenants_and_keys() {
    let id = mem().await;
    cli(&id, &["tenant", "create", "acme", "--priority", "premium", "--requests-per-minute", "10"]).await.unwrap();
    let t = id.get_tenant("acme").await.unwrap();
    assert_eq!(t.priority, Priority::Premium);
    assert_eq!(t.limits.requests_per_minute, Some(10));

    cli(&id, &["tenant", "update", "acme", "--tokens-per-day", "500", "--log-prompts", "true"]).await.unwrap();
    let t = id.get_tenant("acme").await.unwrap();
    assert_eq!((t.limits.requests_per_minute, t.limits.tokens_per_day, t.log_prompts), (Some(10), Some(500), true));

    let (out, _) = cli(&id, &["tenant", "list"]).await.unwrap();
    assert!(out.starts_with("ID"), "{out}");
    assert!(out.lines().nth(1).unwrap().contains("acme"), "{out}");

    let (out, err) = cli(&id, &["key", "create", "--tenant", "acme", "--models", "a,b"]).await.unwrap();
    assert!(err.contains("shown only now"), "{err}");
    let created: serde_json::Value = serde_json::from_str(&out).unwrap();
    let secret = created["key"].as_str().unwrap();
    let p = id.authenticate(secret).await.unwrap();
    assert_eq!(p.models, Some(vec!["a".to_string(), "b".to_string()]));

    let (out, _) = cli(&id, &["key", "list", "--tenant", "acme"]).await.unwrap();
    assert!(out.contains(created["prefix"].as_str().unwrap()));
    assert!(!out.contains(&secret[12..]));

    let key_id = created["id"].to_string();
    // Update and rotate, before revoking.
    let (out, _) =
        cli(&id, &["key", "update", &key_id, "--all-models", "--requests-per-minute", "7", "--expires-in", "60"])
            .await
            .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((v["models"].is_null(), &v["limits"]["requests_per_minute"]), (true, &serde_json::json!(7)), "{v}");
    assert!(v["expires_ms"].is_i64(), "{v}");
    let (out, _) = cli(&id, &["key", "update", &key_id, "--never-expires"]).await.unwrap();
    assert!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["expires_ms"].is_null());
    let (out, err) = cli(&id, &["key", "rotate", &key_id, "--grace-s", "0"]).await.unwrap();
    assert!(err.contains("shown only now"), "{err}");
    let rotated: serde_json::Value = serde_json::from_str(&out).unwrap();
    let new_secret = rotated["key"].as_str().unwrap();
    assert!(id.authenticate(new_secret).await.is_ok());
    cli(&id, &["key", "revoke", &key_id]).await.unwrap();
    assert!(id.authenticate(secret).await.is_err());

    id.record(rec("acme", "llama", 200, 4, 2, 0, now_ms()));
    id.flush().await;
    let (out, _) = cli(&id, &["usage", "--csv"]).await.unwrap();
    assert_eq!(out.lines().nth(1), Some("acme,llama,1,0,4,2,0"), "{out}");
    let (out, _) = cli(&id, &["audit", "--tenant", "acme", "--limit", "5"]).await.unwrap();
    assert_eq!(out.lines().count(), 2, "{out}");

    cli(&id, &["tenant", "disable", "acme"]).await.unwrap();
    assert!(id.get_tenant("acme").await.unwrap().disabled);
    assert!(cli(&id, &["tenant", "create", "Bad Name"]).await.is_err());
    assert!(cli(&id, &["key", "create", "--tenant", "nobody"]).await.is_err());
}
