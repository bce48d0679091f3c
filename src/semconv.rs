//! Attribute names: OpenTelemetry GenAI semantic conventions v1.41.1 and the development stream that followed
//! them (open-telemetry/semantic-conventions-genai, `gen-ai-dev/1.42.0-dev`; docs/exports.md says which names
//! come from where), and llmtap's own under `llmtap.`.

pub const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
pub const GEN_AI_PROVIDER_NAME: &str = "gen_ai.provider.name";
pub const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
pub const GEN_AI_REQUEST_MAX_TOKENS: &str = "gen_ai.request.max_tokens";
pub const GEN_AI_REQUEST_STREAM: &str = "gen_ai.request.stream";
pub const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
pub const GEN_AI_RESPONSE_ID: &str = "gen_ai.response.id";
pub const GEN_AI_RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
pub const GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: &str = "gen_ai.response.time_to_first_chunk";
pub const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
pub const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
pub const GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: &str = "gen_ai.usage.cache_read.input_tokens";
/// The development conventions' name for prompt-cache writes (renamed from `cache_creation`).
pub const GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS: &str = "gen_ai.usage.cache_write.input_tokens";
/// v1.41's name for the same count, still emitted next to the new one: back ends and dashboards built on v1.41
/// read it, and none reads the new one yet.
pub const GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: &str = "gen_ai.usage.cache_creation.input_tokens";
pub const GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: &str = "gen_ai.usage.reasoning.output_tokens";
/// Not an OpenTelemetry GenAI convention (v1.41 defines no cost attribute): the name OpenLIT emits and Langfuse
/// reads as a generation's cost in USD, so those back ends show llmtap's cost without mapping (docs/exports.md).
pub const GEN_AI_USAGE_COST: &str = "gen_ai.usage.cost";
/// The proposed convention's cost (semantic-conventions-genai PR 443, development): the amount as a double, its
/// ISO 4217 currency, and `local` (computed by the recorder from its price table) or `provider` (received).
pub const GEN_AI_USAGE_COST_AMOUNT: &str = "gen_ai.usage.cost.amount";
pub const GEN_AI_USAGE_COST_CURRENCY: &str = "gen_ai.usage.cost.currency";
pub const GEN_AI_USAGE_COST_SOURCE: &str = "gen_ai.usage.cost.source";
pub const GEN_AI_CONVERSATION_ID: &str = "gen_ai.conversation.id";
pub const GEN_AI_AGENT_NAME: &str = "gen_ai.agent.name";
pub const GEN_AI_TOOL_NAME: &str = "gen_ai.tool.name";
pub const GEN_AI_TOOL_CALL_ID: &str = "gen_ai.tool.call.id";
pub const GEN_AI_TOOL_TYPE: &str = "gen_ai.tool.type";
pub const GEN_AI_TOOL_CALL_ARGUMENTS: &str = "gen_ai.tool.call.arguments";
pub const GEN_AI_TOOL_CALL_RESULT: &str = "gen_ai.tool.call.result";
pub const GEN_AI_SYSTEM_INSTRUCTIONS: &str = "gen_ai.system_instructions";
pub const GEN_AI_INPUT_MESSAGES: &str = "gen_ai.input.messages";
pub const GEN_AI_OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
pub const GEN_AI_TOOL_DEFINITIONS: &str = "gen_ai.tool.definitions";
pub const SERVER_ADDRESS: &str = "server.address";
pub const SERVER_PORT: &str = "server.port";
pub const ERROR_TYPE: &str = "error.type";

pub const OP_CHAT: &str = "chat";
pub const OP_EXECUTE_TOOL: &str = "execute_tool";
pub const OP_INVOKE_AGENT: &str = "invoke_agent";

pub const LLMTAP_CALL_TYPE: &str = "llmtap.call_type";
/// main | subagent | warmup | quota | compaction | title | side.
pub const LLMTAP_PURPOSE: &str = "llmtap.purpose";
pub const LLMTAP_STEP_INDEX: &str = "llmtap.step_index";
pub const LLMTAP_PREFIX_REUSE_TOKENS: &str = "llmtap.prefix_reuse_tokens";
pub const LLMTAP_PREFIX_REUSE_ESTIMATED: &str = "llmtap.prefix_reuse_estimated";
pub const LLMTAP_TRAJECTORY_ID: &str = "llmtap.trajectory_id";
/// Prefix of the cost's five parts in USD: `llmtap.cost.input_usd`, `.cache_read_usd`, `.cache_write_usd`,
/// `.output_usd`, `.reasoning_usd`.
pub const LLMTAP_COST_PREFIX: &str = "llmtap.cost.";
/// Agent spans: the trajectory's calls without a known cost.
pub const LLMTAP_COST_UNPRICED_CALLS: &str = "llmtap.cost.unpriced_calls";
pub const LLMTAP_PROVIDER_TRACE_ID: &str = "llmtap.provider_trace_id";
pub const LLMTAP_SESSION_ID: &str = "llmtap.session_id";
/// OpenTelemetry general semantic conventions (session): the agent run a span belongs to.
pub const SESSION_ID: &str = "session.id";
pub const LLMTAP_AGENT_ROLE: &str = "llmtap.agent_role";
pub const LLMTAP_OUTCOME: &str = "llmtap.outcome";
pub const LLMTAP_TOOL_DURATION_ESTIMATED: &str = "llmtap.tool.duration_estimated";
pub const LLMTAP_PARENT_TRAJECTORY_ID: &str = "llmtap.parent_trajectory_id";
pub const LLMTAP_CONTINUES: &str = "llmtap.continues";
