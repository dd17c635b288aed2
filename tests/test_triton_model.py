"""The GPU path's wiring without a GPU: the model with the Triton kernel backend (run by Triton's
interpreter on CPU tensors) against the torch path on the same weights — logits of a mixed step,
greedy tokens through the CUDA-graph runner's padded static buffers (replayed eagerly), and
through the engine with its worker process selecting the kernels (eager steps).
What stays untested here: compiling the kernels, CUDA graph capture and replay, NCCL."""

import random

import pytest
import torch

from tokstream.config import EngineConfig
from tokstream.engine.llm import LLM
from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict, save_hf_folder
from tokstream.sampling_params import SamplingParams
from tokstream.text.tokenizer import dummy_tokenizer
from tokstream.worker.cuda_graphs import DecodeGraphs, batch_sizes
from tokstream.worker.model import LlamaModel
from tokstream.worker.model_runner import ModelRunner, allocate_kv_caches
from helpers.triton_interpreter import interpreted_kernels  # noqa: F401 (a fixture)

BLOCK = 4
POOL = 48


def sharp_weights():
    """dummy:tiny's weights scaled 10x: with the preset's std of 0.02 the greedy tokens barely
    depend on attention (each step repeats its input token), so errors would not show."""
    weights = load_state_dict(resolve_model("dummy:tiny"), torch.float32, seed=1)
    return {name: w if name.endswith("norm.weight") else w * 10 for name, w in weights.items()}


def tiny_model(backend=None):
    model = LlamaModel(resolve_model("dummy:tiny").config, torch.float32, backend=backend)
    model.load_weights(sharp_weights())
    return model


class Driver:
    """A small scheduler: every step decodes each prefilled request and prefills the next
    chunk of the others (decodes first, as the engine lays them out); greedy. A request that
    has max_new tokens finishes and its blocks go straight back to be reused."""

    def __init__(self, prompts, max_new, chunk=5):
        self.prompts, self.max_new, self.chunk = prompts, max_new, chunk
        self.free = list(range(POOL))
        random.Random(0).shuffle(self.free)
        self.tables = [[] for _ in prompts]
        self.done = [0] * len(prompts)  # tokens already in the cache
        self.outputs = [[] for _ in prompts]
        self.finished = set()
        self.step = 0

    def plan(self):
        decodes, prefills, finished_ids = [], [], []
        for i, prompt in enumerate(self.prompts):
            if i in self.finished:
                continue
            if len(self.outputs[i]) >= self.max_new[i]:
                self.finished.add(i)
                finished_ids.append(str(i))
                self.free += self.tables[i]  # popped first by the next allocation
                continue
            decoding = self.done[i] >= len(prompt)
            n = 1 if decoding else min(self.chunk, len(prompt) - self.done[i])
            tokens = (prompt + self.outputs[i])[self.done[i]:self.done[i] + n]
            new = [self.free.pop()
                   for _ in range(-(-(self.done[i] + n) // BLOCK) - len(self.tables[i]))]
            self.tables[i] += new
            final = self.done[i] + n >= len(prompt)
            (decodes if decoding else prefills).append(ScheduledChunk(
                str(i), tokens, self.done[i], new, len(self.outputs[i]) if final else None))
            self.done[i] += n
        new_requests = [NewRequestData(str(i), SamplingParams(temperature=0.0), 0)
                        for i in range(len(self.prompts))] if self.step == 0 else []
        self.step += 1
        return StepPlan(self.step, new_requests, decodes + prefills, finished_ids)

    def run(self, runner, max_steps=30):
        """Execute plans until every request finished; every request's sampled tokens and the
        batch sizes of the decode-only steps."""
        decode_batches = []
        for _ in range(max_steps):
            plan = self.plan()
            if not plan.chunks:
                break
            if all(len(c.token_ids) == 1 and c.start_position >= len(self.prompts[int(
                    c.request_id)]) for c in plan.chunks):
                decode_batches.append(len(plan.chunks))
            sampled = iter(runner.execute(plan).sampled_token_ids)
            for chunk in plan.chunks:
                if chunk.sample_index is not None:
                    self.outputs[int(chunk.request_id)].append(next(sampled))
        return self.outputs, decode_batches


def runner_for(model, graphs=False):
    caches = allocate_kv_caches(model.config, POOL, BLOCK, 1, torch.float32, torch.device("cpu"))
    decode_graphs = None
    if graphs:
        max_blocks = -(-model.config.max_position // BLOCK)
        decode_graphs = DecodeGraphs(model, caches, max_blocks, batch_sizes(4),
                                     torch.device("cpu"), capture=False)
    return ModelRunner(model, caches, BLOCK, torch.device("cpu"), decode_graphs=decode_graphs)


def test_triton_backend_logits_match_the_torch_path(interpreted_kernels):
    """One step with two decodes and a prefill chunk on a cached prefix: both attention
    kernels, the cache write, rotary and the norms in one forward pass."""
    reference, triton = tiny_model(), tiny_model(interpreted_kernels.triton_backend.TritonBackend())
    logits = []
    for model in (reference, triton):
        runner = runner_for(model)
        driver = Driver([[5, 9, 13, 17, 21, 25], [40, 41, 42], list(range(100, 113))],
                        max_new=[9, 9, 9])
        driver.run(runner, max_steps=2)
        plan = driver.plan()  # decodes of 0 and 1, a 3-token chunk of 2 after 10 cached
        runner.update_requests(plan)
        input_ids, positions, meta, rows, _ = runner.prepare(plan)
        assert meta.num_decodes == 2 and [(p.query_len, p.context_len)
                                          for p in meta.prefills] == [(3, 13)]
        with torch.inference_mode():
            logits.append(model.compute_logits(model(input_ids, positions, runner.kv_caches,
                                                     meta)))
    assert torch.allclose(logits[0], logits[1], atol=1e-4), (logits[0] - logits[1]).abs().max()


def test_triton_tokens_through_padded_graph_buffers_match_the_torch_path(interpreted_kernels):
    """Greedy tokens of four requests through the CUDA-graph runner's static buffers (replayed
    eagerly on CPU) equal the torch path's: decode batches of 4, then 3 (padded to 4; the
    padded row last held a finished request whose blocks are reused at once), then 2 and 1."""
    backend = interpreted_kernels.triton_backend.TritonBackend()
    prompts = [[3, 1, 4, 1, 5], [27, 18], [200, 201, 202], [60, 61, 62, 63]]
    # Request 3 finishes after step 3; request 0 gets its last block at step 5 and writes the
    # slot the padded row last held at step 6; step 7 reads it.
    max_new = [7, 6, 6, 3]
    expected, batches = Driver(prompts, max_new).run(runner_for(tiny_model()))
    assert [len(tokens) for tokens in expected] == max_new
    graph_runner = runner_for(tiny_model(backend), graphs=True)
    assert graph_runner.decode_graphs.sizes == [1, 2, 4]
    got, graph_batches = Driver(prompts, max_new).run(graph_runner)
    assert got == expected
    assert graph_batches == batches and batches[:4] == [4, 4, 3, 3], batches
    assert len(set(sum(expected, []))) > 10, "tokens vary: they depend on attention"


@pytest.mark.startup
def test_engine_selects_triton_kernels_in_the_worker(interpreted_kernels, monkeypatch,
                                                    tmp_path):
    """The worker process picks the Triton backend (TOKSTREAM_KERNELS=triton stands in for
    --device cuda) and the engine's greedy tokens equal the torch path's on the same weights
    (a Hugging Face folder holding the sharp weights)."""
    config = resolve_model("dummy:tiny").config
    tokenizer = dummy_tokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)
    folder = save_hf_folder(tmp_path / "tiny", config, sharp_weights(),
                            tokenizer_json=tokenizer.backend.to_str())
    prompts = [[5, 17, 99, 3], list(range(10, 19))]
    expected, _ = Driver(prompts, max_new=[4, 4]).run(runner_for(tiny_model()))
    monkeypatch.setenv("TOKSTREAM_KERNELS", "triton")
    # The rank imports triton afresh (under the interpreter). Ranks fork from this process's
    # forkserver, which an earlier engine may have started: rank_start gives them this
    # environment all the same (TRITON_ variables by a new forkserver).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(EngineConfig(model=str(folder), dtype="float32", device="cpu")) as llm:
        assert llm.core.executor.ready.kernels == "triton"
        assert [c.token_ids for c in llm.generate(prompts, params)] == expected


def test_backend_and_device_choice(interpreted_kernels, monkeypatch):
    from tokstream.errors import UserInputError
    from tokstream.worker.backend import choose_backend
    from tokstream.worker.worker import resolve_device

    cpu = torch.device("cpu")
    assert choose_backend(cpu).name == "torch"
    monkeypatch.setenv("TOKSTREAM_KERNELS", "triton")
    assert choose_backend(cpu).name == "triton"
    monkeypatch.setenv("TOKSTREAM_KERNELS", "cuda")
    with pytest.raises(ValueError, match="TOKSTREAM_KERNELS"):
        choose_backend(cpu)
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(UserInputError, match="no CUDA device"):
            resolve_device("cuda")
