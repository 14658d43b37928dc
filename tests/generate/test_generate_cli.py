"""`tpurl generate --json` writes strict JSON: a non-finite logprob becomes null, never NaN or
Infinity (which `json.loads` elsewhere rejects)."""

import pytest
import json
import types

import numpy as np

from tpurl.commands import main as cli
from tpurl.commands import generate as generate_cli

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes


def _strict(text):
    def reject(name):
        raise ValueError(f"{name} in JSON output")

    return json.loads(text, parse_constant=reject)


def test_json_output_is_strict(capsys, monkeypatch):
    assert cli.main(["generate", "--model", "tiny", "--prompt-ids", "5,6", "--max-new-tokens", "3", "--json"]) == 0
    doc = _strict(capsys.readouterr().out)
    assert len(doc["completions"][0]["logprobs"]) == 3

    def nan_generate(engine, params, prompts, **kw):
        ids = np.asarray(prompts[0], np.int32)
        return [[types.SimpleNamespace(prompt_index=0, sample_index=0, prompt_ids=ids, token_ids=np.array([7, 8, 9]),
                            logprobs=np.array([np.nan, -np.inf, -0.5]), finish_reason="length")]]

    monkeypatch.setattr(generate_cli, "generate", nan_generate)
    assert cli.main(["generate", "--model", "tiny", "--prompt-ids", "5,6", "--json"]) == 0
    doc = _strict(capsys.readouterr().out)
    assert doc["completions"][0]["logprobs"] == [None, None, -0.5]
