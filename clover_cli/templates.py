"""Chat templates: --chat-template (a built-in name or a Jinja file) when given, else the tokenizer's own when it has
one, else a built-in one chosen by the model alias.

The built-in templates are Jinja strings in the same form Hugging Face tokenizers store them, so one code path
(`tokenizer.apply_chat_template`) renders every conversation.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CloverError, one_line

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

# FastChat's vicuna_v1.1: "SYSTEM USER: hi ASSISTANT: hello</s>USER: more ASSISTANT:"
VICUNA_V11 = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{% set loop_messages = messages[1:] %}"
    "{% else %}" + VICUNA_SYSTEM + "{% set loop_messages = messages %}{% endif %} "
    "{% for m in loop_messages %}"
    "{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CHATML = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN = {"vicuna_v1.1": VICUNA_V11, "llama3": LLAMA3, "chatml": CHATML}

# Strings that end an assistant turn in each built-in template (besides the tokenizer's EOS token).
STOP_STRINGS = {"vicuna_v1.1": ["</s>", "USER:"], "llama3": ["<|eot_id|>"], "chatml": ["<|im_end|>"]}


TEMPLATE_FILE_LIMIT = 1 << 20  # bytes of a --chat-template file


def chosen_template(choice: str) -> tuple[str, str]:
    """--chat-template: (name, Jinja template) of a built-in template's name or a Jinja file's; one line when it is
    neither, or the file cannot be read or parsed. Checked before the model loads."""
    if choice in BUILTIN:
        return choice, BUILTIN[choice]
    path = Path(choice).expanduser()
    if not path.is_file():
        raise CloverError(f"--chat-template must be one of {', '.join(BUILTIN)} or a Jinja file: {choice!r} is "
                          f"neither")
    try:
        with path.open("rb") as f:
            data = f.read(TEMPLATE_FILE_LIMIT + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CloverError(f"--chat-template {choice}: cannot read it ({getattr(e, 'strerror', None) or one_line(e)})")
    if len(data) > TEMPLATE_FILE_LIMIT:
        raise CloverError(f"--chat-template {choice}: larger than {TEMPLATE_FILE_LIMIT} bytes")
    try:
        import jinja2

        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise CloverError(f"--chat-template {choice}: not a Jinja template (line {e.lineno}: {e.message})")
    return "file", text


def chat_template(tokenizer, fallback: str | None, choice: str | None = None) -> tuple[str, str]:
    """Return (template name, Jinja template) for this tokenizer: --chat-template (`choice`) first, then its own
    template, then the alias's `fallback`, then Vicuna's."""
    if choice:
        return chosen_template(choice)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and own.strip():
        return "tokenizer", own
    name = fallback or "vicuna_v1.1"
    if name not in BUILTIN:
        raise CloverError(f"unknown chat template {name!r}; choose one of {', '.join(BUILTIN)}")
    return name, BUILTIN[name]


def render(tokenizer, messages: list[dict], template: str, add_generation_prompt: bool = True,
           tools: list[dict] | None = None) -> str:
    """The conversation as the template writes it; `tools` (OpenAI's function tools) handed to it when given."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


def assistant_spans(tokenizer, messages: list[dict], template: str) -> tuple[str, list[tuple[int, int]]]:
    """Render a whole conversation and return the character spans of every assistant reply.

    A reply's span runs from the end of the conversation rendered up to its generation prompt to the end of the
    conversation rendered with the reply, so it holds exactly what the model must produce there (its end-of-turn
    marker included). Templates whose renderings are not prefixes of each other are refused.
    """
    full = render(tokenizer, messages, template, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], template, add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1], template, add_generation_prompt=False)
        if not full.startswith(upto) or not upto.startswith(before):
            raise CloverError("the chat template does not render conversations incrementally; cannot mask turns")
        spans.append((len(before), len(upto)))
    return full, spans
