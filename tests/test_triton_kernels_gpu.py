"""On a GPU: every compiled Triton kernel against its torch reference at serving shapes
(tokstream.kernels.check), and dummy:tiny's greedy tokens on CUDA (Triton kernels, with and
without CUDA graphs) equal to the CPU path's. Skipped without CUDA."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_every_kernel_matches_its_reference_on_the_gpu():
    from tokstream.kernels import check

    results = check.run("cuda")
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_cuda_greedy_tokens_equal_the_cpu_path(monkeypatch, graphs):
    from tokstream.config import EngineConfig
    from tokstream.engine.llm import LLM
    from tokstream.sampling_params import SamplingParams

    prompts = [[5, 17, 99, 3], list(range(10, 60)), [7] * 33]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("TOKSTREAM_CUDA_GRAPHS", graphs)
    tokens = {}
    for device in ("cpu", "cuda"):
        with LLM(EngineConfig(model="dummy:tiny", dtype="float32", device=device)) as llm:
            if device == "cuda":
                assert llm.core.executor.ready.kernels == "triton"
                assert bool(llm.core.executor.ready.graph_batch_sizes) == (graphs == "1")
            tokens[device] = [c.token_ids for c in llm.generate(prompts, params)]
    assert tokens["cuda"] == tokens["cpu"]
