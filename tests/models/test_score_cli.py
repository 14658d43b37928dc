"""`tpurl score` against log-probabilities computed by `transformers` on the same weights."""

import json
import os

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from tpurl.commands import score as cli
from tpurl.models.hf import save_hf_checkpoint

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Qwen2 model with a byte-level BPE tokenizer and a chat template, saved by transformers."""
    path = str(tmp_path_factory.mktemp("score"))
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the cat sat on the mat", "scores are log probabilities"] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok) + 5, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   initializer_range=0.3)
    model = transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    model.save_pretrained(path)
    return path, model, tok


@pytest.mark.slow
def test_scores_checkpoint_prompt_like_transformers(checkpoint, capsys):
    path, model, tok = checkpoint
    prompt = "the cat sat on a log"
    rc, out, _ = run(capsys, "--model", path, "--prompt", prompt, "--json")
    assert rc == 0
    result = json.loads(out)
    ids = tok.encode(prompt, add_special_tokens=False)  # Qwen-style: no BOS
    assert [t["id"] for t in result["tokens"]] == ids
    assert "".join(t["text"] for t in result["tokens"]) == prompt
    want = hf_logprobs(model, ids)
    got = np.array([t["logprob"] for t in result["tokens"][1:]])
    assert result["tokens"][0]["logprob"] is None and result["num_scored"] == len(ids) - 1
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert abs(result["total_logprob"] - want.sum()) < 1e-3

    rc, out, _ = run(capsys, "--model", path, "--prompt", prompt, "--chat", "--json")
    chat_ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    result = json.loads(out)
    assert [t["id"] for t in result["tokens"]] == list(chat_ids)
    np.testing.assert_allclose([t["logprob"] for t in result["tokens"][1:]], hf_logprobs(model, list(chat_ids)),
                               atol=1e-4)


def test_scores_preset_with_char_tokenizer(tmp_path, capsys):
    rc, out, _ = run(capsys, "--model", "tiny", "--prompt", "hi you", "--seed", "3")
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[1].split()[:3] == ["0", "1", "-"]  # <bos> is not scored
    total = float(lines[-1].split()[2])
    # The same random model, exported and scored by transformers.
    model, tokenizer = cli.load_for_scoring("tiny", seed=3)
    save_hf_checkpoint(model, str(tmp_path))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = tokenizer.encode("hi you", add_bos=True)
    want = hf_logprobs(ref, ids)
    assert [float(line.split()[2]) for line in lines[2:-1]] == pytest.approx(want, abs=1e-4)
    assert total == pytest.approx(want.sum(), abs=1e-3)


def test_score_errors(checkpoint, tmp_path, capsys):
    path, _, _ = checkpoint
    rc, _, err = run(capsys, "--model", str(tmp_path / "none"), "--prompt", "x")
    assert rc == 2 and "neither a checkpoint directory nor a preset" in err
    os.symlink(os.path.join(path, "config.json"), tmp_path / "config.json")
    rc, _, err = run(capsys, "--model", str(tmp_path), "--prompt", "x")
    assert rc == 2 and "has no tokenizer.json" in err
    rc, _, err = run(capsys, "--model", path, "--prompt", "t")
    assert rc == 2 and "at least two tokens" in err
    model = cli.load_for_scoring(path)[0]
    with pytest.raises(ValueError, match="token id 10000 is outside the model's vocabulary"):
        cli.score_tokens(model, [1, 10_000])
    # The offending id is reported, not max(ids) (which is in range here).
    with pytest.raises(ValueError, match="token id -3 is outside the model's vocabulary"):
        cli.score_tokens(model, [5, -3, 7])
