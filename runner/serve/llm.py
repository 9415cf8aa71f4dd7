"""The offline API, in vLLM's shape:

    from runner import LLM, SamplingParams
    llm = LLM("out/pmx")
    for out in llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, temperature=0)):
        print(out.outputs[0].text, out.outputs[0].token_ids)

Under `mpirun -np N` / `torchrun` every rank runs the same script and makes the same calls; every rank runs
the same engine on them and gets the same results.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from runner.config import serving_config
from runner.errors import PmxError
from runner.serve.output import CompletionOutput, RequestOutput, TextProcessor
from runner.serve.loader import load
from runner.serve.params import SamplingParams

PromptType = Union[str, Sequence[int]]


class LLM:
    """A PMX model with continuous batching over a paged KV cache, for offline generation.

    Args:
        ckpt_dir: PMX directory split into as many shards as ranks are started.
        tokenizer_path: tokenizer.model / tokenizer.json, or a directory (default: ckpt_dir).
        chat_template: a jinja chat template file (default: the tokenizer's own).
        random_weights: random weights in the shapes of ckpt_dir's pmx_params.json (no shard is read), as
            `serve --random_weights`: for measuring without a checkpoint.
        **options: any field of runner.config.EngineConfig, the flags of `python -m runner generate` (e.g.
            max_batch, kv_cache_tokens, device, dtype, quantized_cache); the cache is paged (cache_mode 1) in layout
            2 unless given (runner.config.serving_config).
    """

    def __init__(self, ckpt_dir: str, tokenizer_path: Optional[str] = None, chat_template: Optional[str] = None,
                 random_weights: bool = False, **options):
        try:
            config = serving_config(**options)
        except TypeError as e:
            raise PmxError(f"LLM: {e} (the engine options are runner.config.EngineConfig's fields)") from None
        self._loaded = load(ckpt_dir, tokenizer_path, config, chat_template=chat_template,
                            random_weights=random_weights)
        self.engine = self._loaded.engine
        self.tokenizer = self._loaded.tokenizer
        self.session = self._loaded.session
        self._counter = 0

    # -- public API --------------------------------------------------------------------------------
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text (BOS is added) or token ids."""
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        encoded = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in prompts]
        return self._run(encoded, sampling_params)

    def chat(self, messages: Union[list, Sequence[list]], sampling_params=None, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Generation for one conversation (a list of {"role", "content"} dicts) or a list of them, each
        rendered with the model's chat template."""
        template = self._loaded.chat_template
        if template is None:
            raise PmxError("this model has no chat template (no chat_template in its tokenizer_config.json); "
                           "use generate() with your own prompt text")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = []
        for conv in convs:
            text = template.render(conv, add_generation_prompt, **(chat_template_kwargs or {}))
            encoded.append((text, template.encode(self.tokenizer, text)))
        return self._run(encoded, sampling_params)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside --------------------------------------------------------------------------------------
    def _run(self, encoded: list, sampling_params) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(encoded)
        if len(params) != len(encoded):
            raise PmxError(f"{len(params)} sampling params for {len(encoded)} prompts")
        for (_, ids), p in zip(encoded, params):  # every rank checks, so a bad request fails on every rank
            self.engine.check(ids, p)
        eng, out = self.engine, TextProcessor(self.tokenizer)
        self._counter += 1
        results = {}
        for i, ((text, ids), p) in enumerate(zip(encoded, params)):
            rid = f"{self._counter}-{i}"
            results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(k) for k in range(p.n)])
            eng.add_request(rid, ids, p)
            out.add(rid, ids, p)
        while eng.has_work():
            token_deltas = eng.step()
            while token_deltas:  # (completions that stop strings ended are cancelled before the next step)
                deltas, cancels = out.process(token_deltas)
                for d in deltas:
                    results[d.request_id].apply(d, self.tokenizer.token_text)
                token_deltas = [td for rid, i in cancels for td in eng.cancel(rid, i)]
        return list(results.values())
