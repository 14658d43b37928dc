"""`tpurl generate --json` writes strict JSON: a non-finite logprob becomes null, never NaN or
Infinity (which `json.loads` elsewhere rejects); a second call loads its programs from the compile
cache (`--compile-cache`)."""

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


# Counts the programs a `tpurl generate` process compiled and loaded from the persistent cache.
_COUNTING = """
import json, sys
import jax
from tpurl.commands.main import main
seen = {"programs": 0, "loaded": 0}
def count(event, *a, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        seen["programs"] += 1
    if event == "/jax/compilation_cache/cache_hits":
        seen["loaded"] += 1
jax.monitoring.register_event_listener(lambda event, **kw: count(event))
jax.monitoring.register_event_duration_secs_listener(count)
status = main(["generate", *sys.argv[1:]])
print(json.dumps(seen), file=sys.stderr)
sys.exit(status)
"""


def _generate(*args, env):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COUNTING, "--model", "tiny", "--prompt-ids", "5,6", "--n", "2",
                           "--max-new-tokens", "4", "--json", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _strict(done.stdout), json.loads(done.stderr.strip().splitlines()[-1])


def test_a_second_call_loads_its_programs_from_the_compile_cache(tmp_path):
    from multiprocess_helpers import cpu_env

    cache, env_cache = tmp_path / "cache", tmp_path / "env_cache"
    env = {**cpu_env(1), "JAX_COMPILATION_CACHE_DIR": str(env_cache)}  # JAX's own setting, which the flag overrides
    first, c1 = _generate("--compile-cache", str(cache), env=env)
    assert c1["programs"] - c1["loaded"] > 3 and any(cache.iterdir()) and not env_cache.exists(), c1
    kept = sorted(p.name for p in cache.iterdir())
    second, c2 = _generate("--compile-cache", str(cache), env=env)
    assert c2["programs"] == c2["loaded"] == c1["programs"] and second == first, (c1, c2)
    off, c3 = _generate("--compile-cache", "none", env=env)  # off: nothing loaded, nothing written
    assert c3["loaded"] == 0 and off == first and not env_cache.exists(), c3
    assert sorted(p.name for p in cache.iterdir()) == kept
