"""Greedy tokens of dummy:tiny on DEVICE equal the CPU reference (float32). Exit 1 if not.

    python scripts/device_parity.py cuda
"""

import sys

from tokstream.config import EngineConfig
from tokstream.engine.llm import LLM
from tokstream.sampling_params import SamplingParams


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    prompts = [[5, 17, 99, 3], list(range(10, 60)), [7] * 33]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for dev in ("cpu", device):
        with LLM(EngineConfig(model="dummy:tiny", dtype="float32", device=dev)) as llm:
            results[dev] = [c.token_ids for c in llm.generate(prompts, params)]
    same = results["cpu"] == results[device]
    print(f"cpu == {device}: {same}")
    return 0 if same else 1


if __name__ == "__main__":  # workers are spawned: the main module must be importable
    sys.exit(main())
