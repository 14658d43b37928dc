"""Tokenizers: the built-in character tokenizer, and `HFTokenizer` against transformers'
`PreTrainedTokenizerFast` on a byte-level BPE trained here, with Qwen-style chat templates."""

import json
import os

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tpurl.tokenizer import CharTokenizer, HFTokenizer, load_hf_tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Reinforcement learning from verifiable rewards!",
          "def add(a, b):\n    return a + b", "héllo wörld, 世界 — naïve café", "1234 + 5678 = 6912"] * 4

# Qwen2.5's template structure (dash-trimmed tags, tools as JSON, raise_exception on bad roles).
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
    {%- if message.role != 'system' or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Plain tags: output depends on trim_blocks / lstrip_blocks; uses bos_token, loop controls, tojson.
PLAIN_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    [{{ m.role }}] {{ m.content }}{{ eos_token }}
    {% if m.meta is defined %}{{ m.meta | tojson(indent=2) }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 世界, what is 1234 + 5678?"},
    {"role": "assistant", "content": "6912"},
    {"role": "user", "content": "and <|im_start|> inside text?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add — two numbers",
                                           "parameters": {"a": "int", "b": "int"}}}]


@pytest.fixture(scope="module")
def bpe():
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def saved(bpe, tmp_path_factory):
    """(transformers tokenizer, directory it saved itself to) for each template."""
    out = {}
    for name, template in [("qwen", QWEN_TEMPLATE), ("plain", PLAIN_TEMPLATE)]:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
        hf.chat_template = template
        path = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(path)
        out[name] = (transformers.AutoTokenizer.from_pretrained(path), path)
    return out


TEXTS = ["The quick brown fox.", "héllo wörld, 世界!", "  leading spaces and\ttabs\n", "<|im_start|>user\nhi<|im_end|>",
         "", "unseen words: zygote quokka"]


def test_encode_decode_and_special_ids_match_transformers(saved):
    hf, path = saved["qwen"]
    ours = load_hf_tokenizer(path)
    assert ours.vocab_size == len(hf)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_bos=True) == [hf.bos_token_id] + ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)
    assert ours.decode(ours.encode(TEXTS[1])) == TEXTS[1]
    assert ours.encode(TEXTS[3])[0] == ours.token_to_id("<|im_start|>")  # special tokens stay whole


@pytest.mark.parametrize("template", ["qwen", "plain"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(saved, template, add_generation_prompt):
    hf, path = saved[template]
    ours = load_hf_tokenizer(path)
    messages = [dict(m) for m in MESSAGES]
    messages[1]["meta"] = {"lang": "中文", "n": [1, 2]}
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=False)
        got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        assert got == want
        assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True) == hf.encode(want, add_special_tokens=False)


def test_chat_template_raise_exception_and_sandbox(saved):
    hf, path = saved["qwen"]
    ours = load_hf_tokenizer(path)
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(ValueError, match=r"chat_template.jinja: the chat template rejects these messages: "
                                         r"Unsupported role: robot$"):
        ours.apply_chat_template(bad)
    with pytest.raises(Exception, match="Unsupported role: robot"):
        hf.apply_chat_template(bad, tokenize=False)
    backend = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    evil = HFTokenizer(backend, chat_template="{{ messages.append(1) }}")  # immutable sandbox
    with pytest.raises(ValueError, match="the chat template failed \\(SecurityError: "):
        evil.apply_chat_template([])


def test_tokenizer_config_variants(bpe, tmp_path):
    """AddedToken dicts, a list of named templates, clean-up on decode, no pad token."""
    bpe.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"},
              "clean_up_tokenization_spaces": True,
              "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "D{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_hf_tokenizer(str(tmp_path))
    assert ours.bos_id is None and ours.eos_id == bpe.token_to_id("<|im_end|>")
    assert ours.pad_id == ours.eos_id  # no pad token: pad with EOS
    assert ours.encode("hi", add_bos=True) == ours.encode("hi")  # no BOS to add
    assert ours.apply_chat_template([]) == "D<|im_end|>"
    assert ours.decode(ours.encode("fox .")) == "fox."
    config["chat_template"] = "S{{ messages[0].content }}"  # the plain-string form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_hf_tokenizer(str(tmp_path)).apply_chat_template([{"content": "x"}]) == "Sx"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_hf_tokenizer(str(tmp_path)).apply_chat_template([{}, {}]) == "J2"


def test_hf_tokenizer_errors(bpe, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist.*only fast tokenizers"):
        load_hf_tokenizer(str(tmp_path))
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    with pytest.raises(ValueError, match="pad_token '<pad>' is not in the vocabulary"):
        load_hf_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_hf_tokenizer(str(tmp_path))
    os.remove(tmp_path / "tokenizer_config.json")
    plain = load_hf_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no chat_template"):
        plain.apply_chat_template([])
    with pytest.raises(ValueError, match="neither pad_token nor eos_token"):
        plain.pad_id


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("abc ")
    assert tok.vocab_size == 7
    ids = tok.encode("ab c", add_bos=True)
    assert ids == [1, 3, 4, 6, 5]
    assert tok.decode(ids) == "ab c"
    assert tok.decode(ids + [2], skip_special=False) == "<bos>ab c<eos>"
    with pytest.raises(ValueError, match="'z' is not in the alphabet"):
        tok.encode("az")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([7])
    with pytest.raises(ValueError, match="repeats a character"):
        CharTokenizer("aa")


def _backend(saved):
    return tokenizers.Tokenizer.from_file(os.path.join(saved["qwen"][1], "tokenizer.json"))


def test_chat_template_raise_exception_is_one_line(saved):
    """HF templates reject what they cannot render with `raise_exception` (transformers' global)."""
    tok = HFTokenizer(_backend(saved), chat_template="{{ raise_exception('System role not supported') }}",
                      template_source="m/tokenizer_config.json")
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    assert str(e.value) == "m/tokenizer_config.json: the chat template rejects these messages: System role not supported"


def test_chat_template_syntax_error_is_one_line(saved):
    tok = HFTokenizer(_backend(saved), chat_template="{% for m in messages %}\n{{ m }", template_source="m/chat_template.jinja")
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template([])
    assert str(e.value) == "m/chat_template.jinja: chat template syntax error at line 2: unexpected '}'; fix the template"


def test_chat_template_runtime_error_is_one_line(saved):
    tok = HFTokenizer(_backend(saved), chat_template="{{ messages[0].content + 1 }}")
    with pytest.raises(ValueError, match=r"^the chat template: the chat template failed \(TypeError: "):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template, message", [
    ([{"template": "x"}], r'chat_template\[0\] must be an object with a "name" and a "template" string'),
    ([{"name": "default", "template": "x"}, "y"], r"chat_template\[1\] must be an object"),
    ({"default": "x"}, r"chat_template must be a string or a list .* not a dict"),
])
def test_malformed_named_templates(bpe, tmp_path, template, message):
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(ValueError, match=message):
        load_hf_tokenizer(str(tmp_path))


def test_deeply_nested_tokenizer_config(bpe, tmp_path):
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="tokenizer_config.json nests JSON too deeply"):
        load_hf_tokenizer(str(tmp_path))
