"""Chat templates written for afmd's tests, one per call format, in each family's style.

Each renders tools, assistant calls (with the reasoning sent back) and tool results the
way the family's own template does, and contains what mlx-lm's detection looks for, so a
test model built with it is read as the real model would be. Everything is output through
``{{- '…' }}`` so the result does not depend on trim_blocks/lstrip_blocks.
"""

from __future__ import annotations

from afmd.engine.demo.template import CHAT_TEMPLATE as HERMES

_CALL = ("{%- set tc = tool_call.function if tool_call.function is defined "
         "else tool_call %}")
_RAW = ("{%- if v is string %}{{- v }}{%- else %}{{- v | tojson }}{%- endif %}")


def chatml(*, tools: str, calls: str, think: tuple[str, str] | None = None,
           result: str | None = None) -> str:
    """A ChatML skeleton around a family's tools block, calls block and reasoning."""
    reasoning = gen = ""
    if think:
        reasoning = ("{%- if message.reasoning_content %}{{- '" + think[0]
                     + "\\n' + message.reasoning_content + '\\n" + think[1]
                     + "\\n\\n' }}{%- endif %}")
        gen = ("{%- if enable_thinking is defined and enable_thinking is false %}{{- '"
               + think[0] + "\\n\\n" + think[1] + "\\n\\n' }}{%- endif %}")
    result = result or (
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
        "{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
        "{{- '<|im_end|>\\n' }}{%- endif %}")
    return (
        "{%- set has_system = messages and messages[0].role == 'system' %}"
        "{%- if tools or has_system %}{{- '<|im_start|>system\\n' }}"
        "{%- if has_system %}{{- messages[0].content }}{%- if tools %}{{- '\\n\\n' }}"
        "{%- endif %}{%- endif %}"
        "{%- if tools %}" + tools + "{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'system' and loop.first %}"
        "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        + reasoning + "{{- message.content or '' }}"
        "{%- if message.tool_calls %}{%- if message.content %}{{- '\\n' }}{%- endif %}"
        + calls + "{%- endif %}{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}" + result +
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
        " + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + gen +
        "{%- endif %}"
    )


def _tools(intro: str) -> str:
    return ("{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
            "{%- endfor %}{{- '\\n</tools>\\n\\n" + intro + "' }}")


def _each(body: str, sep: str = "\\n") -> str:
    return ("{%- for tool_call in message.tool_calls %}" + _CALL
            + "{%- if not loop.first %}{{- '" + sep + "' }}{%- endif %}" + body
            + "{%- endfor %}")


QWEN3_CODER = chatml(
    tools=_tools("To call a function reply in this format:\\n\\n<tool_call>\\n"
                 "<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
                 "value_1\\n</parameter>\\n</function>\\n</tool_call>"),
    calls=_each(
        "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}"
        "{%- for k, v in tc.arguments.items() %}{{- '<parameter=' + k + '>\\n' }}"
        "{%- if v is mapping or (v is sequence and v is not string) %}{{- v | tojson }}"
        "{%- else %}{{- v | string }}{%- endif %}{{- '\\n</parameter>\\n' }}{%- endfor %}"
        "{{- '</function>\\n</tool_call>' }}"),
)

_GLM_CALL = ("{{- '<tool_call>' + tc.name + '\\n' }}{%- for k, v in tc.arguments.items() %}"
             "{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' }}" + _RAW
             + "{{- '</arg_value>\\n' }}{%- endfor %}{{- '</tool_call>' }}")
GLM47 = (
    "{{- '[gMASK]<sop>' }}{%- if tools %}{{- '<|system|>\\n# Tools\\n\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '</tools>\\n\\nFor each function call, output the function name and arguments in "
    "this XML format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n"
    "<arg_value>{arg-value-1}</arg_value>\\n...\\n</tool_call>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '<|system|>\\n' + m.content }}"
    "{%- elif m.role == 'user' %}{{- '<|user|>\\n' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{- '<|assistant|>\\n<think>' }}"
    "{{- m.reasoning_content or '' }}{{- '</think>' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for tool_call in m.tool_calls or [] %}" + _CALL + "{{- '\\n' }}" + _GLM_CALL
    + "{%- endfor %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|observation|>' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '\\n<think></think>' }}"
    "{%- endif %}{%- endif %}"
)

LONGCAT = chatml(
    tools=_tools("Call functions as <longcat_tool_call>name\\n<longcat_arg_key>key"
                 "</longcat_arg_key>\\n<longcat_arg_value>value</longcat_arg_value>\\n"
                 "</longcat_tool_call>"),
    calls=_each(
        "{{- '<longcat_tool_call>' + tc.name + '\\n' }}{%- for k, v in tc.arguments.items() %}"
        "{{- '<longcat_arg_key>' + k + '</longcat_arg_key>\\n<longcat_arg_value>' }}" + _RAW
        + "{{- '</longcat_arg_value>\\n' }}{%- endfor %}{{- '</longcat_tool_call>' }}"),
    think=("<longcat_think>", "</longcat_think>"),
)


def _invokes(section: str, invoke: str, parameter: str) -> str:
    close = section.replace("<", "</", 1)
    return ("{{- '" + section + "\\n' }}{%- for tool_call in message.tool_calls %}" + _CALL
            + "{{- '<" + invoke + " name=\"' + tc.name + '\">\\n' }}"
            "{%- for k, v in tc.arguments.items() %}{{- '<" + parameter
            + " name=\"' + k + '\">' }}" + _RAW + "{{- '</" + parameter + ">\\n' }}"
            "{%- endfor %}{{- '</" + invoke + ">\\n' }}{%- endfor %}{{- '" + close + "' }}")


MINIMAX_M2 = chatml(
    tools=_tools("Call tools inside <minimax:tool_call></minimax:tool_call>."),
    calls=_invokes("<minimax:tool_call>", "invoke", "parameter"),
    think=("<think>", "</think>"),
)
MUSE_SPARK = chatml(
    tools=_tools("Call tools inside <atem:function_calls></atem:function_calls>."),
    calls=_invokes("<atem:function_calls>", "atem:invoke", "atem:parameter"),
)
MINICPM5 = chatml(
    tools=_tools("Call a tool as <function name=\"name\"><param name=\"key\">value</param>"
                 "</function>."),
    calls=_each(
        "{{- '<function name=\"' + tc.name + '\">' }}{%- for k, v in tc.arguments.items() %}"
        "{{- '<param name=\"' + k + '\">' }}"
        "{%- if v is string and ('<' in v or '&' in v or '\\n' in v) %}"
        "{{- '<![CDATA[' + v + ']]>' }}{%- else %}" + _RAW + "{%- endif %}"
        "{{- '</param>' }}{%- endfor %}{{- '</function>' }}"),
    think=("<think>", "</think>"),
)
PYTHONIC = chatml(
    tools=("{{- 'List of tools: <|tool_list_start|>' + (tools | tojson) + "
           "'<|tool_list_end|>' }}"),
    calls=("{{- '<|tool_call_start|>[' }}" + _each(
        "{{- tc.name + '(' }}{%- for k, v in tc.arguments.items() %}"
        "{%- if not loop.first %}{{- ', ' }}{%- endif %}{{- k + '=' + (v | tojson) }}"
        "{%- endfor %}{{- ')' }}", ", ") + "{{- ']<|tool_call_end|>' }}"),
    think=("<think>", "</think>"),
    result=("{{- '<|im_start|>tool\\n<|tool_response_start|>' + message.content + "
            "'<|tool_response_end|><|im_end|>\\n' }}"),
)


def _gemma(start: str, end: str, quote: str) -> str:
    return _each(
        "{{- '" + start + "call:' + tc.name + '{' }}{%- for k, v in tc.arguments.items() %}"
        "{%- if not loop.first %}{{- ',' }}{%- endif %}{{- k + ':' }}"
        "{%- if v is string %}{{- '" + quote + "' + v + '" + quote + "' }}"
        "{%- else %}{{- v | tojson }}{%- endif %}{%- endfor %}{{- '}" + end + "' }}", "")


GEMMA4 = chatml(
    tools=_tools("Call tools as <|tool_call>call:name{key:value}<tool_call|>."),
    calls=_gemma("<|tool_call>", "<tool_call|>", '<|"|>'),
    think=("<|channel>thought", "<channel|>"),
)
FUNCTION_GEMMA = chatml(
    tools=_tools("Call tools as <start_function_call>call:name{key:value}"
                 "<end_function_call>."),
    calls=_gemma("<start_function_call>", "<end_function_call>", "<escape>"),
)

KIMI_K2 = (
    "{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson)"
    " + '<|im_end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '<|im_system|>system<|im_middle|>' + m.content"
    " + '<|im_end|>' }}"
    "{%- elif m.role == 'user' %}{{- '<|im_user|>user<|im_middle|>' + m.content"
    " + '<|im_end|>' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- if m.reasoning_content %}{{- '<think>' + m.reasoning_content + '</think>' }}"
    "{%- endif %}{{- m.content or '' }}"
    "{%- if m.tool_calls %}{{- '<|tool_calls_section_begin|>' }}"
    "{%- for tool_call in m.tool_calls %}{{- '<|tool_call_begin|>' + tool_call.id"
    " + '<|tool_call_argument_begin|>' + (tool_call.function.arguments | tojson)"
    " + '<|tool_call_end|>' }}{%- endfor %}{{- '<|tool_calls_section_end|>' }}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_system|>tool<|im_middle|>## Return of '"
    " + m.tool_call_id + '\\n' + m.content + '<|im_end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- endif %}"
)


def _mistral(array: bool) -> str:
    if array:
        calls = ("{{- '[TOOL_CALLS] [' }}{%- for tool_call in m.tool_calls %}"
                 "{%- if tool_call.id is not string or tool_call.id | length != 9 %}"
                 "{{- raise_exception('Tool call IDs should be alphanumeric strings with "
                 "length 9!') }}{%- endif %}{%- if not loop.first %}{{- ', ' }}{%- endif %}"
                 "{{- {'name': tool_call.function.name, 'arguments': "
                 "tool_call.function.arguments, 'id': tool_call.id} | tojson }}"
                 "{%- endfor %}{{- ']' }}")
        result = ("{{- '[TOOL_RESULTS] ' + ({'content': m.content, 'call_id': m.tool_call_id}"
                  " | tojson) + '[/TOOL_RESULTS]' }}")
    else:
        calls = ("{%- for tool_call in m.tool_calls %}{{- '[TOOL_CALLS]' + "
                 "tool_call.function.name + '[ARGS]' + (tool_call.function.arguments | tojson)"
                 " }}{%- endfor %}")
        result = "{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}"
    think = "" if array else (
        "{%- if m.reasoning_content %}{{- '[THINK]' + m.reasoning_content + '[/THINK]' }}"
        "{%- endif %}")
    return (
        "{{- '<s>' }}{%- for m in messages %}"
        "{%- if m.role == 'system' %}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' }}"
        "{%- elif m.role == 'user' %}"
        "{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson)"
        " + '[/AVAILABLE_TOOLS]' }}{%- endif %}{{- '[INST]' + m.content + '[/INST]' }}"
        "{%- elif m.role == 'assistant' %}" + think + "{{- m.content or '' }}"
        "{%- if m.tool_calls %}" + calls + "{%- endif %}{{- '</s>' }}"
        "{%- elif m.role == 'tool' %}" + result + "{%- endif %}{%- endfor %}"
    )


MISTRAL = _mistral(array=False)
MISTRAL_V3 = _mistral(array=True)

HARMONY = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by "
    "OpenAI.\\nReasoning: ' + (reasoning_effort or 'medium') + '\\n\\n# Valid channels: "
    "analysis, commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: "
    "\\'functions\\'.' }}{%- endif %}{{- '<|end|>' }}"
    "{%- set has_system = messages and messages[0].role == 'system' %}"
    "{%- if has_system or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if has_system %}{{- '# Instructions\\n\\n' + messages[0].content + '\\n\\n' }}"
    "{%- endif %}{%- if tools %}{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for tool in tools %}{{- '// ' + (tool.function.description or '') + '\\ntype '"
    " + tool.function.name + ' = (_: ' + (tool.function.parameters | tojson)"
    " + ') => any;\\n\\n' }}{%- endfor %}{{- '} // namespace functions' }}{%- endif %}"
    "{{- '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'assistant' %}{%- if m.tool_calls %}"
    "{%- if m.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking"
    " + '<|end|>' }}{%- endif %}"
    "{%- for tool_call in m.tool_calls %}{{- '<|start|>assistant<|channel|>commentary "
    "to=functions.' + tool_call.function.name + ' <|constrain|>json<|message|>'"
    " + (tool_call.function.arguments | tojson) + '<|call|>' }}{%- endfor %}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content"
    " + '<|end|>' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}{{- '<|start|>functions.' + (m.name or 'tool')"
    " + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

KIMI_K3 = (
    "{%- if tools %}{{- '<|open|>message role=\"system\"<|sep|>Tools: ' + (tools | tojson)"
    " + '<|close|>message<|sep|>' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|open|>message role=\"' + m.role + '\"<|sep|>' }}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.reasoning_content %}{{- '<|open|>think<|sep|>' + m.reasoning_content"
    " + '<|close|>think<|sep|>' }}{%- endif %}{{- m.content or '' }}"
    "{%- if m.tool_calls %}{{- '<|open|>tools<|sep|>' }}{%- for tool_call in m.tool_calls %}"
    + _CALL + "{{- '<|open|>call tool=\"' + tc.name + '\" index=\"' + (loop.index | string)"
    " + '\"<|sep|>' }}{%- for k, v in tc.arguments.items() %}"
    "{{- '<|open|>argument key=\"' + k + '\" type=\"' + ('string' if v is string else 'json')"
    " + '\"<|sep|>' }}" + _RAW + "{{- '<|close|>argument<|sep|>' }}{%- endfor %}"
    "{{- '<|close|>call<|sep|>' }}{%- endfor %}{{- '<|close|>tools<|sep|>' }}{%- endif %}"
    "{%- else %}{{- m.content }}{%- endif %}{{- '<|close|>message<|sep|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|open|>message role=\"assistant\"<|sep|>' }}"
    "{%- endif %}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}{%- set has_system = messages and messages[0].role == 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\n\n' }}"
    "{%- if has_system %}{{- messages[0].content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- set first = namespace(user=true) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}"
    "{%- if tools and first.user %}{{- 'Given the following functions, please respond with "
    "a JSON for a function call with its proper arguments that best answers the given "
    "prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}. Do not use variables.\n\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\n\n' }}{%- endfor %}"
    "{%- set first.user = false %}{%- endif %}{{- m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- if m.tool_calls %}{%- for tool_call in m.tool_calls %}" + _CALL
    + "{%- if not loop.first %}{{- '; ' }}{%- endif %}{{- '{\"name\": \"' + tc.name + "
    "'\", \"parameters\": ' + (tc.arguments | tojson) + '}' }}{%- endfor %}"
    "{{- '<|eom_id|>' }}{%- else %}{{- m.content + '<|eot_id|>' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\n\n'"
    " + m.content + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

__all__ = ["FUNCTION_GEMMA", "GEMMA4", "GLM47", "HARMONY", "HERMES", "KIMI_K2", "KIMI_K3",
           "LLAMA3", "LONGCAT", "MINICPM5", "MINIMAX_M2", "MISTRAL", "MISTRAL_V3", "MUSE_SPARK",
           "PYTHONIC", "QWEN3_CODER"]
