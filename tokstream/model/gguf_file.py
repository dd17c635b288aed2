"""GGUF files: a fast header reader, and dequantisation to float32 arrays under Hugging Face
Llama names. No torch here.

The header is parsed with `struct` rather than gguf.GGUFReader: the reader builds numpy views
of every tokenizer string (98k of them in SmolLM2), which takes ~2 s, while resolving a model
only needs a dozen scalars. Tensor data is still dequantised by llama.cpp's own `gguf.quants`.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from tokstream.config import ModelConfig
from tokstream.errors import CorruptModelError, UserInputError
from tokstream.model.hf_folder import check_tensor_shapes, tensor_shapes

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# llama.cpp's converter permutes q/k rows into its interleaved rotary layout for Llama only;
# Qwen2 uses the NeoX layout, which is Hugging Face's, and is stored as is.
PERMUTED_ARCHITECTURES = ("llama",)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32

_U64 = struct.Struct("<Q")
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    """GGUF name, e.g. blk.0.attn_q.weight."""
    shape: tuple[int, ...]
    """numpy order (slowest dimension first): GGUF lists its dims the other way round."""
    ggml_type: int
    offset: int
    """Absolute byte offset of the data in the file."""


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    file_size: int
    metadata: dict[str, object]
    """Key/value metadata; arrays are lists, or absent when read with arrays=False."""
    array_lengths: dict[str, int]
    """Length of every array in the metadata, read or not (e.g. tokenizer.ggml.tokens)."""
    tensors: dict[str, GGUFTensorInfo]


def _shortest_float32(x: float) -> float:
    """The shortest decimal that is the same float32, so an rms_norm_eps stored as float32
    reads back as 1e-05 (as in config.json), not 9.999999747378752e-06."""
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        try:
            if struct.pack("<f", candidate) == struct.pack("<f", x):
                return candidate
        except OverflowError:  # rounding near float32's maximum
            continue
    return x


class _Cursor:
    """Bounds-checked reads from the mapped file; running off the end means truncation."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            raise CorruptModelError(
                f"{self.path} is truncated: its header runs past the end of the file at byte"
                f" {len(self.buf)}")

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def raw_string(self) -> bytes:
        n = self.unpack("<Q")
        self.need(n)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw

    def skip_strings(self, count: int) -> None:
        """Step over count strings without copying them out: a weights-only reader passes the
        tokenizer's ~100k tokens and merges this way (every rank of every start does)."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8)  # raises: truncated
            pos += 8 + length(buf, pos)[0]
        self.pos = pos
        self.need(0)  # the last string ran past the end

    def string(self) -> str:
        try:
            return self.raw_string().decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptModelError(f"{self.path}: a header string is not UTF-8") from None

    def value(self, value_type: int, keep_arrays: bool):
        if value_type == _FLOAT32:
            return _shortest_float32(self.unpack("<f"))
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if not keep_arrays and item_type in _SCALAR_FORMATS:
                self.need(count * struct.calcsize(_SCALAR_FORMATS[item_type]))
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[item_type])
                return count
            if not keep_arrays and item_type == _STRING:
                self.skip_strings(count)
                return count
            return [self.value(item_type, True) for _ in range(count)]
        raise CorruptModelError(f"{self.path}: unknown metadata value type {value_type}")


def read_gguf_header(path: str | Path, arrays: bool = False) -> GGUFHeader:
    """Parse a GGUF header: metadata and tensor table, no tensor data. Takes ~50 ms on SmolLM2
    without arrays; with arrays=True the tokenizer's token and merge lists are decoded too."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise CorruptModelError(f"{path} is empty, not a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_header(_Cursor(buf, path), size, arrays)
    except OSError as e:
        raise CorruptModelError(f"{path} cannot be read: {e.strerror or e}") from None


def _parse_header(cursor: _Cursor, size: int, arrays: bool) -> GGUFHeader:
    path = cursor.path
    if size < 24 or cursor.buf[:4] != b"GGUF":
        raise CorruptModelError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise CorruptModelError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    if tensor_count > size or kv_count > size:
        raise CorruptModelError(f"{path}: header counts are impossible for a {size}-byte file")
    metadata: dict[str, object] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = cursor.string()
        value_type = cursor.unpack("<I")
        value = cursor.value(value_type, arrays)
        if value_type == _ARRAY:
            array_lengths[key] = value if isinstance(value, int) else len(value)
            if not isinstance(value, list):
                continue
        metadata[key] = value
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.unpack("<I")
        if n_dims > MAX_DIMS:
            raise CorruptModelError(f"{path}: tensor {name} claims {n_dims} dimensions")
        dims = [cursor.unpack("<Q") for _ in range(n_dims)]
        ggml_type, offset = cursor.unpack("<I"), cursor.unpack("<Q")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise CorruptModelError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
               for name, shape, ggml_type, offset in infos}
    return GGUFHeader(path, size, metadata, array_lengths, tensors)


def config_from_header(header: GGUFHeader, name: str | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata; `name` defaults to the file's stem."""
    meta, path = header.metadata, header.path
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CorruptModelError(f"{path}: unsupported architecture {arch!r}"
                                f" (tokstream runs {', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise CorruptModelError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in header.tensors:
        raise CorruptModelError(f"{path}: rope scaling ({scaling}) is not supported")
    embedding = header.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise CorruptModelError(f"{path}: tensor token_embd.weight is missing or not 2-D")
    eos_ids = [meta.get(key) for key in ("tokenizer.ggml.eos_token_id",
                                          "tokenizer.ggml.eot_token_id")]
    try:
        heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
        return ModelConfig(
            name=name or Path(path).stem,
            vocab_size=int(meta.get(f"{arch}.vocab_size") or embedding.shape[0]),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // max(heads, 1)),
            max_position=int(need("context_length")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in header.tensors,
            qkv_bias="blk.0.attn_q.bias" in header.tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos_ids if t is not None)),
        )
    except CorruptModelError:
        raise
    except UserInputError as e:  # ModelConfig's own validation
        raise CorruptModelError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:  # e.g. a string where a count belongs
        raise CorruptModelError(f"{path}: bad model metadata ({e})") from None


def read_gguf_config(path: str | Path, name: str | None = None) -> ModelConfig:
    """ModelConfig of a GGUF file, from its header alone."""
    return config_from_header(read_gguf_header(path), name)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when tokstream has no use for it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"
    return None


def unpermute_rotary(w, n_heads: int):
    """Inverse of llama.cpp's convert permute(w, n_heads), which is
    w.reshape(n_heads, 2, rows // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_tensors(path: str | Path, config: ModelConfig, unpermute: bool = True):
    """Dequantise every tensor to float32 numpy arrays under HF Llama names, exactly the
    Hugging Face weights (q/k rotary permutation undone). `unpermute=False` exists only so a
    test can show the check that catches a missing inverse."""
    import numpy as np
    from gguf.quants import dequantize

    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    slices = _tensor_slices(header, config)  # validates every tensor before any work
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray] = {}
    for name, (info, qtype, start, end, row_bytes) in slices.items():
        raw = data[start:end].reshape(*info.shape[:-1], row_bytes)
        try:
            weight = np.array(dequantize(raw, qtype), dtype=np.float32)  # copy off the mmap
        except NotImplementedError:
            raise CorruptModelError(f"{header.path}: tensor {info.name} uses {qtype.name},"
                                    " which gguf cannot dequantise") from None
        if unpermute and arch in PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in name:
                weight = unpermute_rotary(weight, config.num_heads)
            elif ".self_attn.k_proj." in name:
                weight = unpermute_rotary(weight, config.num_kv_heads)
        tensors[name] = np.ascontiguousarray(weight)  # (out_features, in_features) for linears
    return tensors


def _tensor_slices(header: GGUFHeader, config: ModelConfig) -> dict:
    """HF name -> (info, quant type, start byte, end byte, bytes per row), in load order;
    raises CorruptModelError for unknown, missing, misshapen or cut tensors."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = header.path
    known = {}
    for info in header.tensors.values():
        name = hf_name(info.name)
        if name is None:
            raise CorruptModelError(f"{path}: tensor {info.name} is not supported")
        known[name] = info
    check_tensor_shapes(config, {k: info.shape for k, info in known.items()}, path)
    slices = {}
    for name in tensor_shapes(config):
        info = known[name]
        if info.ggml_type not in GGML_QUANT_SIZES:
            raise CorruptModelError(f"{path}: tensor {info.name} has unknown type {info.ggml_type}")
        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row = info.shape[-1]
        if row % block_size:
            raise CorruptModelError(
                f"{path}: tensor {info.name} rows do not fill {qtype.name} blocks")
        row_bytes = row // block_size * type_size
        end = info.offset + row_bytes * (int(np.prod(info.shape)) // row)
        if end > header.file_size:
            raise CorruptModelError(f"{path} is truncated: tensor {info.name} needs bytes up to"
                                    f" {end}, the file has {header.file_size}")
        slices[name] = (info, qtype, info.offset, end, row_bytes)
    return slices


NATIVE_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
"""ggml types the CPU kernels multiply without dequantising (kernels/cpu_quant_matmul.c)."""


@dataclass(frozen=True)
class QuantizedArray:
    """A weight matrix kept in its GGUF blocks: data (out_features, row bytes) uint8."""

    data: object
    """numpy uint8 array, one row of blocks per output feature."""
    ggml_type: int
    in_features: int


def native_weight_types(path: str | Path) -> set[int]:
    """The ggml types of a file's 2-D weights (what decides whether native serving applies)."""
    header = read_gguf_header(path)
    return {info.ggml_type for info in header.tensors.values() if len(info.shape) == 2}


def load_gguf_native(path: str | Path, config: ModelConfig) -> dict[str, object]:
    """Every tensor under HF Llama names: 2-D weights in a NATIVE_TYPES format stay quantised
    (QuantizedArray, copied off the file; q/k rows unpermuted, which moves whole rows of
    blocks), everything else is dequantised to float32 numpy arrays as load_gguf_tensors."""
    import numpy as np
    from gguf.quants import dequantize

    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    slices = _tensor_slices(header, config)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    tensors: dict[str, object] = {}
    for name, (info, qtype, start, end, row_bytes) in slices.items():
        raw = data[start:end].reshape(*info.shape[:-1], row_bytes)
        native = len(info.shape) == 2 and info.ggml_type in NATIVE_TYPES
        weight = np.array(raw) if native else np.array(dequantize(raw, qtype), dtype=np.float32)
        if arch in PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in name:
                weight = unpermute_rotary(weight, config.num_heads)
            elif ".self_attn.k_proj." in name:
                weight = unpermute_rotary(weight, config.num_kv_heads)
        weight = np.ascontiguousarray(weight)
        tensors[name] = (QuantizedArray(weight, info.ggml_type, info.shape[-1]) if native
                         else weight)
    return tensors
