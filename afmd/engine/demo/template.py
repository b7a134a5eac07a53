"""The chat template of the built-in demo models (kept apart: it is data, not code)."""

# Qwen2.5-style ChatML with Hermes tool calls (Qwen3's system layout: no default system
# prompt). Every tag strips whitespace before it and all output is in string literals,
# so the result is the same with or without trim_blocks/lstrip_blocks; in particular no
# `{%-` can eat the newline after `<|im_end|>`. mlx-lm picks its "json_tools" parser
# because the template contains "<tool_call>" and "tool_call.name".
CHAT_TEMPLATE = r"""{%- macro content_text(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is mapping %}
        {{- content | tojson }}
    {%- elif content is iterable %}
        {%- for part in content %}
            {%- if part is string %}
                {{- part }}
            {%- elif part.type == 'text' %}
                {{- part.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools or has_system %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- content_text(messages[0].content) }}
        {%- if tools %}
            {{- '\n\n' }}
        {%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
        {{- 'You are provided with function signatures within <tools></tools> XML tags:\n' }}
        {{- '<tools>' }}
        {%- for tool in tools %}
            {{- '\n' }}
            {{- tool | tojson }}
        {%- endfor %}
        {{- '\n</tools>\n\nFor each function call, return a json object with function name ' }}
        {{- 'and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
        {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = content_text(message.content) %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.tool_calls %}
            {%- if content %}
                {{- '\n' + content }}
            {%- endif %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '\n<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- elif tool_call.arguments is defined and tool_call.arguments is not none %}
                    {{- tool_call.arguments | tojson }}
                {%- else %}
                    {{- '{}' }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- else %}
            {{- '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
