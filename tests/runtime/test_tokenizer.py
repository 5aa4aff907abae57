"""Chat templates as SGLang reads them: a --chat-template file, and the content format a template takes."""
from __future__ import annotations

from tandem.runtime.tokenizer import read_chat_template, template_content_format


def test_chat_template_file_is_read_as_sglangs(tmp_path):
    """SGLang's TemplateManager._load_jinja_template: literal `\\n` escapes (a template copied out
    of tokenizer_config.json) become newlines, and the newlines around the file are dropped."""
    path = tmp_path / "chat.jinja"
    path.write_text("\n{% for m in messages %}{{ m.content }}\\n{% endfor %}{{ 'assistant:' }}\n")
    assert read_chat_template(str(path)) == "{% for m in messages %}{{ m.content }}\n{% endfor %}{{ 'assistant:' }}"


def test_content_format_is_openai_only_for_a_template_that_loops_over_content():
    """SGLang's detect_jinja_template_content_format: a loop over a message's content (also through
    a filter, or by subscript) takes the list of parts; anything else, or a template that does not
    parse, takes a string."""
    assert template_content_format("{% for m in messages %}{% for p in m.content %}{{ p.text }}"
                                   "{% endfor %}{% endfor %}") == "openai"
    assert template_content_format("{% for message in messages %}{% for p in message['content'] | "
                                   "selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}"
                                   "{% endfor %}") == "openai"
    assert template_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    assert template_content_format("{% for x in items.content %}{% endfor %}") == "string"
    assert template_content_format(None) == template_content_format("{% for") == "string"
