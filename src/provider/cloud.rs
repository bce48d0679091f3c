//! The cloud routes to the providers' models: AWS Bedrock (runtime and Mantle), Google Vertex AI and Azure
//! OpenAI. They speak the providers' own wire protocols (Anthropic Messages, OpenAI Chat and Responses, Gemini)
//! under other paths, plus one of their own (Bedrock Converse, `bedrock_converse`). This module maps a cloud
//! route's paths onto those adapters and reads what the path holds that the body does not: the model (Bedrock
//! and Vertex put it in the path and leave it out of the body; Azure names a deployment) and the cloud
//! (`gen_ai.provider.name`, which prices the call by the cloud's own table: a Bedrock cross-region profile or
//! a Vertex region is not priced as the vendor's first-party API).
//!
//! Paths (query removed; the upstream's own prefix, such as Vertex's `/v1`, may come first):
//! - Bedrock runtime: `/model/{modelId}/invoke`, `/invoke-with-response-stream` (the Anthropic Messages body with
//!   `anthropic_version: bedrock-2023-05-31`), `/model/{modelId}/converse`, `/converse-stream`;
//! - Bedrock Mantle: `/anthropic/v1/messages`, OpenAI's `/v1/chat/completions` and `/v1/responses` (also under
//!   `/openai/`);
//! - Vertex AI: `/projects/{p}/locations/{l}/publishers/anthropic/models/{m}:rawPredict` | `:streamRawPredict`,
//!   `/projects/{p}/locations/{l}/publishers/google/models/{m}:generateContent` | `:streamGenerateContent`;
//! - Azure OpenAI: `/openai/deployments/{deployment}/chat/completions` (and `/responses`), `/openai/v1/...`.

use crate::capture::Api;
use crate::config::ApiFamily;

/// The API a request on a cloud route speaks; None for the non-cloud families (their adapters decide).
pub fn detect(family: ApiFamily, path: &str) -> Option<Api> {
    Some(match family {
        ApiFamily::Openai | ApiFamily::Anthropic | ApiFamily::Gemini => return None,
        ApiFamily::Bedrock => match bedrock_action(path) {
            Some((model, "invoke" | "invoke-with-response-stream")) if is_anthropic_on_bedrock(model) => {
                Api::AnthropicMessages
            }
            Some((_, "converse" | "converse-stream")) => Api::BedrockConverse,
            _ => Api::Other,
        },
        // `/anthropic/v1/messages` on the service's host; a client whose base URL already ends in `/anthropic`
        // (Claude Code's ANTHROPIC_BEDROCK_MANTLE_BASE_URL) may be routed to it as `/v1/messages`.
        ApiFamily::BedrockMantle => {
            if path.ends_with("/v1/messages") {
                Api::AnthropicMessages
            } else {
                openai(path)
            }
        }
        ApiFamily::Vertex => match vertex_action(path) {
            Some(("anthropic", _, "rawPredict" | "streamRawPredict")) => Api::AnthropicMessages,
            Some(("google", _, "generateContent" | "streamGenerateContent")) => Api::GeminiGenerateContent,
            _ => Api::Other,
        },
        ApiFamily::AzureOpenai => openai(path),
    })
}

fn openai(path: &str) -> Api {
    if path.ends_with("/chat/completions") {
        Api::OpenAiChat
    } else if path.ends_with("/responses") {
        Api::OpenAiResponses
    } else {
        Api::Other
    }
}

/// The model a cloud path names, for a body that names none: Bedrock's model id (percent-decoded: SDKs
/// encode the `:` of `...-v1:0` and inference profile ARNs), Vertex's publisher model, Azure's deployment.
pub fn model_from_path(path: &str) -> Option<String> {
    let raw = bedrock_action(path)
        .map(|(model, _)| model)
        .or_else(|| vertex_action(path).map(|(_, model, _)| model))
        .or_else(|| azure_deployment(path))?;
    let model = percent_encoding::percent_decode_str(raw).decode_utf8_lossy();
    (!model.is_empty()).then(|| model.into_owned())
}

/// The model a call is billed as, when the path says more than the response: a Bedrock model id carries the
/// geography of its inference profile (`global.`, `us.`, ...), which sets the price, while the response names
/// only the vendor's model. None for other paths and for ARNs (an application profile names no model).
pub fn billed_model(path: &str) -> Option<String> {
    let path = path.split('?').next().unwrap_or(path);
    let (model, _) = bedrock_action(path)?;
    let model = percent_encoding::percent_decode_str(model).decode_utf8_lossy();
    (!model.is_empty() && !model.starts_with("arn:")).then(|| model.into_owned())
}

/// `gen_ai.provider.name` (OpenTelemetry well-known values) of a call whose path is unmistakably a cloud's:
/// `aws.bedrock`, `gcp.vertex_ai`, `azure.ai.openai`. Paths that gateways share (Mantle's
/// `/anthropic/v1/messages`, `/v1/chat/completions`, Azure's `/openai/v1/...`) give None: see
/// [`provider_of_model`], else the call keeps its adapter's or upstream's name.
pub fn provider_of_path(path: &str) -> Option<&'static str> {
    let path = path.split('?').next().unwrap_or(path);
    if bedrock_action(path).is_some() {
        Some("aws.bedrock")
    } else if vertex_action(path).is_some() {
        Some("gcp.vertex_ai")
    } else if azure_deployment(path).is_some() {
        Some("azure.ai.openai")
    } else {
        None
    }
}

/// `aws.bedrock` for a Bedrock model id (`anthropic.claude-opus-4-7`, `us.anthropic.claude-...-v1:0`,
/// `openai.gpt-oss-120b-1:0`): a vendor prefix with a dot, after an optional geography. The vendors' own APIs
/// and the gateways llmtap knows never name models that way (OpenRouter and LiteLLM use `vendor/model`), so this
/// finds Bedrock Mantle calls, whose paths look like any gateway's.
pub fn provider_of_model(model: &str) -> Option<&'static str> {
    let mut parts = model.split('.');
    let vendor = match (parts.next(), parts.next()) {
        (Some("us" | "eu" | "apac" | "au" | "jp" | "ca" | "us-gov" | "global"), Some(vendor)) => vendor,
        (Some(vendor), Some(_)) => vendor,
        _ => return None,
    };
    matches!(
        vendor,
        "anthropic" | "openai" | "meta" | "amazon" | "mistral" | "cohere" | "deepseek" | "qwen" | "ai21"
    )
    .then_some("aws.bedrock")
}

/// `.../model/{id}/{action}` → (id, action) for Bedrock runtime's model actions.
fn bedrock_action(path: &str) -> Option<(&str, &str)> {
    let (before, action) = path.rsplit_once('/')?;
    if !matches!(
        action,
        "invoke" | "invoke-with-response-stream" | "converse" | "converse-stream"
    ) {
        return None;
    }
    // Everything after `/model/`: an unencoded inference profile ARN holds a `/` of its own.
    let model = before.split_once("/model/")?.1;
    (!model.is_empty()).then_some((model, action))
}

/// Bedrock's InvokeModel takes each vendor's own body; llmtap reads the Anthropic one. A model id names its
/// vendor after an optional geography prefix (`us.`, `eu.`, `apac.`, `global.`): `anthropic.claude-...`. An
/// inference profile ARN names no vendor and is taken as Anthropic (what coding agents run on Bedrock).
fn is_anthropic_on_bedrock(model: &str) -> bool {
    let model = percent_encoding::percent_decode_str(model).decode_utf8_lossy();
    if model.starts_with("arn:") {
        return !model.contains("foundation-model/") || model.contains("foundation-model/anthropic.");
    }
    let mut parts = model.split('.');
    let vendor = match (parts.next(), parts.next()) {
        (Some("us" | "eu" | "apac" | "au" | "jp" | "ca" | "us-gov" | "global"), Some(vendor)) => vendor,
        (Some(vendor), _) => vendor,
        _ => "",
    };
    vendor == "anthropic"
}

/// `.../publishers/{publisher}/models/{model}:{method}` → (publisher, model, method).
fn vertex_action(path: &str) -> Option<(&str, &str, &str)> {
    let (before, last) = path.rsplit_once("/models/")?;
    let (model, method) = last.split_once(':')?;
    let publisher = before.rsplit_once("/publishers/")?.1;
    (!publisher.contains('/') && !model.contains('/')).then_some((publisher, model, method))
}

/// `/openai/deployments/{deployment}/...` → the deployment.
fn azure_deployment(path: &str) -> Option<&str> {
    let after = path.split_once("/openai/deployments/")?.1;
    let deployment = after.split('/').next()?;
    (!deployment.is_empty()).then_some(deployment)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bedrock_paths() {
        let b = ApiFamily::Bedrock;
        let id = "us.anthropic.claude-sonnet-4-5-20250929-v1:0";
        assert_eq!(detect(b, &format!("/model/{id}/invoke")), Some(Api::AnthropicMessages));
        assert_eq!(
            detect(
                b,
                "/model/global.anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke-with-response-stream"
            ),
            Some(Api::AnthropicMessages)
        );
        assert_eq!(
            detect(b, &format!("/model/{id}/converse-stream")),
            Some(Api::BedrockConverse)
        );
        assert_eq!(
            detect(b, "/model/amazon.nova-pro-v1:0/converse"),
            Some(Api::BedrockConverse)
        );
        assert_eq!(
            detect(b, "/model/meta.llama3-70b-instruct-v1:0/invoke"),
            Some(Api::Other)
        );
        assert_eq!(
            detect(b, "/model/us.meta.llama3-2-90b-instruct-v1:0/invoke"),
            Some(Api::Other)
        );
        assert_eq!(
            detect(
                b,
                "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Aapplication-inference-profile%2Fabc/invoke"
            ),
            Some(Api::AnthropicMessages)
        );
        assert_eq!(
            detect(
                b,
                "/model/arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/abc/converse"
            ),
            Some(Api::BedrockConverse)
        );
        assert_eq!(detect(b, "/model/x/count-tokens"), Some(Api::Other));
        assert_eq!(detect(b, "/invoke"), Some(Api::Other));
        assert_eq!(
            model_from_path("/model/global.anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke").as_deref(),
            Some("global.anthropic.claude-sonnet-4-5-20250929-v1:0")
        );
        assert_eq!(provider_of_path(&format!("/model/{id}/converse")), Some("aws.bedrock"));
        assert_eq!(
            billed_model("/model/global.anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke?x=1").as_deref(),
            Some("global.anthropic.claude-sonnet-4-5-20250929-v1:0")
        );
        assert_eq!(
            billed_model("/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Aapplication-inference-profile%2Fa/invoke"),
            None
        );
        assert_eq!(
            billed_model("/v1/projects/p/locations/l/publishers/anthropic/models/m:rawPredict"),
            None
        );
    }

    #[test]
    fn vertex_paths() {
        let v = ApiFamily::Vertex;
        let base = "/v1/projects/my-proj/locations/us-east5/publishers";
        assert_eq!(
            detect(
                v,
                &format!("{base}/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict")
            ),
            Some(Api::AnthropicMessages)
        );
        assert_eq!(
            detect(v, &format!("{base}/google/models/gemini-2.5-pro:generateContent")),
            Some(Api::GeminiGenerateContent)
        );
        assert_eq!(
            detect(v, &format!("{base}/anthropic/models/claude-x:countTokens")),
            Some(Api::Other)
        );
        assert_eq!(
            model_from_path(&format!(
                "{base}/anthropic/models/claude-sonnet-4-5@20250929:rawPredict"
            ))
            .as_deref(),
            Some("claude-sonnet-4-5@20250929")
        );
        assert_eq!(
            provider_of_path(&format!("{base}/google/models/gemini-2.5-pro:generateContent")),
            Some("gcp.vertex_ai")
        );
        // Gemini's own API has no publisher: not a Vertex path.
        assert_eq!(provider_of_path("/v1beta/models/gemini-2.5-pro:generateContent"), None);
    }

    #[test]
    fn azure_and_mantle_paths() {
        let a = ApiFamily::AzureOpenai;
        assert_eq!(
            detect(a, "/openai/deployments/my-gpt4o/chat/completions"),
            Some(Api::OpenAiChat)
        );
        assert_eq!(detect(a, "/openai/v1/responses"), Some(Api::OpenAiResponses));
        assert_eq!(detect(a, "/openai/deployments/d/embeddings"), Some(Api::Other));
        assert_eq!(
            model_from_path("/openai/deployments/my-gpt4o/chat/completions").as_deref(),
            Some("my-gpt4o")
        );
        assert_eq!(
            provider_of_path("/openai/deployments/my-gpt4o/chat/completions?api-version=2024-10-21"),
            Some("azure.ai.openai")
        );
        assert_eq!(provider_of_path("/openai/v1/chat/completions"), None);
        let m = ApiFamily::BedrockMantle;
        assert_eq!(detect(m, "/anthropic/v1/messages"), Some(Api::AnthropicMessages));
        assert_eq!(detect(m, "/v1/messages"), Some(Api::AnthropicMessages));
        assert_eq!(detect(m, "/anthropic/v1/messages/count_tokens"), Some(Api::Other));
        assert_eq!(detect(m, "/v1/chat/completions"), Some(Api::OpenAiChat));
        assert_eq!(detect(m, "/openai/v1/responses"), Some(Api::OpenAiResponses));
        assert_eq!(detect(m, "/v1/models"), Some(Api::Other));
        assert_eq!(provider_of_path("/anthropic/v1/messages"), None, "a gateway's path too");
        assert_eq!(provider_of_model("anthropic.claude-opus-4-7"), Some("aws.bedrock"));
        assert_eq!(
            provider_of_model("global.anthropic.claude-sonnet-4-5-20250929-v1:0"),
            Some("aws.bedrock")
        );
        assert_eq!(provider_of_model("openai.gpt-oss-120b-1:0"), Some("aws.bedrock"));
        for own in [
            "claude-opus-4-7",
            "gpt-5.2",
            "gpt-4.1-mini",
            "gemini-2.5-flash",
            "openai/gpt-4o",
            "o3",
        ] {
            assert_eq!(provider_of_model(own), None, "{own}");
        }
        assert_eq!(detect(ApiFamily::Openai, "/v1/chat/completions"), None);
        assert_eq!(model_from_path("/v1/chat/completions"), None);
    }
}
