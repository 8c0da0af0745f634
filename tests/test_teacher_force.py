"""``LLM.teacher_force``: the engine's own model over given sequences equals transformers' logits and hidden
states at every position; batches split by the token budget; nothing is left allocated; bad input names
the argument."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, folder = save_tiny("llama", tmp_path_factory.mktemp("llama"))
    return model, LLM(folder, block_size=16, kv_cache_bytes=1 << 22)


@pytest.mark.parametrize("max_tokens", [4096, 40])
def test_logits_and_layer_inputs_equal_transformers(tiny, max_tokens):
    model, llm = tiny
    gen = torch.Generator().manual_seed(max_tokens)
    seqs = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (7, 1, 37, 19)]
    free = llm.engine.kv.num_free_blocks
    forced = llm.teacher_force(seqs, top_k=5, layers=[0, 2], max_tokens=max_tokens)
    assert llm.engine.kv.num_free_blocks == free
    hidden = model.config.hidden_size
    for seq, got in zip(seqs, forced, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_hidden_states=True)
        logits = ref.logits[0]
        top = logits.topk(5, dim=-1)
        assert got.top_ids.shape == (len(seq), 5) and got.features.shape == (len(seq), 2 * hidden)
        scale = logits.abs().max().item()
        assert (got.top_logits - top.values).abs().max().item() <= 1e-4 * scale
        assert torch.equal(got.top_ids[:, 0], logits.argmax(-1))
        # Layer 0's input is the embedding; id 2 (= the number of layers) is the last layer's output.
        torch.testing.assert_close(got.features[:, :hidden], ref.hidden_states[0][0], rtol=1e-5, atol=1e-5)
        last = got.features[:, hidden:]
        normed = model.model.norm(last)
        torch.testing.assert_close(normed, ref.hidden_states[-1][0], rtol=1e-4, atol=1e-4)


def test_bad_input_names_the_argument(tiny):
    _, llm = tiny
    with pytest.raises(ValueError, match="top_k"):
        llm.teacher_force([[1, 2]], top_k=0)
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        llm.teacher_force([[1, 2], []], top_k=2)
    with pytest.raises(ValueError, match=r"sequences\[0\].*outside"):
        llm.teacher_force([[1, 10**6]], top_k=2)
