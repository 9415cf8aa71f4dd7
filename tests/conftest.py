"""Shared fixtures: the real checkpoints in ../shared/models and random-weight HF checkpoints."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores (scripts/test.sh): OpenMP threads that wait for work sleep rather than spin, here and
    # in the jobs the tests start (set before torch loads libgomp; a spinning team beside a busy one starves both)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run under its interpreter on CPU (set before Triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import fast_interpreter  # noqa: E402
    fast_interpreter.install()
# torch.compile's cache beside the other build caches in ~/.cache rather than in /tmp (see leftovers())
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "pmx-runner" / "torchinductor"))
# and no precompiled header, which inductor keeps in /tmp/torchinductor_USER whatever the cache directory: building it
# on a fresh machine left that directory behind, and cost more than it saved (a cold compiled-step test: 74 s with,
# 65 s without)
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")

ROOT = Path(__file__).resolve().parents[1]
SHARED_MODELS = ROOT.parent / "shared" / "models"
STORIES_PROMPT = ["--prompt", "Once upon a time", "--max_gen_len", 40]


def shared_model_path(name: str) -> Path:
    """Path of a real checkpoint in ../shared/models; skips the test when ../shared is absent."""
    path = SHARED_MODELS / name
    if not (path / "config.json").is_file():
        pytest.skip(f"{path} not found: the real checkpoints live in ../shared/models beside the project")
    return path


@pytest.fixture
def shared_model():
    """shared_model(name): see :func:`shared_model_path`."""
    return shared_model_path


@pytest.fixture(scope="session")
def stories(tmp_path_factory):
    """stories260k as PMX, unsplit and split in 2, with greedy dumps of steps 0, 1 and 39 at TP=1 and TP=2."""
    import subprocess
    import sys

    from runner.pmx.convert import convert, reshard
    src = SHARED_MODELS / "stories260k"
    if not (src / "config.json").is_file():
        pytest.skip(f"{src} not found: the real checkpoints live in ../shared/models beside the project")
    base = tmp_path_factory.mktemp("stories")
    convert(str(src), str(base / "pmx"), progress=False)
    reshard(str(base / "pmx"), str(base / "pmx_2"), 2, progress=False)
    demo = [sys.executable, ROOT / "scripts" / "Demo.py"]
    for tp, cmd in ((2, [ROOT / "scripts" / "mpirun.sh", "-np", 2, *demo, "--ckpt_dir", base / "pmx_2"]),
                    (1, [*demo, "--ckpt_dir", base / "pmx"])):
        cmd += [*STORIES_PROMPT, "--dump_tensor_path", base / f"dump{tp}", "--dump_steps", "0,1,39"]
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
    return base


ARCH_CONFIGS = {
    # name: (transformers config class name, kwargs)
    "llama_mha": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=4, num_hidden_layers=2, vocab_size=101)),
    "llama_gqa_odd": ("LlamaConfig", dict(hidden_size=48, intermediate_size=70, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=6, num_hidden_layers=2, vocab_size=77,
                                          tie_word_embeddings=True)),
    "llama_bias": ("LlamaConfig", dict(hidden_size=32, intermediate_size=50, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=1, vocab_size=64,
                                       attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=96, head_dim=8,
                                      sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=88, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=120,
                                  tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral_window": ("MistralConfig", dict(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                                             num_key_value_heads=4, num_hidden_layers=2, vocab_size=96, head_dim=8,
                                             sliding_window=5)),
    "qwen3": ("Qwen3Config", dict(hidden_size=48, intermediate_size=72, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, num_hidden_layers=2, vocab_size=90)),  # 4 x 16 != 48
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=42, num_attention_heads=8,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, num_local_experts=4,
                                      num_experts_per_tok=2, experts_implementation="eager")),
}


# config.json as the hub publishes them (their keys and layout; the transformers version that wrote them), sizes made
# tiny: built by make_hf as transformers reads such a file, weights saved in the published layout
_LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.4],
             "long_factor": [1.0, 1.5, 2.2, 3.1, 4.4, 6.0, 8.1, 10.6]}
PUBLISHED = {
    # google/gemma-2-2b-it (transformers 4.42); soft caps small enough to cap these weights' scores and logits
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "attn_logit_softcapping": 0.15, "bos_token_id": 2, "cache_implementation": "hybrid",
               "eos_token_id": [1, 107], "final_logit_softcapping": 0.5, "head_dim": 16,
               "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64,
               "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 8192,
               "model_type": "gemma2", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
               "pad_token_id": 0, "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
               "sliding_window": 5, "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True,
               "vocab_size": 300},
    # google/gemma-3-1b-it (transformers 4.50): one KV head, head_dim x heads != hidden; a global layer every 2nd
    # (6th as published) so that 2 layers hold both kinds; the 4B's linear rope scaling on the global ones
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
               "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 32,
               "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "initializer_range": 0.02,
               "intermediate_size": 96, "max_position_embeddings": 32768, "model_type": "gemma3_text",
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 1, "pad_token_id": 0,
               "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000,
               "sliding_window": 5, "sliding_window_pattern": 2, "torch_dtype": "float32",
               "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 300},
    # google/gemma-3-4b-it (transformers 4.50): the text_config gives a few keys, Gemma3TextConfig the rest (8 heads,
    # 4 KV heads of 256, the ropes, ...); weights under language_model.*, a vision tower and projector beside them
    "gemma3_mm": {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                  "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
                  "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
                  "text_config": {"hidden_size": 64, "intermediate_size": 96, "model_type": "gemma3_text",
                                  "num_hidden_layers": 2, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                  "sliding_window": 5, "vocab_size": 300},
                  "torch_dtype": "float32", "transformers_version": "4.50.0.dev0",
                  "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                    "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                    "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
    # microsoft/Phi-3-mini-4k-instruct (transformers 4.40): a sliding window on every layer (2047 as published)
    "phi3": {"_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
             "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000 % 300,
             "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
             "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 4, "num_hidden_layers": 2,
             "num_key_value_heads": 4, "original_max_position_embeddings": 4096, "pad_token_id": 32000 % 300,
             "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
             "sliding_window": 5, "tie_word_embeddings": False, "torch_dtype": "float32",
             "transformers_version": "4.40.2", "use_cache": True, "attention_bias": False, "vocab_size": 300},
    # microsoft/Phi-3.5-mini-instruct: LongRoPE (short factors up to original_max 8 positions, long beyond)
    "phi3_5": {"architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
               "embd_pdrop": 0.0, "eos_token_id": 32000 % 300, "hidden_act": "silu", "hidden_size": 64,
               "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 64,
               "model_type": "phi3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
               "original_max_position_embeddings": 8, "pad_token_id": 32000 % 300, "resid_pdrop": 0.0,
               "rms_norm_eps": 1e-05, "rope_scaling": _LONGROPE, "rope_theta": 10000.0, "sliding_window": 64,
               "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.43.3",
               "use_cache": True, "attention_bias": False, "vocab_size": 300},
    # microsoft/Phi-4-mini-instruct: GQA, a partial rotary (0.75 of the head), LongRoPE, tied embeddings
    "phi4_mini": {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "bos_token_id": 299, "embd_pdrop": 0.0, "eos_token_id": 299, "full_attn_mod": 1,
                  "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
                  "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 64, "mlp_bias": False,
                  "model_type": "phi3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                  "original_max_position_embeddings": 8, "pad_token_id": 299, "partial_rotary_factor": 0.75,
                  "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
                  "rope_scaling": {**_LONGROPE, "short_factor": _LONGROPE["short_factor"][:6],
                                   "long_factor": _LONGROPE["long_factor"][:6]},
                  "rope_theta": 10000.0, "sliding_window": 64, "tie_word_embeddings": True,
                  "torch_dtype": "float32", "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 300},
}


def make_published(name: str, directory: Path, seed: int = 0, fmt: str = "safetensors", num_files: int = 1,
                   **overrides):
    """(directory, HF model in eval mode) of PUBLISHED[name] (with `overrides` on its config.json, the text_config's
    for a multimodal one): config.json as written, the model transformers builds from it (eager attention), random
    weights (norms too) saved in the published layout."""
    import transformers
    cfg = json.loads(json.dumps(PUBLISHED[name]))
    (cfg["text_config"] if "text_config" in cfg else cfg).update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    hf = transformers.AutoConfig.from_pretrained(directory)
    multimodal = "text_config" in cfg
    if multimodal:  # the language model of the checkpoint, on its own
        hf = hf.text_config
        hf.architectures = ["Gemma3ForCausalLM"]
    hf._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="eager").eval()
    with torch.no_grad():  # norms at random (Gemma's 1 + w init at w = 0), the embeddings' scale as published
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if hf.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if multimodal:
        sd = {f"language_model.{k}": v for k, v in sd.items()}
        sd["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.randn(8, 3, 2, 2)
        sd["multi_modal_projector.mm_input_projection_weight"] = torch.randn(8, 64)
        sd["multi_modal_projector.mm_soft_emb_norm.weight"] = torch.randn(8)
    return save_state_dict(sd, directory, fmt, num_files), model


def save_hf(model, directory: Path, fmt: str = "safetensors", num_files: int = 1) -> Path:
    """Writes `model` as a HF checkpoint: safetensors or pytorch .bin, in `num_files` files (+ index)."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if any(".experts." in k for k in sd):  # transformers 5 fuses experts in memory; save_pretrained writes the hub layout
        model.save_pretrained(directory)
        return directory
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return save_state_dict(sd, directory, fmt, num_files)


def save_state_dict(sd: dict, directory: Path, fmt: str = "safetensors", num_files: int = 1) -> Path:
    """Writes the tensors `sd` as a HF checkpoint's weights: safetensors or pytorch .bin, in `num_files` files (+ an
    index where more than one)."""
    from safetensors.torch import save_file
    names = list(sd)
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if num_files == 1:
        files = {f"{stem}.{ext}": names}
    else:
        files = {f"{stem}-{i + 1:05d}-of-{num_files:05d}.{ext}": names[i::num_files] for i in range(num_files)}
    for fname, keys in files.items():
        part = {k: sd[k] for k in keys}
        if fmt == "safetensors":
            save_file(part, str(directory / fname), metadata={"format": "pt"})
        else:
            torch.save(part, directory / fname)
    if num_files > 1:
        index = {"metadata": {}, "weight_map": {k: f for f, keys in files.items() for k in keys}}
        (directory / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
    return directory


@pytest.fixture
def make_hf(tmp_path):
    """make_hf(arch, fmt="safetensors", num_files=1, seed=0, **overrides) -> (dir, HF model in eval mode): arch one of
    ARCH_CONFIGS (the config as transformers writes it) or PUBLISHED (as the hub has it)."""
    return hf_maker(tmp_path)


def hf_maker(tmp_path: Path):
    """make_hf's function, writing under `tmp_path` (for fixtures of a wider scope)."""
    import transformers

    def make(arch: str, fmt: str = "safetensors", num_files: int = 1, seed: int = 0, **overrides):
        if arch in PUBLISHED:
            return make_published(arch, tmp_path / f"{arch}-{fmt}-{num_files}-{seed}", seed, fmt, num_files,
                                  **overrides)
        cls_name, kwargs = ARCH_CONFIGS[arch]
        cfg = getattr(transformers, cls_name)(**{**kwargs, **overrides})
        model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
        torch.manual_seed(seed)
        model = model_cls(cfg).eval()
        with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise so the tests see them
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith(".bias"):
                    p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))
                if name.endswith("mlp.gate.weight"):  # a decisive router: no near-ties between experts
                    p.mul_(50)
        d = save_hf(model, tmp_path / f"{arch}-{fmt}-{num_files}-{seed}", fmt, num_files)
        return d, model
    return make


# --- what the suite leaves in /dev/shm and /tmp (tests/test_leftovers.py, run last) ---------------------------
LEFTOVER_DIRS = (Path("/dev/shm"), Path(tempfile.gettempdir()))
AT_START = pytest.StashKey[dict]()


def _entries() -> dict:
    """{directory: {name: owner uid}} of what /dev/shm and /tmp hold now."""
    out = {}
    for d in LEFTOVER_DIRS:
        names = {}
        for name in (os.listdir(d) if d.is_dir() else ()):
            try:
                names[name] = os.lstat(d / name).st_uid
            except FileNotFoundError:
                pass
        out[d] = names
    return out


def _held() -> set:
    """Paths that a live process has open, mapped or as its working directory."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                held.update(parts[5].rstrip("\n") for parts in (ln.split(None, 5) for ln in f) if len(parts) == 6)
            links = [f"/proc/{pid}/cwd"] + [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # the process ended meanwhile
            continue
        for link in links:
            try:
                held.add(os.readlink(link))
            except OSError:
                pass
    return held


def leftovers(at_start: dict, grace_s: float = 5.0) -> list[str]:
    """Entries of /dev/shm and /tmp that appeared since `at_start`, are ours (this uid) and that no live process
    holds (another job running beside the suite holds its own), waiting up to `grace_s` for them to go."""
    deadline = time.monotonic() + grace_s
    while True:
        now, held = _entries(), _held()
        left = []
        for d, names in now.items():
            for name, uid in names.items():
                path = str(d / name)
                if name in at_start.get(d, {}) or uid != os.getuid():
                    continue
                if not any(h == path or h.startswith(path + "/") for h in held):
                    left.append(path)
        if not left or time.monotonic() > deadline:
            return sorted(left)
        time.sleep(0.2)


def suite_leftovers(at_start: dict) -> list[str]:
    """leftovers() but pytest's own /tmp/pytest-of-USER (its temporary directories, kept by its design)."""
    return [p for p in leftovers(at_start) if not Path(p).name.startswith("pytest-of-")]


def pytest_sessionstart(session):
    # The jobs the tests start get SIGINT as a terminal's user would send it. A shell starts a background job (`cmd &`
    # in a script, as CI may run the suite) with SIGINT ignored, and every process started from it inherits that: a
    # SIGINT to mpiexec then ends nothing (test_faults). A handler of Python's own is reset to the default in each
    # child at exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A suite run inside another one (test_scripts runs scripts/test.sh) leaves the check to the outer run: the jobs of
    # the outer run's other tests come and go in the same /tmp and /dev/shm meanwhile
    if os.environ.get("PMX_TEST_LEFTOVERS_CHECK") != "0":
        session.config.stash[AT_START] = _entries()
    from runner.kernels.cpu_ext import cpu_ops
    cpu_ops()  # built here on a fresh machine (and said so), not inside the first test whose job uses the kernels


def _xdist_controller(config) -> bool:
    """True in the process that hands tests to pytest-xdist's workers (and runs none itself)."""
    return not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None) not in (None, 0)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Under pytest-xdist the leftovers check runs here, in the controller, once every worker has ended (a test of a
    worker cannot see the other's end); it fails the run as test_leftovers.py does a serial one."""
    if not _xdist_controller(session.config) or AT_START not in session.config.stash:
        return
    left = suite_leftovers(session.config.stash[AT_START])
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.write("\n")  # (after the progress line)
    if left:
        if reporter:
            reporter.write_line(f"FAILED leftovers check: left behind by the test suite (nothing holds them): {left}",
                                red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter:
        reporter.write_line("leftovers check (the suite left nothing in /dev/shm or /tmp): passed")


# --- two workers (pytest-xdist, --dist loadgroup: scripts/test.sh) ----------------------------------------------------
# Tests marked `alone` time what they check (a job ends within 5 s of a fault, a bad request is answered within a
# second, the soak's flat memory): they run in one group, first, each while no other test runs (the lock below). A
# module whose tests share a fixture of module scope (a server, converted models) is a group of its own, so that it is
# set up once; every other test is a unit of its own. Long modules are handed out first, so that no worker is left
# with one at the end. The workers compute the groups as they collect and leave them in the run's temporary directory
# for the controller's scheduler (pytest_xdist_make_scheduler): xdist's own loadgroup reads `xdist_group` marks
# through a nodeid suffix that pytest 9.2 no longer takes, and would have handed out every test on its own.
LONG_FIRST = ("test_readme.py", "test_export.py", "test_triton_aot.py", "test_step.py", "test_seed_families.py",
              "test_gguf.py", "test_multihost.py", "test_server.py", "test_families.py", "test_quant_engine.py",
              "test_triton_kernels.py", "test_serve_features.py", "test_engine.py")  # (test_step's compiles, ~15 s
# a graph on a fresh machine, and the Triton engine tests, 20-25 s on one core each, had each been the run's last)


class _Room:
    """The two locks of a worker (flock(2) on files in the run's temporary directory, released if a worker dies): a
    test marked `alone` holds the room to itself, from the first of a run of such tests on this worker to the last;
    every other test shares it. The turnstile lets a waiting `alone` test in before the other worker's next test."""

    def __init__(self, directory: Path):
        self.turnstile, self.room = (open(directory / f"alone.{name}", "a+") for name in ("turnstile", "room"))
        self.alone = False  # this worker holds the room to itself

    def enter(self, alone: bool):
        if self.alone:
            return
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.alone = alone

    def leave(self, keep: bool):
        if keep:
            return
        fcntl.flock(self.room, fcntl.LOCK_UN)
        if self.alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.alone = False

    def close(self):
        self.turnstile.close()
        self.room.close()


ROOM = pytest.StashKey[_Room]()
GROUPS_FILE = "xdist-groups.json"  # {nodeid: group} of the tests that are not a unit of their own


def _groups(items: list) -> dict:
    """{item: its group under pytest-xdist, or None (a unit of its own)}: `alone`, the module's file name, or None."""
    shared = set()
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for defs in (info.name2fixturedefs.values() if info else ()):
            if any(d.scope in ("module", "package", "class") for d in defs):
                shared.add(item.path.name)
    return {item: "alone" if item.get_closest_marker("alone") else
            item.path.name if item.path.name in shared else None for item in items}


def _run_dir(config) -> Path | None:
    """On an xdist worker, the run's temporary directory (its workers' basetemps are in it); else None."""
    if hasattr(config, "workerinput") and config.option.basetemp:
        return Path(config.option.basetemp).parent
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: times what it checks: under pytest-xdist, runs while no other test runs")
    shared = _run_dir(config)
    if shared is not None:
        shared.mkdir(parents=True, exist_ok=True)
        config.stash[ROOM] = _Room(shared)


def pytest_unconfigure(config):
    if ROOM in config.stash:
        config.stash[ROOM].close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist: each test in the room (_Room), alone or shared as it is marked."""
    room = item.config.stash.get(ROOM, None)
    if room is None:
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    room.enter(alone)
    try:
        return (yield)
    finally:
        room.leave(keep=alone and nextitem is not None and nextitem.get_closest_marker("alone") is not None)


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked `extended`: the wider matrix (more families, rank counts and "
                          "launchers through the same code) that the default run samples; and the soak (60 s) and "
                          "the ahead-of-time compiles (sm_80 too, every pair of choices) at their full length")


def pytest_collection_modifyitems(session, config, items):
    """Tests marked `extended` are deselected unless --extended is given (the default run keeps at least one case of
    every feature, within CI's 20 minutes on 2 cores); the leftovers check runs after every other test (under
    pytest-xdist, in the controller: pytest_sessionfinish). On an xdist worker: the groups and order above."""
    if not config.getoption("--extended"):
        wider = [item for item in items if item.get_closest_marker("extended")]
        if wider:
            config.hook.pytest_deselected(items=wider)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]
    if not hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.path.name == "test_leftovers.py")
        return
    last = [item for item in items if item.path.name == "test_leftovers.py"]
    if last:
        config.hook.pytest_deselected(items=last)
    groups = _groups([item for item in items if item not in last])
    order = {name: i for i, name in enumerate(LONG_FIRST)}
    items[:] = sorted(groups, key=lambda item: (groups[item] != "alone", order.get(item.path.name, len(order))))
    if _run_dir(config) is not None:  # (every worker writes the same)
        path = _run_dir(config) / GROUPS_FILE
        part = path.with_name(f"{path.name}.{os.getpid()}")
        part.write_text(json.dumps({item.nodeid: group for item, group in groups.items() if group is not None}))
        part.replace(path)


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist, where it is installed)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by the groups above: pytest-xdist's scheduler by scope, each test's scope its group (or
    itself), read from the workers' file once they have collected."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling
    path = config._tmp_path_factory.getbasetemp() / GROUPS_FILE  # the workers' basetemps are in it (xdist's making)

    class GroupScheduling(LoadScopeScheduling):
        groups = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(path.read_text()) if path.is_file() else {}
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)
