"""Every request field the installed ``openai`` SDK types is one afmd knows, at the top
level of a body and, for ``[api] strict``, inside its objects.

A field afmd does not know is listed in ``X-AFM-Ignored-Fields`` and, under ``[api] strict``,
refused as ``unknown_parameter``, which OpenAI never answers for its own fields: a client
passing a field its SDK offers (``prompt_cache_retention``) would break on a strict server.
When the SDK grows a field, this fails until the field is handled or knowingly ignored.
"""

from __future__ import annotations

import typing
from typing import Any

import anthropic.types as claude
import anthropic.types.beta as claude_beta
import pytest
from openai.types import chat as chat_types
from openai.types import completion_create_params, embedding_create_params
from openai.types import responses as r
from openai.types.chat import chat_completion_content_part_image_param as image_part
from openai.types.chat import chat_completion_custom_tool_param as custom_tool
from openai.types.chat import chat_completion_message_custom_tool_call_param as custom_call
from openai.types.chat import chat_completion_message_function_tool_call_param as tool_call
from openai.types.chat import chat_completion_named_tool_choice_custom_param as named_custom
from openai.types.chat import chat_completion_named_tool_choice_param as named_choice
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import input_token_count_params, response_create_params
from openai.types.responses import response_function_shell_call_output_content_param as shell_output
from openai.types.responses import response_input_item_param as input_item
from openai.types.responses import response_reasoning_item_param as reasoning_item
from openai.types.shared_params import (
    FunctionDefinition,
    custom_tool_input_format,
    response_format_json_schema,
)

from afmd.dialects.anthropic import history, messages_body, tools_body
from afmd.dialects.fields import messages, tool_specs
from afmd.dialects.openai import chat_body, completions_body, custom_tools, embeddings
from afmd.dialects.responses import client_tools, items, options, responses_body

#: Fields afmd knows and refuses with a pointer to their replacement.
REFUSED = {"functions", "function_call"}


def typed_fields(params: Any) -> set[str]:
    """The keys a TypedDict types, or any of a union of them (a message of each role)."""
    if not hasattr(params, "__mro__"):
        return set().union(*map(typed_fields, typing.get_args(params)))
    return {key for base in params.__mro__ for key in getattr(base, "__annotations__", {})}


@pytest.mark.parametrize(("params", "known"), [
    (chat_create_params.CompletionCreateParamsBase, chat_body.KNOWN_FIELDS | REFUSED),
    (completion_create_params.CompletionCreateParamsBase, completions_body.KNOWN_FIELDS),
    (embedding_create_params.EmbeddingCreateParams, embeddings.KNOWN_FIELDS),
    (response_create_params.ResponseCreateParamsBase, responses_body.KNOWN_FIELDS),
    (input_token_count_params.InputTokenCountParams, responses_body.COUNT_FIELDS),
], ids=["chat", "completions", "embeddings", "responses", "input_tokens"])
def test_every_field_the_sdk_types_is_known(params: Any, known: frozenset[str]) -> None:
    fields = typed_fields(params)
    assert "model" in fields  # the SDK's layout is the one this reads
    assert fields - known == set()


# ---------------------------------------------------------------------------- nested objects

#: (where, the SDK's TypedDicts of that object, the keys ``[api] strict`` admits there).
NESTED: list[tuple[str, tuple[Any, ...], frozenset[str]]] = [
    ("chat.messages[system]", (chat_types.ChatCompletionSystemMessageParam,),
     messages.MESSAGE_KEYS["system"]),
    ("chat.messages[developer]", (chat_types.ChatCompletionDeveloperMessageParam,),
     messages.MESSAGE_KEYS["developer"]),
    ("chat.messages[user]", (chat_types.ChatCompletionUserMessageParam,),
     messages.MESSAGE_KEYS["user"]),
    ("chat.messages[assistant]", (chat_types.ChatCompletionAssistantMessageParam,),
     messages.MESSAGE_KEYS["assistant"]),
    ("chat.messages[tool]", (chat_types.ChatCompletionToolMessageParam,),
     messages.MESSAGE_KEYS["tool"]),
    ("chat.content[text]", (chat_types.ChatCompletionContentPartTextParam,),
     messages.PART_KEYS["text"]),
    ("chat.content[image_url]", (chat_types.ChatCompletionContentPartImageParam,),
     messages.PART_KEYS["image_url"]),
    ("chat.content[refusal]", (chat_types.ChatCompletionContentPartRefusalParam,),
     messages.PART_KEYS["refusal"]),
    ("chat.content[].image_url", (image_part.ImageURL,), messages.IMAGE_URL_KEYS),
    ("chat.tool_calls[]", (chat_types.ChatCompletionMessageFunctionToolCallParam,),
     messages.TOOL_CALL_KEYS),
    ("chat.tool_calls[].function", (tool_call.Function,), messages.CALL_FUNCTION_KEYS),
    ("chat.tool_calls[custom]", (custom_call.ChatCompletionMessageCustomToolCallParam,),
     messages.CUSTOM_CALL_KEYS),
    ("chat.tool_calls[custom].custom", (custom_call.Custom,), messages.CALL_CUSTOM_KEYS),
    ("chat.tools[custom]", (custom_tool.ChatCompletionCustomToolParam,),
     tool_specs.CUSTOM_TOOL_KEYS),
    ("chat.tools[custom].custom", (custom_tool.Custom,), tool_specs.CUSTOM_KEYS),
    ("chat.tools[custom].format[text]", (custom_tool.CustomFormatText,),
     custom_tools.FORMAT_KEYS["text"]),
    ("chat.tools[custom].format[grammar]", (custom_tool.CustomFormatGrammar,),
     custom_tools.FORMAT_KEYS["grammar"]),
    ("chat.tools[custom].format.grammar", (custom_tool.CustomFormatGrammarGrammar,),
     custom_tools.GRAMMAR_KEYS),
    ("chat.tool_choice[custom]", (named_custom.ChatCompletionNamedToolChoiceCustomParam,),
     tool_specs.NAMED_CUSTOM_CHOICE_KEYS),
    ("chat.tool_choice[custom].custom", (named_custom.Custom,),
     tool_specs.CHOICE_FUNCTION_KEYS),
    ("chat.tools[]", (chat_types.ChatCompletionFunctionToolParam,), tool_specs.TOOL_KEYS),
    ("chat.tools[].function", (FunctionDefinition,), tool_specs.FUNCTION_KEYS),
    ("chat.tool_choice", (chat_types.ChatCompletionNamedToolChoiceParam,),
     tool_specs.NAMED_CHOICE_KEYS),
    ("chat.tool_choice.function", (named_choice.Function,), tool_specs.CHOICE_FUNCTION_KEYS),
    ("chat.tool_choice[allowed_tools]", (chat_types.ChatCompletionAllowedToolChoiceParam,),
     tool_specs.ALLOWED_CHOICE_KEYS),
    ("chat.tool_choice.allowed_tools", (chat_types.ChatCompletionAllowedToolsParam,),
     tool_specs.ALLOWED_TOOLS_KEYS),
    ("chat.response_format[json_schema]", (response_format_json_schema.ResponseFormatJSONSchema,),
     tool_specs.RESPONSE_FORMAT_KEYS["json_schema"]),
    ("chat.response_format.json_schema", (response_format_json_schema.JSONSchema,),
     tool_specs.JSON_SCHEMA_KEYS),
    ("responses.input[message]", (r.EasyInputMessageParam, input_item.Message,
                                  r.ResponseOutputMessageParam), items.ITEM_KEYS["message"]),
    ("responses.input[function_call]", (r.ResponseFunctionToolCallParam,),
     items.ITEM_KEYS["function_call"]),
    ("responses.input[custom_tool_call]", (r.ResponseCustomToolCallParam,),
     items.ITEM_KEYS["custom_tool_call"]),
    ("responses.input[function_call_output]", (input_item.FunctionCallOutput,),
     items.ITEM_KEYS["function_call_output"]),
    ("responses.input[custom_tool_call_output]", (r.ResponseCustomToolCallOutputParam,),
     items.ITEM_KEYS["custom_tool_call_output"]),
    ("responses.input[reasoning]", (r.ResponseReasoningItemParam,),
     items.ITEM_KEYS["reasoning"]),
    ("responses.input[item_reference]", (input_item.ItemReference,),
     items.ITEM_KEYS["item_reference"]),
    ("responses.input[shell_call]", (input_item.ShellCall,), items.ITEM_KEYS["shell_call"]),
    ("responses.input[shell_call].action", (input_item.ShellCallAction,),
     client_tools.SHELL_ACTION_KEYS),
    ("responses.input[shell_call_output]", (input_item.ShellCallOutput,),
     items.ITEM_KEYS["shell_call_output"]),
    ("responses.input[shell_call_output].output[]",
     (r.ResponseFunctionShellCallOutputContentParam,), client_tools.SHELL_OUTPUT_KEYS),
    ("responses.input[shell_call_output].output[].outcome",
     (shell_output.OutcomeExit, shell_output.OutcomeTimeout), client_tools.OUTCOME_KEYS),
    ("responses.input[local_shell_call]", (input_item.LocalShellCall,),
     items.ITEM_KEYS["local_shell_call"]),
    ("responses.input[local_shell_call].action", (input_item.LocalShellCallAction,),
     client_tools.EXEC_ACTION_KEYS),
    ("responses.input[local_shell_call_output]", (input_item.LocalShellCallOutput,),
     items.ITEM_KEYS["local_shell_call_output"]),
    ("responses.input[apply_patch_call]", (input_item.ApplyPatchCall,),
     items.ITEM_KEYS["apply_patch_call"]),
    ("responses.input[apply_patch_call].operation", (
        input_item.ApplyPatchCallOperationCreateFile, input_item.ApplyPatchCallOperationDeleteFile,
        input_item.ApplyPatchCallOperationUpdateFile), client_tools.OPERATION_KEYS),
    ("responses.input[apply_patch_call_output]", (input_item.ApplyPatchCallOutput,),
     items.ITEM_KEYS["apply_patch_call_output"]),
    ("responses.content[input_text]", (r.ResponseInputTextParam,
                                       r.ResponseInputTextContentParam),
     items.PART_KEYS["input_text"]),
    ("responses.content[output_text]", (r.ResponseOutputTextParam,),
     items.PART_KEYS["output_text"]),
    ("responses.content[refusal]", (r.ResponseOutputRefusalParam,), items.PART_KEYS["refusal"]),
    ("responses.content[input_image]", (r.ResponseInputImageParam,
                                        r.ResponseInputImageContentParam),
     items.PART_KEYS["input_image"]),
    ("responses.reasoning.summary[]", (reasoning_item.Summary, reasoning_item.Content),
     items.TEXT_PART_KEYS),
    ("responses.tools[function]", (r.FunctionToolParam,), options.TOOL_KEYS["function"]),
    ("responses.tools[custom]", (r.CustomToolParam,), options.TOOL_KEYS["custom"]),
    ("responses.tools[namespace]", (r.NamespaceToolParam,), options.TOOL_KEYS["namespace"]),
    ("responses.tools[shell]", (r.FunctionShellToolParam,), options.TOOL_KEYS["shell"]),
    ("responses.tools[local_shell]", (r.tool_param.LocalShell,), options.TOOL_KEYS["local_shell"]),
    ("responses.tools[apply_patch]", (r.ApplyPatchToolParam,), options.TOOL_KEYS["apply_patch"]),
    ("responses.tool_choice[shell]", (r.ToolChoiceShellParam, r.ToolChoiceApplyPatchParam),
     options.CLIENT_CHOICE_KEYS),
    ("responses.tools[custom].format[text]", (custom_tool_input_format.Text,),
     options.CUSTOM_FORMAT_KEYS["text"]),
    ("responses.tools[custom].format[grammar]", (custom_tool_input_format.Grammar,),
     options.CUSTOM_FORMAT_KEYS["grammar"]),
    ("responses.tool_choice", (r.ToolChoiceFunctionParam, r.ToolChoiceCustomParam),
     options.CHOICE_KEYS),
    ("responses.tool_choice[allowed_tools]", (r.ToolChoiceAllowedParam,),
     options.ALLOWED_CHOICE_KEYS),
    ("responses.text.format[json_schema]", (r.ResponseFormatTextJSONSchemaConfigParam,),
     options.TEXT_FORMAT_KEYS["json_schema"]),
    # The anthropic SDK's, its betas' beside (Claude Code sends those).
    ("anthropic.messages[]", (claude.MessageParam, claude_beta.BetaMessageParam),
     history.MESSAGE_KEYS),
    ("anthropic.content[text]", (claude.TextBlockParam, claude_beta.BetaTextBlockParam),
     history.BLOCK_KEYS["text"]),
    ("anthropic.content[image]", (claude.ImageBlockParam, claude_beta.BetaImageBlockParam),
     history.BLOCK_KEYS["image"]),
    ("anthropic.content[document]", (claude.DocumentBlockParam,
                                     claude_beta.BetaRequestDocumentBlockParam),
     history.BLOCK_KEYS["document"]),
    ("anthropic.content[tool_use]", (claude.ToolUseBlockParam,
                                     claude_beta.BetaToolUseBlockParam),
     history.BLOCK_KEYS["tool_use"]),
    ("anthropic.content[tool_result]", (claude.ToolResultBlockParam,
                                        claude_beta.BetaToolResultBlockParam),
     history.BLOCK_KEYS["tool_result"]),
    ("anthropic.content[thinking]", (claude.ThinkingBlockParam,
                                     claude_beta.BetaThinkingBlockParam),
     history.BLOCK_KEYS["thinking"]),
    ("anthropic.content[redacted_thinking]", (claude.RedactedThinkingBlockParam,
                                              claude_beta.BetaRedactedThinkingBlockParam),
     history.BLOCK_KEYS["redacted_thinking"]),
    ("anthropic.messages[system].output_config",
     (claude_beta.BetaSystemMessageOutputConfigParam,), history.TURN_OUTPUT_KEYS),
    ("anthropic.content[search_result]", (claude.SearchResultBlockParam,
                                          claude_beta.BetaSearchResultBlockParam),
     history.BLOCK_KEYS["search_result"]),
    ("anthropic.content[tool_reference]", (claude_beta.BetaToolReferenceBlockParam,),
     history.BLOCK_KEYS["tool_reference"]),
    ("anthropic.content[tool_addition]", (claude_beta.BetaRequestToolAdditionBlockParam,),
     history.BLOCK_KEYS["tool_addition"]),
    ("anthropic.content[tool_removal]", (claude_beta.BetaRequestToolRemovalBlockParam,),
     history.BLOCK_KEYS["tool_removal"]),
    ("anthropic.tool_change[tool_reference]", (claude_beta.BetaToolChangeToolReferenceParam,),
     history.TOOL_CHANGE_KEYS["tool_reference"]),
    ("anthropic.tool_change[tool_definition]", (
        claude_beta.BetaToolChangeToolDefinitionParam,),
     history.TOOL_CHANGE_KEYS["tool_definition"]),
    ("anthropic.source[base64]", (claude.Base64ImageSourceParam,
                                  claude_beta.BetaBase64ImageSourceParam),
     history.SOURCE_KEYS["base64"]),
    ("anthropic.source[text]", (claude.PlainTextSourceParam,
                                claude_beta.BetaPlainTextSourceParam),
     history.SOURCE_KEYS["text"]),
    ("anthropic.source[content]", (claude.ContentBlockSourceParam,
                                   claude_beta.BetaContentBlockSourceParam),
     history.SOURCE_KEYS["content"]),
    ("anthropic.tools[]", (claude.ToolParam, claude_beta.BetaToolParam), tools_body.TOOL_KEYS),
    ("anthropic.tool_choice[auto]", (claude.ToolChoiceAutoParam,
                                     claude_beta.BetaToolChoiceAutoParam),
     tools_body.CHOICE_KEYS["auto"]),
    ("anthropic.tool_choice[any]", (claude.ToolChoiceAnyParam,
                                    claude_beta.BetaToolChoiceAnyParam),
     tools_body.CHOICE_KEYS["any"]),
    ("anthropic.tool_choice[tool]", (claude.ToolChoiceToolParam,
                                     claude_beta.BetaToolChoiceToolParam),
     tools_body.CHOICE_KEYS["tool"]),
    ("anthropic.tool_choice[none]", (claude.ToolChoiceNoneParam,
                                     claude_beta.BetaToolChoiceNoneParam),
     tools_body.CHOICE_KEYS["none"]),
    ("anthropic.thinking[enabled]", (claude.ThinkingConfigEnabledParam,
                                     claude_beta.BetaThinkingConfigEnabledParam),
     messages_body.THINKING_KEYS["enabled"]),
    ("anthropic.thinking[disabled]", (claude.ThinkingConfigDisabledParam,
                                      claude_beta.BetaThinkingConfigDisabledParam),
     messages_body.THINKING_KEYS["disabled"]),
    ("anthropic.thinking[adaptive]", (claude.ThinkingConfigAdaptiveParam,
                                      claude_beta.BetaThinkingConfigAdaptiveParam),
     messages_body.THINKING_KEYS["adaptive"]),
    ("anthropic.thinking[between_tools]", (claude_beta.BetaThinkingConfigBetweenToolsParam,),
     messages_body.THINKING_KEYS["between_tools"]),
    ("anthropic.output_config", (claude.OutputConfigParam, claude_beta.BetaOutputConfigParam),
     messages_body.OUTPUT_CONFIG_KEYS),
    ("anthropic.output_config.format", (claude.JSONOutputFormatParam,
                                        claude_beta.BetaJSONOutputFormatParam),
     messages_body.FORMAT_KEYS),
]


@pytest.mark.parametrize(("params", "known"), [(p, k) for _, p, k in NESTED],
                         ids=[where for where, _, _ in NESTED])
def test_every_nested_field_the_sdk_types_is_admitted_under_strict(
    params: tuple[Any, ...], known: frozenset[str]
) -> None:
    """``[api] strict`` refuses a nested key afmd does not know: one the SDK can send
    there would break the official client on a strict server."""
    fields = set().union(*map(typed_fields, params))
    assert fields
    assert fields - known == set()
