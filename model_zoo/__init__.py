"""Model families: everything that is specific to one HuggingFace architecture lives here.

Each family says how a HF `config.json` becomes `pmx_params.json` and which HF tensor becomes which
PMX tensor. The engine and the PMX layer never branch on family names.
"""

from __future__ import annotations

from model_zoo.baichuan import BAICHUAN
from model_zoo.chatglm import CHATGLM
from model_zoo.decoder import DecoderFamily
from model_zoo.gemma2 import GEMMA2
from model_zoo.gemma3 import GEMMA3
from model_zoo.internlm import INTERNLM
from model_zoo.internlm2 import INTERNLM2
from model_zoo.llama import LLAMA
from model_zoo.mistral import MISTRAL
from model_zoo.mixtral import MIXTRAL
from model_zoo.phi3 import PHI3
from model_zoo.qwen import QWEN
from model_zoo.qwen2 import QWEN2
from model_zoo.qwen3 import QWEN3
from runner.errors import PmxError

FAMILIES: tuple[DecoderFamily, ...] = (LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, CHATGLM, INTERNLM,
                                       INTERNLM2, BAICHUAN, QWEN)


def family_for(config: dict, source: str = "config.json") -> DecoderFamily:
    """The family that handles `config["architectures"][0]`."""
    archs = config.get("architectures") or []
    if not archs:
        raise PmxError(f"{source}: has no 'architectures' entry; cannot tell the model family")
    for fam in FAMILIES:
        if archs[0] in fam.architectures:
            return fam
    supported = sorted(a for f in FAMILIES for a in f.architectures)
    raise PmxError(f"{source}: unknown architecture {archs[0]!r}; supported: {', '.join(supported)}")


def family_for_gguf(architecture: str, experts: bool, source: str) -> DecoderFamily:
    """The family of a GGUF file of llama.cpp's `general.architecture` (with MoE experts or not)."""
    for fam in FAMILIES:
        if fam.gguf_architecture == architecture and (fam.moe_module is not None) == experts:
            return fam
    supported = sorted({f"{f.gguf_architecture}{' with experts' if f.moe_module else ''}" for f in FAMILIES
                        if f.gguf_architecture})
    raise PmxError(f"{source}: GGUF architecture {architecture!r}{' with experts' if experts else ''} is not "
                   f"supported; supported: {', '.join(supported)}")


__all__ = ["FAMILIES", "family_for", "family_for_gguf", "DecoderFamily"]
