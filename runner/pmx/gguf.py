"""GGUF files (llama.cpp's format) read for conversion to PMX: the header, metadata and tensor table parsed here
(`read_gguf`: the `gguf` package's reader spent ~6 s on a 49k-token vocabulary's strings, which only transformers'
tokenizer converter reads), the quantised types' sizes and dequantisers from `gguf` (the format's reference, maintained
with llama.cpp); the file is memory-mapped and each tensor read as it is written, so memory follows the largest
tensor, as for safetensors.

What comes in and what is written (runner.pmx.convert.convert_gguf prints one line per type):

- F32 / F16 / BF16: floats, at the model's dtype (`--dtype auto`: the width of the matrices the file stores as
  floats; float32 where every matrix is quantised);
- Q8_0, Q4_0, Q4_1 on the weights PMX quantises (the linears, the lm head, the embedding): the same integers and
  scales, repacked (runner/pmx/quant.py): int8 in groups of 32, int4 in groups of 32 (the nibble is Q4_0's q + 8
  already), int4 in groups of 32 with offsets (Q4_1's minimum). The scales are float16 in the file, float32 in PMX
  (exact); dequantising either gives gguf's own dequantiser's values bit for bit;
- every other type gguf dequantises (K-quants, IQ*, Q5_*, ...) and any quantised tensor PMX keeps float (a router):
  dequantised with gguf's dequantiser, then kept float or re-quantised as `--quantize` asks;
- a type gguf cannot read (Q8_1, integer tensors, ...): refused before anything is written.

The tokenizer is rebuilt from the metadata with transformers' GGUF converter (`PreTrainedTokenizerFast.from_pretrained(
dir, gguf_file=...)`: the vocabulary, merges, special tokens), with llama.cpp's pre-tokenizer for `tokenizer.ggml.pre`
and BOS / EOS as `tokenizer.ggml.add_bos_token` / `add_eos_token` say, written as tokenizer.json; the special
tokens, the chat template and add_bos_token go into tokenizer_config.json.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from runner.errors import PmxError
from runner.pmx.quant import QuantScheme

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SMALL_ARRAY = 4096  # metadata arrays read into the key dict (the vocabulary's are left to the tokenizer converter)

# The types kept bit-exact: GGUF type name -> the PMX leaf scheme holding the same integers and scales
EXACT = {"Q8_0": QuantScheme("int8", 32), "Q4_0": QuantScheme("int4", 32), "Q4_1": QuantScheme("int4", 32, offset=True)}
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_OF = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def gguf_files(path: Path) -> Optional[list[Path]]:
    """The GGUF file(s) `path` names: a `.gguf` file (the first of a split set `-00001-of-0000N.gguf`: all its
    parts), or a directory holding one file or one split set and no config.json; None where `path` is neither (a
    HuggingFace directory)."""
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(path.glob("*.gguf"))
        if not found:
            return None
        singles = [p for p in found if not SPLIT_NAME.match(p.name)]
        firsts = [p for p in found if (m := SPLIT_NAME.match(p.name)) and int(m["no"]) == 1]
        if len(singles) + len(firsts) != 1:
            names = ", ".join(p.name for p in singles + firsts)
            raise PmxError(f"{path}: holds several GGUF models ({names}); give one as --input_dir {path}/FILE.gguf")
        path = (singles + firsts)[0]
    elif path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise PmxError(f"{path}: file not found")
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if int(m["no"]) != 1:
        raise PmxError(f"{path}: is part {int(m['no'])} of a split GGUF; give its first part, "
                       f"{m['stem']}-00001-of-{m['count']}.gguf")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise PmxError(f"{path}: the split GGUF has {count} parts, but {', '.join(missing)} "
                       f"{'is' if len(missing) == 1 else 'are'} missing beside it")
    return parts


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its type's name, its shape in torch order (GGUF lists dimensions innermost first) and
    the reader's memory-mapped data (bytes [.., rows, row bytes] for quantised types)."""
    name: str
    type: str
    shape: tuple
    data: np.ndarray
    path: Path
    offset: int  # of its data in `path`


class GGUFCheckpoint:
    """The metadata and tensors of a GGUF model (one file or a split set), memory-mapped."""

    def __init__(self, files: list[Path]):
        try:
            import gguf
        except ImportError:
            raise PmxError(f"{files[0]}: reading a GGUF file needs the gguf package: pip install -e '.[gguf]' (or "
                           f"bash scripts/install.sh)") from None
        self.files, self.path = files, files[0]
        self.tensors: dict[str, GGUFTensor] = {}
        self.meta: dict = {}
        for i, f in enumerate(files):
            try:
                meta, lengths, tensors = read_gguf(f, gguf)
            except Exception as e:  # noqa: BLE001 - a short or corrupt file: struct / numpy / index / value errors
                raise PmxError(f"{f}: not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
            if len(files) > 1:
                no, count = meta.get("split.no"), meta.get("split.count")
                if (no, count) != (i, len(files)):
                    raise PmxError(f"{f}: its split.no / split.count say part {no} of {count}, but its name says "
                                   f"part {i} of {len(files)} (counting from 0)")
            if i == 0:
                self.meta = meta
                self.token_count = lengths.get("tokenizer.ggml.tokens", 0)
            for t in tensors:
                if t.name in self.tensors:
                    raise PmxError(f"{f}: tensor {t.name!r} is also in {self.tensors[t.name].path}")
                self.tensors[t.name] = t
        if len(files) > 1 and "split.tensors.count" in self.meta and \
                int(self.meta["split.tensors.count"]) != len(self.tensors):
            raise PmxError(f"{self.path}: split.tensors.count says {self.meta['split.tensors.count']} tensors, the "
                           f"{len(files)} parts hold {len(self.tensors)}")
        self.architecture = self.meta.get("general.architecture")
        if not isinstance(self.architecture, str):
            raise PmxError(f"{self.path}: has no general.architecture")
        self._check_types()

    def _check_types(self) -> None:
        """Every tensor's type must be a float, kept exact or dequantisable by gguf; refused before any work."""
        import gguf
        for type_name in sorted({t.type for t in self.tensors.values()}):
            if type_name in FLOATS or type_name in EXACT:
                continue
            qtype = gguf.GGMLQuantizationType[type_name]
            try:
                gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
            except (NotImplementedError, KeyError):
                first = next(t.name for t in self.tensors.values() if t.type == type_name)
                raise PmxError(f"{self.path}: tensor {first!r} is of type {type_name}, which cannot be read (gguf "
                               f"has no dequantiser for it)") from None

    def float_tensor(self, t: GGUFTensor) -> torch.Tensor:
        """A float tensor (F32 / F16 / BF16) as stored, or any other type dequantised by gguf to float32."""
        if t.type in ("F32", "F16"):
            return torch.from_numpy(np.array(t.data, copy=True)).reshape(t.shape)
        if t.type == "BF16":
            return torch.from_numpy(np.array(t.data, copy=True).view(np.int16)).view(torch.bfloat16).reshape(t.shape)
        import gguf
        return torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType[t.type])
                                .reshape(t.shape))

    @staticmethod
    def exact_parts(t: GGUFTensor) -> tuple:
        """A Q8_0 / Q4_0 / Q4_1 tensor [.., N, K] as the parts of its PMX scheme (EXACT): qweight, scale[, offset]."""
        *lead, k = t.shape
        if t.type == "Q8_0":
            b = np.asarray(t.data).reshape(*lead, k // 32, 34)        # per block: d (float16), 32 x int8
            q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(*lead, k)
            return torch.from_numpy(q), _halves(b, 0)
        offset = t.type == "Q4_1"
        b = np.asarray(t.data).reshape(*lead, k // 32, 20 if offset else 18)  # d[, m] (float16), 16 bytes
        qs = b[..., -16:]
        elems = np.concatenate([qs & 15, qs >> 4], axis=-1)         # block element j in byte j's low nibble,
        packed = elems[..., 0::2] | (elems[..., 1::2] << 4)         # j + 16 in its high one -> PMX's pairs
        q = torch.from_numpy(np.ascontiguousarray(packed).reshape(*lead, k // 2))
        return (q, _halves(b, 0), _halves(b, 2)) if offset else (q, _halves(b, 0))


def _halves(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [.., blocks] (exact)."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at: at + 2]).view(np.float16)[..., 0].astype(np.float32))


# GGUF's metadata value types: the scalars' struct formats (little-endian), 8 a string, 9 an array
_VALUE = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}  # tensor types read as numbers; every other type as bytes [.., rows, row bytes]


def read_gguf(path: Path, gguf) -> tuple[dict, dict, list]:
    """One GGUF file's metadata (key -> value; arrays of more than SMALL_ARRAY entries left out), the length of every
    array (key -> entries) and its tensors, their data memory-mapped. `gguf`: the package (the types' names and
    sizes)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    magic, version = struct.unpack_from("<4sI", buf, 0)
    if magic != b"GGUF":
        raise ValueError(f"starts with {bytes(magic)!r}, not GGUF")
    if version not in (2, 3):
        raise ValueError(f"version {version} (big-endian, or not 2 / 3)")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    at = 24

    def unpack(fmt: str):
        nonlocal at
        v = struct.unpack_from("<" + fmt, buf, at)[0]
        at += struct.calcsize("<" + fmt)
        return v

    def string(keep: bool = True) -> Optional[str]:
        nonlocal at
        n = unpack("Q")
        at += n
        if at > len(buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(buf[at - n: at]).decode("utf-8", errors="replace") if keep else None

    def value(kind: int, keep: bool = True):
        """The value of type `kind` at `at` (None where not `keep`: skipped); an array's is (entries, values)."""
        nonlocal at
        if kind == _STRING:
            return string(keep)
        if kind == _ARRAY:
            item, count = unpack("I"), unpack("Q")
            if item in _VALUE:
                fmt = "<" + _VALUE[item]
                values = np.frombuffer(buf, dtype=fmt, count=count, offset=at).tolist() if keep else None
                at += struct.calcsize(fmt) * count
                return count, values
            values = [value(item, keep) for _ in range(count)]  # strings (or arrays) one by one
            return count, values if keep else None
        if kind not in _VALUE:
            raise ValueError(f"metadata value type {kind}")
        return unpack(_VALUE[kind])

    meta, lengths = {}, {}
    for _ in range(n_kv):
        key, kind = string(), unpack("I")
        if kind == _ARRAY:
            count = struct.unpack_from("<Q", buf, at + 4)[0]
            lengths[key], values = value(kind, keep=count <= SMALL_ARRAY)
            if count <= SMALL_ARRAY:
                meta[key] = [v[1] if isinstance(v, tuple) else v for v in values]  # (nested arrays: their values)
        else:
            meta[key] = value(kind)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), unpack("I")
        dims = [unpack("Q") for _ in range(n_dims)]
        infos.append((name, dims, unpack("I"), unpack("Q")))
    alignment = int(meta.get("general.alignment", 32))
    start = -(-at // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        qtype = gguf.GGMLQuantizationType(type_id)
        type_name, shape = qtype.name, tuple(int(d) for d in reversed(dims))  # (shape: torch order)
        if type_name in _NUMPY:
            dtype = np.dtype(_NUMPY[type_name])
            rows, nbytes = shape, int(np.prod(shape)) * dtype.itemsize
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            dtype, rows = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * size)
            nbytes = int(np.prod(rows))
        first = start + offset
        if first + nbytes > len(mm):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, type_name, shape, mm[first: first + nbytes].view(dtype).reshape(rows), path,
                                  first))
    return meta, lengths, tensors


# --- the tokenizer ------------------------------------------------------------------------------------------------
# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) of the families converted here, as `tokenizers` pre-tokenizers
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_SPLIT = (  # o200k's, Phi-4-mini's
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str):
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2():
    from tokenizers import pre_tokenizers
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm():  # digits one by one, then GPT-2's split (SmolLM's own tokenizer.json)
    from tokenizers import pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# llama.cpp's LLAMA3 type: a piece the vocabulary holds whole is taken as it is, merges ignored (HF's ignore_merges),
# and BOS added where the file does not say
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "falcon3")
PRE_TOKENIZERS = {  # no pre-tokenizer named, or "default" (llama.cpp's fallback): GPT-2's split, as transformers takes
    "default": _gpt2, "gpt-2": _gpt2, "smollm": _smollm,
    **{name: (lambda: _split_then_bytes(LLAMA3_SPLIT)) for name in LLAMA3_PRE},
    **{name: (lambda: _split_then_bytes(QWEN2_SPLIT)) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
    "gpt-4o": lambda: _split_then_bytes(GPT4O_SPLIT),
}


def tokenizer_files(ckpt: GGUFCheckpoint, max_positions: int) -> tuple[dict, list]:
    """tokenizer.json and tokenizer_config.json (name -> text) of the tokenizer the file's metadata describes, and the
    ids generation stops at (:func:`eos_ids`)."""
    meta, path = ckpt.meta, ckpt.path
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise PmxError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (gpt2: byte-level BPE, llama: "
                       f"sentencepiece)")
    pre = meta.get("tokenizer.ggml.pre", "default") if kind == "gpt2" else None
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
        raise PmxError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                       f"{', '.join(sorted(PRE_TOKENIZERS))})")
    try:
        from transformers import PreTrainedTokenizerFast
        from tokenizers import processors
        # (not AutoTokenizer: it reads the whole file's metadata a second time for a config, to pick this same class)
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except ImportError as e:
        raise PmxError(f"{path}: converting a GGUF's tokenizer needs transformers ({e}): pip install -e '.[gguf]' "
                       f"(or bash scripts/install.sh)") from None
    backend = tok.backend_tokenizer
    if pre is not None:
        backend.pre_tokenizer = PRE_TOKENIZERS[pre]()

    def token(key: str) -> Optional[str]:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else backend.id_to_token(int(i))

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or pre in LLAMA3_PRE))  # llama.cpp's
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))  # defaults where the file says none
    bos, eos = token("bos_token_id"), token("eos_token_id")
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise PmxError(f"{path}: tokenizer.ggml.add_{'bos' if add_bos and bos is None else 'eos'}_token is true, "
                       f"but the file names no such token")
    single = ([bos] if add_bos else []) + ["$A"] + ([eos] if add_eos else [])
    specials = [(t, backend.token_to_id(t)) for t in {bos if add_bos else None, eos if add_eos else None} - {None}]
    backend.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": add_eos,
              "bos_token": bos, "eos_token": eos, "unk_token": token("unknown_token_id"),
              "pad_token": token("padding_token_id"), "model_max_length": max_positions,
              "clean_up_tokenization_spaces": False}
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    spec = json.loads(backend.to_str())  # without the tokens the converter's class adds on its own (GPT-2's
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < ckpt.token_count]  # <|endoftext|>)
    if pre in LLAMA3_PRE:
        spec["model"]["ignore_merges"] = True
    config["added_tokens_decoder"] = {  # as transformers writes them: a chat template's special tokens are found here
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in spec["added_tokens"]}
    files = {"tokenizer.json": json.dumps(spec, ensure_ascii=False),
             "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
    named = (backend.token_to_id(t) for t in END_OF_GENERATION)
    return files, eos_ids(meta, [i for i in named if i is not None and i < ckpt.token_count])


# The tokens llama.cpp also ends generation at, found by their text (llama-vocab.cpp; converters name no eot_token_id
# for Gemma's <end_of_turn> or Phi-3's <|end|>, whose instruct models end their turns with them)
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
                     "<|end_of_text|>", "</s>", "<eos>")


def eos_ids(meta: dict, found: tuple = ()) -> list:
    """The ids generation stops at: the EOS, the end-of-turn / end-of-message tokens the file names, and those `found`
    by their text (END_OF_GENERATION), as llama.cpp stops at all of them."""
    ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")] + list(found)
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
