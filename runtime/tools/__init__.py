"""Tool calling: the OpenAI `tools` a chat request names, the call formats of SGLang's
`--tool-call-parser` names, the constraint a required or named call runs under, and parsing the
calls out of an answer, whole or streamed."""
from __future__ import annotations

from tandem.runtime.tools.formats import (DeepSeekV3Format, JsonArrayFormat, Llama3Format, MistralFormat,
                                          TaggedFormat)
from tandem.runtime.tools.parser import ToolFormat
from tandem.runtime.tools.pythonic import PythonicFormat

# SGLang's --tool-call-parser names that tandem has, and their formats
FORMATS: dict[str, ToolFormat] = {
    "qwen25": TaggedFormat(), "qwen": TaggedFormat(), "hermes": TaggedFormat(),
    "llama3": Llama3Format(), "mistral": MistralFormat(), "pythonic": PythonicFormat(),
    "deepseekv3": DeepSeekV3Format(),
}
TOOL_CALL_PARSERS = tuple(FORMATS)
JSON_ARRAY = JsonArrayFormat()  # a required / named call's answer where the format has no structural tag
