"""The engine tests' shared setup: a tiny model, prompts of every length up to 32, and an engine
config whose small page pool makes admission wait and pages get reused (the fixtures over them
are in conftest.py)."""

import numpy as np

from tpurl.generate import SamplingConfig
from tpurl.models import preset

CFG = preset("tiny")
MAX_NEW = 12
MAX_PROMPT = 32
SEQ = 48  # max_seq_len >= MAX_PROMPT + MAX_NEW
# Pages of 4 tokens; 32 pages is less than 4 slots of the longest requests (11 pages each), so
# admission has to wait, and far less than the 32 requests' total, so pages are reused.
ENGINE = dict(max_slots=4, max_seq_len=SEQ, page_size=4, num_pages=32, prefill_buckets=(8, MAX_PROMPT))
PROMPTS = [np.random.default_rng(100 + n).integers(3, CFG.vocab_size, n).tolist() for n in range(1, MAX_PROMPT + 1)]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)
SAMPLED = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=MAX_NEW)


def tokens(out):
    """The token ids of `generate`'s completions, as nested lists."""
    return [[c.token_ids.tolist() for c in row] for row in out]
