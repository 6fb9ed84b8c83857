"""The Python API: batchrun.Engine.load(...).generate(...) as the seed's engine, the same
outputs as the engine driven by hand."""

import subprocess
import sys

import pytest

import batchrun
from batchrun.engine.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return batchrun.Engine.load(max_concurrency=4, prefix_cache=False)


def test_generate_takes_texts_token_ids_and_chats_and_answers_in_order(engine):
    chat = [{"role": "user", "content": "Hi there"}]
    ids = engine.prompts.encode("Once upon a time")
    outs = engine.generate(["Once upon a time", ids, chat], max_tokens=6)
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    assert len(outs) == 3 and all(o.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
                                  for o in outs)
    assert outs[0].token_ids == outs[1].token_ids  # the text and its ids are the same prompt
    alone = engine.generate([chat], SamplingParams(max_tokens=6))[0]
    assert alone.token_ids == outs[2].token_ids  # greedy: the batch does not change a row


def test_the_seed_api_add_step_abort(engine):
    keep = engine.add_request("The kettle", SamplingParams(max_tokens=5))
    drop = engine.add_request(messages=[{"role": "user", "content": "x"}],
                              params=SamplingParams(max_tokens=50))
    assert engine.abort(drop)
    outs = {o.request_id: o for o in engine.run()}
    assert outs[keep].completion_tokens == 5 and outs[drop].finish_reason is FinishReason.ABORT
    assert engine.stats.requests_finished >= 2


def test_bad_sampling_is_a_value_error(engine):
    with pytest.raises(ValueError):
        engine.generate(["x"], temperature=-1)
    with pytest.raises(ValueError):
        engine.generate(["x"], SamplingParams(), max_tokens=3)


def test_import_batchrun_is_cheap():
    code = "import sys, batchrun; print('mlx.core' in sys.modules, 'mlx_lm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "False"]
